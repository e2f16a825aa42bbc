"""A training script for the in-job restart and hang tests: ``python restart_child.py ROOT OUT OPTIONS``.

Under torchrun (``--nproc-per-node 2 --max-restarts 1``) it is a 2-process DDP job (gloo, CPU) that resumes by
itself: every start of the group looks up the newest committed checkpoint with ``find_latest_checkpoint`` (with the
local tier), so after a SIGKILL torchrun restarts the group and no one reruns anything. Run with plain ``python`` it
is one process.

OPTIONS (JSON): ``max_steps``, ``every`` (save interval in steps), ``persist_every`` (with a local tier under
OUT.local: every Nth save goes to ROOT), ``kill_at`` (in the group's first attempt, rank 1 SIGKILLs itself at the
end of that global step), ``slow`` (seconds rank 1 sleeps in each training_step: a straggler), ``hang_at`` (the
training step at that global step sleeps until killed; ``HangWatchdog(timeout_seconds=hang_timeout)`` is on).

Prints ``START rank=<r> restart=<n> step=<s> tier=<t>`` and, at the end, rank 0 saves the weights to OUT.weights.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_resilient import AtomicCheckpointIO, HangWatchdog, ResumeStateCallback, find_latest_checkpoint

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Net(LightningModule):
    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__()
        self.options = options
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.options.get("slow"):
            time.sleep(self.options["slow"])  # a straggler: its forward takes longer than the other rank's
        if self.global_step == self.options.get("hang_at"):
            print(f"HANGING at step {self.global_step}\n", end="", flush=True)
            time.sleep(600)  # a hang: the watchdog ends the process long before this returns
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Kill(Callback):
    """Rank 1 SIGKILLs itself at the end of a global step, in the group's first attempt only (ResumeStateCallback
    runs first, so that step is in its record)."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if RESTART == 0 and trainer.global_rank == 1 and trainer.global_step == self.at:
            print(f"KILLING rank 1 at step {trainer.global_step}\n", end="", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Report(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        last = getattr(trainer.strategy.checkpoint_io, "last_load", None)
        tier = (last.tier or "-") if last is not None and trainer.ckpt_path is not None else "-"
        print(f"START rank={trainer.global_rank} restart={RESTART} step={trainer.global_step} tier={tier}\n", end="",
              flush=True)


def main(root: str, out: str, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    distributed = "WORLD_SIZE" in os.environ
    local_tier = f"{out}.local" if options.get("persist_every") else None  # this node's disk (one node)
    io_options = {"local_tier": local_tier, "persist_every": options["persist_every"]} if local_tier else {}
    io = AtomicCheckpointIO(**io_options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = Net(options)
    callbacks: list[Callback] = [ResumeStateCallback(), Kill(options.get("kill_at")), Report(),
                                 ModelCheckpoint(dirpath=root, every_n_train_steps=options["every"], save_top_k=-1)]
    if options.get("hang_at") is not None:
        callbacks.append(HangWatchdog(timeout_seconds=options["hang_timeout"], warmup_steps=1))
    trainer = Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                      strategy="ddp" if distributed else "auto", max_steps=options["max_steps"], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, plugins=[io],
                      callbacks=callbacks)
    ckpt = find_latest_checkpoint(root, local_tier=local_tier)
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), ckpt_path=ckpt)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}.weights")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    # The run is over and its outputs are written: skip the interpreter's teardown, where gloo's threads can abort a
    # rank on CPU ("terminate called without an active exception", SIGABRT after `max_steps` was reached: seen once
    # in CI; see tests/io/sharded_child.py). A failure above still exits with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
