"""Incremental saves (``AtomicCheckpointIO(dedup=True)``, issue 41) against full saves, on local disk or S3.

    python benchmarks/incremental.py                         # LoRA (256 MiB frozen base) and a full fine-tune
    python benchmarks/incremental.py --base-mib 64 --saves 4
    python benchmarks/incremental.py --store s3-latency      # moto behind the latency proxy of checkpoint_io.py

Two training states, each saved ``--saves`` times with one optimizer step between saves, with ``dedup=False``
(today's default) and ``dedup=True``, each with synchronous saves and with ``async_save=True``, into a fresh root
(``keep_last=2``) on this disk or on the latency-modelled S3:

- ``lora``: a frozen base (linear layers of ``--base-mib`` MiB in total, float32, plus their norms) with rank-8
  low-rank adapters on each layer, trained with AdamW: the trainable state is the adapters and their two moments;
- ``full``: the same model with every weight trainable (AdamW over everything): every tensor changes at every save,
  so ``dedup`` can only cost (its layout, a pointer read per save), never save anything.

Reported per save: bytes written (the objects the commit wrote into its own folder; the rest it references), save time
(until committed) and blocked time (until ``save_checkpoint`` returned: what the training loop waits for); per run: the
bytes the root holds at the end (after keep_last), and the trainable bytes (weights + AdamW's two moments). Writes
``benchmarks/results/incremental_cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import importlib.util
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


def root_bytes(root: str, options: dict[str, Any]) -> int:
    """Bytes of the root's checkpoints (not its pointer folder), on local disk or S3."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **options)
    fs.invalidate_cache()
    return sum(int(info["size"]) for name, info in fs.find(path, detail=True).items()
               if "/.lightning_resilient/" not in name)


