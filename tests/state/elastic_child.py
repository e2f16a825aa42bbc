"""A training job for the elastic-resume tests: one process of a job of ``devices x nodes`` processes (gloo on CPU),
that resumes from its root when it can. Run: python elastic_child.py ROOT OUT JSON_OPTIONS.

Every rank appends one JSON line per training batch to ``OUT.r<global rank>.jsonl`` (after ResumeStateCallback
counted the batch): ``attempt`` (the ``attempt`` option), ``world``, ``epoch``, ``step`` (the global step when the
batch started), ``batch`` (batch_idx), ``ids`` (the batch's sample indices), ``loss`` and ``accumulate``
(``trainer.accumulate_grad_batches``). With ``kill_at``, every rank SIGKILLs itself once the global step reaches it
(after that batch's line is written): a preemption mid-epoch, after the checkpoint of an earlier step. A run that is
not killed writes rank 0's final weights to ``OUT.weights``.

Options: attempt, devices, nodes (with nodes > 1 start one process per node, with NODE_RANK, MASTER_ADDR and
MASTER_PORT set), epochs, accumulate, every (save every N optimizer steps), kill_at, loader ("map" |
"stateful": torchdata's StatefulDataLoader), workers, keep (ResumeStateCallback(keep_global_batch=...)), from_step
(resume from the root's checkpoint of that step instead of its latest).

The model has no dropout and draws nothing in the step: with the same global batches, the losses of runs on
different numbers of processes agree up to float reduction order. Each sample's augmentation is drawn from the
global RNGs in ``__getitem__``: per-sample seeding makes it the same whichever process reads the sample.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import AtomicCheckpointIO, ResumeStateCallback, find_latest_checkpoint

SAMPLES = 64
BATCH = 4


class Augmented(Dataset):
    """64 deterministic samples, each with noise drawn from torch's global RNG (augmentation), and its index."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(6, generator=g)
        return x + 0.1 * torch.randn(6), x.sum(0, keepdim=True), i


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.batch_loss = loss.item()  # (Lightning hands on_train_batch_end the loss divided by the accumulation)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(Callback):
    def __init__(self, out: str, options: dict[str, Any]) -> None:
        self.out, self.options = out, options
        self.start = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.start = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        line = {"attempt": self.options["attempt"], "world": trainer.world_size, "epoch": trainer.current_epoch,
                "step": self.start, "batch": batch_idx, "ids": batch[2].tolist(), "loss": pl_module.batch_loss,
                "accumulate": trainer.accumulate_grad_batches}
        with open(f"{self.out}.r{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if trainer.global_step == self.options.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)  # every rank, at the same step: the job is preempted


def main(root: str, out: str, options: dict[str, Any]) -> None:
    if options.get("loader") == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        torch.manual_seed(7)  # the StatefulDataLoader's RandomSampler seeds its generator from here: alike on all ranks
        workers = options.get("workers", 0)
        loader: Any = StatefulDataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=workers,
                                         persistent_workers=workers > 0)
    else:
        loader = DataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=options.get("workers", 0))
    devices, nodes = options.get("devices", 1), options.get("nodes", 1)
    trainer = Trainer(
        max_epochs=options.get("epochs", 1), accumulate_grad_batches=options.get("accumulate", 1), accelerator="cpu",
        devices=devices, num_nodes=nodes, strategy="ddp" if devices * nodes > 1 else "auto", logger=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[AtomicCheckpointIO()],
        callbacks=[ResumeStateCallback(keep_global_batch=options.get("keep", False)), Record(out, options),
                   ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=options.get("every", 3))])
    ckpt = find_latest_checkpoint(root)
    if options.get("from_step") is not None:  # an earlier checkpoint of the root than its latest
        ckpt = next(str(p) for p in Path(root).glob(f"*-step={options['from_step']}.ckpt"))
    trainer.fit(Net(), loader, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        torch.save({k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}, out + ".weights")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo teardown at interpreter exit can abort on CPU (see the sharded tests); everything is written


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
