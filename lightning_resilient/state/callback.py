"""``ResumeStateCallback``: RNG state (per rank) and the data-loader position, so a resumed run is bit-identical.

Stock Lightning saves no RNG state, and a mid-epoch resume with a plain DataLoader replays the head of the
epoch and never sees its tail. This callback records, per rank:

- the RNG states at the moment the epoch's data stream starts (they decide the shuffle permutation and the
  worker seeds) and the RNG states at the moment of the save;
- the data position: epoch, batches and samples consumed in it, the sampler's epoch and seed, and for stateful
  loaders and datasets their own state as of the last consumed batch.

On resume it puts back the epoch-start RNG states when Lightning creates the data iterator, moves the loader to
the next unseen batch (map-style: skipped at the batch-sampler level, no sample is read; stateful: its state is
loaded), and puts back the save-time RNG states before the next training step. How the loader is seen (its
kind, its epoch starts, its fetches) is in ``_loader.py``; what is saved per rank, and what a resume plans from it,
in ``_record.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loops.loop import _Loop
from torch.utils.data import DataLoader, IterableDataset

from lightning_resilient._checks import check_bool, check_number, check_optional_int
from lightning_resilient._namespaces import require_lightning_pytorch
from lightning_resilient._warnings import warn
from lightning_resilient.io.fit_check import add_fit_start_check
from lightning_resilient.io.store import Store
from lightning_resilient.state._loader import (
    LoaderKind,
    Start,
    TrackedBatchSampler,
    apply_sample_seeding,
    batch_len,
    classify,
    custom_samplers,
    draw_once_per_epoch,
    generators,
    give_batches,
    has_state,
    hook_iterators,
    own_batch_sampler,
    restore_batch_sampler,
    sampler_facts,
    set_data_epoch,
    sized,
    untrack,
)
from lightning_resilient.state._record import FORMAT, OrderReplay, RankRecord, ResumePlan, check_format
from lightning_resilient.state.attempts import StepDigest
from lightning_resilient.state.audit import (
    ResumeAudit,
    StateSampler,
    digest_batch,
    digest_indices,
    digest_sample_set,
)
from lightning_resilient.state.elastic import (
    OrderSpec,
    Rest,
    describe_order,
    distributed_batch_sampler,
    kept_accumulation,
    plan_rest,
)
from lightning_resilient.state.ledger import AttemptTimer, end_of
from lightning_resilient.state.rng import RngState, capture_rng, restore_rng
from lightning_resilient.state.seeding import SampleSeeding, sample_seed, seed_global_rngs

__all__ = ["ResumeStateCallback"]

log = logging.getLogger(__name__)
_ABSENT = object()  # an attribute a wrap did not replace (the class's own method)
# Lightning's warning on every mid-epoch resume of a loader it cannot resume itself; replaced by our own line when
# this callback did resume the position.
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"

_DESCRIBE = {
    LoaderKind.MAP: "map-style DataLoader",
    LoaderKind.LOADER: "stateful DataLoader (state_dict/load_state_dict)",
    LoaderKind.DATASET: "DataLoader over an IterableDataset with state_dict/load_state_dict",
    LoaderKind.ITERABLE: "DataLoader over an IterableDataset without a usable state",
    LoaderKind.OTHER: "iterable that is not a DataLoader",
}
# Kinds whose position is a state (the loader's or the dataset's own), saved as of the last consumed batch.
_STATEFUL = (LoaderKind.LOADER, LoaderKind.DATASET)
_FIX = ("To resume the data exactly, give the IterableDataset state_dict()/load_state_dict() (read with"
        " num_workers=0) or load it with torchdata's StatefulDataLoader.")


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

    Per rank it saves Python's, NumPy's, torch's and each CUDA device's RNG; the states of the loader's own
    ``torch.Generator`` objects (``DataLoader(generator=...)``, a sampler's ``generator``, torchdata's
    ``RandomSampler``), at the epoch start and now; and the data position: epoch, batches and samples consumed in
    it, the sampler's ``epoch``/``seed`` where it has them (``DistributedSampler``), and for stateful data its
    state as of the last *consumed* batch. Everything is tensors, lists, numbers, strings and dicts, so the
    checkpoint loads with ``weights_only=True`` (a stateful dataset's own ``state_dict()`` must be, too).

    Covered, bit for bit (mid-epoch or at an epoch boundary, gradient accumulation, resumed more than once, DDP
    with each rank restoring its own state, ``trainer.estimated_stepping_batches`` read in
    ``configure_optimizers``):

    - one map-style training ``DataLoader`` with any batch sampler (``shuffle=True``, ``DistributedSampler``),
      ``num_workers`` 0 or more: consumed batches are skipped at the index level, no sample is read;
    - torchdata's ``StatefulDataLoader``, ``num_workers`` 0 or more, over a map-style dataset or an
      ``IterableDataset``: each rank's own loader state is saved and loaded, and Lightning's copy (rank 0's,
      dropped anyway when ``estimated_stepping_batches`` is read in ``configure_optimizers``, #20550) is not
      applied, so no position is applied twice;
    - an ``IterableDataset`` with ``state_dict()``/``load_state_dict()`` in a plain ``DataLoader`` with
      ``num_workers=0``. ``load_state_dict(state)`` then ``iter(dataset)`` must continue where ``state_dict()``
      was taken (as torchdata expects).

    For unsized data Lightning's fetcher reads one batch ahead, so a stateful position taken at the save is one
    batch late; the position is snapshotted before each fetch and the one before the first unconsumed batch is
    saved. The sampler (``set_epoch``) and a :class:`PerSampleSeeded` dataset get the resumed epoch before the
    iterator draws indices (with workers, or torchdata's batch sampler, that happens before Lightning sets it,
    #21938). A ``DistributedSamplerWrapper`` (Lightning's, under DDP, around torchdata's ``RandomSampler``) draws
    its inner order once per epoch while this callback builds the epoch's iterator. After a resume from a save on
    an epoch's last batch, Lightning's epoch counters are corrected so a later mid-epoch save resumes at the
    right ``batch_idx``.

    Per-sample seeding (``per_sample_seeding=True``, the default): every sample of a map-style training dataset is
    read with Python's, NumPy's and torch's global RNGs seeded from (seed, epoch, index), in the main process and in
    every worker, so random augmentation in ``__getitem__`` does not depend on which worker read the sample and a
    resume that skips batches draws the same numbers as the uninterrupted run (in a worker, a ``collate_fn``'s
    draws depend on the batch only). The seed is ``seed_everything``'s where it was called, else rank 0's
    ``torch.initial_seed()`` at the first attempt, and it is stored in the checkpoint: a resume uses the stored seed
    (a different ``seed_everything`` seed wins, with a warning). A :class:`PerSampleSeeded` dataset keeps its own
    seed. Where seeding cannot apply (an ``IterableDataset``, a dataset whose instance already has its own
    ``__getitems__``, ``batch_size=None``) and it matters, a warning at fit start names the case and the fix, as it
    does for a sampler whose order a resume may not reproduce (a custom sampler without state).
    ``per_sample_seeding=False`` leaves the dataset as it is: a resume with ``num_workers > 0`` then draws other
    augmentation than the uninterrupted run (the cost it saves is about 15 us per sample, in the process that reads
    it).

    Resume audit (``audit=True``, the default): every rank records, for each training step, a digest of its sample
    indices and inputs and its loss, in ``.lightning_resilient/attempts/`` of the checkpoint root (the first
    ``ModelCheckpoint``'s dirpath): on local disk every step, on an object store by a background thread at most every
    ``audit_flush_seconds`` (or ``audit_flush_steps`` steps). After a resume, the steps the interrupted attempt ran
    past the checkpoint are compared, rank by rank, as they are replayed, and one line starting with
    ``resume audit:`` says whether they were identical on every rank or DIFFER (the first step, rank and what:
    data or loss), or that there was nothing to compare. ``lightning-resilient ls ROOT`` shows each attempt's result.
    The log line that replaces Lightning's "not resumable" warning claims an exact continuation only when every
    condition for it holds; otherwise it says what was restored and what was not.

    Goodput ledger (``ledger=True``, the default, with or without the audit): the same record also keeps where the
    attempt's time went: when the fit started, the time to its first training step (the restore, when it resumed) and
    the commit it loaded, the global step reached (every optimizer step, written as the record is), the median step
    time, the time saves blocked the loop, and how the attempt ended (finished, preempted, error, hang) where it
    could tell. At each save every rank's median time of its batches' own work (fetch and forward) is compared, and
    a rank ``straggler_factor`` times slower than the others is reported in the log and the record.
    ``lightning-resilient goodput ROOT`` adds the attempts up: productive time, steps recomputed after each restart,
    restore time, save stalls, goodput, and the Young/Daly interval from the measured save cost and time between
    failures (see docs/goodput.md).

    It runs first among the callbacks (it moves itself there), so a saver's ``on_train_batch_end`` (a user's
    ``trainer.save_checkpoint``, ``OnExceptionCheckpoint``) sees the batch counted; the RNG draws Lightning's restart
    makes when it skips the validation that followed a save are replayed from the save's RNG; a resume from an
    epoch-end save with ``max_steps`` starts the next epoch, as without ``max_steps``; and an epoch's order is drawn
    from the epoch's RNG however many iterators are created before it (``persistent_workers``).

    Elastic resume (``state/elastic.py``): a checkpoint written by another number of processes continues its epoch
    so that every sample of it is trained once: each save records the epoch's global order (the
    ``DistributedSampler`` permutation, or one process's sampler order and the generator state it was drawn from)
    and every rank's samples up to its last optimizer step; the resume splits the rest among this run's ranks in
    equal numbers of batches (a map-style loader skips to them at the index level, a ``StatefulDataLoader`` reads
    them for that epoch), moves Lightning's batch count to where the rest starts, and says in one line what was and
    was not restored (ranks both jobs have continue their RNG streams, new ranks start streams seeded from (seed,
    step, rank)). ``keep_global_batch=True`` also keeps processes x ``accumulate_grad_batches`` x batch size: the
    optimizer steps then read the same samples as the checkpoint's job would have. What has no global order (an
    ``IterableDataset``, a custom sampler or batch sampler) is named in a warning at resume, and the epoch's data
    restarts.

    Not covered; a warning at resume says what was resumed instead (the RNG states and the loop's epoch and
    step) and that the epoch's data starts from its beginning: an ``IterableDataset`` without state, or with state
    read by ``num_workers > 0`` in a plain ``DataLoader`` (use ``StatefulDataLoader``); several training loaders;
    a changed batch size, number of batches, loader kind, sampler seed, number of sampler generators, or
    (``StatefulDataLoader``) number of workers (at the same number of processes). Training data that is not a
    ``DataLoader`` gets RNG states only (Lightning restores its ``state_dict()`` if it has one). Also not covered:
    random numbers drawn by a validation right after a save (a resume skips it; a warning names the step when it
    happens), ``training_step(dataloader_iter)``, a ``StatefulDataLoader`` with ``in_order=False``,
    ``reload_dataloaders_every_n_epochs`` mid-epoch positions, and samplers whose randomness lives outside
    ``torch.Generator`` objects and the global RNGs.

    Args:
        per_sample_seeding: seed each sample of a map-style training dataset from (seed, epoch, index), so that
            random augmentation drawn in ``__getitem__`` (in workers too) resumes exactly. False: leave the dataset
            alone (augmentation drawn in workers then differs after a resume).
        audit: record what each training step consumed beside the checkpoints and, after a resume, compare the
            replayed steps with the interrupted attempt's and log one ``resume audit:`` line.
        audit_flush_seconds: on an object store, the attempt record is rewritten at most this often (a kill loses at
            most this interval of it); ``float("inf")``: only every ``audit_flush_steps`` steps and at the end.
            Local disk appends every step whatever this says.
        audit_flush_steps: on an object store, also rewrite the record once this many steps are unwritten (one
            request each time: 1 is one request per step); None: by time only.
        ledger: keep the goodput ledger's figures in the attempt record (also with ``audit=False``; the record is
            written on the same schedule, ``audit_flush_seconds``/``audit_flush_steps``).
        straggler_factor: report a rank whose median own time per batch exceeds this many times the other ranks'
            (checked at each save, under DDP and the like); None: never.
        keep_global_batch: on a resume, set ``trainer.accumulate_grad_batches`` so that processes x accumulation x
            batch size is the checkpoint's (a ValueError naming the sizes when no whole accumulation does), and in
            one process read each epoch in ``DistributedSampler``'s order (as under DDP), so the training is the
            same at any number of processes up to float reduction order. False: the global batch follows the
            number of processes.
    """

    def __init__(self, *, per_sample_seeding: bool = True, audit: bool = True, audit_flush_seconds: float = 30.0,
                 audit_flush_steps: int | None = None, ledger: bool = True,
                 straggler_factor: float | None = 1.5, keep_global_batch: bool = False) -> None:
        super().__init__()
        self.per_sample_seeding = check_bool("per_sample_seeding", per_sample_seeding)
        self.keep_global_batch = check_bool(
            "keep_global_batch", keep_global_batch,
            hint="True: a resume on another number of processes sets accumulate_grad_batches to keep the global batch")
        self.audit = check_bool("audit", audit)
        self.audit_flush_seconds = check_number("audit_flush_seconds", audit_flush_seconds, above=0, finite=False)
        self.audit_flush_steps = check_optional_int("audit_flush_steps", audit_flush_steps, minimum=1,
                                                    none_means="by time only")
        self.ledger = check_bool("ledger", ledger)
        self.straggler_factor = (None if straggler_factor is None else
                                 check_number("straggler_factor", straggler_factor, above=1,
                                              hint="how many times slower than the others; None: never"))
        self._trainer: Trainer | None = None
        self._loader: Any = None  # the training loader being tracked
        self._wrapped: list[tuple[Any, str, Any, Any]] = []  # (owner, name, what it replaced, the wrap)
        # What the loader is (each named as the RankRecord field it is saved in).
        self._kind: LoaderKind | None = None
        self._batches: int | None = None  # the loader's length; None: unsized
        self._batch_size: int | None = None
        self._num_workers = 0
        # The current data stream: the training epoch it reads (the sampler's set_epoch) and how far it got.
        self._epoch = 0
        self._consumed = 0  # batches of the epoch trained on (including those skipped on resume)
        self._samples = 0
        self._base = 0  # batches of the epoch consumed before this stream's iterator was created (a resume)
        self._fetched = 0  # batches this stream's iterator has returned; runs ahead of _consumed by the prefetch
        self._snapshots: dict[int, Any] = {}  # stream fetch index -> stateful position right before that fetch
        self._handed: deque[Any] = deque()  # MAP: the batches of indices the index stream handed out, unconsumed
        self._fetched_digests: deque[str] = deque()  # digests of the batches fetched (on the host), unconsumed
        self._live_iterator: weakref.ref[Any] | None = None  # the loader's current iterator
        self._epoch_rng: RngState | None = None  # the RNG at the stream's start
        self._epoch_generators: list[torch.Tensor] | None = None  # the loader's own generators at the stream's start
        self._now_rng: RngState | None = None  # save-time RNG, put back before the first resumed step
        self._pending: RankRecord | None = None  # this rank's saved record, until the loader is known
        self._plan: ResumePlan | None = None  # what the first data stream after a resume does
        self._owns_position = False  # our per-rank loader state replaces Lightning's rank-0 copy
        self._draining = False  # creating an iterator only to replay a saved end-of-epoch state
        self._drawn: set[int] | None = None  # while an epoch's iterator is built: sampler wrappers that drew
        # The RNG (and the loader's generators) right before this epoch's order was drawn, and, on a resume, what the
        # next such draw is made from.
        self._order_rng: RngState | None = None
        self._order_generators: list[torch.Tensor] | None = None
        self._order_replay: OrderReplay | None = None
        self._watch_validation: int | None = None  # step of the last save a validation follows, while it runs
        self._replay_validation = False
        self._val_rng: RngState | None = None
        self._warned_validation = False
        self._restored: tuple[int, int, int | None, int] | None = None  # (epoch, batches, of, samples) restored
        self._resumed = False  # this fit restored a saved record
        # Per-sample seeding: the seed this run uses (set at setup, or from the checkpoint), the one seed_everything
        # gave where it was called, what the checkpoint says, and what was installed on the dataset (or why not).
        self._seed = 0
        self._explicit_seed: int | None = None
        self._saved_seeding: tuple[bool, int | None] | None = None  # (seeding on, its seed) in the checkpoint
        self._seed_change: tuple[int, int] | None = None  # (checkpoint's, this run's) when seed_everything differs
        self._seeding: SampleSeeding | None = None
        self._seeding_problem: str | None = None
        self._custom: list[str] = []  # names of samplers a resume may not reproduce
        self._warned_data = False  # the fit-start warnings about the data were given
        self._tracked: list[Any] = []  # every loader this fit tracked (Lightning may reload it), untracked at the end
        # The resume audit of this attempt, the global step at the current batch's start, and how the fit ended.
        self._audit: ResumeAudit | None = None
        self._saved_since_start = False  # a save happened in this fit (the root is claimed: its incarnation known)
        self._sampler: StateSampler | None = None  # a sample of the parameters after each step, for the audit
        self._digests = False  # the audit will run (there is a root to record in): digest each fetched batch
        self._step_at_start = 0
        self._failure: str | None = None
        # The goodput ledger: this rank's timings of the attempt, how the fit ended, and the plugin's load before it.
        self._timer: AttemptTimer | None = None
        self._end = "finished"
        self._load_before: Any = None
        # Elastic resume (state/elastic.py): every rank's saved record when this run has another number of processes
        # (or the save was reading a rest), until the loader is known; the rest this rank reads, with the RNG and
        # generators it starts from and Lightning's batch count it starts at; the batch count Lightning's epoch
        # loop is moved to; the order the current stream reads (None: the sampler's own, described at a save); the
        # samples of the stream up to its last optimizer step; and what the resume line says about it.
        self._elastic: list[RankRecord] | None = None
        self._rest_start: tuple[Rest, RngState, list[torch.Tensor] | None, int] | None = None
        self._shift_to: int | None = None
        self._stream_order: OrderSpec | None = None
        self._draw_generators: list[torch.Tensor] | None = None  # a stateful loader's, before its wrapper drew
        self._step_samples = 0
        self._rest_line: str | None = None
        # keep_global_batch: (world size, accumulate_grad_batches, batch_size) of the checkpoint's job, and the
        # change made to this run's accumulate_grad_batches ((then, now); None: none).
        self._saved_batch: tuple[int, int | None, int | None] | None = None
        self._accumulation_change: tuple[int, int] | None = None

    @property
    def state_key(self) -> str:
        return "ResumeStateCallback"

    # -- wiring ------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_lightning_pytorch(trainer, "ResumeStateCallback")
        if stage != "fit":
            return
        self._loader = None  # a new fit builds a new loader
        self._kind = None
        self._owns_position = False
        self._trainer = trainer
        self._warned_validation = False
        self._resumed = False
        self._restored = None
        self._saved_seeding = self._seed_change = None
        self._seeding = None
        self._seeding_problem = None
        self._custom = []
        self._warned_data = False
        self._failure = None
        self._end = "finished"
        self._digests = False
        self._timer = AttemptTimer(rank=trainer.global_rank) if self.ledger else None
        if self._timer is not None:
            self._timer.fit_started()  # before Lightning loads the checkpoint: a restore is timed from here
            self._load_before = _last_load(trainer)
        self._elastic = self._rest_start = self._shift_to = self._stream_order = self._rest_line = None
        self._saved_batch = self._accumulation_change = None
        if self.per_sample_seeding:
            self._seed, self._explicit_seed = _run_seed()
        add_fit_start_check(trainer)  # the folders are checked in on_fit_start, once ModelCheckpoint resolved them
        # First in line for every hook: another callback that saves from its on_train_batch_end (a user's saver,
        # OnExceptionCheckpoint, a preemption handler) then sees this batch counted, and a callback that draws
        # random numbers in on_train_batch_start draws them after the resumed RNG is back. A new list, since
        # Lightning is iterating the current one to call this very hook. (Trainer does not declare the attribute its
        # CallbackConnector sets.)
        trainer.callbacks = [self, *(c for c in trainer.callbacks if c is not self)]  # type: ignore[attr-defined]
        fit_loop = trainer.fit_loop

        # Lightning builds (and, under DDP, re-instantiates) the train DataLoader in FitLoop.setup_data and
        # creates its iterator right after restoring loader states: the last point where the loader can be
        # wrapped before it is iterated. When configure_optimizers reads estimated_stepping_batches, this runs
        # before the loops' state is restored (so Lightning has no loader state to load yet, #20550); the
        # callback's own state is already loaded then.
        def track_then_load_states(load_states: Callable[[], None]) -> None:
            self._track(fit_loop._combined_loader)  # may load this rank's own loader state
            if self._owns_position:
                fit_loop._combined_loader_states_to_load = []  # ...which replaces Lightning's rank-0 copy
            load_states()

        self._wrap(fit_loop, "_load_combined_loader_states", track_then_load_states)
        self._wrap(fit_loop.epoch_loop, "reset", self._reset_epoch_loop)
        self._wrap(fit_loop.epoch_loop.val_loop, "increment_progress_to_evaluation_end", self._skip_validation)
        self._wrap(trainer, "_teardown", self._teardown_then_release)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After every callback's setup: a wrapper another callback put on save_checkpoint in its setup
        # (CheckpointCadence) is inside ours, so ours, removed first (in _teardown), leaves theirs as they left it.
        if self._timer is not None:
            self._wrap(trainer, "save_checkpoint", self._timed_save)

    def _wrap(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Replace ``owner.name`` by ``wrapper(original, ...)``, once (a second fit reuses the loops)."""
        original = getattr(owner, name)
        if getattr(original, "_resume_state_wrap", None) is self:
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return wrapper(original, *args, **kwargs)

        wrapped._resume_state_wrap = self  # type: ignore[attr-defined]  # our mark: a second fit does not wrap twice
        # What to put back after the fit: the instance attribute it replaced, or nothing (the class's method).
        self._wrapped.append((owner, name, owner.__dict__.get(name, _ABSENT), wrapped))
        setattr(owner, name, wrapped)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._failure = f"{type(exception).__name__}: {exception}"[:300]
        self._end = end_of(exception)

    def _timed_save(self, save: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``trainer.save_checkpoint``, timed for the ledger (how long it blocks the loop), then the straggler check
        (every rank saves together, so every rank reaches its collective)."""
        timer, trainer = self._timer, self._trainer
        if timer is None or trainer is None:
            return save(*args, **kwargs)
        started = timer.save_started()
        try:
            result = save(*args, **kwargs)
        finally:
            timer.save_ended(trainer.global_step, started)
        if self.straggler_factor is not None and trainer.world_size > 1:
            timer.check_stragglers(_gather, step=trainer.global_step, factor=self.straggler_factor)
        return result

    def _teardown_then_release(self, teardown: Callable[[], Any]) -> Any:
        # Lightning calls the callbacks' teardown hooks only when the fit succeeded; its own _teardown runs after a
        # failure too, once every on_exception hook (OnExceptionCheckpoint's save among them) has run.
        try:
            return teardown()
        finally:
            self._release()

    def _release(self) -> None:
        """After the fit (or its failure): give back the user's DataLoader and the Trainer's loops as they were.

        Both stay picklable (``torch.save(trainer)``, ``deepcopy``, a loader reused by another Trainer), and nothing
        of this fit's tracking runs behind a later ``validate`` or a fit without this callback."""
        timer, self._timer = self._timer, None
        if self._audit is not None:
            audit, self._audit = self._audit, None
            ledger = {"end": self._end, "timings": timer.timings()} if timer is not None else {}
            audit.close("finished" if self._failure is None else f"stopped by {self._failure}", **ledger)
        for loader in self._tracked:
            untrack(loader)
        self._tracked = []
        self._seeding = None
        for owner, name, before, wrapped in reversed(self._wrapped):
            if owner.__dict__.get(name) is wrapped:
                if before is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, before)
        self._wrapped = []
        self._trainer = self._loader = self._live_iterator = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickled for ddp_spawn, deep-copied with a Trainer) carries the settings and the saved position, not
        # the objects of a fit in progress: the Trainer, its loader, the live iterator, the loop wraps.
        state = self.__dict__.copy()
        state.update(_trainer=None, _loader=None, _live_iterator=None, _wrapped=[], _audit=None, _seeding=None,
                     _tracked=[], _timer=None, _load_before=None)
        return state

    def _reset_epoch_loop(self, reset: Callable[[], None]) -> None:
        """Lightning warns on every mid-epoch resume that the loader is not resumable; when this callback restored
        the position, that is wrong, and one line of ours says what was restored instead.

        After a resume on another number of processes, Lightning's count of the epoch's batches (per process, as the
        checkpoint's job counted them) is first moved to where this run's rest of the epoch starts, so the epoch ends
        after that rest, with the accumulation boundaries and the last-batch step where they belong."""
        shift, self._shift_to = self._shift_to, None
        if shift is not None and self._trainer is not None:
            _shift_batches(self._trainer.fit_loop.epoch_loop.batch_progress, shift)
        restored, self._restored = self._restored, None
        line, self._rest_line = self._rest_line, None
        if restored is None and line is None:
            reset()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
            reset()
        if line is None and restored is not None:
            line = self._restored_line(*restored)
        rank_zero_info(f"ResumeStateCallback: {line}")

    def _restored_line(self, epoch: int, consumed: int, batches: int | None, samples: int) -> str:
        """What a mid-epoch resume restored, and whether that makes it exact: "continues exactly" only when every
        condition for it holds; otherwise what was not restored."""
        seeding = f"per-sample seeding (seed {self._seeding.seed}), " if self._seeding is not None else ""
        line = (f"restored the data position: epoch {epoch}, after {consumed} of"
                f" {batches if batches is not None else '?'} batches ({samples} samples), {seeding}and the RNG states"
                " of every rank")
        missing = self._not_restored()
        if not missing:
            return f"{line}, so this run continues exactly where the checkpoint was saved"
        return (f"{line}. Not restored: {'; '.join(missing)}. So this run may differ from an uninterrupted one from"
                " here on (the resume audit compares the steps it replays)")

    def _not_restored(self) -> list[str]:
        """What keeps a resumed run from being exact although its position was restored."""
        out = []
        dataset = getattr(self._loader, "dataset", None)
        workers = self._num_workers
        # Random numbers drawn while data is read come from wherever the reading process's RNGs are at that moment: in
        # a worker, from its history; in the main process, from the RNG before the step (a resume restores the state
        # of the step, not of the fetch). Only per-sample seeding makes them a function of the batch.
        where = f"in the {workers} worker process(es)" if workers else "in the main process"
        if isinstance(dataset, IterableDataset):
            out.append(f"random numbers drawn from the global RNGs while the IterableDataset {type(dataset).__name__}"
                       f" is read {where} (per-sample seeding does not apply to it)")
        elif self._seeding is None:
            why = ("per-sample seeding is off" if not self.per_sample_seeding else
                   f"per-sample seeding could not be applied: {self._seeding_problem}")
            out.append(f"random numbers drawn while the dataset is read {where} ({why})")
        saved = self._saved_seeding
        if saved is not None and self._seeding is not None and not saved[0]:
            out.append("augmentation drawn in the dataset (the checkpoint's run read it without per-sample seeding,"
                       " this one seeds each sample)")
        elif saved is not None and saved[0] and self._seeding is None:
            out.append("augmentation drawn in the dataset (the checkpoint's run seeded each sample, this one does"
                       " not)")
        if self._seed_change is not None:
            out.append(f"the per-sample seed ({self._seed_change[0]} then, {self._seed_change[1]} now: the seed given"
                       " to seed_everything changed)")
        out.extend(f"the order of the custom sampler {name}" for name in self._custom)
        trainer = self._trainer
        if trainer is not None and _rebuilds_buckets(trainer):
            out.append(f"the order DDP reduces gradients in on the first step ({trainer.world_size} processes)")
        return out

    def _skip_validation(self, fast_forward: Callable[[], None]) -> None:
        """Lightning, resuming a checkpoint saved right before a validation, skips that validation but still sets up
        its loaders, whose new iterators draw their base seed from the global RNG: in the middle of the resumed
        epoch's stream, where the uninterrupted run drew nothing. Those draws are kept out of it; what the
        uninterrupted validation drew (counted at the save) is accounted for where it belongs (see _epoch_starts)."""
        state = capture_rng()
        replay, self._replay_validation = self._replay_validation and self._now_rng is not None, False
        if replay:  # the count was not known at the save: make the draws from the save's RNG, as the run did
            assert self._now_rng is not None
            restore_rng(self._now_rng)
        try:
            fast_forward()
        finally:
            if replay:
                self._now_rng = capture_rng()
            restore_rng(state)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count_the_epoch_after_a_last_batch_save(trainer)
        self._finish_the_epoch_saved_at_its_end(trainer)
        if self._resumed:
            _warn_if_ddp_rebuilds_buckets(trainer)
        if self._owns_position:
            # Restored after the early loader build of the #20550 path: never apply rank 0's copy on top.
            trainer.fit_loop._combined_loader_states_to_load = []
        if self._pending is not None:  # no training loader was built (e.g. limit_train_batches=0)
            restore_rng(self._pending.now_rng)
            self._pending = None
        if self.audit or self.ledger:
            self._start_audit(trainer)

    def _start_audit(self, trainer: Trainer) -> None:
        """Open this attempt's record beside the checkpoints and, on a resume, get ready to compare the steps it
        replays (collectives: every rank runs this)."""
        url = _checkpoint_root(trainer)
        if url is None:  # no ModelCheckpoint and no resume: nowhere to record (the same on every rank)
            return
        rank, world = _rank_and_world()
        store = _open_store(trainer, url)
        self._saved_since_start = False
        audit = ResumeAudit(rank=rank, world=world, gather=_gather, flush_seconds=self.audit_flush_seconds,
                            flush_steps=self.audit_flush_steps, compare=self.audit)
        resumed = trainer.ckpt_path is not None
        result = audit.start(store, facts=self._facts(trainer, world),
                             resumed_step=trainer.global_step if resumed else None,
                             resumed_from=str(trainer.ckpt_path) if resumed else None,
                             spool=_spool(trainer, store),
                             root_id=_root_id(trainer, url, read=True) if rank == 0 else None)
        self._audit = audit
        if self._timer is not None:
            last = _last_load(trainer)
            loaded = last is not None and last is not self._load_before and resumed
            self._timer.attach(audit.log, loaded=(last.commit, last.tier or None, last.seconds) if loaded else None)
        if result is not None:
            rank_zero_info(result.line)

    def _facts(self, trainer: Trainer, world: int) -> dict[str, Any]:
        """What a DIFFERS line names when it changed between attempts."""
        dataset = getattr(self._loader, "dataset", None)
        size = len(dataset) if dataset is not None and sized(dataset) else None
        return {"world_size": world, "batch_size": self._batch_size, "num_workers": self._num_workers,
                "loader": str(self._kind) if self._kind is not None else None,
                "dataset": None if dataset is None else type(dataset).__name__ + ("" if size is None else f"[{size}]"),
                "per_sample_seeding": self._seeding is not None,
                "sample_seed": self._seeding.seed if self._seeding is not None else None,
                "accumulate_grad_batches": trainer.accumulate_grad_batches}

    def _count_the_epoch_after_a_last_batch_save(self, trainer: Trainer) -> None:
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

    def _finish_the_epoch_saved_at_its_end(self, trainer: Trainer) -> None:
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

    def _track(self, combined: Any) -> None:
        loaders = list(getattr(combined, "flattened", []) or [])
        if len(loaders) == 1 and loaders[0] is self._loader:
            return
        pending, self._pending = self._pending, None
        elastic, self._elastic = self._elastic, None
        if len(loaders) != 1:
            self._loader = self._kind = None
            warn("ResumeStateCallback restores the data position of a single training loader; this run has"
                 f" {len(loaders)}: RNG states are restored but each resumed epoch starts from its first batch",
                 RuntimeWarning)
            if pending is not None:
                restore_rng(pending.now_rng)
            elif elastic is not None:
                restore_rng(self._rank_rng(elastic))
            return
        loader = loaders[0]
        kind = classify(loader)
        self._loader, self._kind = loader, kind
        self._batches = len(loader) if kind != LoaderKind.OTHER and sized(loader) else None
        self._batch_size = getattr(loader, "batch_size", None)
        self._num_workers = int(getattr(loader, "num_workers", 0))
        if not any(seen is loader for seen in self._tracked):
            self._tracked.append(loader)
        # Fetched batches are digested from the first fetch on (Lightning may fetch one before on_train_start).
        self._digests = self.audit and self._trainer is not None and _checkpoint_root(self._trainer) is not None
        if self.per_sample_seeding:
            self._apply_seeding(loader)
        self._warn_about_the_data(loader, kind)
        if self._saved_batch is not None:  # a resume: keep_global_batch with this loader's batch size
            self._keep_global_batch(_batches_of(loader))
        if kind == LoaderKind.MAP:
            # DataLoader refuses a new batch_sampler after construction: set it underneath. With keep_global_batch,
            # one process reads the order DDP's DistributedSampler gives (the same at every number of processes).
            own = own_batch_sampler(loader)
            replacement = (distributed_batch_sampler(own, seed=int(os.environ.get("PL_GLOBAL_SEED", 0) or 0))
                           if self.keep_global_batch and _rank_and_world()[1] == 1 else None)
            tracked = TrackedBatchSampler(loader.batch_sampler, self._epoch_starts, self._handed, self._on_order,
                                          replacement)
            object.__setattr__(loader, "batch_sampler", tracked)
            if self._digests:  # to see each batch on the host, before Lightning moves it to the device
                hook_iterators(loader, None, self._on_iterator, self._before_fetch, self._after_fetch)
        elif kind != LoaderKind.OTHER:
            hook_iterators(loader, self._epoch_starts, self._on_iterator, self._before_fetch, self._after_fetch)
            draw_once_per_epoch(loader, lambda: self._drawn, self._before_wrapper_draw)
        if elastic is not None:
            self._plan = self._plan_elastic(elastic, loader, kind)
        else:
            self._plan = self._plan_resume(pending, loader, kind) if pending is not None else None
        if kind == LoaderKind.OTHER and self._plan is not None:
            restore_rng(self._plan.now_rng)
            self._plan = None

    def _apply_seeding(self, loader: Any) -> None:
        applied = apply_sample_seeding(loader, self._seed)
        if not isinstance(applied, SampleSeeding):
            self._seeding, self._seeding_problem = None, applied
            return
        self._seeding, self._seeding_problem = applied, None
        saved = self._saved_seeding
        if saved is not None and saved[0] and saved[1] is not None and saved[1] != applied.seed:
            self._seed_change = (saved[1], applied.seed)
            warn(f"ResumeStateCallback: the checkpoint's run seeded each sample with seed {saved[1]}, but"
                 f" seed_everything gave this run {applied.seed}, which per-sample seeding uses: every sample's"
                 " random augmentation differs from the interrupted run's from here on. To continue that run"
                 f" exactly, call seed_everything({saved[1]}) (or not at all: the checkpoint's seed is then used).",
                 RuntimeWarning, rank_zero=True)

    def _warn_about_the_data(self, loader: Any, kind: LoaderKind) -> None:
        """Once per fit, when it starts: what keeps a resume of this run from being exact, and the fix."""
        if self._warned_data:
            return
        self._warned_data = True
        dataset = getattr(loader, "dataset", None)
        name = type(dataset).__name__
        workers = self._num_workers
        if kind == LoaderKind.ITERABLE and callable(getattr(dataset, "state_dict", None)):
            warn(f"the training {name} has state_dict()/load_state_dict(), but the plain"
                 f" DataLoader reads it in {loader.num_workers} worker processes, each with its own copy: the main"
                 " process cannot see their positions, so ResumeStateCallback saves no data position for it and a"
                 " mid-epoch resume restarts the iterable from its beginning. Use torchdata's StatefulDataLoader"
                 " (it collects every worker's dataset state) or num_workers=0.", RuntimeWarning)
        elif kind == LoaderKind.ITERABLE:
            warn(f"ResumeStateCallback cannot make a resume of this run exact: the training dataset {name} is an"
                 " IterableDataset without state_dict()/load_state_dict(), so a resume restores the RNG states and"
                 " the loop's epoch and step but restarts the data from its beginning, and per-sample seeding does"
                 f" not apply to it. {_FIX} Draw its random numbers from a generator kept in that state.",
                 RuntimeWarning, rank_zero=True)
        elif kind == LoaderKind.OTHER and not has_state(loader):
            what = ("without automatic batching (batch_size=None)" if isinstance(loader, DataLoader)
                    else "that is not a DataLoader")
            warn(f"ResumeStateCallback cannot make a resume of this run exact: the training data is a"
                 f" {type(loader).__name__} {what}, without state_dict()/load_state_dict(), so a resume restores the"
                 " RNG states and the loop's epoch and step but restarts the data from its beginning. Fix: a"
                 " DataLoader with a batch_size over a map-style dataset, or an iterable with"
                 " state_dict()/load_state_dict().", RuntimeWarning, rank_zero=True)
        elif isinstance(dataset, IterableDataset) and workers:
            warn(f"ResumeStateCallback: random numbers the {workers} worker(s) of the IterableDataset {name} draw from"
                 " the global RNGs are not restored by a resume (per-sample seeding does not apply to an"
                 " IterableDataset, and the loader's state holds the workers' positions, not their RNGs), so a"
                 f" resume of this run is exact only if {name} draws none. Fix: draw them from a generator kept in"
                 f" {name}'s state_dict().", RuntimeWarning, rank_zero=True)
        elif self.per_sample_seeding and self._seeding is None and workers:
            fix = ("give the DataLoader a batch_size" if "batch_size=None" in (self._seeding_problem or "") else
                   "wrap the dataset yourself: DataLoader(lightning_resilient.PerSampleSeeded(dataset, seed=...),"
                   " ...)")
            warn(f"ResumeStateCallback: per-sample seeding cannot apply: {self._seeding_problem}. Random numbers"
                 f" drawn while reading it in the {workers} worker process(es) will differ after a resume, so a resume"
                 f" of this run is not exact if it draws any. Fix: {fix}, or read it with num_workers=0.",
                 RuntimeWarning, rank_zero=True)
        stateful = kind == LoaderKind.LOADER
        custom = [s for s in custom_samplers(loader) if not (stateful and has_state(s))]
        self._custom = [type(s).__name__ for s in custom]
        if custom:
            names = ", ".join(self._custom)
            warn(f"ResumeStateCallback: the training loader's sampler {names} is not torch's, Lightning's or"
                 f" torchdata's{' and has no state_dict()/load_state_dict()' if stateful else ''}: a resume redraws"
                 " its order from the restored RNG states (the global RNGs and the torch.Generator objects it keeps"
                 " as .generator), which reproduces it only if that is all its randomness. A resume of this run is"
                 " therefore not claimed exact; the resume audit compares the sample indices it replays. Fix: give it"
                 " state_dict()/load_state_dict() and read the data with torchdata's StatefulDataLoader, which"
                 " restores it.", RuntimeWarning, rank_zero=True)

    def _plan_resume(self, saved: RankRecord, loader: Any, kind: LoaderKind) -> ResumePlan:
        """Check the saved record against this loader, load a stateful position, and say what the first epoch
        stream must do."""
        consumed, done, mid = saved.consumed, saved.epoch_done, saved.mid_epoch
        problem = None
        if saved.kind != kind:
            problem = f"the training data was a {_describe(saved.kind)} then and is a {_describe(kind)} now"
        elif kind in (LoaderKind.MAP, LoaderKind.LOADER) and saved.batches is not None and (
                saved.batches != self._batches or saved.batch_size != self._batch_size):
            problem = (f"the training loader changed since the checkpoint ({saved.batches} batches of"
                       f" {saved.batch_size} then, {self._batches} of {self._batch_size} now)")
        elif kind == LoaderKind.LOADER and saved.num_workers != self._num_workers:
            problem = (f"the training loader's num_workers changed since the checkpoint ({saved.num_workers}"
                       f" then, {self._num_workers} now) and its saved state holds one state per worker")
        elif saved.now_generators is not None and len(saved.now_generators) != len(generators(loader)):
            problem = ("the training loader's samplers changed since the checkpoint"
                       f" ({len(saved.now_generators)} random generator(s) then, {len(generators(loader))} now)")
        elif (seed := saved.sampler.get("seed")) is not None and (
                (now := sampler_facts(loader).get("seed")) is not None and seed != now):
            problem = f"the sampler's seed changed since the checkpoint ({seed} then, {now} now)"
        if problem is not None and mid:
            ends = (f" (Lightning still counts the {consumed} batch(es) trained before the save, so this epoch ends"
                    " that many batches early)" if self._batches is not None else "")
            warn(f"{problem}: the position in the epoch cannot be mapped; RNG states are restored and the resumed"
                 f" epoch's data starts from its first batch{ends}", RuntimeWarning)
        elif mid and (kind == LoaderKind.ITERABLE or (kind == LoaderKind.OTHER and not has_state(loader))):
            # (Lightning itself restores an iterable that has state_dict/load_state_dict: rank 0's state.)
            what = (f"a {type(loader).__name__} " + ("without automatic batching (batch_size=None)"
                                                     if isinstance(loader, DataLoader) else "that is not a DataLoader")
                    if kind == LoaderKind.OTHER else
                    f"a {type(loader.dataset).__name__}, an IterableDataset "
                    + ("read by worker processes" if callable(getattr(loader.dataset, "state_dict", None))
                       else "without state_dict()/load_state_dict()"))
            warn(f"ResumeStateCallback cannot restore the data position of this run's training data ({what})."
                 f" Resumed: the RNG states and the training loop's epoch and step (epoch {saved.epoch},"
                 f" {consumed} batch(es) into it). Not resumed: the data, which restarts from the beginning of the"
                 f" iterable, so the {consumed} batch(es) already trained on in this epoch are seen again. {_FIX}",
                 RuntimeWarning)
        exact = mid and problem is None and kind in (LoaderKind.MAP, *_STATEFUL)
        state = saved.loader_state if problem is None else None
        if kind == LoaderKind.LOADER:
            # The per-rank state below (or a fresh start, if it cannot be used) replaces the rank-0 copy that
            # Lightning saved under loops; applying both would apply a position twice.
            self._owns_position = True
            if self._trainer is not None:
                self._trainer.fit_loop._combined_loader_states_to_load = []
            if state is not None:
                loader.load_state_dict(state)
                if done:
                    self._replay_to_epoch_end(loader, saved.epoch)
        elif kind == LoaderKind.DATASET and state is not None:
            loader.dataset.load_state_dict(state)
        self._resumed = True
        fits = problem is None  # the saved generator and order states belong to this loader
        return ResumePlan(
            epoch=saved.epoch + 1 if done else saved.epoch, exact=exact,
            skip=consumed if exact and kind == LoaderKind.MAP else 0, consumed=consumed if exact else 0,
            samples=saved.samples if exact else 0, epoch_rng=saved.epoch_rng, now_rng=saved.now_rng,
            order_rng=saved.order_rng if fits else None,
            epoch_generators=saved.epoch_generators if fits else None,
            now_generators=saved.now_generators if fits else None,
            order_generators=saved.order_generators if fits else None,
            validation_follows=saved.validation_follows, validation_draws=saved.validation_draws,
            order_draws=saved.order_draws, order_generator_draws=saved.order_generator_draws)

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

    # -- elastic resume: another number of processes -------------------------------------------------------------
    def _plan_elastic(self, records: list[RankRecord], loader: Any, kind: LoaderKind) -> ResumePlan | None:
        """Plan a resume of a checkpoint written by another number of processes (or while reading such a rest):
        this rank's share of the rest of the saved epoch (or the next epoch, when it was used up), the RNG it starts
        from, and where Lightning's batch count moves to. What cannot be split is said, naming the cause."""
        first = records[0]
        rank, world = _rank_and_world()
        world_then = len(records)
        now_rng = self._rank_rng(records)
        saved_generators = first.now_generators
        gens = saved_generators if saved_generators is not None and len(saved_generators) == len(
            generators(loader)) else None  # the loader's own generators, for the next epoch's draw
        self._resumed = True
        if kind == LoaderKind.LOADER:  # the rank-0 loader state Lightning saved cannot apply at another size either
            self._owns_position = True
            if self._trainer is not None:
                self._trainer.fit_loop._combined_loader_states_to_load = []
        length = self._batches if kind in (LoaderKind.MAP, LoaderKind.LOADER) else None
        plan = ResumePlan(epoch=first.epoch + 1 if first.epoch_done else first.epoch, exact=False, skip=0,
                          consumed=0, samples=0, epoch_rng=None, now_rng=now_rng, order_rng=None,
                          epoch_generators=None, now_generators=gens, order_generators=None, validation_follows=False,
                          validation_draws=0, order_draws=None, order_generator_draws=0)
        sizes = f"on {world} process(es) a checkpoint written by {world_then}"
        if first.epoch_done or not first.mid_epoch:
            if first.epoch_done and length is not None:
                self._shift_to = length  # Lightning then counts the saved epoch finished, at this size too
            where = (f"at the end of epoch {first.epoch}: epoch {first.epoch + 1}" if first.epoch_done else
                     f"at the start of epoch {first.epoch}: it")
            self._rest_line = (f"resumed {sizes} {where} starts from its beginning, split among this run's"
                               f" {world} process(es). {self._elastic_tail(world_then, world, None)}")
            return plan
        rest: Rest | str
        if kind not in (LoaderKind.MAP, LoaderKind.LOADER) or length is None:
            rest = (first.order if isinstance(first.order, str) else
                    f"the training data is a {_describe(kind)}, whose position is its own state")
        elif self._trainer is not None and self._trainer.limit_train_batches not in (1.0, None):
            rest = (f"limit_train_batches={self._trainer.limit_train_batches} cuts the epoch short, so its rest"
                    " cannot be placed in this run's epoch")
        else:
            own = own_batch_sampler(loader)
            rest = plan_rest(records, dataset_size=len(loader.dataset), world=world, rank=rank,
                             batch_size=int(own.batch_size), drop_last=bool(own.drop_last))
        if isinstance(rest, str) or length is None:
            # (a stream without state restarts at any number of processes: resuming on the same one is no fix)
            restarts = kind == LoaderKind.ITERABLE or (kind == LoaderKind.OTHER and not has_state(loader))
            same = "" if restarts else f"resume on {world_then} process(es), or "
            warn(f"ResumeStateCallback: resumed {sizes}, and the rest of epoch {first.epoch} cannot be split among"
                 f" this run's processes: {rest}. Resumed: the model, the optimizer and the loop's epoch and step"
                 f" (epoch {first.epoch}, after {first.consumed} batch(es) per process of the checkpoint's job), and"
                 f" {self._rng_phrase(world_then, world)}. Not resumed: the data, which restarts from the beginning of"
                 " the epoch's order at this number of processes, so in this epoch some samples are trained twice and"
                 f" some not at all. To continue the epoch exactly, {same}read the data with a map-style DataLoader"
                 " whose sampler is torch's, Lightning's or torchdata's.", RuntimeWarning, rank_zero=True)
            return plan
        split = rest.split
        if split.per_rank == 0 or split.per_rank > length:  # nothing left (drop_last), or more than an epoch holds
            self._shift_to = length
            plan = dataclasses.replace(plan, epoch=first.epoch + 1)
            self._rest_line = (f"resumed {sizes} in epoch {first.epoch}, which has no full batch left for them"
                               f" ({rest.length - rest.consumed} sample(s) left out, as drop_last does): epoch"
                               f" {first.epoch + 1} starts from its beginning."
                               f" {self._elastic_tail(world_then, world, None)}")
            return plan
        self._shift_to = length - split.per_rank
        self._rest_start = (rest, now_rng, gens, length - split.per_rank)
        self._rest_line = self._rest_phrase(rest, sizes, world_then, world)
        return None

    def _rest_phrase(self, rest: Rest, sizes: str, world_then: int, world: int) -> str:
        split = rest.split
        spec = rest.order
        order = {"distributed": f"DistributedSampler's permutation, seed {spec.get('seed')}",
                 "wrapper": f"Lightning's DistributedSamplerWrapper, seed {spec.get('seed')}",
                 "random": "the RandomSampler's, drawn again from its saved state",
                 "sequential": "sequential"}.get(str(spec.get("kind")), str(spec.get("kind")))
        notes = []
        if rest.again:
            notes.append(f"the {rest.again} sample(s) read after the checkpoint's last optimizer step are read again"
                         " (their gradients were not saved)")
        if split.repeated:
            notes.append(f"{split.repeated} sample(s) of the last batch are repeated so that every process has one"
                         " (fewer samples were left than processes)")
        if split.dropped:
            notes.append(f"the last {split.dropped} sample(s) are left out (drop_last: not a full batch per process)")
        once = "so every sample of the epoch is trained once" if not (split.repeated or split.dropped) else (
            "so every other sample of the epoch is trained once")
        return (f"resumed {sizes} in epoch {rest.epoch}: {rest.consumed} of its {rest.length} samples were trained"
                f" before the checkpoint (the epoch's global order: {order}), and the other {split.remaining} are"
                f" split among this run's {world} process(es), {split.per_rank} batch(es) each, {once}"
                + "".join(f"; {n}" for n in notes) + f". {self._elastic_tail(world_then, world, rest)}")

    def _elastic_tail(self, world_then: int, world: int, rest: Rest | None) -> str:
        """The resume line's end: the global batch, the per-sample seeding, the RNG streams and the rest not
        restored."""
        parts = []
        trainer = self._trainer
        saved = self._saved_batch
        batch = _batches_of(self._loader)
        if saved is not None and saved[1] is not None and saved[2] is not None and batch is not None:
            accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
            then, now = world_then * saved[1] * saved[2], world * accumulate * batch
            change = self._accumulation_change
            if then == now:
                how = (f" (keep_global_batch: accumulate_grad_batches {change[0]} -> {change[1]})" if change else "")
                parts.append(f"Global batch: {now} samples per optimizer step, as before{how}, so the optimizer steps"
                             " read the same stretches of the epoch's order as the checkpoint's job would have")
            else:
                parts.append(f"Global batch: {then} samples per optimizer step then, {now} now (pass"
                             " ResumeStateCallback(keep_global_batch=True) to keep it): the optimizer steps per epoch"
                             " and the LR schedule's pace per sample change")
        if self._seeding is not None:
            parts.append(f"Per-sample seeding (seed {self._seeding.seed}) gives each sample the augmentation it had"
                         " whichever process reads it")
        parts.append(f"RNG: {self._rng_phrase(world_then, world)}; so random numbers drawn in training (dropout)"
                     " differ from an uninterrupted run's")
        missing = [m for m in self._not_restored() if "reduces gradients" not in m]
        if missing:
            parts.append(f"Not restored: {'; '.join(missing)}")
        return ". ".join(parts) + "."

    @staticmethod
    def _rng_phrase(world_then: int, world: int) -> str:
        if world == world_then:
            return "every rank continues its own RNG streams"

        def ranks(first: int, last: int) -> str:
            return f"rank {first}" if first == last else f"ranks {first}-{last}"

        kept = min(world, world_then)
        out = (f"{ranks(0, kept - 1)} {'continues' if kept == 1 else 'continue'} the RNG streams of the checkpoint's"
               f" {ranks(0, kept - 1)}")
        if world_then > world:
            return f"{out}, and those of its {ranks(world, world_then - 1)} end (they cannot be remapped)"
        return (f"{out}, and {ranks(world_then, world - 1)} {'starts' if world - world_then == 1 else 'start'} new"
                " streams seeded from (seed, step, rank)")

    def _rank_rng(self, records: list[RankRecord]) -> RngState:
        """The RNG this rank resumes with: its own saved streams if the checkpoint's job had this rank, else new ones
        seeded from (seed, step, rank), so no two ranks draw the same numbers and a rerun draws them again."""
        rank, _ = _rank_and_world()
        if rank < len(records):
            return records[rank].now_rng
        step = self._trainer.global_step if self._trainer is not None else 0
        saved = capture_rng()
        seed_global_rngs(sample_seed(f"rank {rank}", epoch=step, seed=self._seed))
        fresh = capture_rng()
        restore_rng(saved)
        return fresh

    def _keep_global_batch(self, batch_size: int | None) -> None:
        """keep_global_batch: set ``trainer.accumulate_grad_batches`` so that processes x accumulation x batch size
        is the checkpoint's (before training, and before ``estimated_stepping_batches`` is read)."""
        saved, trainer = self._saved_batch, self._trainer
        if not self.keep_global_batch or saved is None or trainer is None:
            return
        world_then, accumulate_then, batch_then = saved
        if accumulate_then is None or batch_then is None or batch_size is None:
            warn("ResumeStateCallback(keep_global_batch=True) cannot keep the global batch: the checkpoint does not say"
                 " its accumulate_grad_batches or batch size (written by an earlier version, or without a batch size);"
                 f" accumulate_grad_batches stays {trainer.accumulate_grad_batches}.", RuntimeWarning, rank_zero=True)
            self._saved_batch = None
            return
        _, world = _rank_and_world()
        accumulate = kept_accumulation(world_then=world_then, accumulate_then=accumulate_then, batch_then=batch_then,
                                       world=world, batch=batch_size)
        if accumulate == trainer.accumulate_grad_batches:
            return
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            raise ValueError(
                "ResumeStateCallback(keep_global_batch=True) sets accumulate_grad_batches, and this Trainer has a"
                " GradientAccumulationScheduler that sets it too. Fix: remove one of them.")
        before = self._accumulation_change[0] if self._accumulation_change else trainer.accumulate_grad_batches
        self._accumulation_change = (before, accumulate)
        trainer.accumulate_grad_batches = accumulate

    def _start_rest(self, rest: Rest, now_rng: RngState, gens: list[torch.Tensor] | None, position: int) -> Start:
        """The stream of an epoch's rest (see _plan_elastic): no order is drawn, the batches are given."""
        self._epoch = rest.epoch
        set_data_epoch(self._loader, rest.epoch)  # per-sample seeding's epoch, before workers start
        self._snapshots = {}
        self._fetched = 0
        self._handed.clear()
        self._fetched_digests.clear()
        self._set_generators(gens)
        self._now_rng = now_rng  # put back right before the first step (iterators draw base seeds before it)
        self._consumed = self._base = position
        self._samples = self._step_samples = 0
        self._stream_order = rest.order
        self._order_rng = self._order_generators = None
        self._epoch_rng = capture_rng()
        self._epoch_generators = self._get_generators()
        log.info("resuming epoch %d on another number of processes: %d batch(es) of its rest on this rank",
                 rest.epoch, rest.split.per_rank)
        if self._kind == LoaderKind.LOADER:
            give_batches(self._loader, rest.split.batches, self._handed)
            return 0
        return rest.split.batches

    # -- the data stream -----------------------------------------------------------------------------------------
    def _epoch_starts(self) -> Start:
        """Called when an epoch's data stream starts (before the iterator exists); returns batches to skip."""
        if self._draining:
            return 0
        self._drawn = None if self._kind == LoaderKind.MAP else set()  # until the iterator exists (MAP draws lazily)
        rest, self._rest_start = self._rest_start, None
        if rest is not None:
            return self._start_rest(*rest)
        live = self._live_iterator() if self._live_iterator is not None else None
        restore_batch_sampler(self._loader, live)  # a rest read by a stateful loader: its own batches from now on
        self._stream_order = self._draw_generators = None
        plan, self._plan = self._plan, None
        epoch = plan.epoch if plan is not None else self._loop_epoch()
        self._epoch = epoch
        set_data_epoch(self._loader, epoch)  # before workers start: they copy the sampler and dataset
        self._snapshots = {}
        self._fetched = 0
        self._handed.clear()
        self._fetched_digests.clear()
        if plan is not None and plan.exact and plan.epoch_rng is not None:
            restore_rng(plan.epoch_rng)  # the same permutation and worker seeds as before
            self._set_generators(plan.epoch_generators)
            self._epoch_rng = plan.epoch_rng
            self._epoch_generators = plan.epoch_generators
            if plan.order_rng is not None:  # the order is drawn from where it was, whatever draws precede it
                self._order_replay = OrderReplay(plan.order_rng, plan.order_generators, 0, 0)
            # ...and the next step draws what it would have drawn, after the validation that followed the save: its
            # loaders' draws counted at the save, or, when not known then, replayed as Lightning's restart makes them.
            self._now_rng = plan.now_rng
            if plan.validation_draws is not None:
                self._now_rng = _advanced(plan.now_rng, plan.validation_draws)
            else:
                self._replay_validation = plan.validation_follows
            self._consumed = self._base = plan.consumed
            self._samples = self._step_samples = plan.samples
            self._restored = (epoch, self._consumed, self._batches, self._samples)
            log.info("resuming mid-epoch %d after %d consumed batch(es)", epoch, self._consumed)
            return plan.skip
        if plan is not None:
            restore_rng(plan.now_rng)  # at an epoch boundary (or position lost): the epoch starts from here
            self._set_generators(plan.now_generators)
            if plan.order_draws is not None:
                # The uninterrupted run drew the new epoch's order after a known number of base-seed draws since the
                # save (the validation that followed it, the epoch's iterators); a resume may create iterators it
                # never reads, so the order (MAP) or else the first step is drawn from the save's RNG advanced by
                # exactly those.
                if self._kind == LoaderKind.MAP:
                    self._order_replay = OrderReplay(plan.now_rng, plan.now_generators, plan.order_draws,
                                                     plan.order_generator_draws)
                else:
                    self._now_rng = _advanced(plan.now_rng, plan.order_draws)
        self._consumed = self._base = self._samples = self._step_samples = 0
        self._epoch_rng = capture_rng()
        self._epoch_generators = self._get_generators()
        return 0

    def _on_order(self) -> None:
        """Right before the epoch's order is drawn: on a resume, set the RNG it is drawn from; always, remember it.

        A resume may draw the order more than once before training starts (Lightning reloading a loader, iterators
        whose workers prefetch at once): each draw starts from the same state, so the one that is read is right."""
        replay = self._order_replay
        if replay is not None:
            restore_rng(_advanced(replay.rng, replay.global_draws))
            self._set_generators(replay.generators)
            loader_generator = getattr(self._loader, "generator", None)
            for _ in range(replay.generator_draws if loader_generator is not None else 0):
                torch.empty((), dtype=torch.int64).random_(generator=loader_generator)
        self._order_rng = capture_rng()
        self._order_generators = self._get_generators()

    def _get_generators(self) -> list[torch.Tensor]:
        return [g.get_state() for g in generators(self._loader)]

    def _set_generators(self, states: list[torch.Tensor] | None) -> None:
        if states is not None:  # the count was checked against the loader in _plan_resume
            for g, state in zip(generators(self._loader), states, strict=True):
                g.set_state(state)

    def _loop_epoch(self) -> int:
        """Lightning's training epoch: the epochs its fit loop has processed."""
        return 0 if self._trainer is None else _processed(self._trainer.fit_loop.epoch_progress.current)

    def _on_iterator(self, it: Any) -> None:
        if self._draining:
            return
        self._drawn = None
        self._live_iterator = weakref.ref(it)

    def _position_now(self, it: Any) -> Any:
        if self._kind == LoaderKind.LOADER:
            return None if it is None else it.state_dict()
        return self._loader.dataset.state_dict()

    def _before_fetch(self, it: Any) -> None:
        # Lightning's fetcher reads one batch ahead of training only when the loader has no length; that batch's
        # fetch moves the stateful position past what was trained on. Keep the position before each fetch.
        if self._batches is None and self._kind in _STATEFUL:
            self._snapshots[self._fetched] = copy.deepcopy(self._position_now(it))

    def _after_fetch(self, batch: Any) -> None:
        self._fetched += 1
        if self._digests:  # on the host, in the main process: what the loader produced
            self._fetched_digests.append(digest_batch(batch))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._order_replay = None  # training has started: the epoch's order is the one drawn
        self._step_at_start = trainer.global_step
        if self._timer is not None:
            self._timer.batch_started(trainer.global_step)
        if self._now_rng is not None:
            restore_rng(self._now_rng)
            self._now_rng = None

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._timer is not None:
            self._timer.before_backward()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._timer is not None:
            self._timer.batch_ended(trainer.global_step)
        self._consumed += 1
        # (MAP: the sampler's batches; a stateful loader reading a given rest: those)
        indices = self._handed.popleft() if self._handed else None
        self._samples += len(indices) if indices is not None else batch_len(batch)
        if trainer.global_step != self._step_at_start:  # this batch ended an optimizer step
            self._step_samples = self._samples
        consumed_in_stream = self._consumed - self._base
        for k in [k for k in self._snapshots if k < consumed_in_stream]:
            del self._snapshots[k]
        data = self._fetched_digests.popleft() if self._fetched_digests else None
        audit = self._audit
        if audit is None or not self.audit:
            return
        if audit.root_id is None and trainer.global_rank == 0 and self._saved_since_start:
            root_id = _root_id(trainer, _checkpoint_root(trainer), read=False)  # (in memory once this job claimed)
            if root_id:
                audit.learned_root_id(root_id)
        step = StepDigest(trainer.current_epoch, batch_idx, self._step_at_start,
                          None if indices is None else digest_indices(indices),
                          data if data is not None else digest_batch(batch), None,
                          None if indices is None else (len(indices), digest_sample_set(indices)))
        # The parameters after the step: a change after the loss (to the gradients, the update) shows there.
        if self._sampler is None or self._sampler.module is not pl_module:
            self._sampler = StateSampler(pl_module)
        if audit.step(step, _loss_of(outputs), self._sampler()):
            self._report(audit)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._audit is not None and not self._audit.reported:
            self._report(self._audit)  # the run ended before replaying every step the interrupted attempt ran

    def _report(self, audit: ResumeAudit) -> None:
        result = audit.report()  # a collective: every rank reaches it at the same step
        if result is not None:
            rank_zero_info(result.line)

    # -- checkpoint ----------------------------------------------------------------------------------------------
    def _epoch_done(self) -> bool:
        trainer = self._trainer
        fetcher = None if trainer is None else getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is not None and fetcher.done:
            return True
        limit = None if trainer is None else trainer.num_training_batches
        if self._batches is not None:
            limit = self._batches if limit is None or limit == float("inf") else min(self._batches, int(limit))
        return limit is not None and limit != float("inf") and self._consumed >= limit

    def _loader_state(self) -> Any:
        if self._kind not in _STATEFUL:
            return None
        index = self._consumed - self._base
        if self._fetched > index and index in self._snapshots:
            return self._snapshots[index]  # the next unconsumed batch is already fetched: its position before
        it = self._live_iterator() if self._live_iterator is not None else None
        return copy.deepcopy(self._position_now(it))

    def state_dict(self) -> dict[str, Any]:
        # Lightning writes only global rank 0's callback state but calls this on every rank: gather them all.
        done = self._epoch_done() if self._kind is not None else False
        follows = self._a_validation_follows()
        validation_draws = self._validation_draws() if follows else 0
        order_draws, order_generator_draws = None, 0
        if done and validation_draws is not None:  # what the run draws until the next epoch's order
            fresh, order_generator_draws = self._next_iterator_draws()
            order_draws = validation_draws + fresh
        mine = RankRecord(
            kind=self._kind, epoch=self._epoch, consumed=self._consumed, samples=self._samples, epoch_done=done,
            batches=self._batches, batch_size=self._batch_size, num_workers=self._num_workers,
            sampler=sampler_facts(self._loader) if self._loader is not None else {},
            loader_state=self._loader_state(), epoch_rng=self._epoch_rng, now_rng=capture_rng(),
            epoch_generators=self._epoch_generators, order_rng=self._order_rng,
            order_generators=self._order_generators,
            now_generators=self._get_generators() if self._loader is not None else [],
            validation_follows=follows, validation_draws=validation_draws, order_draws=order_draws,
            order_generator_draws=order_generator_draws, order=self._order_now(), step_samples=self._step_samples)
        if follows:
            self._watch_validation = self._trainer.global_step if self._trainer is not None else 0
        if self._audit is not None:
            self._audit.saved()
            self._saved_since_start = True
        ranks = _gather(mine.to_dict())
        seeding = self._seeding
        accumulate = self._trainer.accumulate_grad_batches if self._trainer is not None else None
        return {"format": FORMAT, "world_size": len(ranks), "ranks": ranks, "per_sample_seeding": seeding is not None,
                "sample_seed": seeding.seed if seeding is not None else None, "accumulate_grad_batches": accumulate,
                "batch_size": _batches_of(self._loader)}

    def _order_now(self) -> OrderSpec | str | None:
        """The global order of the epoch being read (what a resume on another number of processes splits the rest
        of), or why it has none."""
        if self._stream_order is not None:
            return self._stream_order
        if self._loader is None or self._kind is None:
            return None
        if self._kind not in (LoaderKind.MAP, LoaderKind.LOADER):
            return f"the training data is a {_describe(self._kind)}, which has no global order of samples"
        if self._kind == LoaderKind.MAP:  # drawn when the stream started: the RNG and generators right before it
            return describe_order(self._loader, rng=self._order_rng, states=self._order_generators)
        live = self._live_iterator() if self._live_iterator is not None else None
        return describe_order(self._loader, rng=None, iterator=live,
                              states=self._draw_generators if self._draw_generators is not None
                              else self._epoch_generators)

    def _before_wrapper_draw(self) -> None:
        """A ``DistributedSamplerWrapper`` of a stateful loader is about to draw its inner sampler's order: the
        generators it draws from, for the epoch's order (see _order_now)."""
        if not self._draining:
            self._draw_generators = self._get_generators()

    def _a_validation_follows(self) -> bool:
        """Whether a validation runs between this save and the next training step: a save from a training batch's
        end (before Lightning's validation check) at a validation point. A resume skips that validation."""
        trainer = self._trainer
        if trainer is None or not trainer.training or getattr(trainer, "sanity_checking", False):
            return False
        epoch_loop = trainer.fit_loop.epoch_loop
        total = epoch_loop.batch_progress.total
        if total.completed != _processed(total) - 1:  # not inside on_train_batch_end: the validation already ran
            return False
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is None:  # set while a training batch runs
            return False
        try:
            follows = bool(epoch_loop._should_check_val_fx(fetcher))
        except Exception:  # a Lightning without this internal: nothing to account for
            return False
        return follows and not epoch_loop._skip_next_val

    def _validation_draws(self) -> int | None:
        """Base-seed draws from the global RNG that the next validation makes: one per validation loader that will
        create an iterator (not a live persistent one) and has no generator of its own. None when the validation
        loaders are not set up yet (they are at their first validation)."""
        loaders = getattr(self._trainer, "val_dataloaders", None) if self._trainer is not None else None
        if loaders is None:
            return None
        if isinstance(loaders, DataLoader):
            loaders = [loaders]
        elif isinstance(loaders, dict):
            loaders = list(loaders.values())
        return sum(1 for dl in loaders if isinstance(dl, DataLoader) and dl.generator is None
                   and not _has_persistent_iterator(dl))

    def _next_iterator_draws(self) -> tuple[int, int]:
        """The base-seed draws the next epoch's training iterators make before its order is drawn: (from the global
        RNG, from the loader's own generator). None when a persistent iterator is reset for it (no new base seed);
        when Lightning reloads the loader for that epoch it creates an iterator when it reloads and another one to run
        it: two base seeds, and with workers the first one's order too (its workers prefetch at once)."""
        loader, trainer = self._loader, self._trainer
        if not isinstance(loader, DataLoader) or trainer is None:
            return 0, 0
        every = int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0)
        last = getattr(trainer.fit_loop, "_last_train_dl_reload_epoch", float("-inf"))
        reloads = every > 0 and trainer.current_epoch + 1 - last >= every
        count = (3 if loader.num_workers else 2) if reloads else 0 if _has_persistent_iterator(loader) else 1
        return (0, count) if loader.generator is not None else (count, 0)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timer is not None:
            self._timer.paused()  # a validation's time is neither a training step's nor a fetch's
        if self._watch_validation is not None:
            self._val_rng = capture_rng()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timer is not None:
            self._timer.resumed()
        step, self._watch_validation = self._watch_validation, None
        before, self._val_rng = self._val_rng, None
        if step is None or before is None or self._warned_validation:
            return
        after = capture_rng()
        if any(not _same(before.get(k), after.get(k)) for k in ("torch", "numpy", "python")):
            self._warned_validation = True
            warn(f"the validation that ran right after the checkpoint of step {step} drew random numbers from the"
                 " global RNG (torch, NumPy or Python: in validation_step, or a validation loader that shuffles); a"
                 " run resumed from that checkpoint skips this validation (as Lightning does), so from then on its"
                 " random numbers, and its training, differ from this run's. To resume exactly, give validation its"
                 " own torch.Generator (DataLoader(generator=...), and a NumPy Generator) or draw nothing in it.",
                 RuntimeWarning)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_format(state_dict)
        # Per-sample seeding continues with the checkpoint's seed (keys added to format 2 later: absent, the run that
        # wrote it did not seed per sample), unless seed_everything gave this run another one.
        saved_seed = state_dict.get("sample_seed")
        self._saved_seeding = (bool(state_dict.get("per_sample_seeding", False)),
                               None if saved_seed is None else int(saved_seed))
        if self.per_sample_seeding and saved_seed is not None and self._explicit_seed is None:
            self._seed = int(saved_seed)
        rank, world = _rank_and_world()
        records = [RankRecord.from_dict(raw) for raw in state_dict.get("ranks", [])]
        if not records:
            return
        accumulate, batch = state_dict.get("accumulate_grad_batches"), state_dict.get("batch_size")
        self._saved_batch = (len(records), None if accumulate is None else int(accumulate),
                             None if batch is None else int(batch))
        # Set before configure_optimizers reads it (assuming the batch size is as it was; _track checks it again).
        self._keep_global_batch(self._saved_batch[2])
        if len(records) == world and not records[rank].reads_a_rest:
            self._pending = records[rank]
            return
        # Another number of processes (or the rest of an epoch read after such a resume): every rank's record decides
        # what is left of the epoch, and its order is split among this run's processes once the loader is known.
        self._elastic = records


