"""A training job for the crash tests: resumes from the newest committed checkpoint, saves every step.

It prints ``BEGIN <step>`` when a save starts and ``END <step>`` when it returns, so the parent knows whether
its SIGKILL landed inside a save. Run as ``python crash_child.py ROOT STORAGE_OPTIONS_JSON [--max-steps N]
[--keep-last K]``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint


class Announcing(AtomicCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        step = checkpoint["global_step"]
        print(f"BEGIN {step}", flush=True)
        super().save_checkpoint(checkpoint, path, storage_options)
        print(f"END {step}", flush=True)


class Wide(LightningModule):
    """About 1 M parameters: with Adam's state a save is ~12 MB in ~50 shards, long enough to be hit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 1000),
                                       torch.nn.ReLU(), torch.nn.Linear(1000, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main(root: str, options: dict[str, Any], max_steps: int, keep_last: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    io = Announcing(storage_options=options, keep_last=keep_last, shard_size=256 * 1024, orphan_grace_seconds=0)
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[io],
                      callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)])
    ckpt = find_latest_checkpoint(root, options)
    print(f"RESUME {ckpt}", flush=True)
    trainer.fit(Wide(), data, ckpt_path=ckpt)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("options", type=json.loads)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--keep-last", type=int, default=3)
    args = parser.parse_args()
    main(args.root, args.options, args.max_steps, args.keep_last)
