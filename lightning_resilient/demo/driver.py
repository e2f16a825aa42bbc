"""The demo: a LightningCLI training job with every plugin on, killed in the middle of a checkpoint upload to an
S3 server on loopback, restarted with the same command, and compared with the same training never interrupted.

``make demo`` runs ``lightning-resilient demo``. It starts moto's S3 server in this process, writes the job's config
(``demo_output/run.yaml``), runs ``lightning-resilient train fit -c demo_output/run.yaml`` three times (killed,
resumed, uninterrupted) and prints each command exactly as it runs it, writes ``demo_output/loss_curves.png``,
stops the server, and prints a post-mortem report last. When its output is not a terminal (a log file, CI), the
job's progress bar is off and the driver prints one line per checkpoint event instead.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from lightning_resilient.testing.lines import LineReader

__all__ = ["run_demo", "scenario_error"]

BUCKET = "lightning-resilient-demo"
REFERENCE_RUN = "run-uninterrupted"  # the bucket's folder of the uninterrupted run the resumed one is compared with
ACCUMULATE = 2  # the demo config's accumulate_grad_batches


# -- the training job, as a subprocess ---------------------------------------------------------------------------

@dataclass
class Event:
    at: float
    kind: str
    fields: list[str]


class Job:
    """The training command in a subprocess: its output goes to the terminal, its events to a pipe (and, with
    ``echo``, one line each to this process's output: what a progress bar would show, without its redraws)."""

    def __init__(self, cmd: list[str], env: dict[str, str], *, echo: bool = False) -> None:
        self.echo = echo
        events_r, events_w = os.pipe()
        env = {**env, "LR_DEMO_EVENTS_FD": str(events_w)}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=(events_w,))
        os.close(events_w)
        self.events = LineReader(os.fdopen(events_r, "r"), _event, _echo if echo else None)

    def wait_for(self, test: Callable[[Event], bool], what: str, timeout: float = 300) -> Event:
        found = self.events.wait_for(test, timeout)
        if found is None:
            raise RuntimeError(f"the training job ended before {what} (exit status {self.proc.poll()})")
        return found

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events.items() if e.kind == kind]

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.events.join()

    def finish(self, timeout: float = 600) -> None:
        if self.proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"the training job failed (exit status {self.proc.returncode})")
        self.events.join()


def _event(line: str) -> Event:
    kind, *rest = line.strip().split()
    return Event(time.monotonic(), kind.lstrip("@"), rest)


def _echo(event: Event) -> None:
    """One line for a checkpoint event of the job (commits and loads; objects and snapshots are too many)."""
    if event.kind == "commit":
        step, name, seconds = event.fields[:3]
        print(f"  [job] step {step}: checkpoint {name.rstrip('/').rsplit('/', 1)[-1]} committed"
              f" ({float(seconds):.2f} s, in the background)", flush=True)
    elif event.kind == "load":
        print(f"  [job] loaded {event.fields[0]} (step {event.fields[1]})", flush=True)


def train_command() -> tuple[list[str], str]:
    """How the demo runs ``lightning-resilient train``, and how it shows that command: the console script next to
    this interpreter, shown by its name when that is the one on PATH, by its path otherwise; without the script
    (a source tree that was never installed), ``python -m lightning_resilient.cli``."""
    bin_dir = os.path.dirname(sys.executable)
    script = os.path.join(bin_dir, "lightning-resilient")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        on_path = shutil.which("lightning-resilient")
        shown = "lightning-resilient" if on_path and os.path.samefile(on_path, script) else _short(script)
        return [script, "train"], f"{shown} train"
    return [sys.executable, "-m", "lightning_resilient.cli", "train"], \
        f"{_short(sys.executable)} -m lightning_resilient.cli train"


