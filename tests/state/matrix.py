"""The configurations of the resume matrix, and one run of each: uninterrupted, then stopped after its N-th save
and resumed by the same code, as a restarted job would be.

A stopped run raises right after the save returns (or ``overrun`` batches later, as a job killed a little after
its save: the resume replays those batches, and the resume audit compares them), so nothing of the process after
that is kept: the resumed run builds a new Trainer, model and loaders, seeds torch as a fresh process would
(``torch.manual_seed(1234)``), and finds its checkpoint with ``find_latest_checkpoint``. Every step records the
sample ids of its batch, a hash of its dropout mask and its loss, so a difference is located at the first step
where the two runs part. Each run also keeps the lines ResumeStateCallback logged (the restored line, the
``resume audit:`` line).
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_resilient import AtomicCheckpointIO, ResumeStateCallback, find_latest_checkpoint


class Samples(Dataset):
    """``n`` deterministic samples, each carrying its own index (so every step knows which samples it saw).

    ``augment``: random jitter drawn in ``__getitem__`` from Python's ``random``, NumPy's and torch's global RNGs
    (in the workers, with ``num_workers > 0``), as augmentation pipelines do. ``shift`` changes every sample (another
    dataset of the same size)."""

    def __init__(self, n: int, augment: bool = False, shift: float = 0.0) -> None:
        self.n = n
        self.augment = augment
        self.shift = shift

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(6, generator=g) + self.shift
        if self.augment:
            x = x * (1 + 0.1 * random.random()) + 0.1 * torch.from_numpy(np.random.randn(6)).float()
            x = x + 0.1 * torch.randn(6)
        return x, x.sum(0, keepdim=True), i


def noisy_collate(items: list[Any]) -> Any:
    """The default collate, then random noise on the inputs (as masking or mixing in a collate_fn draw)."""
    from torch.utils.data import default_collate

    x, y, ids = default_collate(items)
    return x + 0.1 * torch.randn_like(x), y, ids


class Net(LightningModule):
    """An MLP with dropout and per-step noise (both from torch's global RNG), AdamW and a per-step LR schedule."""

    def __init__(self, steps: list[tuple[Any, ...]], val_noise: bool = False, fail_at: int | None = None,
                 stepping_batches: bool = False) -> None:
        super().__init__()
        self.stepping_batches = stepping_batches
        self.steps = steps
        self.val_noise = val_noise
        self.fail_at = fail_at
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise Stop(f"failure in training step {self.global_step}")  # what OnExceptionCheckpoint is for
        hidden = self.net[0](x)
        mask = self.net[1](torch.ones_like(hidden))
        out = self.net[3](self.net[2](hidden * mask))
        loss = torch.nn.functional.mse_loss(out, y + torch.randn_like(y) * 0.01)
        digest = hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:12]
        self.steps.append((self.global_step, batch_idx, tuple(ids.tolist()), digest, float(loss)))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        out = self.net(x)
        if self.val_noise:
            out = out + torch.randn_like(out)  # validation that draws from the global RNG
        self.log("val_loss", torch.nn.functional.mse_loss(out, y))

    def configure_optimizers(self) -> Any:
        if self.stepping_batches:  # Lightning then builds the training loader before it loads the loops' state
            assert self.trainer.estimated_stepping_batches > 0
        opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Stop(Exception):
    """Ends a run right after a save, as a SIGKILL would (nothing after the save survives into the resume)."""


class StoppingIO(AtomicCheckpointIO):
    def __init__(self, stop_after: int | None, overrun: int = 0) -> None:
        super().__init__()
        self.stop_after = stop_after
        self.overrun = overrun
        self.saves = 0
        self.stop_in: int | None = None  # batches left before the stop, once the save that stops the run is done

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saves += 1
        if self.stop_after is not None and self.saves == self.stop_after:
            if not self.overrun:
                raise Stop(f"stopped after save {self.saves} (step {checkpoint['global_step']})")
            self.stop_in = self.overrun


class StopLater(Callback):
    """Stops the run ``StoppingIO.overrun`` batches after its stopping save (after ResumeStateCallback has recorded
    those batches: it runs first; Lightning runs ModelCheckpoint last, so the save's own batch is not counted)."""

    def __init__(self, io: StoppingIO) -> None:
        self.io = io

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.io.stop_in is None:
            return
        self.io.stop_in -= 1
        if self.io.stop_in == 0:
            raise Stop(f"stopped {self.io.overrun} batch(es) after save {self.io.saves}")


class GradNoise(Callback):
    """Adds noise to every gradient of the optimizer step that ends at global step ``step`` (after the backward: the
    loss of that step is unchanged, the update is not)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.add_(1e-3 * torch.randn_like(p.grad))


class UserSaver(Callback):
    """A user's own saver (not a Checkpoint subclass): ``trainer.save_checkpoint`` from its batch-end hook."""

    def __init__(self, root: Path, every: int) -> None:
        self.root, self.every = root, every

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            trainer.save_checkpoint(str(self.root / f"user-step={trainer.global_step}.ckpt"))


