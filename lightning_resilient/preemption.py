"""``PreemptionCheckpoint``: on a preemption notice, an emergency checkpoint at the next optimizer step, then exit.

Clouds warn before they take a node: SIGTERM (Kubernetes, most schedulers), a configured signal (SLURM
``--signal=USR1@90``), or only a metadata endpoint (AWS Spot ``instance-action``, about two minutes ahead; GCE
``preempted``, about 30 s). Stock Lightning, on SIGTERM, finishes the batch and exits without saving.

Here a notice only sets a flag (from the signal handler or a polling thread); the training loop acts on it at its next
optimizer-step boundary (under gradient accumulation, never mid-accumulation, so the resume is exact): every rank
agrees on that step with one collective per optimizer step (a notice reaching one rank is enough), the checkpoint is
saved synchronously through the Trainer's CheckpointIO (an async save in flight is awaited first) and committed by the
same atomic protocol, and the process exits with ``exit_code``. When the save cannot finish before the deadline, the
previous committed checkpoint stays the latest, the log says so, and the exit code is ``unsaved_exit_code``.

The whole fit is covered: a notice before the first training step (the sanity check, the loaders being built) ends
the fit at once with ``unsaved_exit_code``, as there is nothing new to save; never with Lightning's
``SIGTERMException`` and its exit status 0, which a scheduler would take for success.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient._checks import check_bool, check_int, check_number
from lightning_resilient._namespaces import require_lightning_pytorch
from lightning_resilient._warnings import warn

__all__ = ["AWS_SPOT_URL", "GCE_PREEMPTED_URL", "Notice", "PreemptedExit", "PreemptionCheckpoint"]

log = logging.getLogger(__name__)

AWS_SPOT_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
GCE_PREEMPTED_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
# How long each kind of notice leaves before the node goes (AWS: two minutes; GCE and Kubernetes' default grace:
# about 30 s), less a margin for the exit.
_DEADLINES = {"aws": 100.0, "gce": 25.0, "signal": 25.0, "file": 25.0}


@dataclass(frozen=True)
class Notice:
    """A preemption notice: where it came from (``"signal"``, ``"aws"``, ``"gce"``, ``"file"``), a description, when
    (``time.monotonic()``) and how many seconds it leaves to save."""

    kind: str
    what: str
    at: float
    deadline: float


class PreemptedExit(SystemExit):
    """Ends the process after a preemption notice (its ``code`` is the exit status)."""


class PreemptionCheckpoint(Callback):
    """Save an emergency checkpoint when the node is about to be taken, then exit with a documented code.

    Example::

        Trainer(plugins=[AtomicCheckpointIO()],
                callbacks=[ResumeStateCallback(), PreemptionCheckpoint(signals=["SIGTERM", "SIGUSR1"]),
                           ModelCheckpoint(dirpath=root, every_n_train_steps=500)])

    Args:
        signals: signals that are a notice (names or numbers). From the sanity check (or the start of training) to
            the end of ``fit``, this callback's handler replaces Lightning's for them (Lightning's SIGTERM handler
            broadcasts from inside the handler and exits without saving); the previous handlers come back after the
            fit. A notice before the first training step exits with ``unsaved_exit_code`` (nothing new to save).
        aws_spot: poll the AWS Spot ``instance-action`` metadata endpoint: True for the real one, a URL for another
            (tests use a loopback server). IMDSv2 (a session token) first, then IMDSv1.
        gce: poll the GCE ``preempted`` metadata endpoint (True, or a URL).
        notice_file: a path whose appearance is a notice (for schedulers that write one).
        poll_seconds: how often the pollers ask.
        deadline_seconds: seconds from the notice to save and commit; None: from the notice kind (AWS 100 s,
            GCE, SIGTERM and files 25 s).
        dirpath: where the emergency checkpoint goes; None: the first ModelCheckpoint's dirpath (the root
            ``find_latest_checkpoint`` reads, so the restart resumes it).
        filename: its name in that root; each emergency save replaces the previous one.
        exit_code: exit status after a committed emergency save (default 143, as a process ended by SIGTERM;
            Kubernetes restarts on non-zero).
        unsaved_exit_code: exit status when no emergency checkpoint could be committed in time (the previous
            committed checkpoint is what the restart resumes).
        requeue_slurm: under SLURM, ``scontrol requeue $SLURM_JOB_ID`` before exiting.
    """

    def __init__(self, *, signals: Sequence[str | int] = ("SIGTERM",), aws_spot: bool | str = False,
                 gce: bool | str = False, notice_file: str | None = None, poll_seconds: float = 5.0,
                 deadline_seconds: float | None = None, dirpath: str | None = None,
                 filename: str = "preemption.ckpt", exit_code: int = 143, unsaved_exit_code: int = 124,
                 requeue_slurm: bool = False) -> None:
        super().__init__()
        self.signals = [_signal_number(s) for s in signals]
        self.aws_spot = _endpoint(aws_spot, AWS_SPOT_URL, "aws_spot")
        self.gce = _endpoint(gce, GCE_PREEMPTED_URL, "gce")
        if notice_file is not None and not isinstance(notice_file, str):
            raise TypeError(f"notice_file must be a path or None, got {notice_file!r}")
        self.notice_file = notice_file
        self.poll_seconds = check_number("poll_seconds", poll_seconds, above=0, hint="seconds")
        self.deadline_seconds = (None if deadline_seconds is None else
                                 check_number("deadline_seconds", deadline_seconds, above=0,
                                              hint="seconds, or None: no deadline"))
        if dirpath is not None and not isinstance(dirpath, str):
            raise TypeError(f"dirpath must be a checkpoint root URL or None, got {dirpath!r}")
        if not isinstance(filename, str) or not filename or "/" in filename:
            raise ValueError(f"filename must be a checkpoint name without '/', got {filename!r}")
        self.dirpath = dirpath
        self.filename = filename
        self.exit_code = check_int("exit_code", exit_code, minimum=0, maximum=255, what="an exit status")
        self.unsaved_exit_code = check_int("unsaved_exit_code", unsaved_exit_code, minimum=0, maximum=255,
                                           what="an exit status")
        self.requeue_slurm = check_bool("requeue_slurm", requeue_slurm)
        #: The notice this process received (None until one arrives).
        self.notice: Notice | None = None
        #: What the emergency save did: {"step", "path", "seconds", "committed", "earlier_error"} (None until it
        #: ran; ``earlier_error``: what an earlier save, asynchronous or a persist, had failed with, if anything).
        self.saved: dict[str, Any] | None = None
        self._previous: dict[int, Any] = {}
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._last_step = -1
        self._acted = False

    # -- notices -------------------------------------------------------------------------------------------------------
    def notify(self, kind: str, what: str) -> None:
        """Record a notice (what the signal handler and the pollers call; a later notice keeps the first)."""
        if self.notice is None:
            deadline = self.deadline_seconds if self.deadline_seconds is not None else _DEADLINES.get(kind, 25.0)
            self.notice = Notice(kind, what, time.monotonic(), deadline)
            log.warning("preemption notice (%s): saving an emergency checkpoint at the next optimizer step", what)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the loop acts at its next optimizer step. A second signal (during the save) changes nothing.
        self.notify("signal", signal.Signals(signum).name)

    def _poll(self) -> None:
        checks: list[tuple[str, Callable[[], str | None]]] = []
        if self.aws_spot:
            checks.append(("aws", lambda: _aws_instance_action(self.aws_spot)))  # type: ignore[arg-type]
        if self.gce:
            checks.append(("gce", lambda: _gce_preempted(self.gce)))  # type: ignore[arg-type]
        if self.notice_file:
            path = self.notice_file
            checks.append(("file", lambda: f"file {path} appeared" if os.path.exists(path) else None))
        while not self._stop.is_set() and self.notice is None:
            for kind, check in checks:
                try:
                    what = check()
                except Exception as exc:  # an endpoint that is down is no notice; say so once in the debug log
                    log.debug("preemption poller %s: %s", kind, exc)
                    what = None
                if what:
                    self.notify(kind, what)
                    return
            self._stop.wait(self.poll_seconds)

    # -- wiring --------------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_lightning_pytorch(trainer, "PreemptionCheckpoint")
        if stage == "fit":
            self.notice, self.saved, self._acted = None, None, False

    def _install(self) -> None:
        """Our handlers for ``signals``, for the rest of the fit (once; the previous ones come back at teardown).

        Installed after Lightning registered its own (they run after ``on_fit_start``), which they replace:
        Lightning's SIGTERM handler would end the fit with a ``SIGTERMException``, exit status 0, nothing saved."""
        if self._previous:
            return
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)
        elif self.signals:
            warn("PreemptionCheckpoint: fit runs outside the main thread, where signal handlers cannot be"
                 " set; only the pollers give notices", rank_zero=True)

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The sanity check (and the validation loader it builds) runs before training: covered as well.
        self._install()
        self._exit_if_noticed_before_training(trainer, "before the sanity check")

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit_if_noticed_before_training(trainer, "during the sanity check")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install()
        self._last_step = trainer.global_step
        # A notice while the training loader was set up (or between Lightning's handlers and ours) ends the fit now.
        self._exit_if_noticed_before_training(trainer, "before training started")
        if self.aws_spot or self.gce or self.notice_file:
            self._stop.clear()
            self._poller = threading.Thread(target=self._poll, name="lightning_resilient-preemption", daemon=True)
            self._poller.start()

    def _exit_if_noticed_before_training(self, trainer: Trainer, when: str) -> None:
        """A notice before the first training step: nothing to save (the state is what the fit resumed, or its
        start), so exit at once with ``unsaved_exit_code``: the restart resumes where this fit began. A SIGTERM that
        reached Lightning's handler before ours was in place counts (``trainer.received_sigterm``)."""
        if self.notice is None and trainer.received_sigterm:
            self.notify("signal", "SIGTERM (received by Lightning's handler)")
        noticed = self.notice is not None
        if trainer.world_size > 1:  # every rank reaches this point: all leave together, or none does
            noticed = trainer.strategy.reduce_boolean_decision(noticed, all=False)
        if not noticed:
            return
        if self.notice is None:
            self.notify("signal", "another rank's notice")
        assert self.notice is not None
        self._acted = True
        self.saved = {"step": trainer.global_step, "path": None, "seconds": 0.0, "committed": False,
                      "earlier_error": None}
        warn(f"PreemptionCheckpoint: preemption notice ({self.notice.what}) {when}: no training step was"
             " taken, so there is nothing new to save; the restart resumes where this fit began. Exiting"
             f" with status {self.unsaved_exit_code}.", rank_zero=True)
        self._exit(trainer, self.unsaved_exit_code)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls teardown hooks only after a fit that succeeded
        if (isinstance(exception, SystemExit) and not isinstance(exception, PreemptedExit) and not exception.code
                and (self.notice is not None or trainer.received_sigterm)):
            # Lightning's SIGTERMException (exit status 0) after a notice this callback could not act on: a
            # scheduler must not take the preempted job for a finished one.
            log.error("PreemptionCheckpoint: the fit ended on a preemption notice without an emergency checkpoint;"
                      " exiting with status %d (the previous committed checkpoint is what the restart resumes)",
                      self.unsaved_exit_code)
            exception.code = self.unsaved_exit_code

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
            self._poller = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_poller=None, _previous={}, _stop=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stop = threading.Event()

    # -- the safe point ------------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stepped = trainer.global_step != self._last_step
        self._last_step = trainer.global_step
        if not stepped or self._acted:
            return  # mid-accumulation: the step in progress is not a state a resume can continue exactly
        noticed = self.notice is not None
        if trainer.world_size > 1:  # one rank noticing is enough; all agree on this step (one collective per step)
            noticed = trainer.strategy.reduce_boolean_decision(noticed, all=False)
        if not noticed:
            return
        self._acted = True
        if self.notice is None:
            self.notify("signal", "another rank's notice")
        self._save_and_exit(trainer)

    def _save_and_exit(self, trainer: Trainer) -> None:
        notice = self.notice
        assert notice is not None
        left = notice.deadline - (time.monotonic() - notice.at)
        root = self.dirpath or _first_dirpath(trainer)
        if root is None:
            warn("PreemptionCheckpoint: no dirpath and no ModelCheckpoint with a dirpath: nothing saved",
                 rank_zero=True)
            self._exit(trainer, self.unsaved_exit_code)
        path = f"{root.rstrip('/')}/{self.filename}"
        io = _checkpoint_plugin(trainer)
        estimate = _estimate_save_seconds(io)  # rank 0 saves, so rank 0 knows; every rank follows its decision
        if trainer.world_size > 1:
            estimate, left = trainer.strategy.broadcast((estimate, left), src=0)
        if estimate is not None and estimate > left:
            warn(f"PreemptionCheckpoint: {left:.1f} s left of the {notice.deadline:.0f} s after the notice"
                 f" ({notice.what}), a save takes about {estimate:.1f} s here: no emergency checkpoint;"
                 " the previous committed checkpoint stays the latest", rank_zero=True)
            self.saved = {"step": trainer.global_step, "path": path, "seconds": 0.0, "committed": False,
                          "earlier_error": None}
            self._exit(trainer, self.unsaved_exit_code)
        watchdog = _Watchdog(left, lambda: self._too_late(notice), self.unsaved_exit_code)
        started = time.monotonic()
        try:
            # What failed before (an async save, a persist) is reported, never a reason not to save now: the plugin
            # would raise it from this save, and the emergency checkpoint would be lost to an old error.
            earlier = _settle(io)
            trainer.save_checkpoint(path, weights_only=False)  # a full state to resume from; said, so Lightning
            # does not log that it chose it ("`weights_only` was not set, defaulting to `False`")
            wait = getattr(io, "persist_latest", None) or getattr(io, "wait", None)
            if callable(wait):
                # An async plugin: committed, not merely snapshotted; with a local tier, persisted to the durable
                # root too (this node may not come back).
                wait()
        finally:
            watchdog.cancel()
        seconds = time.monotonic() - started
        self.saved = {"step": trainer.global_step, "path": path, "seconds": seconds, "committed": True,
                      "earlier_error": None if earlier is None else f"{type(earlier).__name__}: {earlier}"}
        rank_zero_info(f"PreemptionCheckpoint: emergency checkpoint {path} (step {trainer.global_step}) committed"
                       f" {seconds:.2f} s after the save began, {time.monotonic() - notice.at:.2f} s after the notice"
                       f" ({notice.what}); exiting with status {self.exit_code}"
                       + ("" if earlier is None else " (an earlier save had failed; see above)"))
        self._exit(trainer, self.exit_code)

    def _too_late(self, notice: Notice) -> None:
        log.error("PreemptionCheckpoint: the emergency save did not commit within %.0f s of the notice (%s); the"
                  " previous committed checkpoint stays the latest (an unfinished save is never loadable)",
                  notice.deadline, notice.what)

    def _exit(self, trainer: Trainer, code: int) -> NoReturn:
        if self.requeue_slurm and os.environ.get("SLURM_JOB_ID") and trainer.is_global_zero:
            job = os.environ["SLURM_JOB_ID"]
            done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            rank_zero_info(f"PreemptionCheckpoint: scontrol requeue {job}: "
                           + ("done" if done.returncode == 0 else f"failed ({done.stderr.strip()})"))
        raise PreemptedExit(code)


