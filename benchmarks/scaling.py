"""Training throughput, scaling efficiency and checkpoint cost at each world size, for one model.

    python benchmarks/scaling.py                                    # every GPU here: world sizes 1, 2, 4, ...
    python benchmarks/scaling.py --world-sizes 1 2 4 8 --model transformer --width 2048 --layers 16
    python benchmarks/scaling.py --root s3://my-bucket/bench --async-save --every-n-steps 50
    python benchmarks/scaling.py --device cpu                       # reduced form: gloo, world sizes 1 and 2, tiny MLP
    python benchmarks/scaling.py --nodes 2 [--procs-per-node 2]     # 2 nodes simulated here: store reads per resume

Each world size N is a fresh multi-process job: this script starts ``scaling.py --worker`` as a subprocess, whose
``Trainer(accelerator="gpu", devices=N, strategy="ddp")`` spawns the other ranks with Lightning's own launcher
(``--launcher torchrun``: the job is started by ``torchrun --standalone --nproc-per-node N`` instead). N = 1 is a
single device without DDP, the baseline of the scaling efficiency.

Multi-node: run the script itself on every node under torchrun or srun, with the usual environment (MASTER_ADDR,
MASTER_PORT, NODE_RANK / SLURM_*), ``--launcher external`` and a ``--root`` that every node can reach. It
measures the world size it is given (WORLD_SIZE and LOCAL_WORLD_SIZE, or SLURM_NTASKS and SLURM_NNODES) and
global rank 0 adds that row to ``--out``'s JSON (replacing a row of the same world size), so one single-node run
for 1..8 GPUs followed by runs on 2 and 4 nodes fills one table::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        benchmarks/scaling.py --launcher external --root s3://bucket/bench
    srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 \\
        python benchmarks/scaling.py --launcher external --root /shared/bench

What is measured, on global rank 0 (medians; steps before ``--warmup`` are not timed):

- step time: wall time of one optimizer step (``--accumulate`` micro-batches of ``--per-gpu-batch`` samples on every
  rank, data loading and the host-to-device copy included), synchronized with the GPU, checkpoint saves excluded;
  throughput = global batch / step time, global batch = per-GPU batch x world size x accumulate;
- scaling efficiency = throughput(N) / (N x throughput(1)) (against the smallest world size measured when 1 is not);
- save: a checkpoint every ``--every-n-steps`` measured steps through ``AtomicCheckpointIO`` (``--async-save`` for
  background uploads) to ``--root``. ``save s`` is the time the loop is blocked by ``trainer.save_checkpoint``
  (state dump, the plugin's blocking part, the closing barrier); ``upload s`` is the plugin's time until the save is
  committed (``io.save_stats``). One untimed save at the end of warmup pays the one-off costs (claiming the root,
  allocating the snapshot buffer); it is reported as ``first save s`` in the JSON;
- load: every rank loads the last checkpoint at once with ``io.load_checkpoint(path)`` (what a resume does, onto the
  CPU); the slowest rank's time, median over ``--load-runs``;
- checkpoint overhead = save / (save + every_n_steps x step time), the share of wall time lost to checkpoints.

``--nodes N`` is another measurement (``benchmarks/scaling_nodes.py``, whose ``--help`` lists its options): an
N-node x P-process DDP job simulated on this machine (one launcher process, node cache folder and counting store
proxy per node, in front of moto's S3 server), trained, then resumed from its latest checkpoint with and without
the node cache; it reports per node the store reads and bytes during the resume and the resume time.

Writes a markdown table, the JSON that ``lightning_resilient.planning.load_scaling`` reads (schema
``lightning_resilient.scaling/1``) and a PNG plot next to the ``--out`` prefix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from typing import Any

SCHEMA = "lightning_resilient.scaling/1"
LAUNCHERS = ["lightning", "torchrun", "external"]
MODELS = ["mlp", "transformer"]
# The reduced CPU form (what CI runs) and the GPU defaults; an explicit flag always wins.
DEFAULTS = {
    "cpu": {"model": "mlp", "width": 64, "layers": 2, "seq": 32, "vocab": 256, "per_gpu_batch": 16, "warmup": 3,
            "steps": 20, "every_n_steps": 5, "precision": "32-true"},
    "cuda": {"model": "transformer", "width": 1024, "layers": 8, "seq": 512, "vocab": 32768, "per_gpu_batch": 8,
             "warmup": 10, "steps": 60, "every_n_steps": 20, "precision": "bf16-mixed"},
}


# -- pure helpers (tested on the CPU; the GPU path only feeds them other numbers) -------------------------------

def default_world_sizes(devices: int) -> list[int]:
    """1, 2, 4, ... up to ``devices``, and ``devices`` itself when it is not a power of two."""
    if devices < 1:
        raise ValueError(f"need at least one device, got {devices}")
    sizes = [1]
    while sizes[-1] * 2 <= devices:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != devices:
        sizes.append(devices)
    return sizes


def launched_world(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(devices per node, nodes) of a job started by torchrun or srun, read from its environment; None outside one."""
    if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:  # torchrun (TorchElastic)
        world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    elif "SLURM_NTASKS" in env:  # srun: one task per GPU
        world, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        if world % nodes:
            raise ValueError(f"SLURM_NTASKS={world} is not a multiple of SLURM_NNODES={nodes}: run the same number"
                             " of tasks (one per GPU) on every node")
        local = world // nodes
    else:
        return None
    if local < 1 or world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of the ranks per node ({local})")
    return local, world // local


