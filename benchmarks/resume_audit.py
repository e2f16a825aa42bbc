"""What the resume audit costs a training step, and what per-sample seeding costs a batch (CPU).

    python benchmarks/resume_audit.py --out benchmarks/results/resume_audit_cpu
    python benchmarks/resume_audit.py --steps 20 --runs 1 --trainer-steps 10 --out /tmp/audit   # a smoke run

Three measurements, each the median of ``--runs`` runs (each run's figure is itself a median or mean over its steps):

- ``in a Trainer``: a Trainer whose step is GPU-like (``time.sleep(0.05)``, the device's work with the GIL released,
  plus 200 small in-place torch ops, the host's dispatch), reading token batches from a map-style DataLoader, with
  ``ResumeStateCallback()`` and with ``ResumeStateCallback(audit=False)``, both with a local checkpoint root. Three
  figures per variant: the training thread's CPU time in ResumeStateCallback's hooks per step (its batch start and
  end, and the hook on each fetched batch), whose difference between the variants is the audit's cost per step as
  the loop pays it (caches cold after each step's sleep; CPU time, so other processes on the machine do not count):
  the figure held to the target; the training thread's CPU time per step; and the median step time (between
  successive ``on_train_batch_start`` calls). The last two show the same cost end to end, within the noise of a
  shared machine.
- ``audit work per step, warm``: the same work timed in a tight loop (the digest of the batch: a strided slice of at
  most 1024 elements of each tensor; the digest of its 64 sample indices; recording the step: appended to a file on
  local disk; on an object store kept in memory for the background thread, which is not timed: it runs off the
  training thread), for a token batch (``input_ids`` and ``labels``, 8 x 512 int64) and an image batch (64 x 3 x 224 x
  224 float32, 64 labels).
- ``per-sample seeding per batch``: reading 64 samples through the ``__getitems__`` ResumeStateCallback installs, in
  the main process (``num_workers=0``, where the caller's RNG states are saved and put back), against reading them
  plainly. In a worker the states are not saved: the cost there is the seeding alone (about a third).

Target: the audit's cost per step in the Trainer under 1% of a 50 ms step (500 us). Writes ``OUT.md`` and
``OUT.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

STEP_SECONDS = 0.05
TARGET = 0.01  # of a 50 ms step


def _sibling(name: str) -> Any:
    path = os.path.join(os.path.dirname(__file__), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batches() -> dict[str, Any]:
    import torch

    tokens = {"input_ids": torch.randint(0, 50_000, (8, 512)), "labels": torch.randint(0, 50_000, (8, 512))}
    images = (torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,)))
    return {"tokens 8x512": tokens, "images 64x3x224x224": images}


def audit_work(batch: Any, store_url: str, steps: int, spool: str | None = None) -> float:
    """Median seconds of the audit's per-step work over ``steps`` steps, recording into ``store_url`` (and, on an
    object store, appending each step to the node's ``spool``), a sample of a 1M-parameter model's state included."""
    import torch

    from lightning_resilient.io.retry import RetryPolicy
    from lightning_resilient.io.store import open_store
    from lightning_resilient.state.attempts import StepDigest
    from lightning_resilient.state.audit import ResumeAudit, StateSampler, digest_batch, digest_indices

    store = open_store(store_url, {}, RetryPolicy())
    audit = ResumeAudit(rank=0, world=1, gather=lambda obj: [obj], flush_seconds=30.0, flush_steps=None)
    audit.start(store, facts={}, resumed_step=None, resumed_from=None, spool=spool)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(16)))  # ~1M parameters, 32 tensors
    state = StateSampler(model)  # (as ResumeStateCallback keeps one per fit)
    indices = list(range(64))
    loss = torch.tensor(2.5)
    times = []
    try:
        for i in range(steps):
            started = time.perf_counter()
            data = digest_batch(batch)
            step = StepDigest(0, i, i, digest_indices(indices), data, None)
            audit.step(step, loss, state())
            times.append(time.perf_counter() - started)
    finally:
        audit.close("finished")
    return statistics.median(times)


def store_traffic(steps_between_saves: int, flush_seconds: float) -> dict[str, float]:
    """What one rank's record costs an object store: one rewrite per flush interval (requests per hour) of the steps
    it keeps (those after the second-to-last save: about twice the steps between saves), so its size per request."""
    import torch

    from lightning_resilient.state.attempts import AttemptRecord, StepDigest
    from lightning_resilient.state.audit import digest_batch, digest_indices, digest_sample_set, digest_state

    indices = list(range(64))
    step = StepDigest(3, 1234, 123456, digest_indices(indices), digest_batch(torch.randn(8, 512)), 2.718281828459045,
                      (64, digest_sample_set(indices)), digest_state([torch.randn(64)]))
    record = AttemptRecord("a000042-0123ab", 0, 8, time.time(), 120000, "s3://bucket/run/ckpt/last.ckpt",
                           {"world_size": 8, "batch_size": 64, "dataset": "Tokens[1000000]"},
                           steps=[step] * (2 * steps_between_saves))
    size = len(record.to_bytes())
    requests = 3600.0 / flush_seconds
    return {"flush_seconds": flush_seconds, "steps_between_saves": steps_between_saves, "bytes_per_request": size,
            "requests_per_hour": requests, "megabytes_per_hour": requests * size / 1e6,
            "bytes_per_step_line": len(json.dumps(step.to_json(), separators=(",", ":"))) + 1}


def seeding_cost(runs: int) -> dict[str, float]:
    """Median seconds to read a batch of 64 samples with per-sample seeding (main process) and without."""
    import random

    import numpy as np
    import torch
    from torch.utils.data import Dataset

    from lightning_resilient.state.seeding import SampleSeeding

    class Augmented(Dataset):
        def __len__(self) -> int:
            return 1024

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((16,), float(i)) + torch.rand(16) + float(np.random.rand()) + random.random()

    data = Augmented()
    seeding = SampleSeeding(data, seed=0)
    indices = list(range(64))
    plain, seeded = [], []
    for _ in range(max(runs, 1) * 50):
        started = time.perf_counter()
        [data[i] for i in indices]
        plain.append(time.perf_counter() - started)
        started = time.perf_counter()
        seeding(indices)
        seeded.append(time.perf_counter() - started)
    return {"plain_s": statistics.median(plain), "seeded_s": statistics.median(seeded)}


# (owner, name): the callback's per-step hooks, and the fetch hooks of its data stream (state/_stream.py), which the
# stream installs on the loader's iterator with these bound names.
_HOOKS = (("callback", "on_train_batch_start"), ("callback", "on_train_batch_end"), ("stream", "_before_fetch"),
          ("stream", "_after_fetch"))


def trainer_step(audit: bool, steps: int, root: str) -> tuple[float, float, float]:
    """A Trainer with a GPU-like 50 ms step, the audit on or off: (median step time, mean seconds per step spent in
    ResumeStateCallback's per-step hooks, median CPU time of the training thread per step)."""
    import warnings

    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, Dataset

    from lightning_resilient import ResumeStateCallback

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 8 * (steps + 8)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 50_000, (512,))
            return {"input_ids": ids, "labels": ids.roll(1)}

    class GpuLike(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64))
            self.scratch = torch.zeros(64)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(STEP_SECONDS)  # the device's work, GIL released
            for _ in range(200):  # the host's dispatch of small kernels
                self.scratch.add_(1.0)
            return (self.w * batch["input_ids"][0, :64].float()).sum() * 0.0

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Clock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cpu: list[float] = []  # the training thread's CPU time: the sleep (the "device") is not in it

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())
            self.cpu.append(time.thread_time())

    clock = Clock()
    callback = ResumeStateCallback(audit=audit)
    spent: list[float] = []

    def timed(owner: Any, name: str) -> None:
        method = getattr(owner, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            # The thread's CPU time: what the hook costs the training thread, not the time other processes on the
            # machine take while it runs.
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent.append(time.thread_time() - started)

        setattr(owner, name, run)  # on the instance: the hooks are looked up there when the loader is hooked

    owners = {"callback": callback, "stream": callback._stream}
    for owner, name in _HOOKS:
        timed(owners[owner], name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                          enable_model_summary=False,
                          callbacks=[callback, clock, ModelCheckpoint(dirpath=root, every_n_train_steps=10**9)])
        trainer.fit(GpuLike(), DataLoader(Tokens(), batch_size=8))
    gaps = [b - a for a, b in zip(clock.starts[2:], clock.starts[3:], strict=False)]  # after a warm-up
    cpu = [b - a for a, b in zip(clock.cpu[2:], clock.cpu[3:], strict=False)]
    return statistics.median(gaps), sum(spent) / steps, statistics.median(cpu)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="steps per run of the per-step measurement")
    parser.add_argument("--trainer-steps", type=int, default=60, help="steps per Trainer run")
    parser.add_argument("--runs", type=int, default=5, help="runs of each measurement (their median is reported)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "resume_audit_cpu"),
                        help="output prefix: OUT.md and OUT.json")
    args = parser.parse_args(argv)
    with _lightning_quiet():
        return _measure(args)


