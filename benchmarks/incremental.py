"""Incremental saves (``AtomicCheckpointIO(dedup=True)``, issue 41) against full saves, on local disk.

    python benchmarks/incremental.py                         # LoRA (256 MiB frozen base) and a full fine-tune
    python benchmarks/incremental.py --base-mib 64 --saves 4

Two training states, each saved ``--saves`` times with one optimizer step between saves, once with ``dedup=False``
(today's default) and once with ``dedup=True``, into a fresh root on this disk (synchronous saves, ``keep_last=2``):

- ``lora``: a frozen base (linear layers of ``--base-mib`` MiB in total, float32, plus their norms) with rank-8
  low-rank adapters on each layer, trained with AdamW: the trainable state is the adapters and their two moments;
- ``full``: the same model with every weight trainable (AdamW over everything): every tensor changes at every save,
  so ``dedup`` can only cost (its layout, a pointer read per save), never save anything.

Reported per save: bytes written (the objects the commit wrote into its own folder; the rest it references) and save
time (until committed); per run: the bytes the root holds at the end (after keep_last), and the trainable bytes
(weights + AdamW's two moments). Writes ``benchmarks/results/incremental_cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_resilient import AtomicCheckpointIO
from lightning_resilient.io.manifest import Manifest
from lightning_resilient.io.pointer import POINTER_NAME, Pointer

RESULTS = Path(__file__).with_name("results")


class Model(nn.Module):
    def __init__(self, dim: int, layers: int, rank: int, *, frozen: bool) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        if frozen:
            for p in [*self.base.parameters(), *self.norms.parameters()]:
                p.requires_grad_(False)
        self.down = nn.ParameterList(nn.Parameter(torch.randn(rank, dim) * 0.01) for _ in range(layers))
        self.up = nn.ParameterList(nn.Parameter(torch.zeros(dim, rank)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, norm, down, up in zip(self.base, self.norms, self.down, self.up, strict=True):
            x = norm(base(x) + x @ down.T @ up.T)
        return x


def root_bytes(root: str) -> int:
    return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file() and ".lightning_resilient" not in f.parts)


def one_run(case: str, dedup: bool, base_mib: int, saves: int, where: str, suffix: str = "") -> dict[str, Any]:
    torch.manual_seed(0)
    dim = 2048
    layers = max(1, base_mib * 2**20 // (dim * dim * 4))
    model = Model(dim, layers, rank=8, frozen=case == "lora")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    root = os.path.join(where, f"{case}-{'dedup' if dedup else 'full'}{suffix}")
    io = AtomicCheckpointIO(dedup=dedup, keep_last=2)
    rows = []
    try:
        for step in range(1, saves + 1):
            loss = model(torch.randn(4, dim)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            checkpoint = {"epoch": 0, "global_step": step, "state_dict": model.state_dict(),
                          "optimizer_states": [opt.state_dict()]}
            started = time.perf_counter()
            io.save_checkpoint(checkpoint, f"{root}/step={step}.ckpt")
            seconds = time.perf_counter() - started
            pointer = Pointer.from_bytes(Path(root, POINTER_NAME).read_bytes(), where=root)
            assert pointer.latest is not None
            commit = pointer.latest.commit
            manifest = Manifest.from_bytes(Path(root, commit, "manifest.json").read_bytes(), where=commit)
            written = sum(o.size for o in manifest.objects if o.path.rsplit("/", 1)[0] == commit)
            rows.append({"step": step, "seconds": seconds, "written": written, "total": manifest.total_bytes})
    finally:
        io.teardown()
    return {"case": case, "dedup": dedup, "saves": rows, "root_bytes": root_bytes(root),
            "trainable_bytes": 3 * sum(p.numel() * p.element_size() for p in trainable),
            "checkpoint_bytes": rows[-1]["total"]}


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case, interleaved (medians over them)")
    parser.add_argument("--dir", default=None, help="where the roots go (default: a temp folder on this disk)")
    parser.add_argument("--out", type=Path, default=RESULTS / "incremental_cpu",
                        help="where the results go (.md and .json are added)")
    args = parser.parse_args(argv)
    where = tempfile.mkdtemp(prefix="incremental-", dir=args.dir)
    runs = []
    try:
        for case in ("lora", "full"):
            for repeat in range(args.repeat):
                for dedup in (False, True):
                    runs.append(one_run(case, dedup, args.base_mib, args.saves, where, f"-{repeat}"))
                    print(f"{case} dedup={dedup}: written per save (MiB)",
                          [mib(r["written"]) for r in runs[-1]["saves"]],
                          "s", [round(r["seconds"], 3) for r in runs[-1]["saves"]])
    finally:
        shutil.rmtree(where, ignore_errors=True)
    lines = ["# Incremental saves (dedup) vs full saves, local disk", "",
             (f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; base {args.base_mib}"
              f" MiB float32, {args.saves} synchronous saves, one AdamW step between saves, keep_last=2. Written: the"
              " objects a commit wrote into its own folder (the rest it references). Later saves: 3..N for bytes"
              " (save 2 also rewrites the small frozen tensors once), 2..N for time; medians over saves and over"
              f" {args.repeat} interleaved runs of each row (a shared 2-core machine: times vary by 20% or more)."), "",
             ("| case | dedup | checkpoint MiB | trainable MiB (w + 2 moments) | save 1 written MiB | save 2 written"
              " MiB"
              " | later saves written MiB (median) | later/trainable | save 1 s | later saves s (median) |"
              " root MiB at the end |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in ("lora", "full"):
        for dedup in (False, True):
            same = [r for r in runs if r["case"] == case and r["dedup"] == dedup]
            run = same[0]
            later = run["saves"][1:]
            written = statistics.median(r["written"] for r in later[1:] or later)
            seconds = statistics.median(r["seconds"] for x in same for r in x["saves"][1:])
            first = statistics.median(x["saves"][0]["seconds"] for x in same)
            lines.append(f"| {run['case']} | {'on' if run['dedup'] else 'off'} | {mib(run['checkpoint_bytes'])} |"
                         f" {mib(run['trainable_bytes'])} | {mib(run['saves'][0]['written'])} |"
                         f" {mib(later[0]['written'])} | {mib(written)} | {written / run['trainable_bytes']:.2f}x |"
                         f" {first:.3f} | {seconds:.3f} | {mib(run['root_bytes'])} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"base_mib": args.base_mib, "saves": args.saves,
                                                               "runs": runs}, indent=1) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
