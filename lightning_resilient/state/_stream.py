"""The training loader ``ResumeStateCallback`` tracks, and the position of its current data stream.

:class:`DataStream` owns, for one fit:

- the loader being tracked and the facts a save records of it (its kind, length, batch size and workers), and the
  hooks ``_loader.py`` puts on it to see each epoch's stream start, the epoch's order drawn, and each batch fetched;
- the position of the current stream: the training epoch it reads, the batches and samples consumed (up to the last
  optimizer step too), the stateful position as of the last consumed batch (snapshotted before each fetch, as
  Lightning's fetcher reads unsized data one batch ahead), the RNG and the loader's generators at the stream's start
  and right before the epoch's order was drawn, and the global order a resume on another number of processes splits
  (:meth:`DataStream.record` writes it all into a :class:`~lightning_resilient.state._record.RankRecord`);
- on a resume, the start of the first stream from a :class:`~lightning_resilient.state._record.ResumePlan` (the
  epoch-start RNG back, consumed batches skipped at the index level) or from the rest of an epoch
  (:class:`RestStart`), a stateful position loaded, and the save-time RNG put back before the first step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer

from lightning_resilient.state._draws import SaveDraws, advanced
from lightning_resilient.state._loader import (
    LoaderKind,
    Start,
    TrackedBatchSampler,
    batch_len,
    draw_once_per_epoch,
    generators,
    give_batches,
    hook_iterators,
    own_batch_sampler,
    restore_batch_sampler,
    sampler_facts,
    set_data_epoch,
    sized,
    untrack,
)
from lightning_resilient.state._loops import loop_epoch
from lightning_resilient.state._record import OrderReplay, RankRecord, ResumePlan
from lightning_resilient.state.audit import digest_batch
from lightning_resilient.state.elastic import OrderSpec, Rest, describe_order, distributed_batch_sampler
from lightning_resilient.state.rng import RngState, capture_rng, restore_rng

__all__ = ["DataStream", "RestStart", "STATEFUL", "describe", "samples_per_batch"]

# The callback's log lines keep the logger they always had (a user may filter on it).
log = logging.getLogger("lightning_resilient.state.callback")

_DESCRIBE = {
    LoaderKind.MAP: "map-style DataLoader",
    LoaderKind.LOADER: "stateful DataLoader (state_dict/load_state_dict)",
    LoaderKind.DATASET: "DataLoader over an IterableDataset with state_dict/load_state_dict",
    LoaderKind.ITERABLE: "DataLoader over an IterableDataset without a usable state",
    LoaderKind.OTHER: "iterable that is not a DataLoader",
}
# Kinds whose position is a state (the loader's or the dataset's own), saved as of the last consumed batch.
STATEFUL = (LoaderKind.LOADER, LoaderKind.DATASET)


def describe(kind: LoaderKind | str | None) -> str:
    """A loader kind in words (a kind a newer version stored, as it is)."""
    return _DESCRIBE[kind] if isinstance(kind, LoaderKind) else str(kind)


def samples_per_batch(loader: Any) -> int | None:
    """Samples per batch of a DataLoader: its ``batch_size``, or its batch sampler's (a loader Lightning re-created
    for DDP around its own batch sampler has ``batch_size=None``); None without automatic batching."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(own_batch_sampler(loader), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


@dataclasses.dataclass(frozen=True)
class RestStart:
    """How this rank's stream of an epoch's rest starts, after a resume on another number of processes."""

    rest: Rest  # the rest of the epoch and this rank's batches of it
    now_rng: RngState  # the RNG the first step draws from
    generators: list[torch.Tensor] | None  # the loader's own generators, for the next epoch's draw
    position: int  # Lightning's batch count the rest starts at


