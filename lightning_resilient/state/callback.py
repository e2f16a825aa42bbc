"""``ResumeStateCallback``: RNG state (per rank) and the data-loader position, so a resumed run is bit-identical.

Stock Lightning saves no RNG state, and a mid-epoch resume with a plain DataLoader replays the head of the
epoch and never sees its tail. This callback records, per rank:

- the RNG states at the moment the epoch's index stream starts (they decide the shuffle permutation and the
  worker seeds) and the RNG states at the moment of the save;
- how many batches of the epoch were trained on.

On resume it puts back the epoch-start RNG states when Lightning creates the data iterator, skips the consumed
batches at the batch-sampler level (indices only: no sample is read), and puts back the save-time RNG states
before the next training step.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_resilient.state.rng import capture_rng, restore_rng
from lightning_resilient.state.seeding import PerSampleSeeded

__all__ = ["ResumeStateCallback"]

log = logging.getLogger(__name__)
FORMAT = 1


class _Stream:
    """One epoch's index stream, started lazily so an iterator torch discards unread costs nothing."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip
        self.started = False
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self.started = True
            self._it = itertools.islice(iter(self.inner), self.skip, None)
        return next(self._it)


class _TrackedBatchSampler:
    """Wraps a loader's batch sampler: each new index stream is the start of an epoch."""

    def __init__(self, inner: Any, owner: ResumeStateCallback) -> None:
        self.inner = inner
        self.owner = owner
        self._last: _Stream | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._last is not None and not self._last.started:
            # torch's multiprocessing iterator asks for the index stream twice while it is created (once in
            # the base class, once in its first reset) and throws the first away: same epoch, same skip.
            stream = _Stream(self.inner, self._last.skip)
        else:
            stream = _Stream(self.inner, self.owner._epoch_stream_starts())
        self._last = stream
        return stream

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        out: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj)
        return out
    return [obj]