def _run_seed() -> tuple[int, int | None]:
    """This run's per-sample seed, and the one ``seed_everything`` gave (None when it was not called): that one, or
    rank 0's ``torch.initial_seed()`` (every rank must seed alike; without any seeding it is random per process)."""
    given = os.environ.get("PL_GLOBAL_SEED")  # what seed_everything sets, in this process and those it starts
    try:
        explicit = None if given is None else int(given)
    except ValueError:
        explicit = None
    if explicit is not None:
        return explicit, explicit
    return int(_gather(torch.initial_seed())[0]), None


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss ``training_step`` returned (as Lightning hands it to ``on_train_batch_end``), detached."""
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs.detach()
    return None


def _checkpoint_root(trainer: Trainer) -> str | None:
    """Where the attempt records go: the first ModelCheckpoint's folder (the checkpoint root), else the folder of
    the checkpoint resumed from."""
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    if dirpath:
        return str(dirpath)
    path = trainer.ckpt_path
    if path is None:
        return None
    from lightning_resilient.io import paths as _paths

    return _paths.dirname(str(path)) or None


def _plugin_of(trainer: Trainer) -> Any:
    """The Trainer's AtomicCheckpointIO (under any wrapper), or None."""
    from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO

    plugin = trainer.strategy.checkpoint_io
    while not isinstance(plugin, AtomicCheckpointIO) and hasattr(plugin, "checkpoint_io"):  # AsyncCheckpointIO
        plugin = plugin.checkpoint_io
    return plugin if isinstance(plugin, AtomicCheckpointIO) else None


