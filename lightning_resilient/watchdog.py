"""``HangWatchdog``: notice a training loop that stopped making progress, put every thread's stack in the log, and
(if asked) end the process with a code of its own, so that torchrun, the scheduler or Kubernetes restarts the job.

A hung job (a collective one rank never joins, a data loader worker deadlocked, a stuck filesystem) burns its
allocation until NCCL's timeout, if any, ends it (10 to 30 minutes by default, without saying where it stood). Here a
daemon thread in each process (each rank has its own) watches the time since the training loop last made progress
(the end of a training batch) and, past the timeout (the step timeout; between epochs, a bound of their own):

1. logs, at ERROR, what it saw (no progress for so long, at which global step, on which rank, the timeout and where
   it came from) and the stack of every thread of its own process. "Every local rank": each rank's watchdog dumps
   its own process; in a collective hang every rank stops making progress, so every rank's watchdog fires and the
   log holds every rank's stacks (the one stuck elsewhere, the others waiting in the collective);
2. with ``exit_code`` set (the default, :data:`HANG_EXIT_CODE`), records the hang as the attempt's end in the goodput
   ledger (``ResumeStateCallback``'s attempt records open in this process, flushed to their store), then ends the
   process with ``os._exit(exit_code)``: the training thread is stuck, so nothing else could end it. torchrun (with
   ``--max-restarts``) restarts the group, a SLURM or Kubernetes job restarts as configured (see docs/restarts.md),
   and the restart resumes from the newest committed checkpoint. With ``exit_code=None`` it only reports, once per
   hang (again if progress resumes and stops again).

The timeout: ``timeout_seconds`` if given; else ``max(factor x the median of the last window optimizer steps,
min_timeout_seconds)``, so it follows the job's own pace. What must not look like a hang does not:

- the first ``warmup_steps`` optimizer steps of each fit (compilation, autotuning, the first collective, workers
  starting) are not watched, unless ``startup_timeout_seconds`` bounds them (from the start of training);
- saves (from ``on_save_checkpoint`` to the next training batch) and validation (``on_validation_start`` to
  ``on_validation_end``) pause the clock, and their time is not taken for a step's: a long synchronous upload is the
  plugin's business (its retries and deadlines), and validation may run as long as it needs;
- between epochs, from the end of an epoch's last training batch (the loader exhausted, ``limit_train_batches`` or
  ``max_steps`` reached, a stop requested; at the latest, this callback's own ``on_train_epoch_end``) until the next
  training batch starts (and from ``on_train_start`` to the first one), the bound is
  ``epoch_boundary_timeout_seconds`` (30 minutes by default, never less than the step timeout; None: not watched).
  That phase is not a step: every callback's and the module's ``on_train_epoch_end`` and ``on_train_epoch_start``
  (a metric over the epoch, artifacts logged; in whatever order the callbacks are listed), the epoch's scheduler
  step, the loggers, a dataloader reload, the sampler's ``set_epoch``, the next epoch's workers starting and its
  first batch, and the ``on_train_end`` hooks that run before this callback's (its own pauses the clock until the
  fit ends, as the plugin's teardown waits for saves in flight). Hung there (a collective one rank never joins in an
  epoch-end metric, a loader whose workers deadlock at start, an upload that never returns), the job is still
  reported, past that bound; validation and saves in it pause the clock as anywhere;
- within an epoch, the time to fetch a batch counts against the step timeout (a deadlocked loader is a hang).

Limits: a thread that holds the GIL forever (a C extension stuck without releasing it) stops this thread too, and
then nothing is reported; torch's collectives and device waits, the data loader's queues, sleeps and I/O all release
it. The exit skips Python's cleanup (``atexit``, ``finally`` blocks of the stuck thread): an async save in flight is
lost (its commit never happened; the previous checkpoint stays the latest).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilient._checks import check_int, check_number, check_positive_int
from lightning_resilient._namespaces import require_lightning_pytorch
from lightning_resilient.state.attempts import open_logs

__all__ = ["HANG_EXIT_CODE", "HangWatchdog"]

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 75
"""The exit status of a process the watchdog ended (``EX_TEMPFAIL``: a temporary failure, try again), apart from
``PreemptionCheckpoint``'s 143 (emergency checkpoint committed) and 124 (none committed)."""

