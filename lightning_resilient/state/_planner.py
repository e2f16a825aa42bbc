"""What a resume does with the records ``ResumeStateCallback`` saved in a checkpoint.

:class:`ResumePlanner` owns the checkpoint's records from the moment Lightning loads the callback's state until the
training loader is known: this rank's own record when the job has as many processes as the checkpoint's (checked
against the loader, a stateful position loaded, a :class:`~lightning_resilient.state._record.ResumePlan` made:
:meth:`ResumePlanner.plan_resume`), or every rank's when it has another number (the rest of the saved epoch split
among this run's ranks through ``elastic.py``: :meth:`ResumePlanner.plan_elastic`, with the RNG a new rank starts
from). It also owns ``keep_global_batch`` (``accumulate_grad_batches`` set from the checkpoint's global batch), the
move of Lightning's batch count a resume on another number of processes needs, and that resume's line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_resilient._warnings import warn
from lightning_resilient.state._loader import LoaderKind, generators, has_state, own_batch_sampler, sampler_facts
from lightning_resilient.state._messages import FIX, rng_phrase
from lightning_resilient.state._record import RankRecord, ResumePlan
from lightning_resilient.state._stream import STATEFUL, DataStream, RestStart, describe
from lightning_resilient.state.elastic import Rest, kept_accumulation, plan_rest
from lightning_resilient.state.rng import RngState, capture_rng, restore_rng
from lightning_resilient.state.seeding import sample_seed, seed_global_rngs

__all__ = ["ResumePlanner"]


class ResumePlanner:
    """The checkpoint's records, until the loader is known, and the resume planned from them."""

    def __init__(self) -> None:
        self.pending: RankRecord | None = None  # this rank's saved record, until the loader is known
        # Every rank's saved record when this run has another number of processes (or the save was reading a rest),
        # until the loader is known.
        self.elastic: list[RankRecord] | None = None
        self.resumed = False  # this fit restored a saved record
        self.owns_position = False  # our per-rank loader state replaces Lightning's rank-0 copy
        # keep_global_batch: (world size, accumulate_grad_batches, batch_size) of the checkpoint's job, and the
        # change made to this run's accumulate_grad_batches ((then, now); None: none).
        self.saved_batch: tuple[int, int | None, int | None] | None = None
        self.accumulation_change: tuple[int, int] | None = None
        # A resume on another number of processes: the batch count Lightning's epoch loop is moved to, and what the
        # resume line says.
        self.shift_to: int | None = None
        self.rest_line: str | None = None

    def start_fit(self) -> None:
        self.owns_position = False
        self.resumed = False
        self.elastic = self.shift_to = self.rest_line = None
        self.saved_batch = self.accumulation_change = None

    def load(self, state_dict: Mapping[str, Any], trainer: Trainer | None, *, rank: int, world: int,
             keep_global_batch: bool) -> None:
        """Keep the checkpoint's records (``state_dict``: the callback's saved state, its format checked) until the
        loader is known."""
        records = [RankRecord.from_dict(raw) for raw in state_dict.get("ranks", [])]
        if not records:
            return
        accumulate, batch = state_dict.get("accumulate_grad_batches"), state_dict.get("batch_size")
        self.saved_batch = (len(records), None if accumulate is None else int(accumulate),
                            None if batch is None else int(batch))
        # Set before configure_optimizers reads it (assuming the batch size is as it was; checked again when the
        # loader is tracked).
        self.keep_global_batch(trainer, self.saved_batch[2], enabled=keep_global_batch, world=world)
        if len(records) == world and not records[rank].reads_a_rest:
            self.pending = records[rank]
            return
        # Another number of processes (or the rest of an epoch read after such a resume): every rank's record decides
        # what is left of the epoch, and its order is split among this run's processes once the loader is known.
        self.elastic = records

    def take(self) -> tuple[RankRecord | None, list[RankRecord] | None]:
        """The records a newly tracked loader plans from (each used once)."""
        pending, self.pending = self.pending, None
        elastic, self.elastic = self.elastic, None
        return pending, elastic

    def keep_global_batch(self, trainer: Trainer | None, batch_size: int | None, *, enabled: bool,
                          world: int) -> None:
        """keep_global_batch: set ``trainer.accumulate_grad_batches`` so that processes x accumulation x batch size
        is the checkpoint's (before training, and before ``estimated_stepping_batches`` is read)."""
        saved = self.saved_batch
        if not enabled or saved is None or trainer is None:
            return
        world_then, accumulate_then, batch_then = saved
        if accumulate_then is None or batch_then is None or batch_size is None:
            warn("ResumeStateCallback(keep_global_batch=True) cannot keep the global batch: the checkpoint does not say"
                 " its accumulate_grad_batches or batch size (written by an earlier version, or without a batch size);"
                 f" accumulate_grad_batches stays {trainer.accumulate_grad_batches}.", RuntimeWarning, rank_zero=True)
            self.saved_batch = None
            return
        accumulate = kept_accumulation(world_then=world_then, accumulate_then=accumulate_then, batch_then=batch_then,
                                       world=world, batch=batch_size)
        if accumulate == trainer.accumulate_grad_batches:
            return
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            raise ValueError(
                "ResumeStateCallback(keep_global_batch=True) sets accumulate_grad_batches, and this Trainer has a"
                " GradientAccumulationScheduler that sets it too. Fix: remove one of them.")
        before = self.accumulation_change[0] if self.accumulation_change else trainer.accumulate_grad_batches
        self.accumulation_change = (before, accumulate)
        trainer.accumulate_grad_batches = accumulate

    def _own_the_position(self, trainer: Trainer | None) -> None:
        # The per-rank state (or a fresh start, if it cannot be used) replaces the rank-0 copy that Lightning saved
        # under loops; applying both would apply a position twice.
        self.owns_position = True
        if trainer is not None:
            trainer.fit_loop._combined_loader_states_to_load = []

    # -- the same number of processes ----------------------------------------------------------------------------
    def plan_resume(self, saved: RankRecord, stream: DataStream, trainer: Trainer | None) -> ResumePlan:
        """Check the saved record against the tracked loader, load a stateful position, and say what the first epoch
        stream must do."""
        loader, kind = stream.loader, stream.kind
        assert kind is not None
        consumed, done, mid = saved.consumed, saved.epoch_done, saved.mid_epoch
        problem = None
        if saved.kind != kind:
            problem = f"the training data was a {describe(saved.kind)} then and is a {describe(kind)} now"
        elif kind in (LoaderKind.MAP, LoaderKind.LOADER) and saved.batches is not None and (
                saved.batches != stream.batches or saved.batch_size != stream.batch_size):
            problem = (f"the training loader changed since the checkpoint ({saved.batches} batches of"
                       f" {saved.batch_size} then, {stream.batches} of {stream.batch_size} now)")
        elif kind == LoaderKind.LOADER and saved.num_workers != stream.num_workers:
            problem = (f"the training loader's num_workers changed since the checkpoint ({saved.num_workers}"
                       f" then, {stream.num_workers} now) and its saved state holds one state per worker")
        elif saved.now_generators is not None and len(saved.now_generators) != len(generators(loader)):
            problem = ("the training loader's samplers changed since the checkpoint"
                       f" ({len(saved.now_generators)} random generator(s) then, {len(generators(loader))} now)")
        elif (seed := saved.sampler.get("seed")) is not None and (
                (now := sampler_facts(loader).get("seed")) is not None and seed != now):
            problem = f"the sampler's seed changed since the checkpoint ({seed} then, {now} now)"
        if problem is not None and mid:
            ends = (f" (Lightning still counts the {consumed} batch(es) trained before the save, so this epoch ends"
                    " that many batches early)" if stream.batches is not None else "")
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
                 f" iterable, so the {consumed} batch(es) already trained on in this epoch are seen again. {FIX}",
                 RuntimeWarning)
        exact = mid and problem is None and kind in (LoaderKind.MAP, *STATEFUL)
        state = saved.loader_state if problem is None else None
        if kind == LoaderKind.LOADER:
            self._own_the_position(trainer)
        if kind in STATEFUL and state is not None:
            stream.load_position(state, epoch=saved.epoch, epoch_done=done)
        self.resumed = True
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

    # -- another number of processes -----------------------------------------------------------------------------
    def plan_elastic(self, records: list[RankRecord], stream: DataStream, trainer: Trainer | None, *, rank: int,
                     world: int, seed: int, tail: str) -> ResumePlan | None:
        """Plan a resume of a checkpoint written by another number of processes (or while reading such a rest):
        this rank's share of the rest of the saved epoch (or the next epoch, when it was used up; then the plan, else
        ``stream.rest_start`` is set and None returned), the RNG it starts from, and where Lightning's batch count
        moves to. What cannot be split is said, naming the cause. ``tail``: the end of the resume line
        (``ResumeMessages.elastic_tail``)."""
        loader, kind = stream.loader, stream.kind
        first = records[0]
        world_then = len(records)
        now_rng = self.rank_rng(records, rank, trainer, seed)
        saved_generators = first.now_generators
        gens = saved_generators if saved_generators is not None and len(saved_generators) == len(
            generators(loader)) else None  # the loader's own generators, for the next epoch's draw
        self.resumed = True
        if kind == LoaderKind.LOADER:  # the rank-0 loader state Lightning saved cannot apply at another size either
            self._own_the_position(trainer)
        length = stream.batches if kind in (LoaderKind.MAP, LoaderKind.LOADER) else None
        plan = ResumePlan(epoch=first.epoch + 1 if first.epoch_done else first.epoch, exact=False, skip=0,
                          consumed=0, samples=0, epoch_rng=None, now_rng=now_rng, order_rng=None,
                          epoch_generators=None, now_generators=gens, order_generators=None, validation_follows=False,
                          validation_draws=0, order_draws=None, order_generator_draws=0)
        sizes = f"on {world} process(es) a checkpoint written by {world_then}"
        if first.epoch_done or not first.mid_epoch:
            if first.epoch_done and length is not None:
                self.shift_to = length  # Lightning then counts the saved epoch finished, at this size too
            where = (f"at the end of epoch {first.epoch}: epoch {first.epoch + 1}" if first.epoch_done else
                     f"at the start of epoch {first.epoch}: it")
            self.rest_line = (f"resumed {sizes} {where} starts from its beginning, split among this run's"
                              f" {world} process(es). {tail}")
            return plan
        rest: Rest | str
        if kind not in (LoaderKind.MAP, LoaderKind.LOADER) or length is None:
            rest = (first.order if isinstance(first.order, str) else
                    f"the training data is a {describe(kind)}, whose position is its own state")
        elif trainer is not None and trainer.limit_train_batches not in (1.0, None):
            rest = (f"limit_train_batches={trainer.limit_train_batches} cuts the epoch short, so its rest"
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
                 f" {rng_phrase(world_then, world)}. Not resumed: the data, which restarts from the beginning of"
                 " the epoch's order at this number of processes, so in this epoch some samples are trained twice and"
                 f" some not at all. To continue the epoch exactly, {same}read the data with a map-style DataLoader"
                 " whose sampler is torch's, Lightning's or torchdata's.", RuntimeWarning, rank_zero=True)
            return plan
        split = rest.split
        if split.per_rank == 0 or split.per_rank > length:  # nothing left (drop_last), or more than an epoch holds
            self.shift_to = length
            plan = dataclasses.replace(plan, epoch=first.epoch + 1)
            self.rest_line = (f"resumed {sizes} in epoch {first.epoch}, which has no full batch left for them"
                              f" ({rest.length - rest.consumed} sample(s) left out, as drop_last does): epoch"
                              f" {first.epoch + 1} starts from its beginning. {tail}")
            return plan
        self.shift_to = length - split.per_rank
        stream.rest_start = RestStart(rest, now_rng, gens, length - split.per_rank)
        self.rest_line = f"{_rest_phrase(rest, sizes, world)}. {tail}"
        return None

    @staticmethod
    def rank_rng(records: list[RankRecord], rank: int, trainer: Trainer | None, seed: int) -> RngState:
        """The RNG this rank resumes with: its own saved streams if the checkpoint's job had this rank, else new ones
        seeded from (seed, step, rank), so no two ranks draw the same numbers and a rerun draws them again."""
        if rank < len(records):
            return records[rank].now_rng
        step = trainer.global_step if trainer is not None else 0
        saved = capture_rng()
        seed_global_rngs(sample_seed(f"rank {rank}", epoch=step, seed=seed))
        fresh = capture_rng()
        restore_rng(saved)
        return fresh


def _rest_phrase(rest: Rest, sizes: str, world: int) -> str:
    """The resume line of a rest split among this run's ranks (before its tail): how much of the epoch was trained,
    in which global order, and how the rest is shared."""
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
            + "".join(f"; {n}" for n in notes))
