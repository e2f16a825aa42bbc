"""A training process for the preemption tests: python preemption_child.py ROOT OUT STORE (local, s3 or ddp).

Trains with dropout, a shuffled loader and gradient accumulation (2), ResumeStateCallback, PreemptionCheckpoint
and step saves (async on S3, so a SIGTERM can land during an upload), resuming from ROOT's newest checkpoint; prints
``BATCH <n>`` as each batch starts; at the end writes the weights to OUT.

With ``PREEMPTION_WINDOW=sanity`` (a sanity check runs) or ``loader`` (no sanity check; the training loader comes
from the model's hook), it prints ``WINDOW`` at that instant before training and waits there two seconds, for the
parent's signal to land in it.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_resilient import (
    AtomicCheckpointIO,
    PreemptionCheckpoint,
    ResumeStateCallback,
    find_latest_checkpoint,
)
from tests.test_preemption import DropoutModel, loader


def _say(line: str) -> None:
    # One write() per line: under DDP both ranks share this pipe, and print() may split a line in two writes.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


class Announce(Callback):
    def __init__(self) -> None:
        self.n = 0

    def on_train_start(self, trainer: Trainer, *args: object) -> None:
        _say(f"PID {trainer.global_rank} {os.getpid()}")

    def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_rank == 0:
            _say(f"BATCH {self.n}")
        self.n += 1
        time.sleep(0.05)  # the parent's signal lands within this batch


WINDOW = os.environ.get("PREEMPTION_WINDOW")


def _in_window() -> None:
    _say("WINDOW")
    time.sleep(2)  # the parent's SIGTERM lands here (the handler runs, then the sleep goes on)


class WindowModel(DropoutModel):
    """Loaders from hooks, a validation step (so a sanity check runs), and the window announced where asked."""

    def train_dataloader(self) -> object:
        if WINDOW == "loader":
            _in_window()
        return loader()

    def val_dataloader(self) -> object:
        return loader()

    def validation_step(self, batch: object, batch_idx: int) -> None:
        if WINDOW == "sanity" and self.trainer.sanity_checking and batch_idx == 0:
            _in_window()


def main() -> None:
    root, out, store = sys.argv[1:4]
    options = {"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}} if store == "s3" else None
    deadline = float(os.environ["PREEMPTION_DEADLINE"]) if "PREEMPTION_DEADLINE" in os.environ else None
    seed_everything(0)
    model = DropoutModel() if WINDOW is None else WindowModel()
    ddp = store == "ddp"  # 2 processes on CPU (gloo); the parent signals rank 1 only
    trainer = Trainer(max_steps=20, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                      devices=2 if ddp else 1, strategy="ddp" if ddp else "auto",
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=2 if WINDOW == "sanity" else 0,
                      plugins=[AtomicCheckpointIO(storage_options=options, async_save=store == "s3")],
                      callbacks=[ResumeStateCallback(), Announce(), PreemptionCheckpoint(deadline_seconds=deadline),
                                 ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)])
    loaders = (loader(),) if WINDOW is None else ()
    trainer.fit(model, *loaders, ckpt_path=find_latest_checkpoint(root, options))
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out)


if __name__ == "__main__":
    main()