def _spool(trainer: Trainer, store: Store | None) -> str | None:
    """This node's spool of the attempt records of ``store`` (an object store; None on local disk), under the plugin's
    local tier when it has one (see ``attempts.spool_folder``). None when it cannot be made (warned: the records
    then reach the store at its flushes only)."""
    from lightning_resilient.io.store import LocalStore
    from lightning_resilient.state.attempts import spool_folder

    if store is None or isinstance(store, LocalStore):
        return None
    plugin = _plugin_of(trainer)
    try:
        return spool_folder(store.url(), getattr(plugin, "local_tier", None))
    except OSError as exc:
        log.warning("the resume audit cannot keep its records on this node (%s): a kill loses the steps since the"
                    " record's last flush to %s", exc, store.url())
        return None


def _root_id(trainer: Trainer, url: str | None, *, read: bool) -> str | None:
    """The incarnation of the checkpoint root ``url`` (its pointer's ``root_id``): as the plugin's root holds it once
    this job claimed, else (``read``) from the pointer; None when not known (a fresh root, another plugin)."""
    plugin = _plugin_of(trainer)
    if plugin is None or url is None:
        return None
    try:
        root = plugin.root(url)
        known = root.fence.root_id
        if known or not read:
            return str(known) if known else None
        pointer, _ = root.read_pointer()
        return pointer.root_id if pointer is not None and pointer.root_id else None
    except Exception as exc:  # the audit never stops training
        log.debug("could not read the root id of %s: %s", url, exc)
        return None


