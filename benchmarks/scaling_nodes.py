"""``scaling.py --nodes N``: an N-node DDP job simulated on this machine, resumed; per node, store reads and resume
time.

    python benchmarks/scaling.py --nodes 2                          # 2 nodes x 2 processes, 3 resumes each way
    python benchmarks/scaling.py --nodes 2 --procs-per-node 4 --runs 5 --width 2048 --out /tmp/nodes

What it runs (CPU, gloo, loopback only): moto's S3 server in its own process, and one counting proxy per "node" in
front of it (:class:`lightning_resilient.testing.StoreProxy`, which also records every response's body size here).
Each node is its own launcher process (``Trainer(num_nodes=N, devices=P, strategy="ddp")`` with ``NODE_RANK``,
``MASTER_ADDR=127.0.0.1`` and one ``MASTER_PORT`` per job; Lightning starts the node's other P - 1 processes), with
its own ``TMPDIR`` (so its own node cache folder) and its own proxy as S3 endpoint (``AWS_ENDPOINT_URL`` and the
plugin's ``storage_options``), so every request a node makes to the store is counted on that node's proxy.

1. Training job: the scaling benchmark's MLP, ``AtomicCheckpointIO`` with ``ModelCheckpoint(every_n_train_steps=
   --every-n-steps)``, for 2 x ``--every-n-steps`` steps (two committed checkpoints).
2. ``--runs`` resume jobs with the node cache (``AtomicCheckpointIO(node_cache=True)``, the default) and as many
   without (``node_cache=False``), interleaved: the same job again, every process calling
   ``trainer.fit(model, ckpt_path=find_latest_checkpoint(root))``, for one step past the checkpoint (no save).
   Each resume is a fresh job (new port, new node folders): the node cache starts cold every time.

Measured per node and resume, reported as the median over ``--runs``:

- store reads: GET and HEAD requests through the node's proxy during the whole resume job (find_latest_checkpoint,
  Lightning's own checks, the load, the claim of the root); writes (the claim's pointer update) are counted apart;
- bytes read: body bytes of those GET responses; ``x checkpoint`` = bytes read / checkpoint size, where the
  checkpoint size is every object of the resumed commit as stored (data, skeleton, manifest). With the node cache a
  node reads the checkpoint about once (plus one small manifest read per process); without it about P times;
- load s: the node's slowest process inside ``AtomicCheckpointIO.load_checkpoint`` (rank 0's resolution, the
  read from the store or the wait for and copy from the node cache, verification, deserialization);
- resume s: from the moment this driver starts the node's launcher process to the moment the node's last process
  begins its first training step (``on_train_batch_start``): interpreter and Lightning start-up, starting the
  node's other processes, the DDP rendezvous with the other nodes, ``find_latest_checkpoint`` and the load.
  Wall-clock stamps of one machine, so they compare across processes. The JSON adds ``load_start_seconds`` (from
  the same start to the moment the node's last process enters the load) and every run's figures.

What this proves, and what it cannot (separate kernels and disks, NCCL, a real network and per-node store
bandwidth), is written into the markdown output. Writes ``--out``.md and ``--out``.json (schema
``lightning_resilient.scaling_nodes/1``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

SCHEMA = "lightning_resilient.scaling_nodes/1"
BUCKET = f"nodes-{uuid.uuid4().hex[:12]}"
HERE = os.path.dirname(os.path.abspath(__file__))
# Test credentials for the loopback moto server, in the driver (while it runs) and in every node's environment;
# no instance-metadata lookups. Set before any S3 client exists.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
# What would steer a node's process elsewhere: other credentials, another launcher's ranks (LOCAL_RANK makes
# Lightning believe the processes were started for it), an allocation's variables.
_DROPPED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "LOCAL_RANK", "RANK", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
_DROPPED_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_")
RESUME_DEFINITION = ("resume s: from the start of the node's launcher process to the first training step of the"
                     " node's last process (start-up, rendezvous, find_latest_checkpoint, load)")
LOAD_DEFINITION = "load s: the node's slowest process inside AtomicCheckpointIO.load_checkpoint"


def _sibling(name: str) -> Any:
    """Another script of this folder, by path (benchmarks/ is no package; the tests load scripts the same way)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(HERE, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- pure helpers: one node's figures from its proxy's log and its processes' records ----------------------------

def node_figures(requests: list[tuple[str, str, int]], records: list[Mapping[str, Any]], launched: float,
                 commit: str, checkpoint_bytes: int) -> dict[str, Any]:
    """One node, one resume: store traffic (``(method, path, body bytes)`` per request) and the timings."""
    reads = [(m, unquote(p.split("?", 1)[0]), n) for m, p, n in requests if m in ("GET", "HEAD")]
    read_bytes = sum(n for m, _, n in reads if m == "GET")
    commit_bytes = sum(n for m, p, n in reads if m == "GET" and f"/{commit}/" in p)
    return {"store_reads": len(reads), "store_writes": len(requests) - len(reads), "store_bytes_read": read_bytes,
            "checkpoint_bytes_read": commit_bytes, "bytes_read_ratio": read_bytes / checkpoint_bytes,
            "load_seconds": max(r["load_end"] - r["load_start"] for r in records),
            "load_start_seconds": max(r["load_start"] for r in records) - launched,
            "resume_seconds": max(r["first_step"] for r in records) - launched,
            "processes": len(records)}


MEDIANS = ("store_reads", "store_writes", "store_bytes_read", "checkpoint_bytes_read", "bytes_read_ratio",
           "load_seconds", "load_start_seconds", "resume_seconds")


def medians(runs: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (node cache, node): the median of each figure over the runs, and the runs themselves."""
    groups: dict[tuple[bool, int], list[Mapping[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["node_cache"], r["node"]), []).append(r)
    rows = []
    for (cache, node), group in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1])):
        row: dict[str, Any] = {"node_cache": cache, "node": node, "runs": len(group)}
        row.update({k: statistics.median(g[k] for g in group) for k in MEDIANS})
        rows.append(row)
    return rows


def table(doc: Mapping[str, Any]) -> str:
    mb = doc["checkpoint_bytes"] / 1e6
    p = doc["procs_per_node"]
    lines = [f"Model: {doc['model']}", "", f"Machine: {doc['machine']}", "",
             (f"{doc['nodes']} nodes x {p} processes (gloo on CPU, loopback), one moto S3 server, one counting proxy"
              f" per node. Checkpoint: {mb:.2f} MB ({doc['commit']}). Median of {doc['runs']} resume(s) per row,"
              " each a fresh job with a cold node cache."), "",
             "| node cache | node | store reads | MB read | x checkpoint | load s | resume s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {'on' if r['node_cache'] else 'off'} | {r['node']} | {r['store_reads']:g} |"
              f" {r['store_bytes_read'] / 1e6:.2f} | {r['bytes_read_ratio']:.2f} | {r['load_seconds']:.2f} |"
              f" {r['resume_seconds']:.2f} |" for r in doc["results"]]
    lines += ["", ("store reads: GET/HEAD requests through the node's proxy during the whole resume job; MB read: their"
              " response bodies; x checkpoint: MB read / checkpoint size (about 1 per node with the node cache, about"
              f" {p} = processes per node without). {LOAD_DEFINITION}; {RESUME_DEFINITION}. Node 0 holds global rank"
              " 0, which also resolves the checkpoint for the job and claims the root (the claim's writes are counted"
              " apart, in the JSON): more requests and a longer load there."), "",
              ("What this shows on one machine: every process of the job resumes the one commit rank 0 chose, and each"
               " node reads it from the store once with the node cache, once per process without, over real TCP (gloo)"
               " and a real S3 API. What it cannot: separate kernels and disks (here both node caches share one disk"
               " and one page cache), NCCL, a real network between nodes, and a store whose bandwidth and latency"
               " differ per node (here every node shares one moto process and this machine's cores, so resume s is"
               " mostly the start-up of every process on those cores, not a cluster's load time).")]
    return "\n".join(lines)


# -- one node's process (every process of the node runs this) ----------------------------------------------------

def node_worker(spec: Mapping[str, Any]) -> None:
    started = time.time()
    import warnings

    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint

    world = spec["nodes"] * spec["procs_per_node"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the job's processes share this machine's cores
    pl.seed_everything(0, verbose=False)
    marks: dict[str, Any] = {"started": started}

    class TimedIO(AtomicCheckpointIO):
        def load_checkpoint(self, path: Any, map_location: Any | None = None,
                            weights_only: bool | None = None) -> dict[str, Any]:
            marks["load_start"] = time.time()
            try:
                return super().load_checkpoint(path, map_location, weights_only)
            finally:
                marks["load_end"] = time.time()

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if "first_step" not in marks:
                marks["first_step"], marks["resumed_step"] = time.time(), trainer.global_step

    options = {"client_kwargs": {"endpoint_url": spec["endpoint"]}}
    io = TimedIO(storage_options=options, node_cache=spec["node_cache"])
    trainer = pl.Trainer(accelerator="cpu", devices=spec["procs_per_node"], num_nodes=spec["nodes"], strategy="ddp",
                         max_steps=spec["max_steps"], plugins=[io, LightningEnvironment()],
                         callbacks=[ModelCheckpoint(dirpath=spec["root"], every_n_train_steps=spec["every_n_steps"],
                                                    save_top_k=-1), FirstStep()],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0)
    model = _sibling("scaling")._parts()[0](spec["model"])
    ckpt = find_latest_checkpoint(spec["root"], options) if spec["resume"] else None  # what a resume script does
    trainer.fit(model, ckpt_path=ckpt)
    record = {**marks, "global_rank": trainer.global_rank, "node": trainer.node_rank, "ckpt_path": ckpt,
              "commit": io.last_load.commit if io.last_load is not None else None,
              "loaded_bytes": io.last_load.bytes if io.last_load is not None else None}
    if trainer.global_rank == 0:  # Lightning is imported here already (the driver never imports it)
        scaling = _sibling("scaling")
        record.update(model=scaling.describe(spec["model"]), machine=scaling.machine_description())
    path = os.path.join(spec["out_dir"], f"rank{trainer.global_rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's teardown at interpreter exit can abort on CPU; everything is written


# -- the driver -----------------------------------------------------------------------------------------------------

def _counting_proxy(upstream: str) -> Any:
    """A StoreProxy that also records ``(method, path, response body bytes)`` of every request in ``.log``."""
    from lightning_resilient.testing import StoreProxy

    proxy = StoreProxy(upstream)
    proxy.log = []
    base = proxy.server.RequestHandlerClass

    class Tally:
        """The connection's writer: counts what is written once a response's headers are out (its body)."""

        def __init__(self, raw: Any, handler: Any) -> None:
            self.raw, self.handler = raw, handler

        def write(self, data: Any) -> Any:
            if self.handler.body_bytes is not None:
                self.handler.body_bytes += len(data)
            return self.raw.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.raw, name)

    class Counting(base):  # type: ignore[misc, valid-type]
        body_bytes: int | None = None

        def setup(self) -> None:
            super().setup()
            self.wfile = Tally(self.wfile, self)

        def end_headers(self) -> None:
            super().end_headers()
            self.body_bytes = 0

        def handle_one_request(self) -> None:
            self.body_bytes = None
            self.command = None
            super().handle_one_request()
            if self.command is not None and self.body_bytes is not None:
                with proxy.lock:
                    proxy.log.append((self.command, self.path, self.body_bytes))

    proxy.server.RequestHandlerClass = Counting
    return proxy.start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _aws_env() -> Iterator[None]:
    """The test credentials in this process while the simulation runs; the previous values afterwards."""
    saved = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _moto() -> Iterator[str]:
    """moto's S3 server in its own process (so its work does not share the proxies' interpreter), on loopback."""
    port = _free_port()
    # (``-m``: moto may be importable without its script on PATH, e.g. installed with pip --target)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _wait_http(url: str, timeout: float = 30) -> None:
    _sibling("checkpoint_io")._wait_http(url, timeout)


def _node_env(base: Mapping[str, str], node: int, port: int, endpoint: str, tmp: str) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _DROPPED and not k.startswith(_DROPPED_PREFIXES)}
    env.update(AWS_ENV)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node), "TMPDIR": tmp,
                "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint})
    return env


def run_job(spec: Mapping[str, Any], proxies: list[Any], work: str, timeout: float) -> dict[str, Any]:
    """One job: N node launchers at once; each node's launch time and its processes' records."""
    scaling = _sibling("scaling")
    job = os.path.join(work, f"job-{uuid.uuid4().hex[:8]}")
    out_dir = os.path.join(job, "records")
    os.makedirs(out_dir)
    port = _free_port()
    procs, launched = [], []
    with contextlib.ExitStack() as logs:  # every node's log stays open until its processes have ended
        try:
            for node, proxy in enumerate(proxies):
                tmp = os.path.join(job, f"node{node}")
                os.makedirs(tmp)
                node_spec = {**spec, "endpoint": proxy.url, "out_dir": out_dir}
                env = _node_env(scaling._repo_env(), node, port, proxy.url, tmp)
                log = logs.enter_context(open(os.path.join(job, f"node{node}.log"), "w"))
                launched.append(time.time())
                procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--node-worker",
                                               json.dumps(node_spec)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True, cwd=job))
            deadline = time.monotonic() + timeout
            codes = []
            for proc in procs:
                try:
                    codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        finally:
            for proc in procs:  # a node that failed leaves the others waiting in a collective: end them all
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                scaling._stop_group(proc.pid, grace=30)  # the node's other processes write their record, then exit
                proc.wait()
    world = spec["nodes"] * spec["procs_per_node"]
    records = []
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                records.append(json.load(f))
    if len(records) != world or any(c != 0 for c in codes):
        tails = []
        for node in range(len(procs)):
            with open(os.path.join(job, f"node{node}.log")) as f:
                tails.append(f"--- node {node} (exit {codes[node] if node < len(codes) else '?'}) ---\n"
                             + f.read()[-3000:])
        raise RuntimeError(f"a {'resume' if spec['resume'] else 'training'} job failed: {len(records)} of {world}"
                           " processes finished\n" + "\n".join(tails))
    shutil.rmtree(job, ignore_errors=True)
    return {"launched": launched, "records": records}


def _checkpoint_bytes(endpoint: str, root: str, commit: str) -> int:
    """Every stored object of the commit, read straight from moto (not through a node's proxy)."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint})
    _, path = fsspec.core.split_protocol(f"{root}/{commit}")
    return int(fs.du(path))


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    model = {"model": "mlp", "width": args.width, "layers": args.layers, "per_gpu_batch": args.per_proc_batch,
             "warmup": 0, "steps": 3 * args.every_n_steps, "accumulate": 1, "heads": 1, "seq": 1, "vocab": 1,
             "device": "cpu", "precision": "32-true"}
    spec = {"nodes": args.nodes, "procs_per_node": args.procs_per_node, "every_n_steps": args.every_n_steps,
            "model": model, "root": f"s3://{BUCKET}/scaling-nodes/ckpt"}
    saved_step = 2 * args.every_n_steps
    work = tempfile.mkdtemp(prefix="scaling-nodes-")
    proxies: list[Any] = []
    runs: list[dict[str, Any]] = []
    first: dict[str, Any] = {}  # rank 0 of the training job: the model's and the machine's descriptions
    try:
        with _aws_env(), _moto() as endpoint:
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
            proxies = [_counting_proxy(endpoint) for _ in range(args.nodes)]
            started = time.perf_counter()
            trained = run_job({**spec, "resume": False, "node_cache": True, "max_steps": saved_step}, proxies, work,
                              args.timeout)
            first = next(r for r in trained["records"] if r["global_rank"] == 0)
            print(f"trained {saved_step} steps ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            commit, size = "", 0
            for run in range(args.runs):
                for cache in (True, False):  # interleaved, so that a drift of the machine affects both alike
                    for proxy in proxies:
                        with proxy.lock:
                            proxy.log.clear()
                    started = time.perf_counter()
                    job = run_job({**spec, "resume": True, "node_cache": cache, "max_steps": saved_step + 1},
                                  proxies, work, args.timeout)
                    commits = {r["commit"] for r in job["records"]}
                    steps = {r["resumed_step"] for r in job["records"]}
                    if len(commits) != 1 or None in commits or steps != {saved_step}:
                        raise RuntimeError(f"the processes did not resume one commit at step {saved_step}: commits"
                                           f" {commits}, steps {steps}")
                    if not commit:
                        commit = commits.pop()
                        size = _checkpoint_bytes(endpoint, spec["root"], commit)
                    elif commit not in commits:
                        raise RuntimeError(f"resume {run} loaded {commits}, not {commit}")
                    for node, proxy in enumerate(proxies):
                        with proxy.lock:
                            requests = list(proxy.log)
                        records = [r for r in job["records"] if r["node"] == node]
                        runs.append({"run": run, "node_cache": cache, "node": node,
                                     **node_figures(requests, records, job["launched"][node], commit, size)})
                    mine = [r for r in runs if r["run"] == run and r["node_cache"] == cache]
                    print(f"resume {run + 1}/{args.runs}, node cache {'on' if cache else 'off'}: "
                          + ", ".join(f"node {r['node']} {r['bytes_read_ratio']:.2f}x checkpoint,"
                                      f" resume {r['resume_seconds']:.1f} s" for r in mine)
                          + f" ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        for proxy in proxies:
            proxy.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"schema": SCHEMA, "model": first["model"], "machine": first["machine"],
            "nodes": args.nodes, "procs_per_node": args.procs_per_node, "runs": args.runs, "commit": commit,
            "checkpoint_bytes": size, "resumed_step": saved_step, "load_definition": LOAD_DEFINITION,
            "resume_definition": RESUME_DEFINITION, "results": medians(runs), "per_run": runs}


def write(doc: Mapping[str, Any], out: str) -> str:
    text = f"# Multi-node resume, simulated on one machine: store reads and resume time per node\n\n{table(doc)}\n"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scaling.py --nodes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True, help="simulated nodes (2: the layout the tests prove)")
    parser.add_argument("--procs-per-node", type=int, default=2, help="DDP processes per node (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="resumes with and as many without the node cache")
    parser.add_argument("--device", choices=["cpu"], default="cpu",
                        help="cpu only: gloo on loopback (NCCL cannot put two nodes' ranks on one GPU)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default 1024: a ~38 MB checkpoint)")
    parser.add_argument("--layers", type=int, default=2, help="MLP hidden layers (default 2)")
    parser.add_argument("--per-proc-batch", type=int, default=16, help="samples per process and step")
    parser.add_argument("--every-n-steps", type=int, default=4,
                        help="checkpoint cadence; the training job commits two checkpoints (default 4)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scaling_nodes"),
                        help="output path prefix (.md and .json are written)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    args = parser.parse_args(argv)
    for name in ("nodes", "procs_per_node", "runs", "width", "layers", "per_proc_batch", "every_n_steps"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.nodes * args.procs_per_node < 2:
        parser.error(f"--nodes {args.nodes} x --procs-per-node {args.procs_per_node} is one process: nothing to share")
    return args


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--node-worker"]:
        node_worker(json.loads(argv[1]))
        return ""
    args = parse(argv)
    doc = simulate(args)
    text = write(doc, args.out)
    print(text)
    return text


if __name__ == "__main__":
    main()