def _short(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


# -- the store -------------------------------------------------------------------------------------------------

def _start_s3() -> tuple[Any, str]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - the Makefile installs it
        raise SystemExit("the demo needs moto's S3 server: pip install 'lightning-resilient[demo]'") from exc
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log would drown the demo
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def _folders(root: str) -> dict[str, set[str]]:
    """commit folder -> names of the objects in it."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    out: dict[str, set[str]] = {}
    for p in sorted(fs.find(path)):
        parts = p[len(path) + 1:].split("/")
        if len(parts) == 3 and not parts[0].startswith("."):  # the protocol's own dot-folder holds no checkpoint
            out.setdefault("/".join(parts[:2]), set()).add(parts[2])
    return out


def _retired(root: str) -> set[str]:
    """Commit folders retention has dropped (their manifest goes at once, their data after the next commit)."""
    import fsspec

    from lightning_resilient.io.pointer import POINTER_NAME, Pointer

    fs, path = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    return set(Pointer.from_bytes(fs.cat_file(f"{path}/{POINTER_NAME}"), where=root).retired)


# -- records the job leaves ------------------------------------------------------------------------------------

@dataclass
class Losses:
    """Per-micro-batch losses of one record folder, one list per attempt (each attempt starts with "# start")."""

    attempts: list[list[tuple[int, int, float]]] = field(default_factory=list)  # (global_step, batch, loss)

    @classmethod
    def read(cls, folder: str) -> Losses:
        out = cls()
        try:
            with open(os.path.join(folder, "losses.txt")) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            if line.startswith("#"):
                out.attempts.append([])
                continue
            step, batch, loss = line.split()
            out.attempts[-1].append((int(step), int(batch), float(loss)))
        return out


def _plot(path: str, uninterrupted: Losses, run: Losses, kill_step: int, resumed_step: int, same: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def xy(points: list[tuple[int, int, float]]) -> tuple[list[float], list[float]]:
        # x in optimizer steps; the micro-batches of one step sit at step + k / ACCUMULATE
        xs: list[float] = []
        ys: list[float] = []
        seen: dict[int, int] = {}
        for step, _, loss in points:
            seen[step] = seen.get(step, -1) + 1
            xs.append(step + seen[step] / ACCUMULATE)
            ys.append(loss)
        return xs, ys

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(*xy(uninterrupted.attempts[0]), color="#bbbbbb", linewidth=5, label="uninterrupted run")
    styles = [("#1f77b4", "-", "attempt 1 (SIGKILLed mid-upload)"),
              ("#ff7f0e", "--", "attempt 2 (same command: resumed)")]
    # a run that never restarted has one attempt: the second style goes unused
    for points, (color, dash, label) in zip(run.attempts, styles, strict=False):
        ax.plot(*xy(points), color=color, linestyle=dash, linewidth=1.4, label=label)
    ax.axvline(kill_step, color="red", linewidth=0.8)
    ax.text(kill_step, ax.get_ylim()[1], " SIGKILL", color="red", va="top", fontsize=8)
    ax.axvline(resumed_step, color="green", linewidth=0.8)
    ax.text(resumed_step, ax.get_ylim()[1] * 0.9, " resumed from here", color="green", va="top", fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (per micro-batch)")
    ax.set_yscale("log")
    # The title says what the comparison found (torch.equal on every tensor), never more.
    ax.set_title("Killed and resumed vs uninterrupted: " + ("the curves coincide (bit-identical final weights)" if same
                 else "the final weights DIFFER"), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the demo --------------------------------------------------------------------------------------------------

def _config(out_dir: str, name: str, root: str, max_steps: int, every: int, progress_bar: bool) -> tuple[str, str]:
    record = os.path.join(out_dir, f"records-{name}")
    text = resources.files("lightning_resilient.demo").joinpath("demo.yaml").read_text()
    values = {"ROOT": root, "RECORD": record, "MAX_STEPS": str(max_steps), "EVERY": str(every),
              "PROGRESS_BAR": "true" if progress_bar else "false"}
    for key, value in values.items():
        text = re.sub(rf"\b{key}\b", value, text)
    path = os.path.join(out_dir, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path, record


def scenario_error(max_steps: int, kill_step: int, every: int, *, flags: bool = False) -> str | None:
    """What is wrong with a demo scenario, or None; ``flags``: named as the command line's options."""
    name = (lambda n: f"--{n.replace('_', '-')}") if flags else (lambda n: n)
    if every < 1:
        return f"{name('every')} must be >= 1, got {every}"
    if kill_step % every or not every <= kill_step < max_steps:
        return (f"{name('kill_step')} must be a multiple of {name('every')} ({every}) between {every} and"
                f" {name('max_steps')} - 1 ({max_steps - 1}), got {kill_step}")
    return None


def run_demo(max_steps: int = 60, kill_step: int = 30, every: int = 10, out_dir: str = "demo_output",
             preempt: bool = False) -> int:
    """Run the demo; returns 0 when everything it shows held (the exit status of ``make demo``). ``preempt``: the
    first attempt gets a preemption notice (SIGTERM) once the checkpoint of ``kill_step`` committed, instead of a
    SIGKILL in the middle of its upload."""
    problem = scenario_error(max_steps, kill_step, every)
    if problem:
        raise ValueError(problem)
    from lightning_resilient._extras import require

    require("demo", "lightning-resilient demo")  # before any work: not after three trainings
    # The jobs write to the same output: ours must not wait in a buffer while theirs goes out.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    terminal = sys.stdout.isatty()
    os.environ.update({"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_DEFAULT_REGION": "us-east-1"})
    server, endpoint = _start_s3()
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # reaches s3fs here, in the jobs, and Lightning's own client
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
        root = f"s3://{BUCKET}/run-1/checkpoints"
        reference_root = f"s3://{BUCKET}/{REFERENCE_RUN}/checkpoints"
        config, record = _config(out_dir, "run", root, max_steps, every, terminal)
        reference_config, reference_record = _config(out_dir, "uninterrupted", reference_root, max_steps, every,
                                                     terminal)
        train, shown_train = train_command()
        cmd = [*train, "fit", "-c", config]
        shown = f"{shown_train} fit -c {config}"
        print(f"S3 server (moto) on {endpoint}; checkpoints go to {root}")
        print(f"The job: {config} (AtomicCheckpointIO with async saves, ResumeStateCallback, AutoPrecision, a warmup +"
              " cosine LR schedule counted in optimizer steps)")
        if not terminal:
            print("Output is not a terminal: no progress bar; one [job] line per checkpoint event instead")
        print(f"\n$ {shown}")
        report, ok = _show(cmd, shown, root, record, reference_config, reference_record, out_dir, max_steps,
                           kill_step, preempt, echo=not terminal)
    finally:
        server.stop()
    _print_report(report, ok)
    return 0 if ok else 1


def _print_report(report: list[str], ok: bool) -> None:
    """The post-mortem, last and framed, so that it stands out from the jobs' logs above it."""
    rule = "=" * 100
    print(f"\n\n{rule}\n{report[0].upper()}\n{rule}")
    print("\n".join(report[1:]))
    print(rule)
    print("DEMO OK: everything above held" if ok else "DEMO FAILED: see the lines above")


def _show(cmd: list[str], shown: str, root: str, record: str, reference_config: str, reference_record: str,
          out_dir: str, max_steps: int, kill_step: int, preempt: bool = False, *,
          echo: bool = False) -> tuple[list[str], bool]:
    from lightning_resilient import find_latest_checkpoint
    from lightning_resilient.io.manifest import MANIFEST_NAME

    env = dict(os.environ)
    first = Job(cmd, env, echo=echo)
    if preempt:
        return _show_preemption(first, cmd, env, shown, root, record, reference_config, reference_record, out_dir,
                                max_steps, kill_step, echo)
    target = f"step={kill_step}.ckpt/"
    first.wait_for(lambda e: e.kind == "save-begin" and e.fields[0] == str(kill_step), f"the save of step {kill_step}")
    # Aim inside the upload: after a few of that checkpoint's objects are stored, before its manifest.
    first.wait_for(lambda e: sum(1 for x in first.of("object") if target in x.fields[0]) >= 3,
                   f"the upload of step {kill_step}")
    first.kill()
    # What the store holds, not what the job announced: an object can land between the last announcement and the
    # kill, so counting announcements would undercount what the listing shows.
    folders = _folders(root)
    killed = {f: names for f, names in folders.items() if target in f"{f}/"}
    stored = sum(len(names - {MANIFEST_NAME}) for names in killed.values())
    committed = any(MANIFEST_NAME in names for names in killed.values())
    blocked_first = sum(float(e.fields[1]) for e in first.of("save-end"))
    # Optimizer steps completed when the kill hit: the last step whose loss was recorded, or the step being saved
    # (the loop may have been inside that save, which runs before the step's loss is recorded).
    recorded = Losses.read(record).attempts
    killed_at = max([kill_step, *(s for s, _, _ in (recorded[-1] if recorded else []))])
    what = ("its manifest had been written: that save was committed" if committed
            else "no manifest: never committed")
    print(f"\n*** SIGKILL at training step {killed_at}, in the middle of uploading the checkpoint of step {kill_step}"
          f" ({_objects(stored)} stored, {what}) ***\n")

    retired = _retired(root)
    partial = sorted(f for f, names in folders.items() if MANIFEST_NAME not in names and f not in retired)
    latest = find_latest_checkpoint(root)
    print("What the store holds after the kill:")
    for folder, names in sorted(folders.items()):
        state = ("committed" if MANIFEST_NAME in names else "retired by keep_last (deleted after the next commit)"
                 if folder in retired else "PARTIAL (no manifest: invisible to resume)")
        print(f"  {folder:60s} {_objects(len(names)):>11s}  {state}")
    print(f"\nNewest committed checkpoint: {latest}\n")

    print(f"$ {shown}     # the same command again")
    second = Job(cmd, env, echo=echo)
    second.finish()
    loads = second.of("load")
    resumed_url, resumed_step = (loads[0].fields[0], int(loads[0].fields[1])) if loads else (None, 0)
    teardown = second.of("teardown")
    blocked_second = float(teardown[-1].fields[1]) if teardown else 0.0
    saves_second = int(teardown[-1].fields[0]) if teardown else 0
    upload_second = float(teardown[-1].fields[2]) if teardown else 0.0
    wall_second = time.monotonic() - second.started

    run, reference, same, same_losses, final_step, tensors = _uninterrupted(cmd, env, reference_config, record,
                                                                            reference_record, shown, echo)
    after = _folders(root)
    png = os.path.join(out_dir, "loss_curves.png")
    _plot(png, reference, run, killed_at, resumed_step, same)

    report = [
        "Post-mortem",
        (f"  what the kill hit:        training step {killed_at}, during the background upload of the checkpoint of"
         f" step {kill_step} ({_objects(stored)} stored;"
         f" {'committed' if committed else 'never committed: no manifest'})"),
        f"  partial folders it left:  {len(partial)}" + (f" ({', '.join(partial)})" if partial else ""),
        f"  restart resumed from:     {resumed_url} (step {resumed_step}), found by the same command",
        f"  steps recomputed:         {max(0, killed_at - resumed_step)} (step {resumed_step} to step {killed_at})",
        f"  resumed run finished at:  step {final_step} of {max_steps}",
        (f"  partial folders collected when the restart claimed the root: {sum(1 for f in partial if f not in after)}"
         f" of {len(partial)}"),
        (f"  time spent checkpointing: {blocked_first + blocked_second:.2f} s blocked in the training loop over both"
         f" attempts ({saves_second} saves in attempt 2: {blocked_second:.2f} s blocked, {upload_second:.2f} s of"
         f" uploads in the background, out of {wall_second:.1f} s of wall time)"),
        (f"  killed + resumed vs uninterrupted: {'bit-identical' if same else 'DIFFERENT'} final weights (torch.equal"
         f" on all {tensors} tensors); per-step losses after the resume {'identical' if same_losses else 'DIFFER'}"),
        f"  loss curves:              {png}",
    ]
    with open(os.path.join(out_dir, "report.txt"), "w") as f:
        f.write("\n".join(report) + "\n")
    ok = (same and same_losses and resumed_url == latest and final_step == max_steps and not committed
          and resumed_step < kill_step)
    return report, ok


def _objects(n: int) -> str:
    return f"{n} object{'' if n == 1 else 's'}"


def _show_preemption(first: Job, cmd: list[str], env: dict[str, str], shown: str, root: str, record: str,
                     reference_config: str, reference_record: str, out_dir: str, max_steps: int,
                     kill_step: int, echo: bool) -> tuple[list[str], bool]:
    """``demo --preempt``: a SIGTERM after the checkpoint of ``kill_step`` committed (what a cloud's notice is);
    PreemptionCheckpoint saves the step in progress, the job exits 143, and the restart recomputes nothing."""
    from lightning_resilient import find_latest_checkpoint

    first.wait_for(lambda e: e.kind == "commit" and e.fields[0] == str(kill_step), f"the commit of step {kill_step}")
    noticed = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    status = first.proc.wait(timeout=120)
    first.events.join()
    emergency = [e for e in first.of("commit") if e.fields[1].endswith("preemption.ckpt")]
    saved_step = int(emergency[0].fields[0]) if emergency else None
    took = (emergency[0].at - noticed) if emergency else None
    print(f"\n*** SIGTERM (a preemption notice) after the checkpoint of step {kill_step} committed: exit status"
          f" {status}; " + (f"emergency checkpoint of step {saved_step} committed {took:.2f} s after the notice ***\n"
                            if emergency else "no emergency checkpoint ***\n"))
    latest = find_latest_checkpoint(root)
    print(f"Newest committed checkpoint: {latest}\n")

    print(f"$ {shown}     # the same command again")
    second = Job(cmd, env, echo=echo)
    second.finish()
    loads = second.of("load")
    resumed_url, resumed_step = (loads[0].fields[0], int(loads[0].fields[1])) if loads else (None, 0)
    run, reference, same, same_losses, final_step, _ = _uninterrupted(cmd, env, reference_config, record,
                                                                      reference_record, shown, echo)
    # The last step the first attempt trained: its losses are recorded after every callback's batch end, so the step
    # the emergency save ended may not be among them.
    trained = max([saved_step or 0, *(s for s, _, _ in (run.attempts[0] if run.attempts else []))])
    png = os.path.join(out_dir, "loss_curves.png")
    _plot(png, reference, run, trained, resumed_step, same)
    report = [
        "Post-mortem (preemption)",
        (f"  the notice:               SIGTERM after step {kill_step}'s checkpoint; the job had trained to step"
         f" {trained}"),
        "  emergency checkpoint:     " + (f"step {saved_step}, committed {took:.2f} s after the notice; exit status"
                                           f" {status}" if emergency else f"none (exit status {status})"),
        f"  restart resumed from:     {resumed_url} (step {resumed_step}), found by the same command",
        f"  steps recomputed:         {max(0, trained - resumed_step)}",
        f"  resumed run finished at:  step {final_step} of {max_steps}",
        (f"  preempted + resumed vs uninterrupted: {'bit-identical' if same else 'DIFFERENT'} final weights;"
         f" per-step losses after the resume {'identical' if same_losses else 'DIFFER'}"),
        f"  loss curves:              {png}",
    ]
    with open(os.path.join(out_dir, "report.txt"), "w") as f:
        f.write("\n".join(report) + "\n")
    ok = (same and same_losses and status == 143 and saved_step is not None and resumed_step == saved_step
          and resumed_url == latest and final_step == max_steps and trained <= saved_step)
    return report, ok


def _uninterrupted(cmd: list[str], env: dict[str, str], reference_config: str, record: str,
                   reference_record: str, shown: str, echo: bool) -> tuple[Losses, Losses, bool, bool, int, int]:
    """Run the same training uninterrupted and compare: (run, reference, same final weights, same per-step losses
    after the resume, the resumed run's final step, the number of tensors compared)."""
    import torch

    print(f"\n$ {shown.rsplit(' ', 1)[0]} {reference_config}     # the same training, never interrupted")
    Job([*cmd[:-1], reference_config], env, echo=echo).finish()
    run, reference = Losses.read(record), Losses.read(reference_record)
    differs = _differs_before_the_fault(run, reference)
    if differs is not None:
        # The comparison needs the very training the first attempt ran: a reference that already parted from it
        # before the fault says nothing of the resume. Seen rarely on a loaded 2-core CPU, cause unknown (same inputs,
        # weights and RNG states; another loss at step 0): the same command trained once more, on a root of its own.
        again, reference_record = _another_reference(reference_config, reference_record)
        print(f"  (the uninterrupted run differs from the first attempt before the fault, at step {differs}, so it is"
              " not the same training as the one interrupted; training it once more)")
        Job([*cmd[:-1], again], env, echo=echo).finish()
        reference = Losses.read(reference_record)
        differs = _differs_before_the_fault(run, reference)
        if differs is not None:
            print(f"  (again different from the first attempt before the fault, at step {differs}: the comparison"
                  " below is not about the resume)")
    resumed_w = torch.load(os.path.join(record, "weights.pt"))
    plain_w = torch.load(os.path.join(reference_record, "weights.pt"))
    same = resumed_w.keys() == plain_w.keys() and all(torch.equal(resumed_w[k], plain_w[k]) for k in plain_w)
    resumed_losses = run.attempts[-1] if run.attempts else []
    same_losses = bool(resumed_losses) and reference.attempts[0][-len(resumed_losses):] == resumed_losses
    final_step = resumed_losses[-1][0] if resumed_losses else 0  # recorded after the optimizer step
    return run, reference, same, same_losses, final_step, len(plain_w)


def _differs_before_the_fault(run: Losses, reference: Losses) -> int | None:
    """The first step at which the uninterrupted run's losses part from the first attempt's (which ended at the
    fault), or None when they agree on every step the first attempt trained."""
    first = run.attempts[0] if run.attempts else []
    plain = reference.attempts[0] if reference.attempts else []
    for ours, theirs in zip(first, plain, strict=False):
        if ours != theirs:
            return ours[0]
    return None


def _another_reference(config: str, record: str) -> tuple[str, str]:
    """A copy of the uninterrupted run's ``config`` with a checkpoint root and a record folder of its own (the first
    reference's root would be resumed: auto-resume); (its path, its record folder)."""
    folder, name = os.path.dirname(record), os.path.basename(record)
    with open(config) as f:
        text = f.read()
    again = config.replace(".yaml", "-again.yaml")
    with open(again, "w") as f:
        f.write(text.replace(name, f"{name}-again").replace(REFERENCE_RUN, f"{REFERENCE_RUN}-again"))
    return again, os.path.join(folder, f"{name}-again")
