"""What ``ResumeStateCallback`` keeps: the per-rank record it saves (:class:`RankRecord`, and the format of the state
that holds it), the plan a resume derives from a record (:class:`ResumePlan`), and the RNG an epoch's order is drawn
from on a resume (:class:`OrderReplay`). Only :class:`RankRecord` reaches a checkpoint, and only as the plain dict of
:meth:`RankRecord.to_dict`.

The callback's ``state_dict()`` is ``{"format": FORMAT, "world_size": N, "ranks": [one record dict per rank], ...}``
(also ``accumulate_grad_batches``, and the per-sample seed):
dicts, lists, numbers, strings and tensors only, so a checkpoint loads with ``weights_only=True`` (a
:class:`LoaderKind` is stored as its string). Keys added to format 2 after its first version are optional on read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.state._loader import LoaderKind
from lightning_resilient.state.rng import RngState

__all__ = ["FORMAT", "OrderReplay", "RankRecord", "ResumePlan", "check_format"]

FORMAT = 2


def check_format(state: Mapping[str, Any]) -> None:
    """Refuse a callback state of another format than :data:`FORMAT`, saying what to do instead."""
    found = state.get("format")
    if found == FORMAT:
        return
    if isinstance(found, int) and not isinstance(found, bool) and found > FORMAT:
        raise UnsupportedFormatError(
            f"the ResumeStateCallback state in this checkpoint has format {found}, but this lightning_resilient"
            f" reads format {FORMAT}: it was written by a newer version. Upgrade lightning_resilient to resume"
            " from it.")
    raise UnsupportedFormatError(
        f"the ResumeStateCallback state in this checkpoint has format {found!r}, but this lightning_resilient reads"
        f" format {FORMAT} only (no release wrote another). To resume from this checkpoint anyway, resume without"
        " ResumeStateCallback in the Trainer's callbacks, or delete checkpoint['callbacks']['ResumeStateCallback']"
        " from it: training then continues at the saved step with fresh RNG states and the epoch's data from its"
        " start.")


def _kind(value: Any) -> LoaderKind | str | None:
    if value is None or isinstance(value, LoaderKind):
        return value
    try:
        return LoaderKind(value)
    except ValueError:
        return str(value)  # a kind this version does not know: never equal to this run's, described by its name


@dataclass(frozen=True)
class RankRecord:
    """One rank's RNG states and data position at a save.

    "Epoch" here is the training epoch of the data stream the rank was reading (the one its sampler's
    ``set_epoch`` got); a stateful position is the loader's or dataset's own ``state_dict()`` as of the last
    *consumed* batch.
    """

    # The training data's kind; None: no single training loader was tracked (several, or none yet). A kind this
    # version does not know is kept as its string.
    kind: LoaderKind | str | None
    epoch: int  # the training epoch of the data stream
    consumed: int  # batches of that epoch trained on, those skipped by an earlier resume included
    samples: int  # samples in those batches
    epoch_done: bool  # the epoch's data was used up at the save: a resume starts the next epoch
    batches: int | None  # the loader's length in batches; None: unsized
    batch_size: int | None  # the loader's batch_size; None: no automatic batching, or not a DataLoader
    num_workers: int  # the loader's num_workers (a StatefulDataLoader's state holds one state per worker)
    sampler: dict[str, int]  # the sampler's epoch, seed, num_replicas and rank, where it has them
    loader_state: Any  # the stateful position (LOADER, DATASET kinds); None for the others
    epoch_rng: RngState | None  # the RNG at the start of the epoch's stream: its permutation and worker seeds
    now_rng: RngState  # the RNG at the save
    # The loader's own torch.Generator states (DataLoader(generator=...), samplers' generators), in the order
    # state/_loader.py's generators() finds them: at the start of the epoch's stream, and at the save. None for
    # epoch_generators before the first stream; now_generators is [] when no loader is tracked.
    epoch_generators: list[torch.Tensor] | None
    now_generators: list[torch.Tensor] | None
    # The RNG and the loader's generators right before the epoch's order was drawn; None: not drawn yet. This
    # field and those below were added to format 2 later: absent from a record, they read as these defaults.
    order_rng: RngState | None = None
    order_generators: list[torch.Tensor] | None = None
    validation_follows: bool = False  # a validation runs between this save and the next step (a resume skips it)
    # Base-seed draws from the global RNG that validation makes; None: not known at the save (its loaders were not
    # set up yet): a resume replays them as Lightning's restart makes them.
    validation_draws: int | None = 0
    # Saved at an epoch's end with validation_draws known: the base-seed draws the run makes from the save until the
    # next epoch's order is drawn, from the global RNG (order_draws) and from the loader's own generator
    # (order_generator_draws). None: not known; then neither key is stored.
    order_draws: int | None = None
    order_generator_draws: int = 0
    # The epoch's global order (state/elastic.py's OrderSpec: what a resume on another number of processes splits the
    # rest of), or why it cannot be described (a phrase naming the sampler or dataset); None: not recorded (a record
    # written before elastic resume, or no loader). Added to format 2 later, as is step_samples: the samples of the
    # stream consumed up to the last optimizer step (those after it trained no step yet); None: not recorded.
    order: dict[str, Any] | str | None = None
    step_samples: int | None = None

    @property
    def mid_epoch(self) -> bool:
        """Saved inside an epoch: some of its batches were trained on, and not all of them."""
        return self.consumed > 0 and not self.epoch_done

    def to_dict(self) -> dict[str, Any]:
        """The stored form: plain values only (``weights_only=True``), in the key order of every earlier save."""
        out: dict[str, Any] = {
            "kind": self.kind.value if isinstance(self.kind, LoaderKind) else self.kind, "epoch": self.epoch,
            "consumed": self.consumed, "samples": self.samples, "epoch_done": self.epoch_done,
            "mid_epoch": self.mid_epoch, "batches": self.batches, "batch_size": self.batch_size,
            "num_workers": self.num_workers, "sampler": self.sampler, "loader_state": self.loader_state,
            "epoch_rng": self.epoch_rng, "now_rng": self.now_rng, "epoch_generators": self.epoch_generators,
            "order_rng": self.order_rng, "order_generators": self.order_generators,
            "now_generators": self.now_generators, "validation_follows": self.validation_follows,
            "validation_draws": self.validation_draws}
        if self.order_draws is not None:
            out["order_draws"] = self.order_draws
            out["order_generator_draws"] = self.order_generator_draws
        if self.order is not None:
            out["order"] = self.order
        if self.step_samples is not None:
            out["step_samples"] = self.step_samples
        return out

    @property
    def reads_a_rest(self) -> bool:
        """Saved inside an epoch whose rest this stream read after a resume on another number of processes: a
        resume (on any number) splits what is left of that order again."""
        return self.mid_epoch and isinstance(self.order, dict) and self.order.get("layout") == "rest"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RankRecord:
        """Read a stored record of format :data:`FORMAT` (checked by :func:`check_format`)."""
        try:
            return cls(
                kind=_kind(raw["kind"]), epoch=raw["epoch"], consumed=int(raw["consumed"]),
                samples=int(raw["samples"]), epoch_done=bool(raw["epoch_done"]), batches=raw["batches"],
                batch_size=raw["batch_size"], num_workers=raw["num_workers"], sampler=raw["sampler"],
                loader_state=raw["loader_state"], epoch_rng=raw["epoch_rng"], now_rng=raw["now_rng"],
                epoch_generators=raw["epoch_generators"], now_generators=raw["now_generators"],
                order_rng=raw.get("order_rng"), order_generators=raw.get("order_generators"),
                validation_follows=bool(raw.get("validation_follows", False)),
                validation_draws=raw.get("validation_draws", 0),
                order_draws=None if raw.get("order_draws") is None else int(raw["order_draws"]),
                order_generator_draws=int(raw.get("order_generator_draws", 0)), order=raw.get("order"),
                step_samples=None if raw.get("step_samples") is None else int(raw["step_samples"]))
        except KeyError as exc:
            raise CheckpointCorruptedError(
                f"the ResumeStateCallback record in this checkpoint has no {exc.args[0]!r}, which every record of"
                f" format {FORMAT} has: the callback state is damaged. Resume without ResumeStateCallback (or delete"
                " checkpoint['callbacks']['ResumeStateCallback']) to continue with fresh RNG states.") from None


@dataclass(frozen=True)
class ResumePlan:
    """What the first data stream after a resume does, decided from the saved :class:`RankRecord` and this run's
    loader. Generator and order states are None when the loader changed since the save (they would not fit it)."""

    epoch: int  # the training epoch that stream runs: the saved one, or the next when the save was at its end
    # The saved position is restored: saved mid-epoch, the loader unchanged, and a kind whose position can be saved.
    exact: bool
    skip: int  # batches the MAP index stream skips (0 for the other kinds: their loaded state is the position)
    consumed: int  # batches of the epoch counted as trained on (0 unless exact)
    samples: int  # samples in those batches (0 unless exact)
    epoch_rng: RngState | None  # the record's epoch_rng: the saved epoch's permutation and worker seeds
    now_rng: RngState  # the record's now_rng
    order_rng: RngState | None  # the record's order_rng
    epoch_generators: list[torch.Tensor] | None
    now_generators: list[torch.Tensor] | None
    order_generators: list[torch.Tensor] | None
    validation_follows: bool  # see RankRecord
    validation_draws: int | None  # see RankRecord
    order_draws: int | None  # see RankRecord
    order_generator_draws: int  # see RankRecord


@dataclass(frozen=True)
class OrderReplay:
    """On a resume, what the epoch's order is drawn from: the RNG and loader generators to set right before the
    draw, then how far to advance them (the base-seed draws the uninterrupted run made in between)."""

    rng: RngState
    generators: list[torch.Tensor] | None  # None: leave the loader's generators as they are
    global_draws: int  # base-seed draws to make from the global (torch CPU) RNG
    generator_draws: int  # base-seed draws to make from the loader's own generator, when it has one