@contextlib.contextmanager
def _lightning_quiet() -> Iterator[None]:
    """Lightning's per-fit INFO lines off while measuring, and back as they were after: a test runs ``main`` in its
    own process, and the next test there expects Lightning's INFO lines (ours go through its loggers)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _measure(args: argparse.Namespace) -> str:
    machine = _sibling("first_hour").machine_description()
    work: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="resume-audit-") as folder:
        for name, batch in batches().items():
            for store, url in (("local disk", os.path.join(folder, f"local-{len(work)}")),
                               ("object store (memory://) + node spool",
                                f"memory://resume-audit-{os.getpid()}-{len(work)}")):
                spool = os.path.join(folder, f"spool-{len(work)}") if url.startswith("memory") else None
                if spool is not None:
                    os.makedirs(spool)
                per_run = [audit_work(batch, f"{url}-{r}", args.steps, spool) for r in range(args.runs)]
                median = statistics.median(per_run)
                work.append({"batch": name, "store": store, "median_s": median, "runs_s": per_run,
                             "fraction_of_50ms": median / STEP_SECONDS})
        on, off = [], []
        for r in range(args.runs):  # alternated, so drift in the machine's load hits both alike
            off.append(trainer_step(False, args.trainer_steps, os.path.join(folder, f"off-{r}")))
            on.append(trainer_step(True, args.trainer_steps, os.path.join(folder, f"on-{r}")))
    trainer = {"audit_off_s": statistics.median(r[0] for r in off), "audit_on_s": statistics.median(r[0] for r in on),
               "off_runs_s": [r[0] for r in off], "on_runs_s": [r[0] for r in on],
               "hooks_off_s": statistics.median(r[1] for r in off), "hooks_on_s": statistics.median(r[1] for r in on),
               "hooks_off_runs_s": [r[1] for r in off], "hooks_on_runs_s": [r[1] for r in on],
               "cpu_off_s": statistics.median(r[2] for r in off), "cpu_on_s": statistics.median(r[2] for r in on),
               "cpu_off_runs_s": [r[2] for r in off], "cpu_on_runs_s": [r[2] for r in on]}
    trainer["difference_s"] = trainer["audit_on_s"] - trainer["audit_off_s"]
    trainer["audit_per_step_s"] = trainer["hooks_on_s"] - trainer["hooks_off_s"]
    seeding = seeding_cost(args.runs)
    worst = trainer["audit_per_step_s"] / STEP_SECONDS
    result = {"schema": "lightning_resilient.resume_audit/1", "machine": machine, "steps": args.steps,
              "trainer_steps": args.trainer_steps, "runs": args.runs, "audit_work": work, "trainer": trainer,
              "seeding_per_batch_of_64": seeding, "target_fraction": TARGET, "worst_fraction": worst,
              "store_traffic": [store_traffic(n, 30.0) for n in (100, 1000)],
              "meets_target": worst < TARGET}
    text = render(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)
    return text


def _runs(values: list[float], scale: float) -> str:
    return ", ".join(f"{v * scale:.2f}" if scale == 1e3 else f"{v * scale:.0f}" for v in values)


def render(result: dict[str, Any]) -> str:
    t = result["trainer"]
    s = result["seeding_per_batch_of_64"]
    extra = s["seeded_s"] - s["plain_s"]
    lines = [
        "# Resume audit: cost per training step (CPU)", "",
        f"Machine: {result['machine']}", "",
        (f"Medians of {result['runs']} runs ({result['trainer_steps']} steps per Trainer run, {result['steps']} per"
         " warm loop)."), "",
        "## In a Trainer with a GPU-like 50 ms step, token batches (8 x 512), local checkpoint root", "",
        ("| ResumeStateCallback | CPU in its hooks per step | runs (us) | training thread CPU per step | runs (ms) |"
         " median step | runs (ms) |"),
        "|---|---:|---|---:|---|---:|---|",
        (f"| audit=False | {t['hooks_off_s'] * 1e6:.0f} us | {_runs(t['hooks_off_runs_s'], 1e6)} |"
         f" {t['cpu_off_s'] * 1e3:.2f} ms | {_runs(t['cpu_off_runs_s'], 1e3)} |"
         f" {t['audit_off_s'] * 1e3:.2f} ms | {_runs(t['off_runs_s'], 1e3)} |"),
        (f"| audit=True (default) | {t['hooks_on_s'] * 1e6:.0f} us | {_runs(t['hooks_on_runs_s'], 1e6)} |"
         f" {t['cpu_on_s'] * 1e3:.2f} ms | {_runs(t['cpu_on_runs_s'], 1e3)} |"
         f" {t['audit_on_s'] * 1e3:.2f} ms | {_runs(t['on_runs_s'], 1e3)} |"), "",
        (f"The audit's cost per step: {t['audit_per_step_s'] * 1e6:.0f} us of the training thread's CPU time in the"
         " hooks"
         f" ({t['audit_per_step_s'] / STEP_SECONDS * 100:.2f}% of 50 ms). The training thread's CPU time per step"
         f" moved by {(t['cpu_on_s'] - t['cpu_off_s']) * 1e6:+.0f} us, the median wall-clock step by"
         f" {t['difference_s'] * 1e6:+.0f} us ({t['difference_s'] / STEP_SECONDS * 100:+.2f}%): both also move with"
         " the machine's load between runs (2 shared cores here)."), "",
        "## The same work, warm (a tight loop: digest of the batch and of its indices, the step recorded)", "",
        "| batch | store | per step | of a 50 ms step |", "|---|---|---:|---:|",
        *(f"| {w['batch']} | {w['store']} | {w['median_s'] * 1e6:.0f} us | {w['fraction_of_50ms'] * 100:.3f}% |"
          for w in result["audit_work"]), "",
        ("On an object store every step is also appended to the node's spool (a local file: what a SIGKILL on this"
         " node leaves for the restart); the background rewrite of the record to the store is not on the training"
         " thread and is not in these figures. Each step also takes a sample of the parameters (8 of the model's 32"
         " tensors, 64 elements each) whose digest is compared on a resume."), "",
        "## What one rank's record costs an object store (the default audit_flush_seconds=30)", "",
        "| steps between saves | requests per hour | bytes per request | MB per hour |", "|---:|---:|---:|---:|",
        *(f"| {t['steps_between_saves']} | {t['requests_per_hour']:.0f} | {t['bytes_per_request']:,} |"
          f" {t['megabytes_per_hour']:.1f} |" for t in result["store_traffic"]), "",
        (f"A step's line is {result['store_traffic'][0]['bytes_per_step_line']} bytes; the record keeps the steps"
         " after the second-to-last save, so its size follows the save interval. Plus, per attempt: a listing and a"
         " read of the interrupted attempt's record at its start, and one write per record a restart ships from the"
         " node's spool."), "",
        "## Per-sample seeding, one batch of 64 samples in the main process", "",
        (f"Plain reads: {s['plain_s'] * 1e6:.0f} us; with per-sample seeding: {s['seeded_s'] * 1e6:.0f} us"
         f" (+{extra * 1e6:.0f} us: about {extra / 64 * 1e6:.0f} us per sample, including saving and restoring the"
         " caller's RNG states once per batch)."), "",
        "## Target", "",
        (f"The audit's cost per step in the Trainer under {TARGET * 100:.0f}% of a 50 ms step:"
         f" {result['worst_fraction'] * 100:.2f}%: {'met' if result['meets_target'] else 'NOT met'}."), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
