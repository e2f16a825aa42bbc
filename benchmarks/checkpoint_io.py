"""Checkpoint save/load against the peers and the raw I/O limit, on the same checkpoint and the same store.

    python benchmarks/checkpoint_io.py                          # 100 MB and 1 GB; local, S3, S3 with latency
    python benchmarks/checkpoint_io.py --size-mb 250 --runs 5   # a size of your own, more runs
    python benchmarks/checkpoint_io.py --stores local --sizes 100

Methods (each measured in a fresh worker process, so peak RSS belongs to it alone):

- ``raw``: the limit. The checkpoint's tensor bytes, already in one buffer, written and read as the same objects
  at the same concurrency with plain ``fs.pipe``/``fs.cat`` (local disk: one file, written sequentially and
  fsynced, ``dd conv=fsync``-style, and read back in one pass);
- ``ours-sync`` / ``ours-async``: ``AtomicCheckpointIO`` (``async_save=True`` for the second);
- ``ours-tiered``: ``AtomicCheckpointIO(async_save=True, local_tier=<a folder on this disk>, persist_every=1)``: save
  = until the checkpoint is durable in the store (persisted from the local tier), load = a resume from the local
  tier; also recorded: until the local commit, and a resume from the store alone (a new node);
- ``lightning``: stock ``TorchCheckpointIO``; ``lightning-async``: Lightning's ``AsyncCheckpointIO`` around it;
- ``dcp``: ``torch.distributed.checkpoint`` with its fsspec writer (``thread_count`` = our concurrency) and reader;
- ``s3torchconnector``: AWS's ``S3LightningCheckpoint`` (s3torchconnector, CRT client), the CheckpointIO a Lightning
  user on S3 is most likely to pick instead of ours (S3 stores only; installed for benchmarks only, never a dependency
  of the package: ``pip install --no-deps -r benchmarks/requirements.txt``; without it the row is left out).

Stores: ``local`` (a folder on this disk), ``s3`` (moto's server, in its own process, on loopback), and
``s3-latency``: the same server behind a loopback proxy that adds ``--latency`` seconds to every request and
caps every connection at ``--bandwidth`` bytes/s, a model of a cloud object store (which serves one
connection far slower than its aggregate: parallel connections add up, as they do on S3 or GCS).

Reported per method: save time (until the checkpoint is durable and visible), the time the training loop was
blocked (equal to save time for synchronous methods), load time, and peak RSS above the process's RSS before
the operation, as a multiple of the checkpoint size (a save of tensors already in memory; a load creates them,
so 1.0x is its floor). Each method runs ``--runs`` times in one process with one plugin instance, as a training
job would (one-off costs such as claiming the root or allocating the async snapshot buffer fall in the first
run, reported apart as "first save s"), into one root kept between runs (each save replaces the previous one's
checkpoint, as ``save_last`` does: ours deletes the replaced one behind the commit, which training overlaps, and
which the benchmark waits for outside the timings); medians; ratios against stock Lightning and against the raw
limit.
Writes a markdown table, a JSON file of every run and a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

MB = 10**6
METHODS = ["raw", "ours-sync", "ours-async", "ours-tiered", "lightning", "lightning-async", "dcp", "s3torchconnector"]
STORES = ["local", "s3", "s3-latency"]
BUCKET = "bench"
# The plugin's defaults (AtomicCheckpointIO's max_concurrency and shard_size): raw and DCP get the same concurrency,
# and raw writes the objects ours writes.
CONCURRENCY = 16
SHARD_SIZE = 8 * 2**20
S3_ONLY = {"s3torchconnector"}


def available(method: str, store: str) -> str | None:
    """Why ``method`` cannot run on ``store`` here (None: it can)."""
    if method in S3_ONLY and not store.startswith("s3"):
        return f"{method} writes S3 only"
    if method == "s3torchconnector":
        import importlib.util

        if importlib.util.find_spec("s3torchconnector") is None:
            return "s3torchconnector is not installed (pip install --no-deps -r benchmarks/requirements.txt)"
    return None


# -- the worker: one method on one store, every run, in its own process --------------------------------------------

def _rss_peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_now_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


#: The server processes whose CPU a save or load costs besides the client's own (the worker's spec names them):
#: moto ("store") and, on s3-latency, the proxy. On 2 cores all three share the machine, so a client that costs
#: less CPU leaves more to the server: the CPU columns say where a save's time went.
SERVER_PIDS: dict[str, int] = {}


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (every thread) or of ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _peak_rss(out: dict[str, float], key: str) -> Iterator[None]:
    """Peak RSS during the block above the RSS at entry, in MB (Linux: the high-water mark is reset on entry), and
    the CPU seconds the block cost this process and each of :data:`SERVER_PIDS` (``<phase>_cpu_<who>``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _rss_now_mb()
    phase = key.split("_")[0]
    who = {"client": None, **SERVER_PIDS}
    cpu = {name: _cpu_seconds(pid) for name, pid in who.items()}
    yield
    out[key] = max(0.0, _rss_peak_mb() - before)
    for name, pid in who.items():
        out[f"{phase}_cpu_{name}"] = _cpu_seconds(pid) - cpu[name]


def make_checkpoint(size_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A Lightning-shaped checkpoint of about ``size_bytes``: fp32 weights plus Adam's two moments."""
    import torch

    g = torch.Generator().manual_seed(seed)
    per_tensor = 4 * 2**20  # 4 MiB tensors, as in a transformer's projections
    n = max(1, size_bytes // (3 * per_tensor))
    rest = max(0, size_bytes - 3 * n * per_tensor) // 3 // 4
    shapes = [(1024, per_tensor // 4096)] * n + ([(rest,)] if rest else [])
    weights = {f"layer{i}.weight": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(s, generator=g),
                 "exp_avg_sq": torch.rand(s, generator=g)} for i, s in enumerate(shapes)}
    return {"epoch": 3, "global_step": 1000, "pytorch-lightning_version": "2.6.6", "state_dict": weights,
            "optimizer_states": [{"state": state, "param_groups": [{"lr": 1e-3, "params": list(state)}]}],
            "loops": {}, "callbacks": {}, "lr_schedulers": []}


def tensor_bytes(ckpt: dict[str, Any]) -> int:
    import torch

    total = 0

    def walk(node: Any) -> None:
        nonlocal total
        if isinstance(node, torch.Tensor):
            total += node.numel() * node.element_size()
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(ckpt)
    return total


def _dcp_state(ckpt: dict[str, Any]) -> dict[str, Any]:
    # DCP takes a dict of tensors (nested dicts allowed); the optimizer state goes in as such a dict.
    opt = {f"{i}.{k}": v for i, s in ckpt["optimizer_states"][0]["state"].items() for k, v in s.items()}
    return {"model": ckpt["state_dict"], "optim": opt}


class Store:
    """Where a worker writes: a URL prefix, fsspec options, and cleanup."""

    def __init__(self, kind: str, location: str, endpoint: str | None) -> None:
        self.kind = kind
        self.location = location
        self.endpoint = endpoint
        self.options: dict[str, Any] = {}
        if endpoint:
            self.options = {"client_kwargs": {"endpoint_url": endpoint}}

    def url(self, name: str) -> str:
        return f"{self.location.rstrip('/')}/{name}"

    def fs(self) -> Any:
        import fsspec

        from lightning_resilient.io.store import with_client_defaults

        # The client keeps as many connections as ours does (botocore's default of 10 would queue raw's uploads).
        options = with_client_defaults(self.options) if self.kind.startswith("s3") else self.options
        return fsspec.core.url_to_fs(self.location, **options)[0]

    def clean(self) -> None:
        fs = self.fs()
        path = fsspec_path(self.location, self.options)
        try:
            if fs.exists(path):
                fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache()


def fsspec_path(url: str, options: dict[str, Any]) -> str:
    import fsspec

    return fsspec.core.url_to_fs(url, **options)[1]


class Runner:
    """One method on one store, measured over several runs in one process, as a training job would use it: the
    plugin is built once, so one-off costs (claiming the root, allocating the snapshot buffer) land in the first
    run, and the reported median is the steady state."""

    def __init__(self, method: str, store: Store) -> None:
        self.method = method
        self.store = store
        self.target = store.url("run")
        if method in ("ours-sync", "ours-async"):
            from lightning_resilient import AtomicCheckpointIO

            self.io: Any = AtomicCheckpointIO(storage_options=store.options, async_save=method == "ours-async",
                                              max_concurrency=CONCURRENCY, claim_on_load=False)
            self.loader: Any = AtomicCheckpointIO(storage_options=store.options, max_concurrency=CONCURRENCY,
                                                  claim_on_load=False)
        elif method == "ours-tiered":
            from lightning_resilient import AtomicCheckpointIO

            # The "node-local disk" is this machine's temp folder; the durable tier is the store under test.
            self.local_tier = tempfile.mkdtemp(prefix="bench-local-tier-")
            common = {"storage_options": store.options, "max_concurrency": CONCURRENCY, "claim_on_load": False}
            self.io = AtomicCheckpointIO(async_save=True, local_tier=self.local_tier, persist_every=1, **common)
            self.loader = AtomicCheckpointIO(local_tier=self.local_tier, **common)  # a restart on the same node
            self.durable_loader = AtomicCheckpointIO(**common)  # a restart on a new node: the store alone
        elif method in ("lightning", "lightning-async"):
            from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

            self.loader = TorchCheckpointIO()
            self.io = AsyncCheckpointIO(TorchCheckpointIO()) if method == "lightning-async" else self.loader
        elif method == "s3torchconnector":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.lightning import S3LightningCheckpoint

            # Its own CRT client: the endpoint (moto or the proxy) by argument, path-style addressing for moto.
            self.io = self.loader = S3LightningCheckpoint("us-east-1", endpoint=store.endpoint,
                                                          s3client_config=S3ClientConfig(force_path_style=True))

    def run(self, ckpt: dict[str, Any], size: int) -> dict[str, float]:
        """One save and one load; returns timings (s) and peak RSS increases (MB)."""
        import torch

        out: dict[str, float] = {}
        method, store, target = self.method, self.store, self.target
        if method in ("ours-sync", "ours-async"):
            with _peak_rss(out, "save_rss"):
                t0 = time.perf_counter()
                self.io.save_checkpoint(ckpt, f"{target}/step.ckpt")
                out["blocked"] = time.perf_counter() - t0
                if self.io._async is not None:  # the commit of the async save (durable then)
                    self.io._async.wait()
                    self.io._async.raise_error()
                out["save"] = time.perf_counter() - t0
                # The deletion of the checkpoint this save replaced (retired), which runs behind the commit: training
                # overlaps it; here it is waited for outside any timing, so that it does not overlap the load.
                self.io.wait()
            # The async snapshot buffer stays allocated between saves (reused): it is part of every save's memory,
            # even once it no longer shows as growth during one.
            held = self.io._async.snapshot.nbytes if self.io._async is not None else 0
            out["save_rss"] = max(out["save_rss"], held / 2**20)
            with _peak_rss(out, "load_rss"):
                t0 = time.perf_counter()
                loaded = self.loader.load_checkpoint(target)
                out["load"] = time.perf_counter() - t0
            _check(loaded["state_dict"], ckpt["state_dict"])
        elif method == "ours-tiered":
            with _peak_rss(out, "save_rss"):
                t0 = time.perf_counter()
                self.io.save_checkpoint(ckpt, f"{target}/step.ckpt")
                out["blocked"] = time.perf_counter() - t0
                self.io._async.wait()  # the local commit (the save is done, locally)
                self.io._async.raise_error()
                out["local_commit"] = time.perf_counter() - t0
                self.io.wait()  # and the persist queued behind it: durable in the store
                out["save"] = time.perf_counter() - t0
            out["save_rss"] = max(out["save_rss"], self.io._async.snapshot.nbytes / 2**20)
            with _peak_rss(out, "load_rss"):
                t0 = time.perf_counter()
                loaded = self.loader.load_checkpoint(target)
                out["load"] = time.perf_counter() - t0
            assert self.loader.last_load is not None
            _check(loaded["state_dict"], ckpt["state_dict"])
            del loaded
            t0 = time.perf_counter()
            loaded = self.durable_loader.load_checkpoint(target)
            out["durable_load"] = time.perf_counter() - t0
            _check(loaded["state_dict"], ckpt["state_dict"])
            out["durable_bytes"] = float(self.durable_loader.last_load.bytes)  # what one persist wrote to the store
        elif method in ("lightning", "lightning-async", "s3torchconnector"):
            path = f"{target}/step.ckpt"
            with _peak_rss(out, "save_rss"):
                t0 = time.perf_counter()
                self.io.save_checkpoint(ckpt, path)
                out["blocked"] = time.perf_counter() - t0
                if method == "lightning-async":
                    # AsyncCheckpointIO has no public wait: its executor holds the pending save (teardown would
                    # shut it down for good).
                    self.io._executor.submit(lambda: None).result()
                    if self.io._error:
                        raise self.io._error
                out["save"] = time.perf_counter() - t0
            with _peak_rss(out, "load_rss"):
                t0 = time.perf_counter()
                loaded = self.loader.load_checkpoint(path)
                out["load"] = time.perf_counter() - t0
            _check(loaded["state_dict"], ckpt["state_dict"])
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

            state = _dcp_state(ckpt)
            with _peak_rss(out, "save_rss"):
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=FsspecWriter(target, thread_count=CONCURRENCY, **store.options))
                out["save"] = out["blocked"] = time.perf_counter() - t0
            with _peak_rss(out, "load_rss"):
                # DCP loads in place: the destination tensors are part of what a load creates, as for the others.
                template = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
                t0 = time.perf_counter()
                dcp.load(template, storage_reader=FsspecReader(target, **store.options))
                out["load"] = time.perf_counter() - t0
            _check(template["model"], ckpt["state_dict"])
        elif method == "raw":
            out.update(_raw(store, ckpt, target, size))
        else:
            raise ValueError(f"unknown method {method!r}")
        return out


def _check(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    import torch

    bad = [k for k in expected if not torch.equal(loaded[k].cpu(), expected[k])]
    if bad:
        raise AssertionError(f"loaded tensors differ from the saved ones: {bad[:3]}")


def _raw(store: Store, ckpt: dict[str, Any], target: str, size: int) -> dict[str, float]:
    """The I/O limit: the same bytes, already serialized, as the same objects at the same concurrency."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning_resilient.io import layout

    out: dict[str, float] = {}
    _, slots = layout.flatten(ckpt)
    total = layout.plan(slots)
    snapshot = layout.Snapshot(pin_memory=False)
    snapshot.fill(slots, total)
    view = snapshot.sources(total)
    spans = layout.windows(total, layout.object_size(total, SHARD_SIZE, CONCURRENCY))  # the objects ours writes
    fs = store.fs()
    base = fsspec_path(target, store.options)
    if store.kind == "local":
        os.makedirs(base, exist_ok=True)
        path = os.path.join(base, "stream.bin")
        with _peak_rss(out, "save_rss"):
            t0 = time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                for a in range(0, total, 16 * 2**20):
                    f.write(view[a : a + 16 * 2**20])
                os.fsync(f.fileno())
            out["save"] = out["blocked"] = time.perf_counter() - t0
        with _peak_rss(out, "load_rss"):
            t0 = time.perf_counter()
            block = bytearray(16 * 2**20)  # dd-style: the read throughput itself, into one reused buffer
            with open(path, "rb", buffering=0) as f:
                while f.readinto(block):
                    pass
            out["load"] = time.perf_counter() - t0
        return out
    from lightning_resilient.io.store import GatherReader

    bucket, key, _ = fs.split_path(base)

    def put(i: int) -> None:
        a, b = spans[i]
        # One PUT per object, from the buffer without a copy (what fs.pipe would do given bytes).
        fs.call_s3("put_object", Bucket=bucket, Key=f"{key}/obj-{i:05d}", Body=GatherReader([view[a:b]]))

    with _peak_rss(out, "save_rss"):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(put, range(len(spans))))
        out["save"] = out["blocked"] = time.perf_counter() - t0
    with _peak_rss(out, "load_rss"):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            parts = list(pool.map(lambda i: fs.cat_file(f"{base}/obj-{i:05d}"), range(len(spans))))
        out["load"] = time.perf_counter() - t0
    assert sum(len(p) for p in parts) == total
    return out


def worker(spec: dict[str, Any]) -> None:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import warnings

    warnings.filterwarnings("ignore")
    SERVER_PIDS.update(spec.get("server_pids", {}))
    store = Store(spec["store"], spec["location"], spec.get("endpoint"))
    ckpt = make_checkpoint(spec["size"])
    size = tensor_bytes(ckpt)
    runner = Runner(spec["method"], store)
    for run in range(spec["runs"]):
        time.sleep(spec.get("pause", 0.0))  # a save interval: in training, saves are minutes apart
        if run == 0 or not spec["method"].startswith("ours"):
            # Ours keeps its root between runs, as a training job's is: the next save replaces the last one's commit
            # (and deletes it, which the save's time includes). Deleting the root under a live job instead made each
            # later save rebuild a lost pointer, a path training never takes (12 serial requests on s3-latency).
            store.clean()
        ckpt["global_step"] = 1000 + run  # a new step each time, as in training (a repeat of a step is cheaper)
        result = runner.run(ckpt, size)
        result.update(run=run, bytes=size)
        print("RESULT " + json.dumps(result), flush=True)
    store.clean()
    if spec["method"] == "ours-tiered":
        runner.io.teardown()
        shutil.rmtree(runner.local_tier, ignore_errors=True)


# -- the driver -------------------------------------------------------------------------------------------------

class Servers:
    """moto's S3 server and the latency proxy, each in its own process."""

    def __init__(self, latency: float, bandwidth: float) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.latency = latency
        self.bandwidth = bandwidth
        self.s3: str | None = None
        self.proxy: str | None = None
        self.pids: dict[str, int] = {}
        self.proxy_pid: int | None = None

    def start(self, stores: list[str]) -> None:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
        if not any(s.startswith("s3") for s in stores):
            return
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # (``-m``: moto may be importable without its script on PATH, e.g. installed with pip --target)
        self.procs.append(subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                            str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True))
        self.s3 = f"http://127.0.0.1:{port}"
        self.pids = {"store": self.procs[-1].pid}
        _wait_http(self.s3)
        import boto3

        boto3.client("s3", endpoint_url=self.s3).create_bucket(Bucket=BUCKET)
        if "s3-latency" in stores:
            proc = subprocess.Popen([sys.executable, "-m", "lightning_resilient.testing", self.s3, "--latency",
                                     str(self.latency), "--bandwidth", str(self.bandwidth)],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
            self.procs.append(proc)
            assert proc.stdout is not None
            self.proxy = proc.stdout.readline().strip()
            self.proxy_pid = proc.pid

    def store(self, kind: str, tmp: str) -> dict[str, Any]:
        if kind == "local":
            return {"store": kind, "location": os.path.join(tmp, "local")}
        endpoint = self.s3 if kind == "s3" else self.proxy
        pids = {**self.pids, **({"proxy": self.proxy_pid} if kind == "s3-latency" and self.proxy_pid else {})}
        return {"store": kind, "location": f"s3://{BUCKET}/{kind}", "endpoint": endpoint, "server_pids": pids}

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def _wait_http(url: str, timeout: float = 30) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def measure(spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if spec.get("endpoint"):
        env["AWS_ENDPOINT_URL"] = spec["endpoint"]  # stock Lightning and DCP take no storage options here
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['method']} on {spec['store']} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def summarize(rows: list[dict[str, Any]]) -> dict[tuple[int, str, str], dict[str, float]]:
    grouped: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["size_mb"], r["store"], r["method"]), []).append(r)
    out = {}
    for key, runs in grouped.items():
        keys = ("save", "blocked", "load", "save_rss", "load_rss", "local_commit", "durable_load", "durable_bytes",
                *(f"{phase}_cpu_{who}" for phase in ("save", "load") for who in ("client", "store", "proxy")))
        med = {k: statistics.median(r[k] for r in runs) for k in keys if k in runs[0]}
        med["first_save"] = min(runs, key=lambda r: r.get("run", 0))["save"]
        med["bytes"] = runs[0]["bytes"]
        med["runs"] = len(runs)
        out[key] = med
    return out


def table(summary: dict[tuple[int, str, str], dict[str, float]], machine: str) -> str:
    lines = [f"Machine: {machine}", "",
             ("| size | store | method | save s | blocked s | load s | save MB/s | save vs stock | save vs raw |"
              " load vs stock | load vs raw | save vs s3torchconnector | load vs s3torchconnector | save RSS (x ckpt) |"
              " load RSS (x ckpt) |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (size_mb, store, method), m in sorted(summary.items(), key=lambda kv: (kv[0][0], STORES.index(kv[0][1]),
                                                                               METHODS.index(kv[0][2]))):
        stock = summary.get((size_mb, store, "lightning"))
        raw = summary.get((size_mb, store, "raw"))
        peer = summary.get((size_mb, store, "s3torchconnector"))
        mb = m["bytes"] / MB

        def ratio(ref: dict[str, float] | None, key: str, m: dict[str, float] = m) -> str:
            # "x faster": the reference's time over this one's (above 1: faster than the reference)
            return f"{ref[key] / m[key]:.2f}x" if ref and m[key] > 0 else "-"

        lines.append(f"| {size_mb} MB | {store} | {method} | {m['save']:.3f} | {m['blocked']:.3f} | {m['load']:.3f} |"
                     f" {mb / m['save']:.0f} | {ratio(stock, 'save')} | {ratio(raw, 'save')} | {ratio(stock, 'load')} |"
                     f" {ratio(raw, 'load')} | {ratio(peer, 'save')} | {ratio(peer, 'load')} |"
                     f" {m['save_rss'] * 2**20 / MB / mb:.2f} |"
                     f" {m['load_rss'] * 2**20 / MB / mb:.2f} |")
    lines += ["", "Ratios are speed-ups: reference time / this method's time (1.00x = as fast; below 1 = slower).",
              ("RSS: peak resident memory during the save or load above the process's memory before it, over the"
               " checkpoint size (ours-async: at least its snapshot buffer, which stays allocated between saves);"
               " a load creates the tensors it returns, so 1.0x is its floor.")]
    return "\n".join(lines)


def cpu_table(summary: dict[tuple[int, str, str], dict[str, float]]) -> str:
    """Where each object-store save's time and CPU went: the first save apart; the client (this process, every
    thread), moto, the proxy."""
    lines = [("| size | store | method | first save s | save s | client CPU s | moto CPU s | proxy CPU s |"
              " client CPU s per GB |"), "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (size_mb, store, method), m in sorted(summary.items(), key=lambda kv: (kv[0][0], STORES.index(kv[0][1]),
                                                                               METHODS.index(kv[0][2]))):
        if "save_cpu_store" not in m:
            continue
        proxy = f"{m['save_cpu_proxy']:.2f}" if "save_cpu_proxy" in m else "-"
        lines.append(f"| {size_mb} MB | {store} | {method} | {m['first_save']:.3f} | {m['save']:.3f} |"
                     f" {m['save_cpu_client']:.2f} |"
                     f" {m['save_cpu_store']:.2f} | {proxy} | {m['save_cpu_client'] / (m['bytes'] / 1e9):.2f} |")
    if len(lines) == 2:
        return ""
    lines += ["", ("First save: the first run's save (ours: it claims the root first). Save: the median of all runs."
                   " CPU seconds during the save (medians), user + system. On this machine the client, moto and the"
                   " proxy share the cores: what one spends the others cannot. A real store's CPU is not the"
                   " client's to pay, so the client's column is the one that carries over to a cloud store.")]
    return "\n".join(lines)


def targets(summary: dict[tuple[int, str, str], dict[str, float]], bandwidth: float | None = None) -> str:
    """The issues' targets, checked against the measured medians (``bandwidth``: the modelled store's bytes/s per
    connection, for the share of what its network allows)."""
    lines = ["| target | store | size | measured | met |", "|---|---|---|---:|---|"]
    for (size_mb, store, method), m in sorted(summary.items()):
        stock = summary.get((size_mb, store, "lightning"))
        raw = summary.get((size_mb, store, "raw"))
        peer = summary.get((size_mb, store, "s3torchconnector"))
        if method == "ours-sync" and peer:
            r = peer["save"] / m["save"]
            lines.append(f"| save >= 1.5x faster than s3torchconnector | {store} | {size_mb} MB | {r:.2f}x |"
                         f" {'yes' if r >= 1.5 else 'NO'} |")
            r = peer["load"] / m["load"]
            lines.append(f"| load >= 5x faster than s3torchconnector | {store} | {size_mb} MB | {r:.2f}x |"
                         f" {'yes' if r >= 5 else 'NO'} |")
        if method == "ours-sync" and store == "s3-latency" and bandwidth:
            # What the modelled network allows for the connections a save uses (one per object, at most
            # CONCURRENCY), and what moto itself takes on this machine (raw on "s3": no proxy, no model).
            objects = -(-m["bytes"] // min(SHARD_SIZE, max(4 * 2**20, m["bytes"] / CONCURRENCY)))
            allowed = min(CONCURRENCY, objects) * bandwidth
            r = m["bytes"] / m["save"] / allowed
            lines.append(f"| save >= 0.7x of the modelled network ({min(CONCURRENCY, objects):.0f} connections x"
                         f" {bandwidth / MB:.0f} MB/s) | {store} | {size_mb} MB | {r:.2f}x |"
                         f" {'yes' if r >= 0.7 else 'NO'} |")
            direct = summary.get((size_mb, "s3", "raw"))
            if direct:
                r, moto = direct["save"] / m["save"], m["bytes"] / MB / direct["save"]
                lines.append(f"| save vs moto's own limit here (raw on s3, no proxy: {moto:.0f} MB/s) | {store} |"
                             f" {size_mb} MB | {r:.2f}x | - |")
        if method == "ours-async" and stock:
            frac = m["blocked"] / stock["save"]
            lines.append(f"| async blocked <= 10% of stock sync save | {store} | {size_mb} MB | {frac:.1%} |"
                         f" {'yes' if frac <= 0.10 else 'NO'} |")
        if method == "ours-sync" and raw:
            r = raw["save"] / m["save"]
            lines.append(f"| sync save throughput >= 0.8x raw | {store} | {size_mb} MB | {r:.2f}x |"
                         f" {'yes' if r >= 0.8 else 'NO'} |")
        if method == "ours-sync" and stock:
            r = stock["load"] / m["load"]
            need = 4.0 if store == "s3-latency" and size_mb >= 1000 else 1.0
            lines.append(f"| load >= {need:.0f}x stock | {store} | {size_mb} MB | {r:.2f}x |"
                         f" {'yes' if r >= need else 'NO'} |")
        if method in ("ours-sync", "ours-async"):
            for phase in ("save", "load"):
                x = m[f"{phase}_rss"] * 2**20 / m["bytes"]
                lines.append(f"| {method} {phase} peak RSS <= 1.3x | {store} | {size_mb} MB | {x:.2f}x |"
                             f" {'yes' if x <= 1.3 else 'NO'} |")
    extra = tiered_targets(summary)
    return "\n".join(lines + ([extra] if extra else []))


def tiered(summary: dict[tuple[int, str, str], dict[str, float]], cadence_minutes: float, persist_every: int) -> str:
    """The tiered rows: what the loop waits for, how long until durable, resume from each tier, and the store bytes
    written per hour of training at a cadence (every save to the store vs every ``persist_every``-th)."""
    rows = [(k, m) for k, m in sorted(summary.items()) if k[2] == "ours-tiered"]
    if not rows:
        return ""
    saves_per_hour = 60.0 / cadence_minutes
    lines = [("| size | store | blocked s (async save: s) | local commit s | durable s | resume local s |"
              " resume store s | local vs store | store GB/h, every save | store GB/h, tiered |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (size_mb, store, _), m in rows:
        asynchronous = summary.get((size_mb, store, "ours-async"))
        blocked = f"{m['blocked']:.3f}" + (f" ({asynchronous['blocked']:.3f})" if asynchronous else "")
        per_save = m["durable_bytes"] / 1e9
        lines.append(f"| {size_mb} MB | {store} | {blocked} | {m['local_commit']:.3f} | {m['save']:.3f} |"
                     f" {m['load']:.3f} | {m['durable_load']:.3f} | {m['durable_load'] / m['load']:.1f}x |"
                     f" {per_save * saves_per_hour:.3g} | {per_save * saves_per_hour / persist_every:.3g} |")
    lines += ["", (f"Store bytes per hour: a save every {cadence_minutes:g} min; tiered persists every"
              f" {persist_every}-th (persist_every={persist_every}), the other saves stay on local disk. The bytes per"
              " save are those a persist wrote (measured); the benchmark itself persists every save"
              " (persist_every=1), so 'durable s' is the lag of each save behind it.")]
    return "\n".join(lines)


def tiered_targets(summary: dict[tuple[int, str, str], dict[str, float]]) -> str:
    lines = []
    for (size_mb, store, method), m in sorted(summary.items()):
        if method != "ours-tiered":
            continue
        asynchronous = summary.get((size_mb, store, "ours-async"))
        if asynchronous:
            # Both are a host snapshot; 5 ms of slack for timer noise on saves of a few ms.
            ok = m["blocked"] <= asynchronous["blocked"] * 1.10 + 0.005
            lines.append(f"| tiered blocked <= async blocked | {store} | {size_mb} MB | {m['blocked']:.3f} s vs"
                         f" {asynchronous['blocked']:.3f} s | {'yes' if ok else 'NO'} |")
        if store == "s3-latency":
            r = m["durable_load"] / m["load"]
            lines.append(f"| resume from local tier >= 5x faster than from the store | {store} | {size_mb} MB |"
                         f" {r:.1f}x | {'yes' if r >= 5 else 'NO'} |")
    return "\n".join(lines)


def plot(summary: dict[tuple[int, str, str], dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(k[0], k[1]) for k in summary}, key=lambda k: (k[0], STORES.index(k[1])))
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 2.6 * len(keys)), squeeze=False)
    for row, (size_mb, store) in enumerate(keys):
        methods = [m for m in METHODS if (size_mb, store, m) in summary]
        for col, phase in enumerate(("save", "load")):
            ax = axes[row][col]
            values = [summary[(size_mb, store, m)][phase] for m in methods]
            bars = ax.barh(methods, values, color=["#999" if m == "raw" else "#2a7" if m.startswith("ours")
                                                   else "#c64" for m in methods])
            if phase == "save":
                blocked = [summary[(size_mb, store, m)]["blocked"] for m in methods]
                ax.barh(methods, blocked, color="none", edgecolor="black", hatch="//", linewidth=0.5)
            ax.bar_label(bars, fmt="%.2f s", fontsize=7)
            ax.invert_yaxis()
            ax.set_title(f"{phase} {size_mb} MB, {store}" + (" (hatched: loop blocked)" if phase == "save" else ""),
                         fontsize=9)
            ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    cores = os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.machine()} {cpu}, {cores} cores, {gpu}, Python {platform.python_version()},"
            f" torch {torch.__version__}")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="checkpoint sizes in MB")
    parser.add_argument("--size-mb", type=int, default=None, help="add a size of your own (MB)")
    parser.add_argument("--stores", nargs="+", default=STORES, choices=STORES)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.03, help="s3-latency: seconds added per request")
    parser.add_argument("--bandwidth", type=float, default=40e6, help="s3-latency: bytes/s per connection")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "checkpoint_io"),
                        help="output path prefix (.md, .json and .png are written)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--pause", type=float, default=2.0,
                        help="seconds between one run's load and the next run's save (default 2: saves in training are"
                             " minutes apart, and a save right after a persist's I/O copies its snapshot on a busy"
                             " node)")
    parser.add_argument("--cadence-minutes", type=float, default=10.0,
                        help="tiered rows: minutes between saves, for the store bytes per hour")
    parser.add_argument("--persist-every", type=int, default=6,
                        help="tiered rows: persist every N-th save, for the store bytes per hour")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return ""
    sizes = sorted(set(args.sizes + ([args.size_mb] if args.size_mb else [])))
    servers = Servers(args.latency, args.bandwidth)
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-")
    rows: list[dict[str, Any]] = []
    try:
        servers.start(args.stores)
        for size_mb in sizes:
            for store in args.stores:
                for method in args.methods:
                    why = available(method, store)
                    if why is not None:
                        if store.startswith("s3"):
                            print(f"{size_mb} MB {store:10s} {method:16s} left out: {why}", file=sys.stderr, flush=True)
                        continue
                    spec = {**servers.store(store, tmp), "method": method, "size": size_mb * MB, "runs": args.runs,
                            "pause": args.pause}
                    started = time.perf_counter()
                    results = measure(spec, args.timeout)
                    rows += [{**r, "size_mb": size_mb, "store": store, "method": method} for r in results]
                    print(f"{size_mb} MB {store:10s} {method:16s}"
                          f" save {statistics.median(r['save'] for r in results):7.3f} s"
                          f"  load {statistics.median(r['load'] for r in results):7.3f} s"
                          f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        servers.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(rows)
    machine = machine_description()
    proxy = (f"s3-latency: moto behind a loopback proxy adding {args.latency * 1000:.0f} ms per request and capping"
             f" each connection at {args.bandwidth / MB:.0f} MB/s.")
    tiered_text = tiered(summary, args.cadence_minutes, args.persist_every)
    cpu_text = cpu_table(summary)
    text = "\n\n".join([f"# Checkpoint save/load, medians of {args.runs} run(s)", table(summary, machine), proxy,
                        *(["## Where a save's CPU went", cpu_text] if cpu_text else []),
                        *(["## Tiered (local tier + store)", tiered_text] if tiered_text else []),
                        "## Targets", targets(summary, args.bandwidth)]) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump({"machine": machine, "args": {k: v for k, v in vars(args).items() if k != "worker"},
                   "runs": rows}, f, indent=1)
    plot(summary, args.out + ".png")
    print(text)
    return text


if __name__ == "__main__":
    main()
