"""A training job with a local tier, for the tiered kill test: resumes the newest checkpoint of either tier.

Run as ``python tiered_child.py ROOT STORAGE_OPTIONS_JSON LOCAL_TIER OUT [--max-steps N] [--persist-delay S]``.
It prints ``START <step>`` when training starts (the step it resumed at), ``SAVED <step>`` when a save returned
(committed to the local tier), ``PERSIST-BEGIN <step>`` / ``PERSIST-END <step> durable=<bool>`` around each persist to
the durable root (False: skipped for a newer one), ``COPIED <step>`` once a persist's objects are in the store
(``--persist-delay`` then holds it that long before its manifest is published: a window for the parent's SIGKILL), and
``DONE`` once ``fit`` returned, after writing the final weights to ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilient import AtomicCheckpointIO, ResumeStateCallback, find_latest_checkpoint
from lightning_resilient.io import tiered

_SAY = threading.Lock()


def say(line: str) -> None:
    """One whole line per call: the training thread and the persist thread both report."""
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Noisy(LightningModule):
    """Dropout and a shuffled loader: a resume that missed an RNG state or the data position would diverge."""

    def __init__(self, step_seconds: float = 0.0) -> None:
        super().__init__()
        self.step_seconds = step_seconds
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_seconds)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


def trainer(root: str, io: Any, max_steps: int, extra: list[Callback]) -> Trainer:
    return Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=[io] if io is not None else None,
                   callbacks=[ResumeStateCallback(), *extra,
                              ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)])


class Announcing(AtomicCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        say(f"SAVED {checkpoint['global_step']}")


class Start(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        say(f"START {trainer.global_step}")


def announce_persists(delay: float) -> None:
    persist, copy = tiered.TieredRoot._persist, tiered.TieredRoot._copy

    def announced(self: Any, entry: Any, **kwargs: Any) -> None:
        say(f"PERSIST-BEGIN {entry.step}")
        persist(self, entry, **kwargs)
        say(f"PERSIST-END {entry.step} durable={entry.commit in self._persisted}")  # False: skipped for a newer one

    def slow_copy(self: Any, manifest: Any) -> Any:
        out = copy(self, manifest)
        say(f"COPIED {manifest.step}")  # the objects are in the store; the manifest is not
        time.sleep(delay)
        return out

    tiered.TieredRoot._persist = announced  # type: ignore[method-assign]
    tiered.TieredRoot._copy = slow_copy  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("options", type=json.loads)
    parser.add_argument("local_tier")
    parser.add_argument("out")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--persist-delay", type=float, default=0.0)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()
    announce_persists(args.persist_delay)
    seed_everything(0)
    io = Announcing(storage_options=args.options, local_tier=args.local_tier, persist_every=4, local_keep=2)
    model = Noisy(args.step_seconds)
    fit = trainer(args.root, io, args.max_steps, [Start()])
    fit.fit(model, loader(), ckpt_path=find_latest_checkpoint(args.root, args.options, local_tier=args.local_tier))
    torch.save(model.state_dict(), args.out)
    say("DONE")


if __name__ == "__main__":
    main()
