"""What ``ResumeStateCallback`` tells the user about how exact a resume is.

:class:`ResumeMessages` owns the fit-start warnings about the training data (what keeps a resume of this run from
being exact, and the fix: an ``IterableDataset`` without state, seeding that cannot apply, a custom sampler) and the
one line that replaces Lightning's "not resumable" warning: what a mid-epoch resume restored and what it did not
(:meth:`ResumeMessages.restored_line`, :meth:`ResumeMessages.not_restored`), or the end of the line of a resume on
another number of processes (:meth:`ResumeMessages.elastic_tail`, :func:`rng_phrase`). The warnings a resume plan
gives about the checkpoint's record are the planner's (``_planner.py``).
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, IterableDataset

from lightning_resilient._warnings import warn
from lightning_resilient.state._loader import LoaderKind, custom_samplers, has_state
from lightning_resilient.state._seed_control import SeedingControl
from lightning_resilient.state._stream import DataStream

__all__ = ["FIX", "ResumeMessages", "rebuilds_buckets", "rng_phrase", "warn_if_ddp_rebuilds_buckets"]

FIX = ("To resume the data exactly, give the IterableDataset state_dict()/load_state_dict() (read with"
       " num_workers=0) or load it with torchdata's StatefulDataLoader.")


class ResumeMessages:
    """The fit-start warnings about the training data (given once per fit) and the resume line's text."""

    def __init__(self) -> None:
        self._warned_data = False  # the fit-start warnings about the data were given
        self._custom: list[str] = []  # names of samplers a resume may not reproduce

    def start_fit(self) -> None:
        self._custom = []
        self._warned_data = False

    def warn_about_the_data(self, stream: DataStream, seeding: SeedingControl, *, per_sample_seeding: bool) -> None:
        """Once per fit, when it starts: what keeps a resume of this run from being exact, and the fix."""
        if self._warned_data:
            return
        self._warned_data = True
        loader, kind = stream.loader, stream.kind
        dataset = getattr(loader, "dataset", None)
        name = type(dataset).__name__
        workers = stream.num_workers
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
                 f" not apply to it. {FIX} Draw its random numbers from a generator kept in that state.",
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
        elif per_sample_seeding and seeding.applied is None and workers:
            fix = ("give the DataLoader a batch_size" if "batch_size=None" in (seeding.problem or "") else
                   "wrap the dataset yourself: DataLoader(lightning_resilient.PerSampleSeeded(dataset, seed=...),"
                   " ...)")
            warn(f"ResumeStateCallback: per-sample seeding cannot apply: {seeding.problem}. Random numbers"
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

    @staticmethod
    def warn_several_loaders(count: int) -> None:
        warn("ResumeStateCallback restores the data position of a single training loader; this run has"
             f" {count}: RNG states are restored but each resumed epoch starts from its first batch", RuntimeWarning)

    def restored_line(self, restored: tuple[int, int, int | None, int], seeding: SeedingControl,
                      missing: list[str]) -> str:
        """What a mid-epoch resume restored, and whether that makes it exact: "continues exactly" only when every
        condition for it holds (``missing``: see :meth:`not_restored`); otherwise what was not restored."""
        epoch, consumed, batches, samples = restored
        applied = seeding.applied
        with_seeding = f"per-sample seeding (seed {applied.seed}), " if applied is not None else ""
        line = (f"restored the data position: epoch {epoch}, after {consumed} of"
                f" {batches if batches is not None else '?'} batches ({samples} samples), {with_seeding}and the RNG"
                " states of every rank")
        if not missing:
            return f"{line}, so this run continues exactly where the checkpoint was saved"
        return (f"{line}. Not restored: {'; '.join(missing)}. So this run may differ from an uninterrupted one from"
                " here on (the resume audit compares the steps it replays)")

    def not_restored(self, stream: DataStream, seeding: SeedingControl, trainer: Trainer | None, *,
                     per_sample_seeding: bool) -> list[str]:
        """What keeps a resumed run from being exact although its position was restored."""
        out = []
        dataset = getattr(stream.loader, "dataset", None)
        workers = stream.num_workers
        # Random numbers drawn while data is read come from wherever the reading process's RNGs are at that moment: in
        # a worker, from its history; in the main process, from the RNG before the step (a resume restores the state
        # of the step, not of the fetch). Only per-sample seeding makes them a function of the batch.
        where = f"in the {workers} worker process(es)" if workers else "in the main process"
        if isinstance(dataset, IterableDataset):
            out.append(f"random numbers drawn from the global RNGs while the IterableDataset {type(dataset).__name__}"
                       f" is read {where} (per-sample seeding does not apply to it)")
        elif seeding.applied is None:
            why = ("per-sample seeding is off" if not per_sample_seeding else
                   f"per-sample seeding could not be applied: {seeding.problem}")
            out.append(f"random numbers drawn while the dataset is read {where} ({why})")
        saved = seeding.saved
        if saved is not None and seeding.applied is not None and not saved[0]:
            out.append("augmentation drawn in the dataset (the checkpoint's run read it without per-sample seeding,"
                       " this one seeds each sample)")
        elif saved is not None and saved[0] and seeding.applied is None:
            out.append("augmentation drawn in the dataset (the checkpoint's run seeded each sample, this one does"
                       " not)")
        if seeding.change is not None:
            out.append(f"the per-sample seed ({seeding.change[0]} then, {seeding.change[1]} now: the seed given"
                       " to seed_everything changed)")
        out.extend(f"the order of the custom sampler {name}" for name in self._custom)
        if trainer is not None and rebuilds_buckets(trainer):
            out.append(f"the order DDP reduces gradients in on the first step ({trainer.world_size} processes)")
        return out

    @staticmethod
    def elastic_tail(world_then: int, world: int, *, trainer: Trainer | None, batch: int | None,
                     saved_batch: tuple[int, int | None, int | None] | None,
                     accumulation_change: tuple[int, int] | None, seeding: SeedingControl, missing: list[str]) -> str:
        """The end of the line of a resume on another number of processes: the global batch (``batch``: this run's
        samples per batch; ``saved_batch``: the checkpoint's (processes, accumulation, batch size)), the per-sample
        seeding, the RNG streams and the rest not restored (``missing``, see :meth:`not_restored`)."""
        parts = []
        if saved_batch is not None and saved_batch[1] is not None and saved_batch[2] is not None and batch is not None:
            accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
            then, now = world_then * saved_batch[1] * saved_batch[2], world * accumulate * batch
            change = accumulation_change
            if then == now:
                how = (f" (keep_global_batch: accumulate_grad_batches {change[0]} -> {change[1]})" if change else "")
                parts.append(f"Global batch: {now} samples per optimizer step, as before{how}, so the optimizer steps"
                             " read the same stretches of the epoch's order as the checkpoint's job would have")
            else:
                parts.append(f"Global batch: {then} samples per optimizer step then, {now} now (pass"
                             " ResumeStateCallback(keep_global_batch=True) to keep it): the optimizer steps per epoch"
                             " and the LR schedule's pace per sample change")
        if seeding.applied is not None:
            parts.append(f"Per-sample seeding (seed {seeding.applied.seed}) gives each sample the augmentation it had"
                         " whichever process reads it")
        parts.append(f"RNG: {rng_phrase(world_then, world)}; so random numbers drawn in training (dropout)"
                     " differ from an uninterrupted run's")
        missing = [m for m in missing if "reduces gradients" not in m]
        if missing:
            parts.append(f"Not restored: {'; '.join(missing)}")
        return ". ".join(parts) + "."


def rng_phrase(world_then: int, world: int) -> str:
    """Which RNG streams a resume on ``world`` processes of a checkpoint of ``world_then`` continues."""
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


def rebuilds_buckets(trainer: Trainer) -> bool:
    """DDP rebuilds its gradient buckets after its first iteration (unless ``find_unused_parameters``): with more
    than two processes the first step after a resume then sums gradients in another order than the uninterrupted
    run did at that step, so the runs agree up to float rounding, not bit for bit (PyTorch, gloo and NCCL alike)."""
    kwargs = getattr(trainer.strategy, "_ddp_kwargs", None)
    return kwargs is not None and trainer.world_size > 2 and not kwargs.get("find_unused_parameters")


def warn_if_ddp_rebuilds_buckets(trainer: Trainer) -> None:
    if not rebuilds_buckets(trainer):
        return
    warn(f"resumed under DDP with {trainer.world_size} processes: DDP rebuilds its gradient buckets after its first"
         " iteration, so the first step after this resume reduces gradients in another order than the uninterrupted"
         " run did, and the runs agree up to float rounding, not bit for bit. For bit-identical resumes use"
         " DDPStrategy(find_unused_parameters=True), which keeps the buckets as built.", RuntimeWarning, rank_zero=True)
