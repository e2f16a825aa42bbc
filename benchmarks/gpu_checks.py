"""Every check that needs a GPU, in one run (the device machine is lent briefly: prepare, run once, record).

    python benchmarks/gpu_checks.py --out "$OUT"        # aimed at < 9 minutes on one GPU (the device budget is 15)

1. AutoPrecision on the real device: the choice (and the detected facts) and a short Trainer fit with it.
2. Pinned memory: an async save of a ~1 GB checkpoint of CUDA tensors (non-blocking device-to-host copies into
   the pinned snapshot), then a load with ``map_location="cuda"`` through pinned buffers; bit-exact, timed.
3. TransferAudit on a CUDA run with a pageable loader, a blocking copy and a per-step ``.item()``: one warning each.
4. The benchmarks: ``step_time.py`` with a real CUDA training loop (step time while a 1 GiB async save or persist
   of CUDA tensors runs behind it), the restore of a replaced node from a peer against the latency-modelled S3 (on
   the machine's CPUs), ``precision_gpu.py``, ``checkpoint_io.py`` (local disk, 1 GB) and ``scaling.py``.
Each check prints PASS or FAIL and goes on; ``gpu_checks.md`` is rewritten after every check, so a run cut short
by the lease still brings back what it finished. Checks that would start after ``--budget-s`` seconds are skipped
(and listed as such). Results land in ``--out`` (``gpu_checks.md`` and the benchmarks' files), ready to quote in
docs/benchmarks.md and the README.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
LINES: list[str] = []
STARTED = time.perf_counter()


def check(name: str, fn: Callable[[], str], budget_s: float = float("inf"), out: str | None = None) -> None:
    started = time.perf_counter()
    if started - STARTED > budget_s:
        LINES.append(f"- SKIPPED {name}: past the --budget-s of {budget_s:.0f} s")
        print(LINES[-1], flush=True)
        return
    try:
        detail = fn()
        LINES.append(f"- PASS {name} ({time.perf_counter() - started:.1f} s): {detail}")
    except Exception:
        LINES.append(f"- FAIL {name}: {traceback.format_exc(limit=3)}")
    print(LINES[-1], flush=True)
    if out is not None:
        write(out)


def write(out: str) -> None:
    import torch

    head = (f"Machine: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, total {time.perf_counter() - STARTED:.0f} s")
    with open(os.path.join(out, "gpu_checks.md"), "w") as f:
        f.write("# GPU checks\n\n" + head + "\n\n" + "\n".join(LINES) + "\n")


def precision_choice() -> str:
    import torch
    from lightning.pytorch import Trainer

    sys.path.insert(0, os.path.join(HERE, ".."))
    from lightning_resilient import AutoPrecision
    from lightning_resilient.precision import detect_facts
    from tests.models import TinyModel, tiny_loader

    plugin = AutoPrecision()
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=5, plugins=[plugin], logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(TinyModel(), tiny_loader())
    return f"{plugin.precision} on {torch.cuda.get_device_name(0)}; facts {detect_facts('cuda:0')}"


def pinned_roundtrip() -> str:
    import torch

    from lightning_resilient import AtomicCheckpointIO

    g = torch.Generator(device="cuda").manual_seed(0)
    ckpt = {"global_step": 1, "state_dict": {f"w{i}": torch.randn(16, 2**20, device="cuda", generator=g)
                                             for i in range(16)}}  # 16 x 64 MiB = 1 GiB
    root = tempfile.mkdtemp(prefix="gpu-pinned-")
    io = AtomicCheckpointIO(async_save=True)
    assert io.pin_memory, "pin_memory=None should pin on a CUDA machine"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    io.save_checkpoint(ckpt, f"{root}/a.ckpt")
    blocked = time.perf_counter() - t0
    io.wait()
    committed = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = AtomicCheckpointIO(claim_on_load=False).load_checkpoint(root, map_location="cuda")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    assert all(loaded["state_dict"][k].is_cuda and torch.equal(loaded["state_dict"][k], v)
               for k, v in ckpt["state_dict"].items())
    io.teardown()
    return (f"1 GiB of CUDA tensors: async save blocked {blocked:.3f} s, committed after {committed:.2f} s; load to"
            f" cuda through pinned buffers {load_s:.2f} s; bit-exact")


def transfer_audit() -> str:
    import torch
    from lightning.pytorch import Trainer

    sys.path.insert(0, os.path.join(HERE, ".."))
    from lightning_resilient import TransferAudit
    from tests.models import TinyModel, tiny_loader

    class Syncing(TinyModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            loss.item()  # a host sync every step
            return loss

    audit = TransferAudit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(accelerator="cuda", devices=1, max_steps=5, callbacks=[audit], logger=False,
                enable_progress_bar=False, enable_checkpointing=False,
                enable_model_summary=False).fit(Syncing(), tiny_loader())
    reported = [str(w.message)[:80] for w in caught if "TransferAudit" in type(w.message).__name__ or "audit" in
                str(w.message).lower()]
    return f"counts {dict(audit.counts)}; warnings: {reported}"


def run_script(args: list[str], timeout: int) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--skip-benchmarks", action="store_true")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no check after this many seconds (the device is lent for minutes)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    def run(name: str, fn: Callable[[], str]) -> None:
        check(name, fn, args.budget_s, args.out)

    def script(argv: list[str], timeout: int) -> Callable[[], str]:
        # a benchmark may not run past the budget either: it gets what is left of it, at least a minute
        left = max(60, int(args.budget_s + 60 - (time.perf_counter() - STARTED)))
        return lambda: run_script(argv, min(timeout, left))

    run("AutoPrecision on the GPU", precision_choice)
    run("pinned async save and CUDA load, 1 GiB", pinned_roundtrip)
    run("TransferAudit on a CUDA run", transfer_audit)
    if not args.skip_benchmarks:
        run("step_time.py (CUDA loop, 1 GiB)", script(
            [os.path.join(HERE, "step_time.py"), "--loops", "cuda", "gpu", "--cases", "async-save", "persist",
             "--size-mb", "1024", "--runs", "3", "--note", "On the lent H200 machine (gpu_checks.py).",
             "--out", os.path.join(args.out, "step_time_gpu")], 240))
        # CPU work, but the device machine's 16 cores stand for two hosts: each "node" has cores of its own (on the
        # 2-core VM both nodes' loads share two cores). Needs moto's server and s3fs there (see docs/development.md).
        run("step_time.py restore (peer vs s3-latency, 512 MiB)", script(
            [os.path.join(HERE, "step_time.py"), "--cases", "restore", "--runs", "5",
             "--note", "On the lent H200 machine's 16 cores (gpu_checks.py): each node's process has cores of its own.",
             "--out", os.path.join(args.out, "step_time_restore_gpu_host")], 150))
        run("precision_gpu.py", script(
            [os.path.join(HERE, "precision_gpu.py"), "--out", os.path.join(args.out, "precision_gpu")], 180))
        run("checkpoint_io.py (local, 1 GB)", script(
            [os.path.join(HERE, "checkpoint_io.py"), "--sizes", "1000", "--runs", "3", "--stores", "local",
             "--out", os.path.join(args.out, "checkpoint_io_gpu")], 300))
        # (a save every 200 steps, ~4 s apart on an H200: the default 20 keeps one save always behind training)
        run("scaling.py", script(
            [os.path.join(HERE, "scaling.py"), "--steps", "600", "--every-n-steps", "200", "--async-save",
             "--out", os.path.join(args.out, "scaling_gpu_async_200")], 180))
    write(args.out)


if __name__ == "__main__":
    main()