def _sibling(name: str) -> Any:
    path = os.path.join(os.path.dirname(__file__), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_run(case: str, dedup: bool, base_mib: int, saves: int, where: str, suffix: str = "", *,
            background: bool = False, options: dict[str, Any] | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    dim = 2048
    layers = max(1, base_mib * 2**20 // (dim * dim * 4))
    model = Model(dim, layers, rank=8, frozen=case == "lora")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    options = options or {}
    root = f"{where}/{case}-{'dedup' if dedup else 'full'}{'-async' if background else ''}{suffix}"
    io = AtomicCheckpointIO(dedup=dedup, keep_last=2, async_save=background, storage_options=options)
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
            blocked = time.perf_counter() - started  # what the training loop waited for
            io.wait()  # (the benchmark waits for the commit, to time it and read its manifest; training would not)
            seconds = time.perf_counter() - started
            store = io.root(root).store
            pointer = Pointer.from_bytes(store.read(POINTER_NAME), where=root)
            assert pointer.latest is not None
            commit = pointer.latest.commit
            manifest = Manifest.from_bytes(store.read(f"{commit}/manifest.json"), where=commit)
            written = sum(o.size for o in manifest.objects if o.path.rsplit("/", 1)[0] == commit)
            rows.append({"step": step, "seconds": seconds, "blocked": blocked, "written": written,
                         "total": manifest.total_bytes})
    finally:
        io.teardown()
    return {"case": case, "dedup": dedup, "async": background, "saves": rows, "root_bytes": root_bytes(root, options),
            "trainable_bytes": 3 * sum(p.numel() * p.element_size() for p in trainable),
            "checkpoint_bytes": rows[-1]["total"]}


MODES = [(False, False), (False, True), (True, False), (True, True)]  # (async_save, dedup), interleaved per repeat


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case, interleaved (medians over them)")
    parser.add_argument("--dir", default=None, help="where the roots go (default: a temp folder on this disk)")
    parser.add_argument("--store", choices=["local", "s3-latency"], default="local",
                        help="s3-latency: moto on loopback behind the proxy that models a cloud store (as in"
                             " checkpoint_io.py)")
    parser.add_argument("--latency", type=float, default=0.03, help="s3-latency: seconds added per request")
    parser.add_argument("--bandwidth", type=float, default=40e6, help="s3-latency: bytes/s per connection")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the results go (.md and .json are added; default: results/incremental_cpu, or"
                             " results/incremental_s3_latency with --store s3-latency)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / ("incremental_cpu" if args.store == "local" else "incremental_s3_latency")
    where = tempfile.mkdtemp(prefix="incremental-", dir=args.dir)
    servers = None
    options: dict[str, Any] = {}
    location = where
    if args.store == "s3-latency":
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # (before any S3 client exists; Servers sets the keys)
        io_bench = _sibling("checkpoint_io")
        servers = io_bench.Servers(args.latency, args.bandwidth)
        servers.start(["s3-latency"])
        spec = servers.store("s3-latency", where)
        location, options = f"{spec['location']}/incremental", {"client_kwargs": {"endpoint_url": spec["endpoint"]}}
    runs = []
    try:
        for case in ("lora", "full"):
            for repeat in range(args.repeat):
                for background, dedup in MODES:
                    runs.append(one_run(case, dedup, args.base_mib, args.saves, location, f"-{repeat}",
                                        background=background, options=options))
                    print(f"{case} async={background} dedup={dedup}: written per save (MiB)",
                          [mib(r["written"]) for r in runs[-1]["saves"]],
                          "s", [round(r["seconds"], 3) for r in runs[-1]["saves"]],
                          "blocked s", [round(r["blocked"], 3) for r in runs[-1]["saves"]])
    finally:
        shutil.rmtree(where, ignore_errors=True)
        if servers is not None:
            servers.stop()
    place = ("local disk" if args.store == "local" else
             f"moto S3 on loopback behind a proxy adding {args.latency * 1000:.0f} ms per request and capping each"
             f" connection at {args.bandwidth / 1e6:.0f} MB/s")
    lines = [f"# Incremental saves (dedup) vs full saves, {place.split(' behind')[0]}", "",
             f"Store: {place}.", "",
             (f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; base {args.base_mib}"
              f" MiB float32, {args.saves} saves, one AdamW step between saves, keep_last=2; synchronous saves, and"
              " background ones (`async_save=True`). Written: the objects a commit wrote into its own folder (the rest"
              " it references). Save s: until committed; blocked s: until save_checkpoint returned (what the training"
              " loop waits for; the whole save when synchronous). Later saves: 3..N for bytes (save 2 also rewrites"
              " the small frozen tensors once), 2..N for time; medians over saves and over"
              f" {args.repeat} interleaved runs of each row (a shared 2-core machine: times vary by 20% or more)."), "",
             ("| case | saves | dedup | checkpoint MiB | trainable MiB (w + 2 moments) | save 1 written MiB |"
              " save 2 written MiB | later saves written MiB (median) | later/trainable | save 1 s |"
              " later saves s (median) | later blocked s (median) | root MiB at the end |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in ("lora", "full"):
        for background, dedup in MODES:
            same = [r for r in runs if r["case"] == case and r["dedup"] == dedup and r["async"] == background]
            run = same[0]
            later = run["saves"][1:]
            written = statistics.median(r["written"] for r in later[1:] or later)
            seconds = statistics.median(r["seconds"] for x in same for r in x["saves"][1:])
            blocked = statistics.median(r["blocked"] for x in same for r in x["saves"][1:])
            first = statistics.median(x["saves"][0]["seconds"] for x in same)
            lines.append(f"| {run['case']} | {'async' if background else 'sync'} | {'on' if run['dedup'] else 'off'} |"
                         f" {mib(run['checkpoint_bytes'])} |"
                         f" {mib(run['trainable_bytes'])} | {mib(run['saves'][0]['written'])} |"
                         f" {mib(later[0]['written'])} | {mib(written)} | {written / run['trainable_bytes']:.2f}x |"
                         f" {first:.3f} | {seconds:.3f} | {blocked:.3f} | {mib(run['root_bytes'])} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"base_mib": args.base_mib, "saves": args.saves,
                                                               "runs": runs}, indent=1) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