def launched_rank(env: Mapping[str, str]) -> int:
    """This process's global rank in a job started by torchrun or srun (0 outside one)."""
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")))


def trainer_kwargs(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer's arguments for one measurement (no plugins, no callbacks)."""
    world = spec["devices"] * spec["num_nodes"]
    return {"accelerator": "gpu" if spec["device"] == "cuda" else "cpu", "devices": spec["devices"],
            "num_nodes": spec["num_nodes"], "strategy": "ddp" if world > 1 else "auto",
            "precision": spec["precision"], "max_steps": spec["warmup"] + spec["steps"],
            "accumulate_grad_batches": spec["accumulate"], "logger": False, "enable_progress_bar": False,
            "enable_model_summary": False, "enable_checkpointing": False, "use_distributed_sampler": False,
            "num_sanity_val_steps": 0}


def summarize(raw: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    """One result row from the timings of rank 0 (scaling_efficiency is filled in by :func:`with_efficiency`)."""
    world = spec["devices"] * spec["num_nodes"]
    global_batch = spec["per_gpu_batch"] * world * spec["accumulate"]
    step = statistics.median(raw["step_times"])
    save = statistics.median(raw["save_times"])
    timed = raw["io_stats"]  # the plugin's SaveStats of the timed saves, as dicts
    uploads = [s["upload"] for s in timed if s["upload"] is not None]
    return {"world_size": world, "global_batch": global_batch, "throughput_samples_per_s": global_batch / step,
            "scaling_efficiency": 1.0, "step_seconds": step, "save_seconds": save,
            "load_seconds": statistics.median(raw["load_times"]),
            "checkpoint_overhead_fraction": save / (save + spec["every_n_steps"] * step),
            # extra fields (load_scaling tolerates them): the detail behind the figures above
            "upload_seconds": statistics.median(uploads) if uploads else None,
            "io_blocked_seconds": statistics.median(s["blocked"] for s in timed) if timed else None,
            "waited_seconds": statistics.median(s["waited"] for s in timed) if timed else None,
            "first_save_seconds": raw["first_save"], "checkpoint_bytes": raw["checkpoint_bytes"],
            "async_save": spec["async_save"], "every_n_steps": spec["every_n_steps"],
            "per_gpu_batch": spec["per_gpu_batch"], "accumulate": spec["accumulate"], "nodes": spec["num_nodes"],
            "measured_steps": len(raw["step_times"]), "saves": len(raw["save_times"]),
            "load_runs": len(raw["load_times"]), "device": spec["device"], "launcher": spec["launcher"],
            "cluster_environment": raw["cluster_environment"]}


def with_efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows sorted by world size, each with throughput / (N x per-GPU throughput of the smallest world size)."""
    rows = sorted(rows, key=lambda r: r["world_size"])
    base = rows[0]
    per_gpu = base["throughput_samples_per_s"] / base["world_size"]
    return [{**r, "scaling_efficiency": r["throughput_samples_per_s"] / (r["world_size"] * per_gpu)} for r in rows]


def model_description(spec: Mapping[str, Any], params: int | None = None) -> str:
    shape = f"width={spec['width']}, layers={spec['layers']}"
    if spec["model"] == "transformer":
        shape += f", heads={spec['heads']}, seq={spec['seq']}, vocab={spec['vocab']}"
    count = "" if params is None else f", {params / 1e6:,.1f}M params" if params >= 1e6 else f", {params:,} params"
    return (f"{spec['model']}({shape}){count}, AdamW, {spec['precision']}, per-GPU batch {spec['per_gpu_batch']}"
            f" x accumulate {spec['accumulate']}")


def machine_description() -> str:
    """CPU model, cores, GPU names and count, torch and Lightning versions (call where CUDA may be initialized)."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names: dict[str, int] = {}
    for i in range(count):
        name = torch.cuda.get_device_name(i)
        names[name] = names.get(name, 0) + 1
    gpus = ", ".join(f"{n} x {name}" for name, n in names.items()) if names else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {gpus}, Python {platform.python_version()}, torch {torch.__version__},"
            f" lightning {lightning.__version__}")


# -- the worker: one world size; every rank runs this ---------------------------------------------------------------

def _parts() -> tuple[type, type, type]:
    """The LightningModule and the timing callback (defined here so the driver never imports Lightning)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class Batches(torch.utils.data.Dataset):
        """Synthetic micro-batches: a small pool of random tensors, served in turn (no per-sample collation)."""

        def __init__(self, pool: list[Any], length: int) -> None:
            self.pool, self.length = pool, length

        def __len__(self) -> int:
            return self.length

        def __getitem__(self, i: int) -> Any:
            return self.pool[i % len(self.pool)]

    class ScalingModel(pl.LightningModule):
        def __init__(self, spec: Mapping[str, Any]) -> None:
            super().__init__()
            self.spec = dict(spec)
            width, layers = spec["width"], spec["layers"]
            if spec["model"] == "mlp":
                blocks: list[nn.Module] = []
                for _ in range(layers):
                    blocks += [nn.Linear(width, width), nn.GELU()]
                self.net = nn.Sequential(*blocks, nn.Linear(width, width))  # width classes
            else:
                self.embed = nn.Embedding(spec["vocab"], width)
                self.pos = nn.Parameter(torch.zeros(spec["seq"], width))
                layer = nn.TransformerEncoderLayer(width, spec["heads"], 4 * width, dropout=0.0, activation="gelu",
                                                   batch_first=True, norm_first=True)
                self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(width)
                self.head = nn.Linear(width, spec["vocab"], bias=False)
                self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(spec["seq"]),
                                     persistent=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.spec["model"] == "mlp":
                x, y = batch
                return nn.functional.cross_entropy(self.net(x), y)
            tokens = batch
            h = self.embed(tokens[:, :-1]) + self.pos
            h = self.norm(self.blocks(h, mask=self.mask, is_causal=True))
            logits = self.head(h)
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            spec = self.spec
            g = torch.Generator().manual_seed(1234 + self.global_rank)
            b = spec["per_gpu_batch"]
            pool: list[Any] = []
            for _ in range(4):
                if spec["model"] == "mlp":
                    pool.append((torch.randn(b, spec["width"], generator=g),
                                 torch.randint(0, spec["width"], (b,), generator=g)))
                else:
                    pool.append(torch.randint(0, spec["vocab"], (b, spec["seq"] + 1), generator=g))
            if self.trainer.strategy.root_device.type == "cuda":  # pinned, as a real loader with pin_memory
                pool = [tuple(t.pin_memory() for t in p) if isinstance(p, tuple) else p.pin_memory() for p in pool]
            length = (spec["warmup"] + spec["steps"] + 2) * spec["accumulate"]
            return torch.utils.data.DataLoader(Batches(pool, length), batch_size=None, shuffle=False)

    class Probe(pl.Callback):
        """Times every optimizer step and every save on this rank; loads the last checkpoint at the end."""

        def __init__(self, spec: Mapping[str, Any], io: Any) -> None:
            self.spec, self.io = spec, io
            self.step_times: list[float] = []
            self.save_times: list[float] = []
            self.load_times: list[float] = []
            self.first_save: float | None = None
            self.checkpoint_bytes: int | None = None
            self.timed_steps: set[int] = set()
            self.paths: list[str] = []
            self._seen = 0
            self._last: float | None = None

        def _sync(self, trainer: pl.Trainer) -> None:
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize(trainer.strategy.root_device)

        def _save(self, trainer: pl.Trainer, step: int) -> float:
            path = f"{self.spec['ckpt_root'].rstrip('/')}/step-{step:07d}.ckpt"
            self._sync(trainer)
            t0 = time.perf_counter()
            trainer.save_checkpoint(path, weights_only=False)
            self._sync(trainer)
            self.paths.append(path)
            return time.perf_counter() - t0

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            step = trainer.global_step
            if step == self._seen:  # inside an accumulation window: not an optimizer step yet
                return
            self._seen = step
            self._sync(trainer)
            now = time.perf_counter()
            warmup, steps, every = self.spec["warmup"], self.spec["steps"], self.spec["every_n_steps"]
            measured = step - warmup
            if measured > 0 and self._last is not None:
                self.step_times.append(now - self._last)
            if measured == 0:
                self.first_save = self._save(trainer, step)
                now = time.perf_counter()
            elif measured > 0 and (measured % every == 0 or (measured == steps and not self.save_times)):
                self.save_times.append(self._save(trainer, step))
                self.timed_steps.add(step)
                now = time.perf_counter()  # the save is not part of the next step's time
            self._last = now

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            from lightning_resilient import AtomicCheckpointIO

            if trainer.is_global_zero:
                self.io.wait()  # the last async upload committed: its time is in save_stats, its files readable
            for _ in range(self.spec["load_runs"]):
                trainer.strategy.barrier("scaling-load")
                # A fresh plugin per load, as a resumed job has; claim_on_load=False: measuring must not fence.
                loader = AtomicCheckpointIO(storage_options=self.spec["storage_options"], claim_on_load=False)
                t0 = time.perf_counter()
                loader.load_checkpoint(self.paths[-1])
                took = torch.tensor([time.perf_counter() - t0], device=trainer.strategy.root_device)
                if loader.last_load is not None:
                    self.checkpoint_bytes = loader.last_load.bytes
                self.load_times.append(float(trainer.strategy.all_gather(took).max()))  # the slowest rank
            trainer.strategy.barrier("scaling-load-done")

    return ScalingModel, Probe, Batches


def describe(spec: Mapping[str, Any]) -> str:
    """The model's description with its parameter count (built on the meta device: no memory, no time)."""
    import torch

    with torch.device("meta"):
        model = _parts()[0](spec)
    return model_description(spec, sum(p.numel() for p in model.parameters()))


def worker(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Run one world size; return rank 0's raw timings (None on the other ranks)."""
    import warnings

    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    import torch

    from lightning_resilient import AtomicCheckpointIO

    if spec["device"] == "cpu":  # the ranks share this machine's cores instead of each getting its own GPU
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec["devices"]))
    pl.seed_everything(0, verbose=False)
    ScalingModel, Probe, _ = _parts()
    model = ScalingModel(spec)
    io = AtomicCheckpointIO(storage_options=spec["storage_options"], async_save=spec["async_save"], keep_last=2)
    probe = Probe(spec, io)
    plugins: list[Any] = [io]
    if spec["launcher"] == "lightning" or (spec["launcher"] == "torchrun" and spec["devices"] == 1):
        from lightning.pytorch.plugins.environments import LightningEnvironment

        plugins.append(LightningEnvironment())  # this script's launcher, even inside a SLURM allocation
    elif spec["launcher"] == "torchrun" and spec["devices"] > 1:
        from lightning.pytorch.plugins.environments import TorchElasticEnvironment

        plugins.append(TorchElasticEnvironment())
    trainer = pl.Trainer(**trainer_kwargs(spec), plugins=plugins, callbacks=[probe])
    trainer.fit(model)
    if not trainer.is_global_zero:
        return None
    timed = [s for s in io.save_stats if s.step in probe.timed_steps]
    environment = getattr(trainer.strategy, "cluster_environment", None)  # who started the ranks
    return {"step_times": probe.step_times, "save_times": probe.save_times, "load_times": probe.load_times,
            "first_save": probe.first_save, "checkpoint_bytes": probe.checkpoint_bytes,
            "io_stats": [vars(s) for s in timed],
            "cluster_environment": type(environment).__name__ if environment is not None else "single device",
            "model": describe(spec), "machine": machine_description()}