class DataStream:
    """The tracked training loader and the position of its current stream (see the module docstring)."""

    def __init__(self) -> None:
        self._trainer: Trainer | None = None  # the fit's (a stream starts in a loader hook, which is handed none)
        self.loader: Any = None  # the training loader being tracked
        self._tracked: list[Any] = []  # every loader this fit tracked (Lightning may reload it), untracked at the end
        # What the loader is (each named as the RankRecord field it is saved in).
        self.kind: LoaderKind | None = None
        self.batches: int | None = None  # the loader's length; None: unsized
        self.batch_size: int | None = None
        self.num_workers = 0
        self.digests = False  # the audit will run (there is a root to record in): digest each fetched batch
        # The current data stream: the training epoch it reads (the sampler's set_epoch) and how far it got.
        self.epoch = 0
        self.consumed = 0  # batches of the epoch trained on (including those skipped on resume)
        self.samples = 0
        self.step_samples = 0  # the samples up to the stream's last optimizer step
        self._base = 0  # batches of the epoch consumed before this stream's iterator was created (a resume)
        self._fetched = 0  # batches this stream's iterator has returned; runs ahead of consumed by the prefetch
        self._snapshots: dict[int, Any] = {}  # stream fetch index -> stateful position right before that fetch
        self._handed: deque[Any] = deque()  # MAP: the batches of indices the index stream handed out, unconsumed
        self._fetched_digests: deque[str] = deque()  # digests of the batches fetched (on the host), unconsumed
        self._live_iterator: weakref.ref[Any] | None = None  # the loader's current iterator
        self._epoch_rng: RngState | None = None  # the RNG at the stream's start
        self._epoch_generators: list[torch.Tensor] | None = None  # the loader's own generators at the stream's start
        self._draining = False  # creating an iterator only to replay a saved end-of-epoch state
        self._drawn: set[int] | None = None  # while an epoch's iterator is built: sampler wrappers that drew
        # The RNG (and the loader's generators) right before this epoch's order was drawn, and, on a resume, what the
        # next such draw is made from.
        self._order_rng: RngState | None = None
        self._order_generators: list[torch.Tensor] | None = None
        self._order_replay: OrderReplay | None = None
        # The order the current stream reads (None: the sampler's own, described at a save), and a stateful loader's
        # generators right before its sampler wrapper drew.
        self._stream_order: OrderSpec | None = None
        self._draw_generators: list[torch.Tensor] | None = None
        # What the first stream after a resume does: a plan, or the rest of an epoch (elastic); the save-time RNG put
        # back before the first resumed step; whether that RNG must first replay a skipped validation's draws; and
        # what was restored, for the resume line: (epoch, batches, of, samples).
        self.plan: ResumePlan | None = None
        self.rest_start: RestStart | None = None
        self.now_rng: RngState | None = None
        self._replay_validation = False
        self.restored: tuple[int, int, int | None, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy carries the position, not the objects of a fit in progress (the Trainer, its loader, the iterator).
        return {**self.__dict__, "_trainer": None, "loader": None, "_live_iterator": None, "_tracked": []}

    # -- the loader ----------------------------------------------------------------------------------------------
    def start_fit(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.loader = self.kind = None  # a new fit builds a new loader
        self.restored = self.rest_start = self._stream_order = None
        self.digests = False

    def forget(self) -> None:
        """Track no loader (this run has several)."""
        self.loader = self.kind = None

    def track(self, loader: Any, kind: LoaderKind, *, digests: bool) -> None:
        """The loader's facts (its hooks come with :meth:`hook`, once seeding and the plan's checks are done)."""
        self.loader, self.kind = loader, kind
        self.batches = len(loader) if kind != LoaderKind.OTHER and sized(loader) else None
        self.batch_size = getattr(loader, "batch_size", None)
        self.num_workers = int(getattr(loader, "num_workers", 0))
        if not any(seen is loader for seen in self._tracked):
            self._tracked.append(loader)
        # Fetched batches are digested from the first fetch on (Lightning may fetch one before on_train_start).
        self.digests = digests

    def hook(self, *, distributed_order: bool) -> None:
        """See the loader's epochs start, its order drawn and its batches fetched. ``distributed_order``: one process
        reads the order DDP's DistributedSampler gives (keep_global_batch: the same at every number of processes)."""
        loader, kind = self.loader, self.kind
        if kind == LoaderKind.MAP:
            # DataLoader refuses a new batch_sampler after construction: set it underneath.
            own = own_batch_sampler(loader)
            replacement = (distributed_batch_sampler(own, seed=int(os.environ.get("PL_GLOBAL_SEED", 0) or 0))
                           if distributed_order else None)
            tracked = TrackedBatchSampler(loader.batch_sampler, self._epoch_starts, self._handed, self._on_order,
                                          replacement)
            object.__setattr__(loader, "batch_sampler", tracked)
            if self.digests:  # to see each batch on the host, before Lightning moves it to the device
                hook_iterators(loader, None, self._on_iterator, self._before_fetch, self._after_fetch)
        elif kind != LoaderKind.OTHER:
            hook_iterators(loader, self._epoch_starts, self._on_iterator, self._before_fetch, self._after_fetch)
            draw_once_per_epoch(loader, lambda: self._drawn, self._before_wrapper_draw)

    def load_position(self, state: Any, *, epoch: int, epoch_done: bool) -> None:
        """Load this rank's saved stateful position into the loader (or its dataset)."""
        if self.kind == LoaderKind.LOADER:
            self.loader.load_state_dict(state)
            if epoch_done:
                self._replay_to_epoch_end(self.loader, epoch)
        elif self.kind == LoaderKind.DATASET:
            self.loader.dataset.load_state_dict(state)

    def _replay_to_epoch_end(self, loader: Any, epoch: int) -> None:
        """The loaded state is the end of an epoch; the next ``iter()`` must start the next epoch, not yield an
        empty rest of this one. Creating an iterator from the state replays the samplers to the end (indices
        only; stateful samplers and datasets end up as in the uninterrupted run), so the next ``iter()`` starts
        the new epoch as one stream. (From a finished unsized state torchdata creates a second, fresh iterator
        here; with workers they prefetch a few batches that are dropped.)"""
        set_data_epoch(loader, epoch)
        self._draining = True
        try:
            iter(loader)
        finally:
            self._draining = False

    def release(self) -> None:
        """Give back every loader this fit tracked as it was, and drop the fit's objects."""
        for loader in self._tracked:
            untrack(loader)
        self._tracked = []
        self._trainer = self.loader = self._live_iterator = None

    # -- a stream starts -----------------------------------------------------------------------------------------
    def _epoch_starts(self) -> Start:
        """Called when an epoch's data stream starts (before the iterator exists); returns batches to skip."""
        if self._draining:
            return 0
        self._drawn = None if self.kind == LoaderKind.MAP else set()  # until the iterator exists (MAP draws lazily)
        rest, self.rest_start = self.rest_start, None
        if rest is not None:
            return self._start_rest(rest)
        live = self._live_iterator() if self._live_iterator is not None else None
        restore_batch_sampler(self.loader, live)  # a rest read by a stateful loader: its own batches from now on
        self._stream_order = self._draw_generators = None
        plan, self.plan = self.plan, None
        epoch = plan.epoch if plan is not None else loop_epoch(self._trainer)
        self.epoch = epoch
        set_data_epoch(self.loader, epoch)  # before workers start: they copy the sampler and dataset
        self._new_stream()
        if plan is not None and plan.exact and plan.epoch_rng is not None:
            restore_rng(plan.epoch_rng)  # the same permutation and worker seeds as before
            self._set_generators(plan.epoch_generators)
            self._epoch_rng = plan.epoch_rng
            self._epoch_generators = plan.epoch_generators
            if plan.order_rng is not None:  # the order is drawn from where it was, whatever draws precede it
                self._order_replay = OrderReplay(plan.order_rng, plan.order_generators, 0, 0)
            # ...and the next step draws what it would have drawn, after the validation that followed the save: its
            # loaders' draws counted at the save, or, when not known then, replayed as Lightning's restart makes them.
            self.now_rng = plan.now_rng
            if plan.validation_draws is not None:
                self.now_rng = advanced(plan.now_rng, plan.validation_draws)
            else:
                self._replay_validation = plan.validation_follows
            self.consumed = self._base = plan.consumed
            self.samples = self.step_samples = plan.samples
            self.restored = (epoch, self.consumed, self.batches, self.samples)
            log.info("resuming mid-epoch %d after %d consumed batch(es)", epoch, self.consumed)
            return plan.skip
        if plan is not None:
            restore_rng(plan.now_rng)  # at an epoch boundary (or position lost): the epoch starts from here
            self._set_generators(plan.now_generators)
            if plan.order_draws is not None:
                # The uninterrupted run drew the new epoch's order after a known number of base-seed draws since the
                # save (the validation that followed it, the epoch's iterators); a resume may create iterators it
                # never reads, so the order (MAP) or else the first step is drawn from the save's RNG advanced by
                # exactly those.
                if self.kind == LoaderKind.MAP:
                    self._order_replay = OrderReplay(plan.now_rng, plan.now_generators, plan.order_draws,
                                                     plan.order_generator_draws)
                else:
                    self.now_rng = advanced(plan.now_rng, plan.order_draws)
        self.consumed = self._base = self.samples = self.step_samples = 0
        self._epoch_rng = capture_rng()
        self._epoch_generators = self._get_generators()
        return 0

    def _start_rest(self, start: RestStart) -> Start:
        """The stream of an epoch's rest (see ``ResumePlanner.plan_elastic``): no order is drawn, the batches are
        given."""
        rest = start.rest
        self.epoch = rest.epoch
        set_data_epoch(self.loader, rest.epoch)  # per-sample seeding's epoch, before workers start
        self._new_stream()
        self._set_generators(start.generators)
        self.now_rng = start.now_rng  # put back right before the first step (iterators draw base seeds before it)
        self.consumed = self._base = start.position
        self.samples = self.step_samples = 0
        self._stream_order = rest.order
        self._order_rng = self._order_generators = None
        self._epoch_rng = capture_rng()
        self._epoch_generators = self._get_generators()
        log.info("resuming epoch %d on another number of processes: %d batch(es) of its rest on this rank",
                 rest.epoch, rest.split.per_rank)
        if self.kind == LoaderKind.LOADER:
            give_batches(self.loader, rest.split.batches, self._handed)
            return 0
        return rest.split.batches

    def _new_stream(self) -> None:
        self._snapshots = {}
        self._fetched = 0
        self._handed.clear()
        self._fetched_digests.clear()

    def _on_order(self) -> None:
        """Right before the epoch's order is drawn: on a resume, set the RNG it is drawn from; always, remember it.

        A resume may draw the order more than once before training starts (Lightning reloading a loader, iterators
        whose workers prefetch at once): each draw starts from the same state, so the one that is read is right."""
        replay = self._order_replay
        if replay is not None:
            restore_rng(advanced(replay.rng, replay.global_draws))
            self._set_generators(replay.generators)
            loader_generator = getattr(self.loader, "generator", None)
            for _ in range(replay.generator_draws if loader_generator is not None else 0):
                torch.empty((), dtype=torch.int64).random_(generator=loader_generator)
        self._order_rng = capture_rng()
        self._order_generators = self._get_generators()

    def _before_wrapper_draw(self) -> None:
        """A ``DistributedSamplerWrapper`` of a stateful loader is about to draw its inner sampler's order: the
        generators it draws from, for the epoch's order (see _order_now)."""
        if not self._draining:
            self._draw_generators = self._get_generators()

    def _get_generators(self) -> list[torch.Tensor]:
        return [g.get_state() for g in generators(self.loader)]

    def _set_generators(self, states: list[torch.Tensor] | None) -> None:
        if states is not None:  # the count was checked against the loader in ResumePlanner.plan_resume
            for g, state in zip(generators(self.loader), states, strict=True):
                g.set_state(state)

    # -- fetches and steps ---------------------------------------------------------------------------------------
    def _on_iterator(self, it: Any) -> None:
        if self._draining:
            return
        self._drawn = None
        self._live_iterator = weakref.ref(it)

    def _position_now(self, it: Any) -> Any:
        if self.kind == LoaderKind.LOADER:
            return None if it is None else it.state_dict()
        return self.loader.dataset.state_dict()

    def _before_fetch(self, it: Any) -> None:
        # Lightning's fetcher reads one batch ahead of training only when the loader has no length; that batch's
        # fetch moves the stateful position past what was trained on. Keep the position before each fetch.
        if self.batches is None and self.kind in STATEFUL:
            self._snapshots[self._fetched] = copy.deepcopy(self._position_now(it))

    def _after_fetch(self, batch: Any) -> None:
        self._fetched += 1
        if self.digests:  # on the host, in the main process: what the loader produced
            self._fetched_digests.append(digest_batch(batch))

    def replay_skipped_validation(self, fast_forward: Callable[[], None]) -> None:
        """Lightning, resuming a checkpoint saved right before a validation, skips that validation but still sets up
        its loaders, whose new iterators draw their base seed from the global RNG: in the middle of the resumed
        epoch's stream, where the uninterrupted run drew nothing. Those draws are kept out of it; what the
        uninterrupted validation drew (counted at the save) is accounted for where it belongs (see _epoch_starts)."""
        state = capture_rng()
        replay, self._replay_validation = self._replay_validation and self.now_rng is not None, False
        if replay:  # the count was not known at the save: make the draws from the save's RNG, as the run did
            assert self.now_rng is not None
            restore_rng(self.now_rng)
        try:
            fast_forward()
        finally:
            if replay:
                self.now_rng = capture_rng()
            restore_rng(state)

    def batch_started(self) -> None:
        self._order_replay = None  # training has started: the epoch's order is the one drawn
        if self.now_rng is not None:
            restore_rng(self.now_rng)
            self.now_rng = None

    def batch_ended(self, batch: Any, *, step_ended: bool) -> tuple[Any, str | None]:
        """Count the batch consumed (``step_ended``: it ended an optimizer step). Returns its indices (MAP: the
        sampler's batch; a stateful loader reading a given rest: that batch; else None) and the digest of what the
        loader fetched for it (None when batches are not digested)."""
        self.consumed += 1
        indices = self._handed.popleft() if self._handed else None
        self.samples += len(indices) if indices is not None else batch_len(batch)
        if step_ended:
            self.step_samples = self.samples
        consumed_in_stream = self.consumed - self._base
        for k in [k for k in self._snapshots if k < consumed_in_stream]:
            del self._snapshots[k]
        return indices, self._fetched_digests.popleft() if self._fetched_digests else None

    # -- a save --------------------------------------------------------------------------------------------------
    def epoch_done(self) -> bool:
        trainer = self._trainer
        fetcher = None if trainer is None else getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is not None and fetcher.done:
            return True
        limit = None if trainer is None else trainer.num_training_batches
        if self.batches is not None:
            limit = self.batches if limit is None or limit == float("inf") else min(self.batches, int(limit))
        return limit is not None and limit != float("inf") and self.consumed >= limit

    def record(self, *, epoch_done: bool, draws: SaveDraws) -> RankRecord:
        """What this rank saves: the loader's facts, the position, the RNG now and at the stream's start."""
        loader = self.loader
        return RankRecord(
            kind=self.kind, epoch=self.epoch, consumed=self.consumed, samples=self.samples, epoch_done=epoch_done,
            batches=self.batches, batch_size=self.batch_size, num_workers=self.num_workers,
            sampler=sampler_facts(loader) if loader is not None else {},
            loader_state=self._loader_state(), epoch_rng=self._epoch_rng, now_rng=capture_rng(),
            epoch_generators=self._epoch_generators, order_rng=self._order_rng,
            order_generators=self._order_generators,
            now_generators=self._get_generators() if loader is not None else [],
            validation_follows=draws.validation_follows, validation_draws=draws.validation_draws,
            order_draws=draws.order_draws, order_generator_draws=draws.order_generator_draws,
            order=self._order_now(), step_samples=self.step_samples)

    def _loader_state(self) -> Any:
        if self.kind not in STATEFUL:
            return None
        index = self.consumed - self._base
        if self._fetched > index and index in self._snapshots:
            return self._snapshots[index]  # the next unconsumed batch is already fetched: its position before
        it = self._live_iterator() if self._live_iterator is not None else None
        return copy.deepcopy(self._position_now(it))

    def _order_now(self) -> OrderSpec | str | None:
        """The global order of the epoch being read (what a resume on another number of processes splits the rest
        of), or why it has none."""
        if self._stream_order is not None:
            return self._stream_order
        if self.loader is None or self.kind is None:
            return None
        if self.kind not in (LoaderKind.MAP, LoaderKind.LOADER):
            return f"the training data is a {describe(self.kind)}, which has no global order of samples"
        if self.kind == LoaderKind.MAP:  # drawn when the stream started: the RNG and generators right before it
            return describe_order(self.loader, rng=self._order_rng, states=self._order_generators)
        live = self._live_iterator() if self._live_iterator is not None else None
        return describe_order(self.loader, rng=None, iterator=live,
                              states=self._draw_generators if self._draw_generators is not None
                              else self._epoch_generators)