_FLUSH_SECONDS = 30.0  # at most this long for the ledger's records to reach their store before the exit


class HangWatchdog(Callback):
    """End (or report) a training process that stopped making progress, with every thread's stack in the log.

    Example::

        Trainer(plugins=[AtomicCheckpointIO()],
                callbacks=[ResumeStateCallback(), HangWatchdog(), ModelCheckpoint(dirpath=root, ...)])
        # torchrun --max-restarts 3 train.py: a hang ends the group with status 75, torchrun restarts it, and the
        # script resumes with find_latest_checkpoint.

    Args:
        timeout_seconds: seconds without progress that make a hang; None (the default): from the job's pace,
            ``max(factor x median step, min_timeout_seconds)``.
        factor: with no ``timeout_seconds``, how many median optimizer steps without progress make a hang.
        min_timeout_seconds: with no ``timeout_seconds``, the least timeout (covers an occasional slow step, a
            garbage collection, an epoch's workers starting).
        window: optimizer steps the median is taken over.
        warmup_steps: optimizer steps of each fit that are not watched (compilation, warm-up), from the start of
            training.
        startup_timeout_seconds: if set, the warm-up steps must complete within this many seconds from the start of
            training (a hang in the first collective); None: not watched.
        epoch_boundary_timeout_seconds: seconds without progress that make a hang between epochs, from the end of an
            epoch's last training batch until the next training batch starts (epoch-end and epoch-start hooks,
            loggers, the next epoch's workers and first batch), and from the start of training to its first batch;
            never less than the step timeout. Default 1800 (Lightning's default process group timeout); None: not
            watched.
        exit_code: the process's exit status after a hang (default :data:`HANG_EXIT_CODE`, 75); None: only report.
    """

    def __init__(self, *, timeout_seconds: float | None = None, factor: float = 10.0,
                 min_timeout_seconds: float = 300.0, window: int = 100, warmup_steps: int = 5,
                 startup_timeout_seconds: float | None = None, epoch_boundary_timeout_seconds: float | None = 1800.0,
                 exit_code: int | None = HANG_EXIT_CODE) -> None:
        super().__init__()
        self.timeout_seconds = (None if timeout_seconds is None else
                                check_number("timeout_seconds", timeout_seconds, above=0,
                                             hint="seconds without progress; None: from the step times"))
        self.factor = check_number("factor", factor, above=1, hint="median steps without progress")
        self.min_timeout_seconds = check_number("min_timeout_seconds", min_timeout_seconds, above=0, hint="seconds")
        self.window = check_positive_int("window", window)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.startup_timeout_seconds = (None if startup_timeout_seconds is None else
                                        check_number("startup_timeout_seconds", startup_timeout_seconds, above=0,
                                                     hint="seconds; None: the warm-up is not watched"))
        self.epoch_boundary_timeout_seconds = (
            None if epoch_boundary_timeout_seconds is None else
            check_number("epoch_boundary_timeout_seconds", epoch_boundary_timeout_seconds, above=0,
                         hint="seconds between an epoch's last training batch and the next one; None: not watched"))
        self.exit_code = (None if exit_code is None else
                          check_int("exit_code", exit_code, minimum=1, maximum=255, what="an exit status"))
        #: The reports made in this process: (global step, seconds without progress, timeout), oldest first.
        self.hangs: list[tuple[int, float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset()

    def _reset(self) -> None:
        self._rank = 0
        self._step = 0  # the global step last seen
        self._steps = 0  # optimizer steps completed in this fit
        self._started = time.monotonic()  # the start of training
        self._last = time.monotonic()  # the last progress
        self._step_mark: float | None = None  # the last optimizer step's end; None after a pause
        self._durations: deque[float] = deque(maxlen=self.window)
        self._paused = True
        self._between_epochs = False  # from an epoch's last training batch to the next batch's start
        self._fired = False  # reported the present stall (exit_code None): wait for progress before another

    # -- what the training loop does ---------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_lightning_pytorch(trainer, "HangWatchdog")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with self._lock:
            self._reset()
            self._rank = trainer.global_rank
            self._step = trainer.global_step
            self._paused = False
            self._between_epochs = True  # the epoch's start hooks, workers and first batch: as between two epochs
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="lightning_resilient-watchdog", daemon=True)
            self._thread.start()
        rank_zero_info(f"HangWatchdog: {self._describe_timeout()}; on a hang, every thread's stack goes to the log"
                       + (f" and the process exits with status {self.exit_code}" if self.exit_code is not None
                          else " (no exit: exit_code=None)"))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        with self._lock:
            if self._paused or self._between_epochs:  # after a save or between epochs: the step clock starts here
                self._paused = self._between_epochs = False
                self._progress(None)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        with self._lock:
            now = time.monotonic()
            if trainer.global_step > self._step:
                if self._step_mark is not None and self._steps >= self.warmup_steps:
                    self._durations.append((now - self._step_mark) / (trainer.global_step - self._step))
                self._steps += trainer.global_step - self._step
                self._step = trainer.global_step
                self._step_mark = now
            self._progress(now)
            if _ends_epoch(trainer):
                self._end_epoch()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Where the last batch's end could not tell (an epoch that on_train_batch_start ended with -1, a stop that a
        # callback after this one requested): between epochs from here at the latest, the clock not restarted.
        with self._lock:
            self._end_epoch()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pause()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with self._lock:  # back to the step clock, or to the epoch boundary's after the epoch's last batch
            self._paused = False
            self._progress(None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end()  # Lightning calls teardown hooks only after a fit that succeeded

    def _pause(self) -> None:
        with self._lock:
            self._paused = True
            self._step_mark = None  # the time until the next batch is not a step's

    def _end_epoch(self) -> None:
        self._between_epochs = True
        self._step_mark = None  # the time until the next epoch's first step is not a step's

    def _progress(self, now: float | None) -> None:
        self._last = time.monotonic() if now is None else now
        self._fired = False

    def _end(self) -> None:
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_thread=None, _lock=None, _stop=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- the timeout -------------------------------------------------------------------------------------------------
    def timeout(self) -> float | None:
        """The present timeout in seconds (None: not watched now: warm-up without ``startup_timeout_seconds``, or
        between epochs without ``epoch_boundary_timeout_seconds``)."""
        if self._steps < self.warmup_steps:
            return self.startup_timeout_seconds
        step = self._step_timeout()
        if not self._between_epochs:
            return step
        if self.epoch_boundary_timeout_seconds is None:
            return None
        # Never below the step timeout: the phase holds at least a batch's fetch, which the step timeout allows.
        return max(self.epoch_boundary_timeout_seconds, step)

    def _step_timeout(self) -> float:
        if self.timeout_seconds is not None:
            return self.timeout_seconds
        if not self._durations:
            return self.min_timeout_seconds
        return max(self.factor * statistics.median(self._durations), self.min_timeout_seconds)

    def _describe_timeout(self) -> str:
        if self.timeout_seconds is not None:
            rule = f"{self.timeout_seconds:g} s without progress (set by timeout_seconds)"
        else:
            rule = (f"max({self.factor:g} x the median of the last {self.window} steps, {self.min_timeout_seconds:g} s)"
                    " without progress")
        warmup = (f" after {self.warmup_steps} warm-up step(s)" if self.warmup_steps else "") + (
            f" (those within {self.startup_timeout_seconds:g} s)" if self.startup_timeout_seconds is not None
            and self.warmup_steps else "")
        boundary = ("not watched (epoch_boundary_timeout_seconds=None)" if self.epoch_boundary_timeout_seconds is None
                    else f"at least {self.epoch_boundary_timeout_seconds:g} s (epoch_boundary_timeout_seconds)")
        return f"a hang is {rule}{warmup}, saves and validation excepted; between epochs {boundary}"

    def _why(self, timeout: float) -> str:
        if self._steps < self.warmup_steps:
            return f"startup_timeout_seconds, {self._steps} of {self.warmup_steps} warm-up step(s) done"
        if self.timeout_seconds is not None:
            step = "timeout_seconds"
        elif not self._durations:
            step = "min_timeout_seconds (no step timed yet)"
        else:
            median = statistics.median(self._durations)
            step = (f"max({self.factor:g} x median step {median:.3g} s over {len(self._durations)} steps,"
                    f" {self.min_timeout_seconds:g} s)")
        if not self._between_epochs or self.epoch_boundary_timeout_seconds is None:
            return step
        where = "between epochs (after an epoch's last training batch, before the next batch)"
        if self.epoch_boundary_timeout_seconds >= timeout:
            return f"epoch_boundary_timeout_seconds, {where}"
        return f"{step}, above epoch_boundary_timeout_seconds {self.epoch_boundary_timeout_seconds:g} s, {where}"

    # -- the thread ----------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        poll = 1.0
        while not self._stop.wait(poll):
            with self._lock:
                timeout = None if self._paused or self._fired else self.timeout()
                idle = time.monotonic() - (self._started if self._steps < self.warmup_steps else self._last)
                if timeout is not None and idle > timeout:
                    self._fired = True
                    step, why = self._step, self._why(timeout)
                else:
                    poll = min(1.0, max(0.02, (timeout or 10.0) / 20))
                    continue
            self._fire(idle, timeout, step, why)

    def _fire(self, idle: float, timeout: float, step: int, why: str) -> None:
        stacks = _stacks()  # first: where every thread is stuck now
        action = (f"exiting with status {self.exit_code}" if self.exit_code is not None else
                  "not exiting (exit_code=None)")
        log.error("HangWatchdog: no training progress for %.1f s on rank %d (pid %d) at global step %d: a hang"
                  " (timeout %.1f s, from %s); %s. The stack of every thread of this process follows:\n%s",
                  idle, self._rank, os.getpid(), step, timeout, why, action, stacks)
        self.hangs.append((step, idle, timeout))
        if self.exit_code is None:
            return
        _record_hang(f"hang: no training progress for {idle:.0f} s at global step {step} (HangWatchdog, timeout"
                     f" {timeout:.0f} s, exit status {self.exit_code})")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream: the exit matters more
                stream.flush()
        logging.shutdown()
        os._exit(self.exit_code)


def _ends_epoch(trainer: Trainer) -> bool:
    """Whether the training batch that just ended is the epoch's last, from the public state Lightning's epoch loop
    decides it by: the loader exhausted (known a batch ahead, as Lightning prefetches one), ``limit_train_batches`` or
    ``max_steps`` reached, or a stop requested (a stop that ``min_epochs`` overrides only lets the next batch's fetch
    run under the epoch boundary's bound)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return (progress.is_last_batch or progress.current.ready >= trainer.num_training_batches
            or 0 <= trainer.max_steps <= trainer.global_step or trainer.should_stop)


def _stacks() -> str:
    """Every thread of this process, its name and its stack (the innermost call last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watchdog's own thread
        out.append(f"--- thread {names.get(ident, '?')} (id {ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def _record_hang(text: str) -> None:
    """The hang as the end of every attempt record this process writes (the goodput ledger), flushed to its store;
    at most :data:`_FLUSH_SECONDS`, so that a store that does not answer cannot keep the process from exiting."""

    def close_all() -> None:
        for record in open_logs():
            record.update(end="hang", ended=text)
            record.close()

    writer = threading.Thread(target=close_all, name="lightning_resilient-watchdog-ledger", daemon=True)
    writer.start()
    writer.join(_FLUSH_SECONDS)
