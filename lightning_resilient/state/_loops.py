"""Lightning's fit loop as ``ResumeStateCallback`` reads and corrects it on a resume.

It owns every read of the loops' progress counters (``processed``, ``loop_epoch``), the move of the epoch loop's batch
count after a resume on another number of processes (``shift_batches``), the two corrections of Lightning 2.6's
restart stage the callback makes when training starts (``count_the_epoch_after_a_last_batch_save``,
``finish_the_epoch_saved_at_its_end``), and the "not resumable" warning Lightning gives on every mid-epoch resume
(``reset_without_the_warning``), which the callback replaces by its own line when it did restore the position.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loops.loop import _Loop

__all__ = ["count_the_epoch_after_a_last_batch_save", "finish_the_epoch_saved_at_its_end", "loop_epoch", "processed",
           "reset_without_the_warning", "shift_batches"]

# Lightning's warning on every mid-epoch resume of a loader it cannot resume itself; replaced by our own line when
# the callback did resume the position.
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def processed(tracker: Any) -> int:
    """``processed`` of a Lightning progress tracker: the trackers the loops use have it, their declared type not."""
    return int(tracker.processed)


def loop_epoch(trainer: Trainer | None) -> int:
    """Lightning's training epoch: the epochs its fit loop has processed (0 without a Trainer)."""
    return 0 if trainer is None else processed(trainer.fit_loop.epoch_progress.current)


def shift_batches(progress: Any, to: int) -> None:
    """Move Lightning's count of the epoch's batches (the epoch loop's ``batch_progress``, current and total alike)
    so that ``current.ready`` is ``to``, keeping the counters' differences (which say where in a batch it was
    saved)."""
    delta = to - int(progress.current.ready)
    for tracker in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(tracker, name, getattr(tracker, name) + delta)


def reset_without_the_warning(reset: Callable[[], None]) -> None:
    """The epoch loop's ``reset``, without Lightning's warning that the loader is not resumable (wrong when the
    callback restored the position: its own line says what was restored instead)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
        reset()


def count_the_epoch_after_a_last_batch_save(trainer: Trainer) -> None:
    """Lightning 2.6 resuming a checkpoint saved on an epoch's last batch: ``FitLoop.reset()`` counts that
    epoch complete, but the restart stage still says mid-epoch, so ``on_advance_start`` skips the next epoch's
    ready/started counts and its ``on_train_epoch_start`` hooks. A mid-epoch checkpoint of that next epoch then
    looks finished, and resuming it restarts ``batch_idx`` at 0 (accumulation boundaries move with it)."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    if (getattr(fit_loop, "restarted_mid_epoch", False)
            and getattr(epoch_loop, "restarted_on_train_batch_end", False)
            and epoch_loop.batch_progress.is_last_batch):
        fit_loop.reset_restart_stage()


def finish_the_epoch_saved_at_its_end(trainer: Trainer) -> None:
    """Lightning 2.6 resuming a checkpoint saved at an epoch's end when ``max_steps`` is set: iteration-based
    training keeps the loop "restarting" although that epoch finished, so it trains on in the finished epoch
    (``batch_idx`` past its end, no ``on_train_epoch_start``, an epoch-end save of the wrong epoch) instead of
    starting the next one. Without ``max_steps`` Lightning counts the epoch complete and starts the next: do
    the same."""
    fit_loop = trainer.fit_loop
    if (fit_loop.restarted_on_epoch_end and fit_loop._iteration_based_training()
            and fit_loop.epoch_loop.batch_progress.is_last_batch):
        fit_loop.epoch_progress.increment_completed()
        fit_loop.reset_restart_stage()
        fit_loop.epoch_loop.reset_restart_stage()
        _Loop.restarting.fset(fit_loop, False)  # type: ignore[attr-defined]  # children too; not the override
