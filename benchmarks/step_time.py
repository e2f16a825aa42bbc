"""Training speed while a checkpoint moves: the step time of a training loop while an async save, a persist or a
replication between nodes runs in the background, against the same loop idle; and the restore of a replaced node
from a peer's replica against the latency-modelled S3.

    python benchmarks/step_time.py                                 # 512 MB, every case, 5 runs
    python benchmarks/step_time.py --size-mb 1024 --runs 7 --cases async-save persist
    python benchmarks/step_time.py --package /work/main --cases async-save persist   # another checkout, to compare

Loops (the training thread):

- ``gpu``: what the host thread of a GPU job does: ~50 ms of waiting with the GIL released (``time.sleep``, standing
  for the device's work: a CUDA sync releases the GIL the same way), then the host-side dispatch of ``--ops`` small
  torch ops (GIL held between them, as a Python training step holds it). A background save that holds the GIL, or
  keeps both cores busy, shows here as a longer step;
- ``cpu``: a CPU-bound step (matrix products on every core for ~50 ms): there the cores are the limit and any
  background work shows, for completeness;
- ``cuda`` (only asked for by name, on a CUDA machine): the real thing: ``--ops`` small ops and as many 4096x4096
  matrix products on the GPU as take ~50 ms idle, then a ``torch.cuda.synchronize()``; the checkpoint's tensors are
  on the GPU too, so an async save copies them to its pinned snapshot first (async-save and persist only).

Cases (each in a fresh process per loop; ``--runs`` times; in each run the loop's idle steps are measured first, then
its steps while the background work runs, whose duration is recorded too):

- ``async-save``: ``AtomicCheckpointIO(async_save=True)`` saving the checkpoint to a folder on this disk (the step that
  calls the save, which waits for the host snapshot, is left out: that is the save's ``blocked`` time);
- ``persist``: ``AtomicCheckpointIO(local_tier=..., persist_every=1)``: the save commits to the local tier (not
  measured), then the persist to the durable root (a folder on this disk) runs behind the loop;
- ``replicate``: 2 "nodes" of one process each (gloo on loopback): node 0 commits the checkpoint to its local tier
  and its background thread sends it to node 1, which verifies and commits it; both loops are measured (the sender's
  and the receiver's), and each process's peak memory above its start during the copy (``VmHWM``);
- ``restore``: a replaced node (empty local tier) resumes the commit its peer holds (``load_across_nodes``: sent over
  gloo, verified on arrival, loaded and verified again), against a new node loading the same checkpoint from the
  durable root on ``s3-latency`` (moto behind a loopback proxy adding ``--latency`` s per request and capping each
  connection at ``--bandwidth`` bytes/s).

Reported: medians over the runs of each run's median step time idle and during, their ratio (measured in the same
run), the background work's duration, and the figures above. The machine is a shared 2-core VM: absolute times
are noisy, ratios taken within one run less so. Writes ``--out``.md and ``--out``.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

MB = 2**20
CASES = ["async-save", "persist", "replicate", "restore"]
LOOPS = ["gpu", "cpu"]
DEVICE_LOOPS = ["cuda"]  # not in the defaults: they need the device


# -- the training loops ------------------------------------------------------------------------------------------

class Loop:
    """One training step of the kind ``kind`` (see the module docstring), calibrated to ~50 ms idle."""

    def __init__(self, kind: str, ops: int) -> None:
        import torch

        self.kind, self.ops = kind, ops
        self.x = torch.zeros(1024)
        self.a = torch.randn(384, 384)
        self.reps = 1
        if kind == "cuda":
            self.x, self.a = self.x.cuda(), torch.randn(4096, 4096, device="cuda")
            for _ in range(10):
                self.a @ self.a
            torch.cuda.synchronize()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 1.0:
                self.a @ self.a
                n += 1
                torch.cuda.synchronize()
            self.reps = max(1, round(0.05 * n / (time.perf_counter() - t0)))
        elif kind == "cpu":  # as many products as take ~50 ms here, idle: counted over 1 s, after a warm-up
            for _ in range(10):
                self.a @ self.a
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 1.0:
                self.a @ self.a
                n += 1
            self.reps = max(1, round(0.05 * n / (time.perf_counter() - t0)))

    def step(self) -> None:
        if self.kind == "gpu":
            time.sleep(0.05)  # the device's work: the host thread waits without the GIL
            y = self.x
            for _ in range(self.ops):  # the host-side dispatch of the step's small ops
                y = y + 1.0
        elif self.kind == "cuda":
            import torch

            for _ in range(self.reps):
                self.a @ self.a
            y = self.x
            for _ in range(self.ops):
                y = y + 1.0
            torch.cuda.synchronize()  # the step's end: the host waits for the device (without the GIL)
        else:
            for _ in range(self.reps):
                self.a @ self.a

    def steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step()
            out.append(time.perf_counter() - t0)
        return out

    def until(self, done: Callable[[], bool], limit: float = 600.0) -> list[tuple[float, float]]:
        """(start, duration) of each step until ``done()`` (checked after each step)."""
        out = []
        deadline = time.perf_counter() + limit
        while not done() and time.perf_counter() < deadline:
            t0 = time.perf_counter()
            self.step()
            out.append((time.time() - (time.perf_counter() - t0), time.perf_counter() - t0))
        return out


def make_checkpoint(size: int) -> dict[str, Any]:
    """A Lightning-shaped checkpoint of ``size`` bytes (benchmarks/checkpoint_io.py's: weights and Adam moments)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from checkpoint_io import make_checkpoint as make

    return make(size)


def _peak_reset() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- one process: async save, persist ----------------------------------------------------------------------------

def run_single(spec: dict[str, Any]) -> None:
    from lightning_resilient import AtomicCheckpointIO

    loop = Loop(spec["loop"], spec["ops"])
    ckpt = make_checkpoint(spec["size"])
    if spec["loop"] == "cuda":
        from torch.utils._pytree import tree_map

        ckpt = tree_map(lambda v: v.cuda() if hasattr(v, "cuda") else v, ckpt)
    tmp = spec["tmp"]
    for run in range(spec["runs"]):
        idle = loop.steps(spec["idle_steps"])
        root = os.path.join(tmp, f"root{run}")
        finished = threading.Event()
        if spec["case"] == "async-save":
            io = AtomicCheckpointIO(async_save=True)
            t0 = time.perf_counter()
            io.save_checkpoint(ckpt, os.path.join(root, "step=1.ckpt"))
            blocked = time.perf_counter() - t0
            stats = io.save_stats[-1]

            def done(stats: Any = stats) -> bool:
                return stats.upload is not None
        else:  # persist
            io = AtomicCheckpointIO(local_tier=os.path.join(tmp, f"nvme{run}"), persist_every=1)
            t0 = time.perf_counter()
            io.save_checkpoint(ckpt, os.path.join(root, "step=1.ckpt"))  # the local commit; the persist starts
            blocked = time.perf_counter() - t0
            threading.Thread(target=lambda io=io, ev=finished: (io.wait(), ev.set()), daemon=True).start()
            done = finished.is_set
        during = loop.until(done)
        took = time.perf_counter() - t0
        io.teardown()
        print("RESULT " + json.dumps({"run": run, "idle": _median(idle), "during": _median([d for _, d in during]),
                                      "steps": len(during), "background_s": took, "blocked_s": blocked}),
              flush=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(os.path.join(tmp, f"nvme{run}"), ignore_errors=True)


# -- two "nodes": replication, restore ---------------------------------------------------------------------------

class _Node:
    """One node's side of a job of 2 nodes, one process each: its tiers and the copies between them, as the plugin
    wires them (see ``AtomicCheckpointIO.nodes_for``). ``nodes``: the job's nodes, joined already (a new job's roots
    over the same folders)."""

    def __init__(self, rank: int, folder: str, nodes: Any = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from lightning_resilient.io.local_tier import local_tier_url
        from lightning_resilient.io.replicas import Access, Nodes, Replicator
        from lightning_resilient.io.root import RootSettings, SerialExecutor, open_root
        from lightning_resilient.io.tiered import TieredRoot, save_key

        self.local_tier = os.path.join(folder, f"nvme{rank}")
        self.durable = os.path.join(folder, "root")
        settings = RootSettings(keep_last=None, shard_size=64 * MB, orphan_grace_seconds=3600.0,
                                fallback_on_corruption=True)
        roots: dict[str, Any] = {}
        tiers: dict[str, TieredRoot] = {}

        def root_for(url: str) -> Any:
            if url not in roots:  # (a thread pool per load or save, as AtomicCheckpointIO opens its roots)
                roots[url] = open_root(url, settings=settings, executor=lambda: ThreadPoolExecutor(
                    settings.max_concurrency, thread_name_prefix="lightning_resilient-io"))
            return roots[url]

        def tiers_for(url: str) -> TieredRoot:
            if url not in tiers:
                tier = tiers[url] = TieredRoot(root_for(url), root_for(local_tier_url(self.local_tier, url)),
                                               persist_every=10**6, executor=SerialExecutor)
                if rank == 0:
                    tier.on_commit = lambda entry: self.replicator.replicate(tier, entry, save_key(entry))
            return tiers[url]

        self.root_for, self.tiers_for = root_for, tiers_for
        self.nodes = nodes if nodes is not None else Nodes.join(node_rank=rank, local_rank=0)
        self.replicator = Replicator(self.nodes, Access(tiers_for), replicas=2)
        if nodes is None:
            self.replicator.start()


def _two_nodes(rank: int, spec: dict[str, Any], port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, spec["package"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    loop = Loop(spec["loop"], spec["ops"])
    ckpt = make_checkpoint(spec["size"]) if rank == 0 else None
    results = []
    for run in range(spec["runs"]):
        folder = os.path.join(spec["tmp"], f"run{run}")
        node = _Node(rank, folder)
        if spec["case"] == "replicate":
            results.append(_replicate(rank, node, loop, ckpt, spec))
        else:
            results.append(_restore(rank, node, ckpt, folder))
        node.replicator.stop()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        for run in range(spec["runs"]):
            row: dict[str, Any] = {"run": run}
            for r, mine in enumerate(gathered):
                row.update({f"{k}{r}": v for k, v in mine[run].items()})
            print("RESULT " + json.dumps(row), flush=True)
    dist.barrier()
    os._exit(0)  # gloo teardown at interpreter exit can abort on CPU (see tests/io/sharded_child.py)


def _replicate(rank: int, node: _Node, loop: Loop, ckpt: Any, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    tiers = node.tiers_for(node.durable)
    idle = loop.steps(spec["idle_steps"])
    dist.barrier()
    finished = threading.Event()
    rss0 = _status_mb("VmRSS")
    _peak_reset()
    box: list[Any] = [None]
    if rank == 0:
        tiers.save(ckpt, "step=1.ckpt")  # the local commit (not measured): its copy to node 1 starts
        started = time.time()
        threading.Thread(target=lambda: (node.replicator.flush(), finished.set()), daemon=True).start()
        during = loop.until(finished.is_set)
        box = [(started, time.time())]
        dist.broadcast_object_list(box, src=0)
    else:  # node 1 trains meanwhile, until node 0 says the copy is over (one machine: one clock)
        waiter = threading.Thread(target=lambda: (dist.broadcast_object_list(box, src=0), finished.set()))
        waiter.start()
        during = loop.until(finished.is_set)
        waiter.join()
    started, ended = box[0]
    peak = _status_mb("VmHWM") - rss0
    tier_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(node.local_tier) for f in fs)
    return {"idle": _median(idle), "during": _median([d for s, d in during if s >= started and s + d <= ended]),
            "steps": len(during), "background_s": ended - started, "peak_mb": peak, "tier_mb": tier_bytes / MB}


def _restore(rank: int, node: _Node, ckpt: Any, folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_resilient.io.local_tier import local_tier_url
    from lightning_resilient.io.replicas import load_across_nodes

    if rank == 0:
        node.tiers_for(node.durable).save(ckpt, "step=1.ckpt")
    node.replicator.flush()
    dist.barrier()
    if rank == 1:  # node 1 is replaced: its local tier is gone
        shutil.rmtree(node.local_tier, ignore_errors=True)
    fresh = _Node(rank, folder, node.nodes)  # the next job: roots opened anew over the same folders
    dist.barrier()

    def load(entry: Any, manifest: Any, sources: Any, failed: set[Any]) -> Any:
        root = sources.local if sources.local is not None else sources.durable
        return root.load(entry.commit, manifest=manifest, map_location=None, weights_only=None)

    t0 = time.perf_counter()
    done = load_across_nodes(fresh.durable, shown=fresh.durable, nodes=fresh.nodes, local_tier=fresh.local_tier,
                             root_for=fresh.root_for, replicas=2, fallback=True, load=load)
    took = time.perf_counter() - t0
    assert done is not None and done.sources.local is not None, "not restored from the peer"
    # The training can start here; the restored copy reaches the node's tier behind it (before its next change).
    fresh.root_for(local_tier_url(fresh.local_tier, fresh.durable)).settle()
    return {"restore_s": took, "durable_s": time.perf_counter() - t0}


# -- the store for the restore comparison ------------------------------------------------------------------------

def restore_from_store(spec: dict[str, Any]) -> None:
    """A new node's resume of the checkpoint from the durable root on s3-latency (one process, the plugin's load)."""
    from lightning_resilient import AtomicCheckpointIO

    ckpt = make_checkpoint(spec["size"])
    options = {"client_kwargs": {"endpoint_url": spec["endpoint"]}}
    url = f"s3://bench/{spec['prefix']}/step=1.ckpt"
    AtomicCheckpointIO(storage_options=options).save_checkpoint(ckpt, url)
    del ckpt
    for run in range(spec["runs"]):
        io = AtomicCheckpointIO(storage_options=options)
        t0 = time.perf_counter()
        io.load_checkpoint(url)
        print("RESULT " + json.dumps({"run": run, "restore_s": time.perf_counter() - t0}), flush=True)


def _servers(latency: float, bandwidth: float) -> tuple[list[subprocess.Popen[str]], str]:
    """moto's S3 server and the latency proxy in front of it, each in its own process; the proxy's URL."""
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # (``-m``: moto may be importable without its script on PATH, e.g. installed with pip --target)
    procs = [subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, text=True)]
    s3 = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    import boto3

    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket="bench")
    proxy = subprocess.Popen([sys.executable, "-m", "lightning_resilient.testing", s3, "--latency", str(latency),
                              "--bandwidth", str(bandwidth)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    procs.append(proxy)
    assert proxy.stdout is not None
    return procs, proxy.stdout.readline().strip()


# -- the driver --------------------------------------------------------------------------------------------------

def worker(spec: dict[str, Any]) -> None:
    sys.path.insert(0, spec["package"])
    if spec["case"] in ("async-save", "persist"):
        run_single(spec)
    elif spec["case"] == "store-restore":
        restore_from_store(spec)
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_two_nodes, args=(spec, port), nprocs=2, start_method="spawn")


def measure(spec: dict[str, Any], timeout: float = 1800) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": spec["package"] + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 and len(rows) < spec["runs"]:
        raise RuntimeError(f"{spec['case']} ({spec['loop']}) failed:\n{proc.stderr[-3000:]}")
    return rows


def summarize(case: str, loop: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    case = case.replace(" (baseline)", "")
    def med(key: str) -> float:
        return _median([r[key] for r in rows if key in r and r[key] == r[key]])

    def ratio(idle: str, during: str) -> float:
        return _median([r[during] / r[idle] for r in rows if r.get(idle) and r.get(during) == r.get(during)])

    if case in ("async-save", "persist"):
        return {"idle_ms": 1000 * med("idle"), "during_ms": 1000 * med("during"), "ratio": ratio("idle", "during"),
                "background_s": med("background_s"), "blocked_s": med("blocked_s"), "steps": med("steps")}
    if case == "replicate":
        return {"idle_ms": 1000 * med("idle0"), "during_ms": 1000 * med("during0"), "ratio": ratio("idle0", "during0"),
                "idle1_ms": 1000 * med("idle1"), "during1_ms": 1000 * med("during1"),
                "ratio1": ratio("idle1", "during1"), "background_s": med("background_s0"),
                "peak0_mb": med("peak_mb0"), "peak1_mb": med("peak_mb1"), "tier1_mb": med("tier_mb1")}
    if case == "restore":
        return {"restore_s": med("restore_s1"), "durable_s": med("durable_s1")}
    return {"restore_s": med("restore_s")}


def machine_description() -> str:
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=int, default=512, help="checkpoint size in MiB")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--idle-steps", type=int, default=15, help="idle steps measured before each run's work")
    parser.add_argument("--ops", type=int, default=300, help="gpu loop: small torch ops dispatched per step")
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--loops", nargs="+", default=LOOPS, choices=LOOPS + DEVICE_LOOPS)
    parser.add_argument("--latency", type=float, default=0.03, help="s3-latency: seconds added per request")
    parser.add_argument("--bandwidth", type=float, default=40e6, help="s3-latency: bytes/s per connection")
    parser.add_argument("--package", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose lightning_resilient is measured (default: this one)")
    parser.add_argument("--baseline", help="another checkout (e.g. the release before a change): async-save and"
                        " persist are measured with it too, in alternating processes, as rows 'CASE (baseline)'")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --baseline: alternate baseline and this checkout this many times, --runs each")
    parser.add_argument("--note", default="", help="a line about the machine's state, written into the results")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "step_time_cpu"))
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return ""
    base = {"size": args.size_mb * MB, "runs": args.runs, "idle_steps": args.idle_steps, "ops": args.ops,
            "package": os.path.abspath(args.package)}
    summary: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    procs: list[subprocess.Popen[str]] = []
    try:
        for case in args.cases:
            loops = [loop for loop in args.loops if loop not in DEVICE_LOOPS or case in ("async-save", "persist")]
            for loop in loops if case != "restore" else ["gpu"]:
                packages = [("", base["package"])]
                if args.baseline and case in ("async-save", "persist"):
                    packages = [(" (baseline)", os.path.abspath(args.baseline)), *packages] * args.rounds
                for suffix, package in packages:
                    with tempfile.TemporaryDirectory(prefix="step-time-") as tmp:
                        rows = measure({**base, "package": package, "case": case, "loop": loop, "tmp": tmp})
                    key = f"{case}{suffix}/{loop}"
                    raw[key] = raw.get(key, []) + rows
                    summary[key] = summarize(case, loop, raw[key])
                    print(key, summary[key], flush=True)
            if case == "restore":
                procs, endpoint = _servers(args.latency, args.bandwidth)
                rows = measure({**base, "case": "store-restore", "loop": "gpu", "endpoint": endpoint,
                                "prefix": f"restore-{os.getpid()}", "tmp": ""})
                raw["store-restore"] = rows
                summary["store-restore"] = summarize("store-restore", "gpu", rows)
                print("store-restore", summary["store-restore"], flush=True)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
    text = report(summary, args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump({"schema": "lightning_resilient.step_time/1", "machine": machine_description(), "note": args.note,
                   "args": {k: v for k, v in vars(args).items() if k != "worker"}, "summary": summary, "runs": raw},
                  f, indent=1)
    print(text)
    return text


def report(summary: dict[str, Any], args: argparse.Namespace) -> str:
    runs = f"{args.runs * args.rounds} runs" if args.baseline else f"{args.runs} runs"
    lines = [f"# Step time while a checkpoint moves ({args.size_mb} MiB), medians of {runs}", "",
             f"Machine: {machine_description()}. {args.note}".rstrip(), "",
             "| case | loop | idle ms | during ms | during / idle | background s | notes |",
             "|---|---|---:|---:|---:|---:|---|"]
    for key, s in summary.items():
        name, _, loop = key.partition("/")
        case = name.replace(" (baseline)", "")
        if "ratio" not in s:
            continue
        notes = f"the save blocked the loop {s['blocked_s']:.2f} s" if case == "async-save" else ""
        before = summary.get(f"{case} (baseline)/{loop}")
        if before is not None and name == case:
            notes += (f"{'; ' if notes else ''}background work {s['background_s'] / before['background_s']:.2f}x"
                      " the baseline's time")
        if case == "replicate":
            notes = (f"receiver: {s['idle1_ms']:.1f} -> {s['during1_ms']:.1f} ms ({s['ratio1']:.2f}x); peak memory"
                     f" above start: sender {s['peak0_mb']:.0f} MB, receiver {s['peak1_mb']:.0f} MB; receiver's tier"
                     f" {s['tier1_mb']:.0f} MB")
        lines.append(f"| {name} | {loop} | {s['idle_ms']:.1f} | {s['during_ms']:.1f} | {s['ratio']:.2f}x |"
                     f" {s['background_s']:.2f} | {notes} |")
    if "restore/gpu" in summary and "store-restore" in summary:
        peer, store = summary["restore/gpu"]["restore_s"], summary["store-restore"]["restore_s"]
        durable = summary["restore/gpu"].get("durable_s", float("nan"))
        lines += ["", (f"Restore of a replaced node: from a peer's replica {peer:.2f} s, from s3-latency"
                       f" {store:.2f} s ({store / peer:.1f}x faster from the peer); the restored copy was on the"
                       f" node's disk {durable:.2f} s after the restore began (written behind training)."), "",
                  (f"s3-latency: moto behind a loopback proxy adding {args.latency * 1000:.0f} ms per request and"
                   f" capping each connection at {args.bandwidth / 1e6:.0f} MB/s.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
