"""How long a preemption notice takes to become a committed emergency checkpoint, and to end the process.

    python benchmarks/preemption.py                       # 100 MB and 1 GB; local, S3, S3 with latency; 3 runs each
    python benchmarks/preemption.py --sizes 100 --stores local --runs 1

Each run is a fresh training process (``Trainer`` with ``AtomicCheckpointIO`` and ``PreemptionCheckpoint``; a model
whose state is ``--sizes`` MB of fp32 parameters, trained with plain SGD so the optimizer adds no state). Once it has
trained a few steps the driver sends SIGTERM and measures, from the moment it sent it:

- ``to commit``: until the emergency checkpoint is committed (the pointer names it), as the child logs it; this
  includes the rest of the optimizer step in progress (``step s``, the median step time, is reported beside it);
- ``to exit``: until the process has exited (status 143 expected).

Stores: ``local`` (this disk), ``s3`` (moto's server in its own process, on loopback) and ``s3-latency`` (the same
behind a proxy adding ``--latency`` s per request and capping each connection at ``--bandwidth`` bytes/s: a model of a
cloud object store), as in ``benchmarks/checkpoint_io.py``. Medians of ``--runs``. Writes a markdown table and JSON.

What fits in a notice window: a save of ``S`` bytes at an effective rate ``R`` (bytes/s, from this table for a store
like yours, or ``max_concurrency`` x your per-connection bandwidth) takes about ``step + S / R + fixed`` seconds;
it fits when that is below the window less the exit (GCE/Kubernetes 30 s, AWS Spot 120 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MB = 10**6
STORES = ["local", "s3", "s3-latency"]


def _sibling(name: str) -> Any:
    path = os.path.join(os.path.dirname(__file__), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHILD = r'''
import os, sys, time, torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning_resilient import AtomicCheckpointIO, PreemptionCheckpoint

size, root, endpoint = int(sys.argv[1]), sys.argv[2], sys.argv[3]

class Big(LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size // 4))
        self.head = torch.nn.Linear(8, 1)
    def training_step(self, batch, batch_idx):
        return self.head(torch.ones(4, 8)).sum() + self.w[:16].sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(10**6)), batch_size=1)

class Steps(Callback):
    def on_train_batch_end(self, trainer, *args):
        print(f"STEP {trainer.global_step} {time.monotonic():.6f}", flush=True)

options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint != "-" else None
trainer = Trainer(max_steps=10**6, accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False,
                  plugins=[AtomicCheckpointIO(storage_options=options)],
                  callbacks=[Steps(), PreemptionCheckpoint(dirpath=root, deadline_seconds=600)])
trainer.fit(Big())
'''

_COMMITTED = re.compile(r"committed ([0-9.]+) s after the save began, ([0-9.]+) s after the notice")


def one_run(size: int, root: str, endpoint: str | None, env: dict[str, str]) -> dict[str, float]:
    # stderr goes to a file so that a chatty child can never block on a full pipe before the notice; stdout is
    # drained to the end after it (closing it early would break the child's next print with EPIPE mid-save).
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(size), root, endpoint or "-"], env=env,
                                stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True)
        assert proc.stdout is not None
        steps: list[float] = []
        for line in proc.stdout:
            if line.startswith("STEP "):
                steps.append(float(line.split()[2]))
                if len(steps) == 4:
                    break
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=900)
        exited = time.monotonic() - sent
        status = proc.returncode
        errors.seek(0)
        err = errors.read()
    found = _COMMITTED.search(err)
    if status != 143 or found is None:
        raise RuntimeError(f"the run did not end with a committed emergency save (status {status}): {err[-2000:]}")
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    return {"save_s": float(found.group(1)), "to_commit_s": float(found.group(2)), "to_exit_s": exited,
            "step_s": statistics.median(gaps) if gaps else 0.0}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="state sizes in MB")
    parser.add_argument("--stores", nargs="+", default=STORES, choices=STORES)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.03, help="s3-latency: seconds added per request")
    parser.add_argument("--bandwidth", type=float, default=40e6, help="s3-latency: bytes/s per connection")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "preemption"),
                        help="output path prefix (.md and .json are written)")
    args = parser.parse_args(argv)
    io_bench = _sibling("checkpoint_io")
    servers = io_bench.Servers(args.latency, args.bandwidth)
    servers.start(args.stores)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "AWS_EC2_METADATA_DISABLED": "true"}
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for size_mb in args.sizes:
                for store in args.stores:
                    where = servers.store(store, tmp)
                    for run in range(args.runs):
                        root = (os.path.join(where["location"], f"{size_mb}-{run}") if store == "local"
                                else f"{where['location']}/{size_mb}-{run}")
                        result = one_run(size_mb * MB, root, where.get("endpoint"), env)
                        rows.append({"size_mb": size_mb, "store": store, "run": run, **result})
                        print(json.dumps(rows[-1]), flush=True)
    finally:
        servers.stop()
    machine = io_bench.machine_description()
    text = table(rows, machine, args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(f"{args.out}.md", "w") as f:
        f.write(text)
    with open(f"{args.out}.json", "w") as f:
        json.dump({"machine": machine, "latency": args.latency, "bandwidth": args.bandwidth, "rows": rows}, f, indent=1)
    print(text)
    return text


def table(rows: list[dict[str, Any]], machine: str, args: argparse.Namespace) -> str:
    lines = [
        "# Preemption: notice to committed emergency checkpoint, and to exit",
        "",
        (f"Machine: {machine}. s3-latency: {args.latency * 1000:.0f} ms per request, {args.bandwidth / MB:.0f} MB/s"
         f" per connection. Medians of {args.runs} run(s), each a fresh process; times from the SIGTERM."),
        "",
        "| state | store | step s | save s | to commit s | to exit s | effective MB/s | fits 30 s | fits 120 s |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    keys = sorted({(r["size_mb"], r["store"]) for r in rows}, key=lambda k: (k[0], STORES.index(k[1])))
    for size_mb, store in keys:
        sel = [r for r in rows if (r["size_mb"], r["store"]) == (size_mb, store)]
        med = {k: statistics.median(r[k] for r in sel) for k in ("step_s", "save_s", "to_commit_s", "to_exit_s")}
        rate = size_mb / med["save_s"] if med["save_s"] else float("inf")
        lines.append(f"| {size_mb} MB | {store} | {med['step_s']:.2f} | {med['save_s']:.2f} | {med['to_commit_s']:.2f}"
                     f" | {med['to_exit_s']:.2f} | {rate:.0f} | {'yes' if med['to_exit_s'] < 30 else 'no'}"
                     f" | {'yes' if med['to_exit_s'] < 120 else 'no'} |")
    lines += ["", ("Estimate for your job: to exit ~ step + state / effective rate + the fixed part seen here"
                   " (process teardown); keep it below the notice window (GCE and Kubernetes' default: 30 s; AWS Spot:"
                   " 120 s) less a margin."), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
