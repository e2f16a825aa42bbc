"""A 2-process DDP (gloo, CPU) job for the DDP test: python ddp_child.py ROOT MAX_STEPS [JSON_IO_OPTIONS].

JSON_IO_OPTIONS are AtomicCheckpointIO arguments (storage_options, shard_size, node_cache, node_cache_dir, local_tier,
persist_every).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import AtomicCheckpointIO, CheckpointCorruptedError, find_latest_checkpoint
from tests.models import TinyModel, tiny_loader


class CountingIO(AtomicCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        print(f"SAVE rank={torch.distributed.get_rank()} pid={os.getpid()} step={checkpoint['global_step']}\n",
              end="", flush=True)
        super().save_checkpoint(checkpoint, path, storage_options)

    def _loader(self, root: Any) -> Any:
        # FAIL_RANK=<r>: that rank's first load fails verification, as a damaged read on one node would.
        load = super()._loader(root)
        if os.environ.get("FAIL_RANK") != str(torch.distributed.get_rank()):
            return load
        failed: list[str] = []

        def failing_once(commit: str, **kwargs: Any) -> Any:
            if not failed:
                failed.append(commit)
                raise CheckpointCorruptedError(f"a damaged read of {commit} on this rank only (simulated)")
            return load(commit, **kwargs)

        return failing_once


class Report(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        io = trainer.strategy.checkpoint_io
        last = getattr(io, "last_load", None)
        commit, tier = (last.commit, last.tier or "-") if last is not None else (None, "-")
        print(f"START rank={trainer.global_rank} pid={os.getpid()} step={trainer.global_step} commit={commit}"
              f" tier={tier}\n", end="", flush=True)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        w = pl_module.net[0].weight.detach().sum().item()
        print(f"END rank={trainer.global_rank} step={trainer.global_step} weight_sum={w!r}\n", end="", flush=True)


def main(root: str, max_steps: int, io_options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, plugins=[CountingIO(**io_options)],
                      callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1), Report()])
    # FRESH=1: a job that forgets its ckpt_path.
    ckpt_path = None if os.environ.get("FRESH") == "1" else find_latest_checkpoint(
        root, io_options.get("storage_options"), local_tier=io_options.get("local_tier"))
    trainer.fit(TinyModel(), tiny_loader(n=128), ckpt_path=ckpt_path)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
