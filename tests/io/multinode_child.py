"""One "node" of a 2-node x 2-process DDP job on loopback (gloo, CPU): python multinode_child.py ROOT OUT OPTIONS.

Run it twice, with ``NODE_RANK`` 0 and 1 and the same ``MASTER_ADDR``/``MASTER_PORT``; Lightning starts the
node's second process itself. Each node has its own ``TMPDIR`` (so its own node cache) and reaches the store through
its own endpoint (``AWS_ENDPOINT_URL``), so a test can count each node's store reads.

OPTIONS (JSON): ``max_steps``, ``every`` (save interval in steps), ``ckpt`` ("latest": every rank looks up the
newest committed checkpoint; "stale": the second node's ranks are handed the oldest one instead, as if they had
looked it up before the old job's last commit), ``fail_rank`` (that global rank's first load attempt fails
verification, as a damaged read on one node would).
Prints ``BEGIN <step>`` / ``END <step>`` around rank 0's saves and ``START rank=<r> step=<s> commit=<c>``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import (
    AtomicCheckpointIO,
    CheckpointCorruptedError,
    ResumeStateCallback,
    find_latest_checkpoint,
)
from lightning_resilient.io.catalog import reader


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class IO(AtomicCheckpointIO):
    def __init__(self, fail_rank: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_rank = fail_rank

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        print(f"BEGIN {checkpoint['global_step']}\n", end="", flush=True)
        super().save_checkpoint(checkpoint, path, storage_options)
        print(f"END {checkpoint['global_step']}\n", end="", flush=True)

    def _loader(self, root: Any) -> Any:
        load = super()._loader(root)
        if self.fail_rank != torch.distributed.get_rank():
            return load

        def failing_once(commit: str, **kwargs: Any) -> Any:
            if self.fail_rank is not None:
                self.fail_rank = None
                raise CheckpointCorruptedError(f"a damaged read of {commit} on this rank only (simulated)")
            return load(commit, **kwargs)

        return failing_once


class Report(Callback):
    def __init__(self, io: IO, out: str) -> None:
        self.io, self.out = io, out

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        commit = self.io.last_load.commit if self.io.last_load is not None else None
        print(f"START rank={trainer.global_rank} step={trainer.global_step} commit={commit}\n", end="", flush=True)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            torch.save({k: v.clone() for k, v in pl_module.state_dict().items()}, self.out)


def main(root: str, out: str, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    x = torch.randn(128, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    io = IO(options.get("fail_rank"), storage_options=options.get("storage_options"), shard_size=8192)
    # find_unused_parameters=True keeps DDP's gradient buckets as built: otherwise DDP rebuilds them after its first
    # iteration, and with more than two processes the first step after a resume reduces gradients in another order
    # than the uninterrupted run's steady state (equal up to float rounding, not bit for bit; see docs/multi-node.md).
    trainer = Trainer(strategy=DDPStrategy(find_unused_parameters=True), num_nodes=2, devices=2, accelerator="cpu",
                      max_steps=options["max_steps"], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[io],
                      callbacks=[ResumeStateCallback(), Report(io, out),
                                 ModelCheckpoint(dirpath=root, every_n_train_steps=options["every"], save_top_k=-1)])
    ckpt = None
    if options.get("ckpt") == "latest":
        ckpt = find_latest_checkpoint(root, options.get("storage_options"))
    elif options.get("ckpt") == "stale":
        if int(os.environ["NODE_RANK"]) == 0:
            ckpt = find_latest_checkpoint(root, options.get("storage_options"))
        else:
            pointer, _ = reader(root, options.get("storage_options")).read_pointer()
            assert pointer is not None
            ckpt = f"{root}/{pointer.candidates()[-1].commit}"
    trainer.fit(Net(), data, ckpt_path=ckpt)
    sys.stdout.flush()
    os._exit(0)  # gloo teardown at interpreter exit can abort on CPU (see the sharded tests); everything is written


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