def _open_store(trainer: Trainer, url: str) -> Store | None:
    """The root's store, with the plugin's storage options and retries where it is ours; None (warned) on failure."""
    from lightning_resilient.io.catalog import normalize
    from lightning_resilient.io.retry import RetryPolicy
    from lightning_resilient.io.store import open_store

    plugin = _plugin_of(trainer)
    options, retry = (plugin.storage_options, plugin.retry) if plugin is not None else ({}, RetryPolicy())
    try:
        return open_store(normalize(url), options, retry)
    except Exception as exc:  # the audit never stops training
        log.warning("the resume audit cannot open %s (%s); this attempt is not recorded", url, exc)
        return None


def _last_load(trainer: Trainer) -> Any:
    """What ``AtomicCheckpointIO`` (the Trainer's, under any wrapper) last loaded (``LoadStats``), or None."""
    plugin = trainer.strategy.checkpoint_io
    while not hasattr(plugin, "last_load") and hasattr(plugin, "checkpoint_io"):  # AsyncCheckpointIO
        plugin = plugin.checkpoint_io
    return getattr(plugin, "last_load", None)


def _describe(kind: LoaderKind | str | None) -> str:
    return _DESCRIBE[kind] if isinstance(kind, LoaderKind) else str(kind)


def _processed(tracker: Any) -> int:
    """``processed`` of a Lightning progress tracker: the trackers the loops use have it, their declared type not."""
    return int(tracker.processed)


