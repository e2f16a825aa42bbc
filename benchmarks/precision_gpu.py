"""What AutoPrecision chooses on this machine, and the numbers behind it: step time and peak memory of a
transformer block under bf16-mixed, 16-mixed (with a GradScaler) and 32-true.

    python benchmarks/precision_gpu.py                  # the current GPU (or the CPU when there is none)
    python benchmarks/precision_gpu.py --device cpu --d-model 128 --steps 3    # a quick CPU smoke run
    python benchmarks/precision_gpu.py ... --out benchmarks/results/precision_cpu    # also writes OUT.md

Each precision runs the same block, batch and optimizer, the same way Lightning's plugins do (autocast, and a
GradScaler for fp16); step time is the median over ``--steps`` timed steps after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import torch

from lightning_resilient.precision import choose_for_device, detect_facts


def run(precision: str, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model, batch_first=True,
                                             dropout=0.0).to(device)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.seq, args.d_model, device=device)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = block(x).float().pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return {"precision": precision, "step_ms": 1000 * statistics.median(times), "peak_mib": peak}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the table, with the machine, to OUT.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    facts = detect_facts(device)
    choice = choose_for_device(device)
    shown = {k: v for k, v in facts.items() if k != "cpu_flags"}
    lines = [f"device: {device} {shown}", f"AutoPrecision chooses: {choice.precision} ({choice.reason})", "",
             (f"TransformerEncoderLayer d_model={args.d_model}, heads={args.heads}, batch={args.batch}x{args.seq},"
              f" AdamW; median of {args.steps} steps after {args.warmup}"), "",
             "| precision | step ms | vs 32-true | peak MiB |", "|---|---:|---:|---:|"]
    results = [run(p, device, args) for p in ("bf16-mixed", "16-mixed", "32-true")]
    base = next(r for r in results if r["precision"] == "32-true")["step_ms"]
    for r in results:
        mark = " (chosen)" if r["precision"] == choice.precision else ""
        peak = "n/a (CPU)" if r["peak_mib"] != r["peak_mib"] else f"{r['peak_mib']:.0f}"
        lines.append(f"| {r['precision']}{mark} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x | {peak} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(f"{args.out}.md", "w") as f:
            f.write(f"# Mixed precision: step time per precision\n\nMachine: {machine_description()}\n\n{text}\n")
    return text


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.machine()} {cpu}, {os.cpu_count()} cores, {gpu}, Python {platform.python_version()},"
            f" torch {torch.__version__}")


if __name__ == "__main__":
    main()
