"""The draws DataLoader iterators make from the global RNG around a save, for ``ResumeStateCallback``.

Every new DataLoader iterator draws its base seed from torch's global RNG (or from the loader's own generator).
Lightning, resuming a checkpoint saved right before a validation, skips that validation, so a resumed run would draw
the next step's random numbers, and the next epoch's order, from another state than the uninterrupted run did.
:class:`ValidationDraws` owns what a save says about those draws (whether a validation follows it, how many base
seeds that validation's loaders draw, how many the next epoch's training iterators draw before its order:
:class:`SaveDraws`) and the warning when a validation right after a save drew from the global RNG itself (a resume
cannot replay that). :func:`advanced` moves an RNG state on by a number of base-seed draws, as a resume replays them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_resilient._warnings import warn
from lightning_resilient.state._loops import processed
from lightning_resilient.state.rng import RngState, capture_rng, restore_rng

__all__ = ["SaveDraws", "ValidationDraws", "advanced", "has_persistent_iterator"]


class SaveDraws(NamedTuple):
    """What a save records about the draws between it and the next training step (``RankRecord``'s fields)."""

    validation_follows: bool  # a validation runs before the next step (a resume skips it)
    validation_draws: int | None  # the base seeds that validation draws from the global RNG; None: not known yet
    order_draws: int | None  # at an epoch's end: the global draws until the next epoch's order; None: not known
    order_generator_draws: int  # ...and those from the loader's own generator


class ValidationDraws:
    """Counts, at a save, the base-seed draws a resume must account for, and watches the validation that follows a
    save for draws of its own (warned once per fit)."""

    def __init__(self) -> None:
        self._watch: int | None = None  # step of the last save a validation follows, while it runs
        self._before: RngState | None = None  # the global RNG when that validation started
        self._warned = False

    def start_fit(self) -> None:
        self._warned = False

    def at_save(self, trainer: Trainer | None, loader: Any, *, epoch_done: bool) -> SaveDraws:
        """The draws this save records; when a validation follows it, that validation is watched."""
        follows = self._a_validation_follows(trainer)
        validation_draws = self._validation_draws(trainer) if follows else 0
        order_draws, order_generator_draws = None, 0
        if epoch_done and validation_draws is not None:  # what the run draws until the next epoch's order
            fresh, order_generator_draws = self._next_iterator_draws(loader, trainer)
            order_draws = validation_draws + fresh
        if follows:
            self._watch = trainer.global_step if trainer is not None else 0
        return SaveDraws(follows, validation_draws, order_draws, order_generator_draws)

    @staticmethod
    def _a_validation_follows(trainer: Trainer | None) -> bool:
        """Whether a validation runs between this save and the next training step: a save from a training batch's
        end (before Lightning's validation check) at a validation point. A resume skips that validation."""
        if trainer is None or not trainer.training or getattr(trainer, "sanity_checking", False):
            return False
        epoch_loop = trainer.fit_loop.epoch_loop
        total = epoch_loop.batch_progress.total
        if total.completed != processed(total) - 1:  # not inside on_train_batch_end: the validation already ran
            return False
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is None:  # set while a training batch runs
            return False
        try:
            follows = bool(epoch_loop._should_check_val_fx(fetcher))
        except Exception:  # a Lightning without this internal: nothing to account for
            return False
        return follows and not epoch_loop._skip_next_val

    @staticmethod
    def _validation_draws(trainer: Trainer | None) -> int | None:
        """Base-seed draws from the global RNG that the next validation makes: one per validation loader that will
        create an iterator (not a live persistent one) and has no generator of its own. None when the validation
        loaders are not set up yet (they are at their first validation)."""
        loaders = getattr(trainer, "val_dataloaders", None) if trainer is not None else None
        if loaders is None:
            return None
        if isinstance(loaders, DataLoader):
            loaders = [loaders]
        elif isinstance(loaders, dict):
            loaders = list(loaders.values())
        return sum(1 for dl in loaders if isinstance(dl, DataLoader) and dl.generator is None
                   and not has_persistent_iterator(dl))

    @staticmethod
    def _next_iterator_draws(loader: Any, trainer: Trainer | None) -> tuple[int, int]:
        """The base-seed draws the next epoch's training iterators make before its order is drawn: (from the global
        RNG, from the loader's own generator). None when a persistent iterator is reset for it (no new base seed);
        when Lightning reloads the loader for that epoch it creates an iterator when it reloads and another one to run
        it: two base seeds, and with workers the first one's order too (its workers prefetch at once)."""
        if not isinstance(loader, DataLoader) or trainer is None:
            return 0, 0
        every = int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0)
        last = getattr(trainer.fit_loop, "_last_train_dl_reload_epoch", float("-inf"))
        reloads = every > 0 and trainer.current_epoch + 1 - last >= every
        count = (3 if loader.num_workers else 2) if reloads else 0 if has_persistent_iterator(loader) else 1
        return (0, count) if loader.generator is not None else (count, 0)

    def validation_started(self) -> None:
        if self._watch is not None:
            self._before = capture_rng()

    def validation_ended(self) -> None:
        step, self._watch = self._watch, None
        before, self._before = self._before, None
        if step is None or before is None or self._warned:
            return
        after = capture_rng()
        if any(not _same(before.get(k), after.get(k)) for k in ("torch", "numpy", "python")):
            self._warned = True
            warn(f"the validation that ran right after the checkpoint of step {step} drew random numbers from the"
                 " global RNG (torch, NumPy or Python: in validation_step, or a validation loader that shuffles); a"
                 " run resumed from that checkpoint skips this validation (as Lightning does), so from then on its"
                 " random numbers, and its training, differ from this run's. To resume exactly, give validation its"
                 " own torch.Generator (DataLoader(generator=...), and a NumPy Generator) or draw nothing in it.",
                 RuntimeWarning)


def has_persistent_iterator(loader: DataLoader[Any]) -> bool:
    """Whether the loader holds a persistent iterator that its next ``iter()`` resets (no new base-seed draw)."""
    return bool(loader.persistent_workers and loader.num_workers and getattr(loader, "_iterator", None) is not None)


def advanced(state: RngState, draws: int) -> RngState:
    """``state`` with torch's CPU generator advanced by ``draws`` base-seed draws, as DataLoader iterators make them."""
    if not draws:
        return state
    saved = capture_rng()
    restore_rng(state)
    for _ in range(draws):
        torch.empty((), dtype=torch.int64).random_()
    out = capture_rng()
    restore_rng(saved)
    return out


def _same(a: Any, b: Any) -> bool:
    """Equality of two captured RNG states (nested lists of numbers and tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