class _Watchdog:
    """Ends the process at the deadline if the save still runs: the platform would kill it anyway, and this way the
    log says what happened and the exit status says nothing was saved (a partial save is never loadable)."""

    def __init__(self, seconds: float, report: Callable[[], None], code: int) -> None:
        def fire() -> None:
            report()
            logging.shutdown()
            os._exit(code)

        self._timer = threading.Timer(max(0.0, seconds), fire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()


def _checkpoint_plugin(trainer: Trainer) -> Any:
    """The Trainer's checkpoint plugin: ours also behind Lightning's ``AsyncCheckpointIO``, whose worker thread runs the
    saves (the plugin's ``wait`` waits for that worker too, and its ``save_stats`` time the saves there)."""
    io = trainer.strategy.checkpoint_io
    for _ in range(4):  # wrappers hold the plugin they wrap as ``checkpoint_io``
        if hasattr(io, "wait") or not hasattr(io, "checkpoint_io"):
            break
        io = io.checkpoint_io
    return io


def _settle(io: Any) -> BaseException | None:
    """Wait for what the checkpoint plugin has in flight (an async save, a persist to the durable tier) and take the
    error of what failed before, if any, so that the emergency save does not raise it; it is logged here and
    returned (``saved["earlier_error"]``)."""
    wait = getattr(io, "wait", None)
    if not callable(wait):
        return None
    try:
        wait()
    except Exception as exc:
        log.error("PreemptionCheckpoint: an earlier save had failed (%s: %s); the emergency save goes ahead",
                  type(exc).__name__, exc)
        return exc
    return None


def _estimate_save_seconds(io: Any) -> float | None:
    """A save's duration on this job so far (median of the last few committed ones), or None before the first."""
    stats = [s for s in list(getattr(io, "save_stats", []))[-5:] if s.committed and s.upload is not None]
    if not stats:
        return None
    return float(statistics.median(max(s.blocked, s.upload or 0.0) for s in stats))


def _first_dirpath(trainer: Trainer) -> str | None:
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return str(callback.dirpath)
    return None


def _signal_number(value: str | int) -> int:
    if isinstance(value, str):
        try:
            return int(signal.Signals[value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"])
        except KeyError:
            raise ValueError(f"signals: {value!r} is not a signal of this platform") from None
    number = check_int("signals", value, what="signal names or numbers")
    try:
        return int(signal.Signals(number))
    except ValueError:
        raise ValueError(f"signals: {value!r} is not a signal of this platform") from None


def _endpoint(value: bool | str, default: str, field: str) -> str | None:
    if value is True:
        return default
    if value is False or value is None:
        return None
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return value
    raise ValueError(f"{field} must be True, False or an http(s) URL, got {value!r}")


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=2) as response:  # a configured metadata URL, never user input
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _aws_instance_action(url: str) -> str | None:
    """The Spot interruption notice, or None (404: none scheduled)."""
    base = url.split("/latest/", 1)[0]
    headers: dict[str, str] = {}
    try:  # IMDSv2: a session token first; IMDSv1 when the endpoint has none
        status, token = _get(f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, "PUT")
        if status == 200 and token:
            headers["X-aws-ec2-metadata-token"] = token
    except urllib.error.URLError:
        pass
    status, body = _get(url, headers)
    if status != 200:
        return None
    try:
        action = json.loads(body)
    except json.JSONDecodeError:
        action = {"action": body.strip()}
    return f"AWS Spot {action.get('action', 'interruption')} at {action.get('time', 'soon')}"


def _gce_preempted(url: str) -> str | None:
    status, body = _get(url, {"Metadata-Flavor": "Google"})
    return "GCE preemption" if status == 200 and body.strip().upper() == "TRUE" else None