@dataclass
class Config:
    """One row of the matrix."""

    name: str
    ckpt: dict[str, Any] = field(default_factory=lambda: {"every_n_train_steps": 5})
    trainer: dict[str, Any] = field(default_factory=dict)
    stops: tuple[int, ...] = (1,)  # stop after the N-th save of each attempt (each resumed in turn)
    samples: int = 40
    batch_size: int = 4
    workers: int = 0
    persistent: bool = False
    val: bool = False  # a validation loader (shuffle=False, no generator of its own)
    val_noise: bool = False
    user_saver: int | None = None  # a UserSaver every N steps, listed before ResumeStateCallback
    on_exception: bool = False  # OnExceptionCheckpoint; the run fails in a training step instead of stopping
    fail_at: int = 13
    stateful: bool = False  # torchdata's StatefulDataLoader instead of a DataLoader
    augment: bool = False  # random augmentation in __getitem__ from the global RNGs (Samples)
    overrun: int = 2  # batches a stopped attempt trains after its stopping save (replayed by the resume)
    callback: dict[str, Any] = field(default_factory=dict)  # ResumeStateCallback's arguments
    seed: int | None = None  # seed_everything(seed) at each attempt's start (None: not called)
    shift: float = 0.0  # Samples' shift: another dataset of the same size
    collate_noise: bool = False  # a collate_fn that draws random numbers (noisy_collate)
    resume_state: bool = True  # ResumeStateCallback in the Trainer (False: stock Lightning's resume)
    stepping_batches: bool = False  # configure_optimizers reads estimated_stepping_batches (Lightning #20550)
    grad_noise_at: int | None = None  # GradNoise at the optimizer step from this global step


@dataclass
class Result:
    steps: list[tuple[Any, ...]]
    weights: dict[str, torch.Tensor]
    warnings: list[str]
    lines: list[str]  # what ResumeStateCallback logged: its restored line and the resume audit's line

    def audit(self) -> list[str]:
        return [line for line in self.lines if line.startswith("resume audit:")]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(("resume audit:", "ResumeStateCallback:")):
            self.lines.append(message)


def run(cfg: Config, root: Path, stop_after: int | None, resume: bool) -> Result:
    """One attempt: a fresh process's worth of state (seed, Trainer, model, loaders), resuming from ``root``."""
    import os
    import warnings

    os.environ.pop("PL_GLOBAL_SEED", None)  # what seed_everything leaves behind: a new process would not have it
    if cfg.seed is not None:
        seed_everything(cfg.seed, verbose=False)
    torch.manual_seed(1234)
    steps: list[tuple[Any, ...]] = []
    fail_at = cfg.fail_at if cfg.on_exception and stop_after is not None else None
    model = Net(steps, cfg.val_noise, fail_at, cfg.stepping_batches)
    loader_cls: Any = DataLoader
    if cfg.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader_cls = StatefulDataLoader
    extra = {"collate_fn": noisy_collate} if cfg.collate_noise else {}
    train = loader_cls(Samples(cfg.samples, cfg.augment, cfg.shift), batch_size=cfg.batch_size, shuffle=True,
                       num_workers=cfg.workers, persistent_workers=cfg.persistent, **extra)
    val = DataLoader(Samples(12), batch_size=4, num_workers=cfg.workers) if cfg.val else None
    io = StoppingIO(None if cfg.on_exception else stop_after, cfg.overrun)
    callbacks: list[Callback] = [UserSaver(root, cfg.user_saver)] if cfg.user_saver else []
    callbacks += [ResumeStateCallback(**cfg.callback)] if cfg.resume_state else []
    callbacks += [ModelCheckpoint(dirpath=root, **{"save_top_k": -1, **cfg.ckpt}),
                  StopLater(io)]
    callbacks += [GradNoise(cfg.grad_noise_at)] if cfg.grad_noise_at is not None else []
    if cfg.on_exception:
        callbacks.append(OnExceptionCheckpoint(dirpath=str(root), filename="on-exception"))
    trainer_args = {"max_epochs": 3, "limit_val_batches": 3, **cfg.trainer}
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, plugins=[io], callbacks=callbacks, **trainer_args)
    ckpt_path = find_latest_checkpoint(str(root)) if resume else None
    lines = _Lines()
    # On the root logger: rank_zero_info logs through lightning.pytorch's or pytorch_lightning's rank_zero logger,
    # whichever namespace was imported last, and both propagate here.
    logger = logging.getLogger()
    logger.addHandler(lines)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                trainer.fit(model, train, val, ckpt_path=ckpt_path)
            except Stop:
                assert stop_after is not None, "an uninterrupted run stopped"
    finally:
        logger.removeHandler(lines)
    return Result(steps, {k: v.detach().clone() for k, v in model.state_dict().items()},
                  [str(w.message) for w in seen], lines.lines)


def first_difference(full: list[tuple[Any, ...]], resumed: list[tuple[Any, ...]]) -> str | None:
    """Where the resumed run's steps leave the uninterrupted run's (each step: global step, batch index, sample
    ids, dropout-mask hash, loss); None when they match to the end."""
    start = next((i for i, s in enumerate(full) if resumed and s[:2] == resumed[0][:2]), None)
    if start is None:
        return (f"the resumed run starts at (step, batch) {resumed[0][:2] if resumed else None}, which the"
                " uninterrupted run never reached")
    tail = full[start:]
    for a, b in zip(tail, resumed, strict=False):  # unequal lengths are reported below
        if a != b:
            what = ("samples" if a[2] != b[2] else "dropout mask" if a[3] != b[3] else
                    "position" if a[:2] != b[:2] else "loss")
            return f"first divergent step {a[0]} (batch {a[1]}): {what} differ: uninterrupted {a}, resumed {b}"
    if len(tail) != len(resumed):
        return f"the uninterrupted run has {len(tail)} steps after the resume point, the resumed run {len(resumed)}"
    return None
