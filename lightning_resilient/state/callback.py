"""``ResumeStateCallback``: RNG state (per rank) and the data-loader position, so a resumed run is bit-identical.

Stock Lightning saves no RNG state, and a mid-epoch resume with a plain DataLoader replays the head of the
epoch and never sees its tail. This callback records, per rank:

- the RNG states at the moment the epoch's data stream starts (they decide the shuffle permutation and the
  worker seeds) and the RNG states at the moment of the save;
- the data position: epoch, batches and samples consumed in it, the sampler's epoch and seed, and for stateful
  loaders and datasets their own state as of the last consumed batch.

On resume it puts back the epoch-start RNG states when Lightning creates the data iterator, moves the loader to
the next unseen batch (map-style: skipped at the batch-sampler level, no sample is read; stateful: its state is
loaded), and puts back the save-time RNG states before the next training step.

This module is the adapter between Lightning and the parts that do that work: it holds the settings, wraps the
Trainer's loops for the fit (and gives them back), and routes each hook to the collaborator that owns the job:

- ``_stream.py`` (``DataStream``): the tracked loader and the position of its current stream;
- ``_planner.py`` (``ResumePlanner``): the checkpoint's records and the resume planned from them (the same or another
  number of processes, ``keep_global_batch``);
- ``_seed_control.py`` (``SeedingControl``): the per-sample seed and the seeding installed on the dataset;
- ``_draws.py`` (``ValidationDraws``): the base-seed draws around a save, and the validation that follows it;
- ``_audit_link.py`` (``AuditLink``): the resume audit and the goodput ledger;
- ``_messages.py`` (``ResumeMessages``): the fit-start warnings about the data and the resume line;
- ``_loops.py``: Lightning's loop counters, read and corrected.

How the loader is seen (its kind, its epoch starts, its fetches) is in ``_loader.py``; what is saved per rank, and
what a resume plans from it, in ``_record.py``. The collaborators are told what they need (the Trainer, the
settings, this process's rank and the job's size) by each call, and hold no reference to the callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilient._checks import check_bool, check_number, check_optional_int
from lightning_resilient._namespaces import require_lightning_pytorch
from lightning_resilient.io.fit_check import add_fit_start_check
from lightning_resilient.state import _loops
from lightning_resilient.state._audit_link import AuditLink, checkpoint_root
from lightning_resilient.state._draws import ValidationDraws
from lightning_resilient.state._loader import LoaderKind, classify
from lightning_resilient.state._messages import ResumeMessages, warn_if_ddp_rebuilds_buckets
from lightning_resilient.state._planner import ResumePlanner
from lightning_resilient.state._record import FORMAT, RankRecord, check_format
from lightning_resilient.state._seed_control import SeedingControl
from lightning_resilient.state._stream import DataStream, samples_per_batch
from lightning_resilient.state.rng import restore_rng

__all__ = ["ResumeStateCallback"]

_ABSENT = object()  # an attribute a wrap did not replace (the class's own method)


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
        self._wrapped: list[tuple[Any, str, Any, Any]] = []  # (owner, name, what it replaced, the wrap)
        self._stream = DataStream()
        self._planner = ResumePlanner()
        self._seeding = SeedingControl()
        self._draws = ValidationDraws()
        self._link = AuditLink()
        self._messages = ResumeMessages()

    @property
    def state_key(self) -> str:
        return "ResumeStateCallback"

    @property
    def _elastic(self) -> list[RankRecord] | None:
        """Every rank's saved record of a checkpoint of another number of processes, until the loader is known."""
        return self._planner.elastic

    # -- wiring ------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_lightning_pytorch(trainer, "ResumeStateCallback")
        if stage != "fit":
            return
        self._trainer = trainer
        self._stream.start_fit(trainer)
        self._planner.start_fit()
        self._draws.start_fit()
        self._messages.start_fit()
        self._link.start_fit(trainer, ledger=self.ledger)
        self._seeding.start_fit(enabled=self.per_sample_seeding, gather=_gather)
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
            if self._planner.owns_position:
                fit_loop._combined_loader_states_to_load = []  # ...which replaces Lightning's rank-0 copy
            load_states()

        self._wrap(fit_loop, "_load_combined_loader_states", track_then_load_states)
        self._wrap(fit_loop.epoch_loop, "reset", self._reset_epoch_loop)
        self._wrap(fit_loop.epoch_loop.val_loop, "increment_progress_to_evaluation_end",
                   self._stream.replay_skipped_validation)
        self._wrap(trainer, "_teardown", self._teardown_then_release)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After every callback's setup: a wrapper another callback put on save_checkpoint in its setup
        # (CheckpointCadence) is inside ours, so ours, removed first (in _teardown), leaves theirs as they left it.
        if self._link.timer is not None:
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
        self._link.failed(exception)

    def _timed_save(self, save: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._link.timed_save(save, args, kwargs, trainer=self._trainer,
                                     straggler_factor=self.straggler_factor, gather=_gather)

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
        self._link.close()
        self._stream.release()
        self._seeding.release()
        for owner, name, before, wrapped in reversed(self._wrapped):
            if owner.__dict__.get(name) is wrapped:
                if before is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, before)
        self._wrapped = []
        self._trainer = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickled for ddp_spawn, deep-copied with a Trainer) carries the settings and the saved position, not
        # the objects of a fit in progress: the Trainer and the loop wraps here, the loader, the live iterator, the
        # audit and the installed seeding in the collaborators (each drops its own).
        return {**self.__dict__, "_trainer": None, "_wrapped": []}

    # -- the training loader -------------------------------------------------------------------------------------
    def _track(self, combined: Any) -> None:
        """Lightning built (or rebuilt) the training loader: track it, seed it, and plan the resume from the
        checkpoint's records."""
        loaders = list(getattr(combined, "flattened", []) or [])
        stream, planner, trainer = self._stream, self._planner, self._trainer
        if len(loaders) == 1 and loaders[0] is stream.loader:
            return
        pending, elastic = planner.take()
        rank, world = _rank_and_world()
        if len(loaders) != 1:
            stream.forget()
            self._messages.warn_several_loaders(len(loaders))
            if pending is not None:
                restore_rng(pending.now_rng)
            elif elastic is not None:
                restore_rng(planner.rank_rng(elastic, rank, trainer, self._seeding.seed))
            return
        loader = loaders[0]
        kind = classify(loader)
        stream.track(loader, kind,
                     digests=self.audit and trainer is not None and checkpoint_root(trainer) is not None)
        if self.per_sample_seeding:
            self._seeding.apply(loader)
        self._messages.warn_about_the_data(stream, self._seeding, per_sample_seeding=self.per_sample_seeding)
        if planner.saved_batch is not None:  # a resume: keep_global_batch with this loader's batch size
            planner.keep_global_batch(trainer, samples_per_batch(loader), enabled=self.keep_global_batch, world=world)
        stream.hook(distributed_order=self.keep_global_batch and world == 1)
        if elastic is not None:
            tail = self._messages.elastic_tail(
                len(elastic), world, trainer=trainer, batch=samples_per_batch(loader), saved_batch=planner.saved_batch,
                accumulation_change=planner.accumulation_change, seeding=self._seeding, missing=self._not_restored())
            stream.plan = planner.plan_elastic(elastic, stream, trainer, rank=rank, world=world,
                                               seed=self._seeding.seed, tail=tail)
        else:
            stream.plan = planner.plan_resume(pending, stream, trainer) if pending is not None else None
        if kind == LoaderKind.OTHER and stream.plan is not None:
            restore_rng(stream.plan.now_rng)
            stream.plan = None

    def _not_restored(self) -> list[str]:
        return self._messages.not_restored(self._stream, self._seeding, self._trainer,
                                           per_sample_seeding=self.per_sample_seeding)

    def _reset_epoch_loop(self, reset: Callable[[], None]) -> None:
        """Lightning warns on every mid-epoch resume that the loader is not resumable; when this callback restored
        the position, that is wrong, and one line of ours says what was restored instead.

        After a resume on another number of processes, Lightning's count of the epoch's batches (per process, as the
        checkpoint's job counted them) is first moved to where this run's rest of the epoch starts, so the epoch ends
        after that rest, with the accumulation boundaries and the last-batch step where they belong."""
        planner = self._planner
        shift, planner.shift_to = planner.shift_to, None
        if shift is not None and self._trainer is not None:
            _loops.shift_batches(self._trainer.fit_loop.epoch_loop.batch_progress, shift)
        restored, self._stream.restored = self._stream.restored, None
        line, planner.rest_line = planner.rest_line, None
        if restored is None and line is None:
            reset()
            return
        _loops.reset_without_the_warning(reset)
        if line is None and restored is not None:
            line = self._messages.restored_line(restored, self._seeding, self._not_restored())
        rank_zero_info(f"ResumeStateCallback: {line}")

    # -- training ------------------------------------------------------------------------------------------------
    # The corrections of Lightning's loops, as the callback's own attributes (a test turns each off to show it
    # matters).
    _count_the_epoch_after_a_last_batch_save = staticmethod(_loops.count_the_epoch_after_a_last_batch_save)
    _finish_the_epoch_saved_at_its_end = staticmethod(_loops.finish_the_epoch_saved_at_its_end)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count_the_epoch_after_a_last_batch_save(trainer)
        self._finish_the_epoch_saved_at_its_end(trainer)
        planner = self._planner
        if planner.resumed:
            warn_if_ddp_rebuilds_buckets(trainer)
        if planner.owns_position:
            # Restored after the early loader build of the #20550 path: never apply rank 0's copy on top.
            trainer.fit_loop._combined_loader_states_to_load = []
        if planner.pending is not None:  # no training loader was built (e.g. limit_train_batches=0)
            restore_rng(planner.pending.now_rng)
            planner.pending = None
        if self.audit or self.ledger:
            rank, world = _rank_and_world()
            self._link.start(trainer, self._stream, self._seeding, rank=rank, world=world, gather=_gather,
                             compare=self.audit, flush_seconds=self.audit_flush_seconds,
                             flush_steps=self.audit_flush_steps)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._link.batch_started(trainer.global_step)
        self._stream.batch_started()  # the resumed RNG back, after every other draw before the step

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._link.before_backward()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._link.batch_ended(trainer.global_step)
        indices, data = self._stream.batch_ended(batch, step_ended=trainer.global_step != self._link.step_at_start)
        if self.audit:
            self._link.record_step(trainer, pl_module, outputs, batch, batch_idx, indices=indices, data=data)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._link.train_ended()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._link.paused()
        self._draws.validation_started()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._link.resumed()
        self._draws.validation_ended()

    # -- checkpoint ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Lightning writes only global rank 0's callback state but calls this on every rank: gather them all.
        stream, trainer = self._stream, self._trainer
        done = stream.epoch_done() if stream.kind is not None else False
        mine = stream.record(epoch_done=done, draws=self._draws.at_save(trainer, stream.loader, epoch_done=done))
        self._link.saved()
        ranks = _gather(mine.to_dict())
        accumulate = trainer.accumulate_grad_batches if trainer is not None else None
        return {"format": FORMAT, "world_size": len(ranks), "ranks": ranks, **self._seeding.saved_fields(),
                "accumulate_grad_batches": accumulate, "batch_size": samples_per_batch(stream.loader)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_format(state_dict)
        self._seeding.load(state_dict, enabled=self.per_sample_seeding)
        rank, world = _rank_and_world()
        self._planner.load(state_dict, self._trainer, rank=rank, world=world, keep_global_batch=self.keep_global_batch)