# -- the driver ---------------------------------------------------------------------------------------------------

def _repo_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch(spec: dict[str, Any], timeout: float, log_dir: str) -> dict[str, Any]:
    """Run one world size as a fresh job (its own process group) and return rank 0's raw timings."""
    world = spec["devices"] * spec["num_nodes"]
    result_file = os.path.join(log_dir, f"ws{world}.json")
    spec = {**spec, "result_file": result_file}
    script = [os.path.abspath(__file__), "--worker", json.dumps(spec)]
    if spec["launcher"] == "torchrun" and world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *script]
    else:
        cmd = [sys.executable, *script]  # Lightning's launcher starts ranks 1..N-1 from this process
    log = os.path.join(log_dir, f"ws{world}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_repo_env(), start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        finally:
            _stop_group(proc.pid, grace=30)
            proc.wait()
    if rc != 0 or not os.path.exists(result_file):
        with open(log) as f:
            tail = f.read()[-4000:]
        why = "timed out" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"world size {world} {why}:\n{tail}")
    with open(result_file) as f:
        return json.load(f)


def _stop_group(pgid: int, grace: float) -> None:
    """Let the job's other ranks end on their own for ``grace`` seconds, then terminate the rest of its group."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            return
        time.sleep(0.2)


def _remove(url: str, options: dict[str, Any]) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    with contextlib.suppress(FileNotFoundError):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def table(rows: list[dict[str, Any]], model: str, machine: str, every: int) -> str:
    base = rows[0]["world_size"]
    against = "" if base == 1 else f" (efficiency against world size {base}, the smallest measured)"
    asynchronous = any(r.get("async_save") for r in rows)
    lines = [f"Model: {model}", "", f"Machine: {machine}", "",
             (f"A checkpoint every {every} steps, {'async' if asynchronous else 'synchronous'} AtomicCheckpointIO"
              f" saves{against}."), "",
             ("| world size | global batch | samples/s | efficiency | step s | save s (blocked) / upload s | load s |"
              " overhead % |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        upload = "-" if r.get("upload_seconds") is None else f"{r['upload_seconds']:.3f}"
        lines.append(f"| {r['world_size']} | {r['global_batch']} | {r['throughput_samples_per_s']:,.1f} |"
                     f" {r['scaling_efficiency']:.2f} | {r['step_seconds']:.4f} | {r['save_seconds']:.3f} / {upload} |"
                     f" {r['load_seconds']:.3f} | {100 * r['checkpoint_overhead_fraction']:.2f} |")
    lines += ["", ("samples/s excludes checkpoint time; save s is what the loop is blocked per save"
              " (trainer.save_checkpoint); upload s is the plugin's time until the save is committed; load s is the"
              " slowest rank's io.load_checkpoint; overhead = save / (save + every_n_steps x step s).")]
    if any(r.get("device") == "cpu" for r in rows):
        lines += ["", ("CPU (the reduced form): the ranks share this machine's cores (cores / N threads each) over"
                       " gloo, so the efficiency shows the script works, not how GPUs scale.")]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["world_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    thr = [r["throughput_samples_per_s"] for r in rows]
    per_gpu = thr[0] / sizes[0]
    left.plot(sizes, thr, "o-", color="#2a7", label="measured")
    left.plot(sizes, [per_gpu * n for n in sizes], "--", color="#999", label="linear")
    left.set_xlabel("world size")
    left.set_ylabel("samples/s")
    eff = left.twinx()
    eff.plot(sizes, [r["scaling_efficiency"] for r in rows], "s:", color="#c64", label="efficiency")
    eff.set_ylabel("scaling efficiency")
    eff.set_ylim(0, max(1.1, max(r["scaling_efficiency"] for r in rows) * 1.1))
    handles = left.get_legend_handles_labels()[0] + eff.get_legend_handles_labels()[0]
    left.set_ylim(bottom=0)
    left.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center",
                bbox_to_anchor=(0.5, -0.15), ncol=3)
    left.set_title("throughput and efficiency", fontsize=10)
    right.plot(sizes, [r["save_seconds"] for r in rows], "o-", label="save (blocked)")
    uploads = [(n, r["upload_seconds"]) for n, r in zip(sizes, rows, strict=True)
               if r.get("upload_seconds") is not None]
    if uploads:
        right.plot([u[0] for u in uploads], [u[1] for u in uploads], "^--", label="upload")
    right.plot(sizes, [r["load_seconds"] for r in rows], "s-", label="load (slowest rank)")
    right.set_xlabel("world size")
    right.set_ylabel("seconds")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    right.set_title("checkpoint save and load", fontsize=10)
    for ax in (left, right):
        if len(sizes) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict[str, Any]], model: str, machine: str, every: int, out: str) -> str:
    rows = with_efficiency(rows)
    text = f"# Scaling: throughput and checkpoint cost per world size\n\n{table(rows, model, machine, every)}\n"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump({"schema": SCHEMA, "model": model, "machine": machine, "results": rows}, f, indent=1)
    plot(rows, out + ".png")
    return text


def _existing_rows(out: str, model: str) -> list[dict[str, Any]]:
    """The rows already in ``out``.json (external launches add theirs); only for the same model and settings."""
    try:
        with open(out + ".json") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return []
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{out}.json has schema {doc.get('schema')!r}, not {SCHEMA!r}: give another --out")
    if doc.get("model") != model:
        raise ValueError(f"{out}.json measured another model ({doc.get('model')!r}), not {model!r}: give another"
                         " --out, or the same model flags")
    return list(doc["results"])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="cuda when a GPU is visible, else cpu (the reduced form)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="default: 1, 2, 4, ... up to the GPUs here (cpu: 1 2)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="lightning",
                        help="lightning: the Trainer spawns the ranks; torchrun: torchrun --standalone does;"
                             " external: this process is one rank of a job started by torchrun/srun (multi-node)")
    parser.add_argument("--model", choices=MODELS, default=None, help="default: transformer (cpu: mlp)")
    parser.add_argument("--width", type=int, default=None, help="hidden size (default 1024; cpu: 64)")
    parser.add_argument("--layers", type=int, default=None, help="default 8 (cpu: 2)")
    parser.add_argument("--heads", type=int, default=None, help="transformer: attention heads (default width // 64)")
    parser.add_argument("--seq", type=int, default=None, help="transformer: tokens per sample (default 512)")
    parser.add_argument("--vocab", type=int, default=None, help="transformer: vocabulary size (default 32768)")
    parser.add_argument("--per-gpu-batch", type=int, default=None, help="micro-batch per rank (default 8; cpu: 16)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--precision", default=None, help="Lightning precision (default bf16-mixed; cpu: 32-true)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps first (default 10; cpu: 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 60; cpu: 20)")
    parser.add_argument("--every-n-steps", type=int, default=None,
                        help="checkpoint cadence in optimizer steps (default 20; cpu: 5)")
    parser.add_argument("--async-save", action="store_true", help="AtomicCheckpointIO(async_save=True)")
    parser.add_argument("--load-runs", type=int, default=1, help="loads of the last checkpoint (median)")
    parser.add_argument("--root", default=None,
                        help="checkpoint root, any fsspec URL (default: a local temporary folder)")
    parser.add_argument("--storage-options", type=json.loads, default={}, help="fsspec options as JSON")
    parser.add_argument("--keep-checkpoints", action="store_true", help="leave the checkpoints under --root")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scaling"),
                        help="output path prefix (.md, .json and .png are written)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per world size")
    parser.add_argument("--nodes", type=int, default=None,
                        help="simulate this many nodes on this machine and measure a resume's store reads per node"
                             " (benchmarks/scaling_nodes.py; see its --help for --procs-per-node, --runs, ...)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.heads is None:
        args.heads = max(1, args.width // 64)
    for name in ("width", "layers", "heads", "seq", "vocab", "per_gpu_batch", "accumulate", "warmup", "steps",
                 "every_n_steps", "load_runs"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.model == "transformer" and args.width % args.heads:
        parser.error(f"--width {args.width} is not divisible by --heads {args.heads}: give --heads")
    if not isinstance(args.storage_options, dict):
        parser.error(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    if args.launcher == "external":
        if args.world_sizes:
            parser.error("--world-sizes does not go with --launcher external: the job's world size is measured")
        if args.root is None:
            parser.error("--launcher external needs --root, a checkpoint root that every rank and node can reach")
        return args
    have = 0
    if args.device == "cuda":
        import torch

        have = torch.cuda.device_count()  # no CUDA context in this process: the jobs get the GPUs
        if have == 0:
            parser.error("--device cuda, but this process sees no GPU: use --device cpu for the reduced form")
    if args.world_sizes is None:
        args.world_sizes = [1, 2] if args.device == "cpu" else default_world_sizes(have)
    if any(n < 1 for n in args.world_sizes):
        parser.error(f"--world-sizes must all be >= 1, got {args.world_sizes}")
    args.world_sizes = sorted(set(args.world_sizes))
    if args.device == "cuda" and max(args.world_sizes) > have:
        parser.error(f"--world-sizes {args.world_sizes} asks for {max(args.world_sizes)} GPUs on one node, but"
                     f" {have} are visible; more nodes: --launcher external under torchrun or srun")
    return args


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {"device": args.device, "launcher": args.launcher, "model": args.model, "width": args.width,
            "layers": args.layers, "heads": args.heads, "seq": args.seq, "vocab": args.vocab,
            "per_gpu_batch": args.per_gpu_batch, "accumulate": args.accumulate, "precision": args.precision,
            "warmup": args.warmup, "steps": args.steps, "every_n_steps": args.every_n_steps,
            "async_save": args.async_save, "load_runs": args.load_runs, "storage_options": args.storage_options,
            "num_nodes": 1}


def _external(args: argparse.Namespace) -> str:
    """One rank of a job started by torchrun or srun: measure its world size; rank 0 adds the row to ``--out``."""
    world = launched_world(os.environ)
    if world is None:
        raise SystemExit("--launcher external runs under torchrun or srun: neither WORLD_SIZE/LOCAL_WORLD_SIZE nor"
                         " SLURM_NTASKS is set")
    devices, nodes = world
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "run"
    spec = {**base_spec(args), "devices": devices, "num_nodes": nodes,
            "ckpt_root": f"{args.root.rstrip('/')}/scaling-ws{devices * nodes}-{run}"}
    existing = _existing_rows(args.out, describe(spec))  # before measuring: refuse to mix models up front
    try:
        raw = worker(spec)
    finally:
        if not args.keep_checkpoints and launched_rank(os.environ) == 0:
            _remove(spec["ckpt_root"], args.storage_options)
    if raw is None:
        return ""
    rows = [r for r in existing if r["world_size"] != devices * nodes]
    rows.append(summarize(raw, spec))
    text = write(rows, raw["model"], raw["machine"] + f", {nodes} node(s)", args.every_n_steps, args.out)
    print(text)
    return text


def _simulates_nodes(argv: list[str]) -> bool:
    return any(a == "--nodes" or a.startswith("--nodes=") for a in argv)


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    if _simulates_nodes(argv):  # its own options and outputs: the simulation parses the whole command line
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaling_nodes.py")
        spec = importlib.util.spec_from_file_location("_bench_scaling_nodes", path)
        assert spec is not None and spec.loader is not None
        nodes = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(nodes)
        return nodes.main(argv)
    args = parse(argv)
    if args.worker:
        spec = json.loads(args.worker)
        raw = worker(spec)
        if raw is not None:
            with open(spec["result_file"], "w") as f:
                json.dump(raw, f)
        return ""
    if args.launcher == "external":
        return _external(args)
    tmp = tempfile.mkdtemp(prefix="scaling-bench-")
    root = args.root or os.path.join(tmp, "ckpt")
    rows: list[dict[str, Any]] = []
    model = machine = ""
    try:
        for n in args.world_sizes:
            spec = {**base_spec(args), "devices": n, "ckpt_root": f"{root.rstrip('/')}/ws{n}-{uuid.uuid4().hex[:8]}"}
            started = time.perf_counter()
            try:
                raw = launch(spec, args.timeout, tmp)
            finally:
                if not args.keep_checkpoints:
                    _remove(spec["ckpt_root"], args.storage_options)
            row = summarize(raw, spec)
            rows.append(row)
            model, machine = raw["model"], raw["machine"]
            print(f"world size {n}: {row['throughput_samples_per_s']:,.1f} samples/s, step {row['step_seconds']:.4f} s,"
                  f" save {row['save_seconds']:.3f} s, load {row['load_seconds']:.3f} s"
                  f" ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = write(rows, model, machine, args.every_n_steps, args.out)
    print(text)
    return text


if __name__ == "__main__":
    main()