def _has_persistent_iterator(loader: DataLoader[Any]) -> bool:
    """Whether the loader holds a persistent iterator that its next ``iter()`` resets (no new base-seed draw)."""
    return bool(loader.persistent_workers and loader.num_workers and getattr(loader, "_iterator", None) is not None)


def _advanced(state: RngState, draws: int) -> RngState:
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


def _rebuilds_buckets(trainer: Trainer) -> bool:
    """DDP rebuilds its gradient buckets after its first iteration (unless ``find_unused_parameters``): with more
    than two processes the first step after a resume then sums gradients in another order than the uninterrupted
    run did at that step, so the runs agree up to float rounding, not bit for bit (PyTorch, gloo and NCCL alike)."""
    kwargs = getattr(trainer.strategy, "_ddp_kwargs", None)
    return kwargs is not None and trainer.world_size > 2 and not kwargs.get("find_unused_parameters")


def _warn_if_ddp_rebuilds_buckets(trainer: Trainer) -> None:
    if not _rebuilds_buckets(trainer):
        return
    warn(f"resumed under DDP with {trainer.world_size} processes: DDP rebuilds its gradient buckets after its first"
         " iteration, so the first step after this resume reduces gradients in another order than the uninterrupted"
         " run did, and the runs agree up to float rounding, not bit for bit. For bit-identical resumes use"
         " DDPStrategy(find_unused_parameters=True), which keeps the buckets as built.", RuntimeWarning, rank_zero=True)


def _batches_of(loader: Any) -> int | None:
    """Samples per batch of a DataLoader: its ``batch_size``, or its batch sampler's (a loader Lightning re-created
    for DDP around its own batch sampler has ``batch_size=None``); None without automatic batching."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(own_batch_sampler(loader), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _shift_batches(progress: Any, to: int) -> None:
    """Move Lightning's count of the epoch's batches (the epoch loop's ``batch_progress``, current and total alike)
    so that ``current.ready`` is ``to``, keeping the counters' differences (which say where in a batch it was
    saved)."""
    delta = to - int(progress.current.ready)
    for tracker in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(tracker, name, getattr(tracker, name) + delta)


def _same(a: Any, b: Any) -> bool:
    """Equality of two captured RNG states (nested lists of numbers and tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
