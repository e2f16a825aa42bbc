"""The demo's model and data: small enough for a laptop CPU, big enough that a checkpoint upload takes a moment.

They are ordinary Lightning classes, referenced by ``class_path`` from ``configs/`` and the demo's own config,
so the example configs run as they are; replace them with your own model and data.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilient.schedule import ScheduleKind, warmup_schedule

__all__ = ["DemoData", "DemoModel"]


class DemoModel(LightningModule):
    """A 2-hidden-layer MLP regressor (~2.3 M parameters; with Adam's state a checkpoint is ~27 MB).

    Args:
        hidden: width of the hidden layers.
        dropout: dropout after the first layer (random numbers in every step, which exact resume restores).
        lr: peak learning rate of Adam.
        schedule: LR schedule counted in optimizer steps (see :func:`~lightning_resilient.warmup_schedule`).
        warmup_steps: warmup length, in optimizer steps or as a fraction of them.
        min_lr_ratio: the schedule's final LR as a fraction of ``lr``.
        record_to: a folder to append each step's loss to (``losses.txt``) and write the final weights to
            (``weights.pt``); the demo compares runs with them.
    """

    def __init__(self, hidden: int = 1500, dropout: float = 0.1, lr: float = 1e-3, schedule: ScheduleKind = "cosine",
                 warmup_steps: float = 0.1, min_lr_ratio: float = 0.05, record_to: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["record_to"])
        self.record_to = record_to
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def _record(self, line: str) -> None:
        if self.record_to and self.trainer.is_global_zero:
            os.makedirs(self.record_to, exist_ok=True)
            with open(os.path.join(self.record_to, "losses.txt"), "a") as f:
                f.write(line + "\n")

    def on_train_start(self) -> None:
        self._record("# start")  # each attempt (a first run, a resume) begins a new segment

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._record(f"{self.trainer.global_step} {batch_idx} {outputs['loss'].item()!r}")

    def on_train_end(self) -> None:
        if self.record_to and self.trainer.is_global_zero:
            torch.save({k: v.detach().clone() for k, v in self.state_dict().items()},
                       os.path.join(self.record_to, "weights.pt"))

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = torch.optim.Adam(self.parameters(), lr=hp["lr"])
        # Sized from the trainer's optimizer-step count: with accumulation it ends exactly at the last step.
        sched = warmup_schedule(opt, hp["schedule"], trainer=self.trainer, warmup_steps=hp["warmup_steps"],
                                min_lr_ratio=hp["min_lr_ratio"])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class DemoData(LightningDataModule):
    """``samples`` random inputs and a smooth target, shuffled every epoch.

    Args:
        samples: dataset size.
        batch_size: micro-batch size.
        seed: the data's seed (the shuffle order comes from the run's RNG, which exact resume restores).
    """

    def __init__(self, samples: int = 2048, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.samples, self.batch_size, self.seed = samples, batch_size, seed

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sin().sum(1, keepdim=True)), batch_size=self.batch_size, shuffle=True)