class ResumeStateCallback(Callback):
    """Save and restore every RNG and the exact data position, so a resumed run equals an uninterrupted one.

    Add it next to the checkpointing (it works with ``AtomicCheckpointIO`` and with stock
    ``TorchCheckpointIO``)::

        Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ResumeStateCallback(), ModelCheckpoint(...)])

    Covered: one map-style training DataLoader with any batch sampler (``shuffle=True``, ``DistributedSampler``
    under DDP), ``num_workers`` 0 or more, gradient accumulation, saves mid-epoch or at an epoch boundary, DDP
    (each rank restores its own RNG states). Not covered yet (a warning says what was resumed instead):
    iterable datasets, torchdata ``StatefulDataLoader``, several training loaders, a changed world size or batch
    size; validation that draws random numbers between a save and the next training step. Randomness drawn
    inside dataset workers resumes exactly when the dataset is wrapped in :class:`PerSampleSeeded`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._epoch_rng: dict[str, Any] | None = None
        self._consumed = 0
        self._pending: dict[str, Any] | None = None  # this rank's restored state, until the data stream starts
        self._now_rng: dict[str, Any] | None = None  # save-time RNG, put back before the first resumed step
        self._tracked = False
        self._length: int | None = None
        self._batch_size: int | None = None
        self._dataset: PerSampleSeeded | None = None
        self._trainer: Trainer | None = None

    @property
    def state_key(self) -> str:
        return "ResumeStateCallback"

    # -- wiring ------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._tracked = False  # a new fit builds a new loader
        self._trainer = trainer
        fit_loop = trainer.fit_loop
        load_states = fit_loop._load_combined_loader_states

        # Lightning builds (and, under DDP, re-instantiates) the train DataLoader in FitLoop.setup_data and
        # creates its iterator right after restoring loader states: the last point where the batch sampler
        # can be wrapped before it is iterated.
        def load_states_then_track() -> None:
            load_states()
            self._track(fit_loop._combined_loader)

        fit_loop._load_combined_loader_states = load_states_then_track  # type: ignore[method-assign]

    def _track(self, combined: Any) -> None:
        loaders = list(getattr(combined, "flattened", []) or [])
        if self._tracked:
            return
        usable = [dl for dl in loaders if isinstance(dl, DataLoader) and dl.batch_sampler is not None
                  and _sized(dl)]
        if len(loaders) != 1 or len(usable) != 1:
            warnings.warn(
                "ResumeStateCallback restores the data position of a single sized map-style training DataLoader;"
                f" this run has {len(loaders)} loader(s), {len(usable)} of them usable: RNG states are restored"
                " but each resumed epoch starts from its first batch",
                RuntimeWarning, stacklevel=2)
            if self._pending is not None:
                restore_rng(self._pending["now_rng"])
                self._pending = None
            return
        loader = usable[0]
        pending = self._pending
        if pending is not None and pending.get("batches") is not None and (
                pending["batches"] != len(loader) or pending.get("batch_size") != loader.batch_size):
            warnings.warn(
                f"the training loader changed since the checkpoint ({pending['batches']} batches of"
                f" {pending.get('batch_size')} then, {len(loader)} of {loader.batch_size} now): the position in"
                " the epoch cannot be mapped; RNG states are restored and the resumed epoch starts from its first"
                " batch", RuntimeWarning, stacklevel=2)
            pending = dict(pending, mid_epoch=False)
            self._pending = pending
        # DataLoader refuses a new batch_sampler after construction: set it underneath.
        object.__setattr__(loader, "batch_sampler", _TrackedBatchSampler(loader.batch_sampler, self))
        self._dataset = loader.dataset if isinstance(loader.dataset, PerSampleSeeded) else None
        self._length = len(loader)
        self._batch_size = loader.batch_size
        self._tracked = True

    # -- the data stream -----------------------------------------------------------------------------------------
    def _epoch_stream_starts(self) -> int:
        """Called when an epoch's index stream starts; returns how many batches to skip."""
        if self._dataset is not None and self._trainer is not None:
            self._dataset.set_epoch(self._trainer.current_epoch)  # before workers start: they copy the dataset
        pending, self._pending = self._pending, None
        if pending is not None:
            consumed = int(pending["consumed"])
            if consumed > 0 and pending["epoch_rng"] is not None and pending.get("mid_epoch", True):
                restore_rng(pending["epoch_rng"])  # the same permutation and worker seeds as before
                self._epoch_rng = pending["epoch_rng"]
                self._now_rng = pending["now_rng"]  # ...and the next step draws what it would have drawn
                self._consumed = consumed
                log.info("resuming mid-epoch: skipping %d consumed batch(es) without reading them", consumed)
                return consumed
            restore_rng(pending["now_rng"])  # saved at an epoch boundary: the next epoch starts from here
        self._consumed = 0
        self._epoch_rng = capture_rng()
        return 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._now_rng is not None:
            restore_rng(self._now_rng)
            self._now_rng = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._consumed += 1

    # -- checkpoint ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Lightning writes only global rank 0's callback state but calls this on every rank: gather them all.
        total = self._length
        mine = {"epoch_rng": self._epoch_rng, "now_rng": capture_rng(), "consumed": self._consumed,
                "mid_epoch": bool(total is not None and 0 < self._consumed < total), "batches": total,
                "batch_size": self._batch_size}
        ranks = _gather(mine)
        return {"format": FORMAT, "world_size": len(ranks), "ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rank, world = _rank_and_world()
        ranks = state_dict.get("ranks", [])
        if len(ranks) != world:
            warnings.warn(
                f"the checkpoint was written by {len(ranks)} process(es) but this run has {world}: RNG states and"
                " the data position cannot be restored exactly; training resumes at the saved step with fresh"
                " RNG states and the epoch's data from its start (what stock Lightning does)",
                RuntimeWarning, stacklevel=2)
            return
        self._pending = ranks[rank]


def _sized(loader: DataLoader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True
