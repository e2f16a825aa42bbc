"""One whole Trainer setup of tests/test_compositions.py, as a user builds it: ``python composition_child.py ROOT OUT
OPTIONS``.

OPTIONS (JSON): ``procs`` ("one", "ddp": 2 processes, "nodes": one of 2 loopback nodes, ``NODE_RANK`` from the
environment), ``ckpt`` ("topk_last": a top-2 ModelCheckpoint on the logged loss with ``save_last``; "every_n": every
2 steps, all kept), ``async`` ("none", "own": ``async_save=True``, "wrapper": Lightning's ``AsyncCheckpointIO``
around the plugin), ``tier`` (a local tier at ``LOCAL_TIER``, persisting every 2nd save), ``s3`` (the root is on S3
at ``AWS_ENDPOINT_URL``, as Lightning's own client sees it too), ``dedup`` (incremental saves; with a local tier on
nodes, each node's tier is sent only what it lacks), ``max_steps``, ``gate`` (optional: ``[step, path]``, every rank
waits before training the step after ``step`` until ``path`` exists: the test brings a store back meanwhile, so the
job cannot reach its end before that however the machine schedules it). The model has a frozen input layer (a
fine-tune's base).

Every setup has ``ResumeStateCallback`` and ``PreemptionCheckpoint`` and resumes with the README's idiom
(``find_latest_checkpoint(root, local_tier=...)`` on every process). It prints ``START rank=<r> step=<s>`` on every
rank, ``SAVED <step>`` after each committed save call on global rank 0, and at the end, on global rank 0, loads every
checkpoint a ModelCheckpoint reports (``LOADABLE <n>``), writes the final weights to OUT and prints ``DONE``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_resilient import (
    AtomicCheckpointIO,
    PreemptionCheckpoint,
    ResumeStateCallback,
    find_latest_checkpoint,
)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # A frozen input layer (a fine-tune's base): what an incremental save references instead of rewriting.
        self.base = torch.nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = self.base(x + 0.01 * torch.randn_like(x))  # an RNG draw per step
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, sync_dist=True)  # (every rank ranks the same top-k)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Announcing(AtomicCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        say(f"SAVED {checkpoint['global_step']}")


class Gate(Callback):
    """Every rank waits at the start of the batch after global step ``step`` until ``path`` exists (bounded)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test never opened the gate {self.path}")
            time.sleep(0.02)


class Report(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        say(f"START rank={trainer.global_rank} step={trainer.global_step}")

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if os.environ.get("COMPOSITION_TRACE"):  # (debugging a setup: where a run first departs from another)
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in pl_module.parameters()))
            say(f"TRACE rank={trainer.global_rank} step={trainer.global_step} batch={batch[0].sum().item()!r}"
                f" rng={hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]}"
                f" params={digest.hexdigest()[:12]}")


def main(root: str, out: str, options: dict[str, Any]) -> None:
    if os.environ.get("COMPOSITION_LOG"):  # (debugging a setup: the package's log on stderr)
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    torch.manual_seed(7)
    x = torch.randn(96, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    storage = ({"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
                "config_kwargs": {"retries": {"max_attempts": 1}}} if options["s3"] else None)
    local_tier = os.environ["LOCAL_TIER"] if options["tier"] else None
    tier: dict[str, Any] = {"local_tier": local_tier, "persist_every": 2, "max_persist_failures": None} \
        if local_tier else {}
    dedup = bool(options.get("dedup"))
    io = Announcing(storage_options=storage, async_save=options["async"] == "own", retry_attempts=3,
                    retry_base_delay=0.05, retry_max_delay=0.2, dedup=dedup, **tier)
    if options["ckpt"] == "topk_last":
        checkpoint = ModelCheckpoint(dirpath=root, monitor="train_loss", mode="min", save_top_k=2,
                                     every_n_train_steps=2, save_last=True)
    else:
        checkpoint = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    procs = options["procs"]
    # find_unused_parameters=True keeps DDP's buckets as built: bit-exact resumes (see docs/multi-node.md).
    strategy: Any = DDPStrategy(find_unused_parameters=True) if procs != "one" else "auto"
    trainer = Trainer(accelerator="cpu", devices=2 if procs == "ddp" else 1, num_nodes=2 if procs == "nodes" else 1,
                      strategy=strategy, max_steps=options["max_steps"], logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      plugins=[AsyncCheckpointIO(io) if options["async"] == "wrapper" else io],
                      callbacks=[ResumeStateCallback(), Report(), PreemptionCheckpoint(), checkpoint,
                                 *([Gate(*options["gate"])] if options.get("gate") else [])])
    trainer.fit(Net(), loader, ckpt_path=find_latest_checkpoint(root, storage, local_tier=local_tier))
    if trainer.global_rank == 0:
        reported = {p for p in [checkpoint.best_model_path, checkpoint.last_model_path,
                                checkpoint.kth_best_model_path, *checkpoint.best_k_models] if p}
        for path in sorted(reported):
            loaded = io.load_checkpoint(path)  # (outside a Trainer: read-only)
            assert isinstance(loaded.get("global_step"), int), path
        say(f"LOADABLE {len(reported)}")
        torch.save({k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}, out)
    say("DONE")
    sys.stdout.flush()
    os._exit(0)  # gloo teardown at interpreter exit can abort on CPU (see tests/io/sharded_child.py)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
