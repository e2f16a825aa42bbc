"""A training job for the exact-resume tests. Resumes from its root when it can; writes its losses per step
and, at the end, its weights. Run: python exact_child.py ROOT OUT JSON_OPTIONS.

It prints ``SAVED <step>`` after each save and ``STEP <global step>`` after each training batch (after
ResumeStateCallback recorded it), so the parent can kill it at a save or a few steps after one.

Options: workers, accumulate, epochs, callback (add ResumeStateCallback), callback_args (its arguments), ckpt
(ModelCheckpoint arguments), augment (None | "raw": drawn from Python's, NumPy's and torch's global RNGs in
``__getitem__`` | "seeded": the same in PerSampleSeeded), schedule (read estimated_stepping_batches in
configure_optimizers), trainer (extra Trainer arguments), loader ("plain" | "stateful": torchdata
StatefulDataLoader), step_sleep (seconds each step waits after printing it: time for a kill to land), pause_at
(global steps whose batch prints ``BEGIN <step>`` at its start, then waits 3 s: a kill part-way through a step)."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import (
    AtomicCheckpointIO,
    PerSampleSeeded,
    ResumeStateCallback,
    find_latest_checkpoint,
    warmup_schedule,
)


class Noisy(Dataset):
    """Deterministic samples; 40 of them."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(6, generator=g)
        return x, x.sum(0, keepdim=True)


class Augmented(Noisy):
    """Random augmentation drawn from Python's, NumPy's and torch's global RNGs inside __getitem__, i.e. inside the
    workers: a random scale, NumPy noise and torch noise."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        x = x * (1 + 0.1 * random.random()) + 0.1 * torch.from_numpy(np.random.randn(6)).float()
        return x + 0.1 * torch.randn(6), y


class Net(LightningModule):
    def __init__(self, schedule: bool = False) -> None:
        super().__init__()
        self.schedule = schedule
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        noise = torch.randn_like(y) * 0.01  # draws from torch's global RNG in the step, as augmentation would
        return torch.nn.functional.mse_loss(self.net(x), y + noise)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        if not self.schedule:
            return opt
        # Reads trainer.estimated_stepping_batches here, which makes Lightning build the train loader early
        # (the case where stock Lightning drops a stateful loader's position, #20550).
        sched = warmup_schedule(opt, "cosine", trainer=self.trainer, warmup_steps=2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(Callback):
    def __init__(self, out: str, step_sleep: float, pause_at: list[int]) -> None:
        self.out = out
        self.step_sleep = step_sleep
        self.pause_at = pause_at

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 0 and trainer.global_step in self.pause_at:
            # Part-way through the batch that starts at this global step: a window for the parent's SIGKILL.
            print(f"BEGIN {trainer.global_step}", flush=True)
            time.sleep(3)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 0:
            return  # one writer: under DDP the ranks' lines would interleave differently in every run
        with open(self.out + ".losses", "a") as f:
            f.write(f"{trainer.global_step} {batch_idx} {outputs['loss'].item()!r}\n")
        print(f"STEP {trainer.global_step}", flush=True)
        time.sleep(self.step_sleep)


class Announce(AtomicCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        print(f"SAVED {checkpoint['global_step']}", flush=True)


def main(root: str, out: str, options: dict[str, Any]) -> None:
    torch.manual_seed(1234)
    augment = options.get("augment")
    dataset = {"seeded": lambda: PerSampleSeeded(Augmented(), seed=3), "raw": Augmented, None: Noisy}[augment]()
    # "stateful": torchdata's StatefulDataLoader (its own RandomSampler with a generator seeded at construction;
    # under DDP Lightning re-instantiates it with that sampler inside a DistributedSamplerWrapper).
    loader_cls = StatefulDataLoader if options.get("loader") == "stateful" else DataLoader
    loader = loader_cls(dataset, batch_size=4, shuffle=True, num_workers=options["workers"],
                        persistent_workers=options["workers"] > 0)
    callbacks: list[Callback] = [Record(out, options.get("step_sleep", 0.0), options.get("pause_at", [])),
                                 ModelCheckpoint(dirpath=root, save_top_k=-1, **options["ckpt"])]
    if options["callback"]:
        callbacks.insert(0, ResumeStateCallback(**options.get("callback_args", {})))
    trainer = Trainer(max_epochs=options["epochs"], accumulate_grad_batches=options["accumulate"],
                      accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=[Announce()], callbacks=callbacks, **options.get("trainer", {}))
    trainer.fit(Net(options.get("schedule", False)), loader, ckpt_path=find_latest_checkpoint(root))
    if trainer.global_rank == 0:
        torch.save({k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}, out + ".weights")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
