"""Save and load time of AtomicCheckpointIO vs stock Lightning TorchCheckpointIO, and the raw I/O limit.

Same checkpoint, same store, medians of several runs. Stores: local disk and S3 (moto on loopback).
The raw limit is ``fs.pipe`` / ``fs.cat`` of the same bytes as one object (no serialization, no checksums).

    python benchmarks/save_load.py --size-mb 100 --runs 5 [--stores local,s3] [--out results.md]

Issue 6 extends this into the full comparison (async saves, DCP, throttled-store proxy, peak RSS, plot).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch


def make_checkpoint(size_mb: int) -> dict[str, Any]:
    n = size_mb * 2**20 // 4
    per = max(1, n // 16)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(16)}
    return {"state_dict": state, "global_step": 1, "epoch": 0}


def timed(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_store(kind: str, base: str, options: dict[str, Any], ckpt: dict[str, Any], runs: int) -> list[tuple]:
    import fsspec
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_resilient import AtomicCheckpointIO

    rows = []
    nbytes = sum(t.numel() * t.element_size() for t in ckpt["state_dict"].values())
    fs, base_path = fsspec.core.url_to_fs(base, **options)
    raw = b"".join(t.numpy().tobytes() for t in ckpt["state_dict"].values())

    def raw_save() -> None:
        path = f"{base_path}/raw/{uuid.uuid4().hex}"
        if kind == "local":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
        else:
            fs.pipe_file(path, raw)
        raw_save.last = path  # type: ignore[attr-defined]

    t_raw_save = timed(raw_save, runs)
    t_raw_load = timed(lambda: fs.cat_file(raw_save.last), runs)  # type: ignore[attr-defined]
    label = "raw limit (one object, fsync)" if kind == "local" else "raw limit (one object)"
    rows.append((kind, label, t_raw_save, t_raw_load))

    stock = TorchCheckpointIO()
    stock_path = f"{base}/stock.ckpt"
    if kind == "local":
        t_save = timed(lambda: stock.save_checkpoint(ckpt, stock_path), runs)
        t_load = timed(lambda: stock.load_checkpoint(stock_path), runs)
        rows.append((kind, "Lightning TorchCheckpointIO", t_save, t_load))
    else:
        # TorchCheckpointIO rejects storage_options; for S3 it reads the endpoint from the environment.
        t_save = timed(lambda: stock.save_checkpoint(ckpt, stock_path), runs)
        t_load = timed(lambda: stock.load_checkpoint(stock_path), runs)
        rows.append((kind, "Lightning TorchCheckpointIO", t_save, t_load))

    for conc in (1, 4):
        ours = AtomicCheckpointIO(storage_options=options, max_concurrency=conc, keep_last=1)
        counter = iter(range(10**6))
        root = f"{base}/atomic-{conc}"
        t_save = timed(lambda: ours.save_checkpoint(dict(ckpt, global_step=next(counter)),
                                                   f"{root}/step.ckpt"), runs)
        reader = AtomicCheckpointIO(storage_options=options, max_concurrency=conc, claim_on_load=False)
        t_load = timed(lambda: reader.load_checkpoint(root), runs)
        rows.append((kind, f"AtomicCheckpointIO (concurrency {conc}, verified)", t_save, t_load))
    return [(k, name, s, l, nbytes) for k, name, s, l in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ckpt = make_checkpoint(args.size_mb)
    rows: list[tuple] = []
    stores = args.stores.split(",")
    if "local" in stores:
        with tempfile.TemporaryDirectory() as tmp:
            rows += bench_store("local", tmp, {}, ckpt, args.runs)
    if "s3" in stores:
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1"})
        import boto3
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        try:
            rows += bench_store("s3 (moto)", "s3://bench/run", {}, ckpt, args.runs)
        finally:
            server.stop()

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}," \
              f" torch {torch.__version__}"
    lines = [f"Checkpoint {args.size_mb} MB of float32 tensors, median of {args.runs} runs; machine: {machine}", "",
             "| store | method | save s | load s | save MB/s | save vs stock | load vs stock |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for kind in dict.fromkeys(r[0] for r in rows):
        group = [r for r in rows if r[0] == kind]
        stock = next(r for r in group if r[1].startswith("Lightning"))
        for _, name, save, load, nbytes in group:
            lines.append(f"| {kind} | {name} | {save:.3f} | {load:.3f} | {nbytes / 2**20 / save:.0f} |"
                         f" {save / stock[2]:.2f}x | {load / stock[3]:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
