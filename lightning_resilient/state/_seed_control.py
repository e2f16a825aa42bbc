"""Which seed ``ResumeStateCallback``'s per-sample seeding uses, and what it installed, for one fit.

:class:`SeedingControl` owns the run's per-sample seed (``seed_everything``'s where it was called, else rank 0's
``torch.initial_seed()`` at the first attempt, else the checkpoint's on a resume), what the checkpoint says its run
did (seeding on or off, and its seed), a change of seed between the two (warned once), and the
:class:`~lightning_resilient.state.seeding.SampleSeeding` installed on the training dataset, or why none could be.
How seeding is put on a loader is ``_loader.apply_sample_seeding``; what a seed gives a sample is ``seeding.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_resilient._warnings import warn
from lightning_resilient.state._loader import apply_sample_seeding
from lightning_resilient.state.seeding import SampleSeeding

__all__ = ["SeedingControl", "run_seed"]


class SeedingControl:
    """The per-sample seed of a fit, the checkpoint's seeding, and the seeding installed on the training dataset."""

    def __init__(self) -> None:
        self.seed = 0  # the seed this run uses (set at setup, or from the checkpoint)
        self._explicit: int | None = None  # the one seed_everything gave, where it was called
        self.saved: tuple[bool, int | None] | None = None  # (seeding on, its seed) in the checkpoint
        self.change: tuple[int, int] | None = None  # (checkpoint's, this run's) when seed_everything differs
        self.applied: SampleSeeding | None = None  # installed on the training dataset
        self.problem: str | None = None  # why seeding could not be installed

    def __getstate__(self) -> dict[str, Any]:
        # A copy carries the seeds, not the seeding installed on a fit's dataset.
        return {**self.__dict__, "applied": None}

    def start_fit(self, *, enabled: bool, gather: Callable[[Any], list[Any]]) -> None:
        self.saved = self.change = None
        self.applied = None
        self.problem = None
        if enabled:
            self.seed, self._explicit = run_seed(gather)

    def load(self, state_dict: Mapping[str, Any], *, enabled: bool) -> None:
        """The checkpoint's seeding. Per-sample seeding continues with the checkpoint's seed (keys added to format 2
        later: absent, the run that wrote it did not seed per sample), unless seed_everything gave this run another
        one."""
        saved_seed = state_dict.get("sample_seed")
        self.saved = (bool(state_dict.get("per_sample_seeding", False)),
                      None if saved_seed is None else int(saved_seed))
        if enabled and saved_seed is not None and self._explicit is None:
            self.seed = int(saved_seed)

    def apply(self, loader: Any) -> None:
        """Install per-sample seeding on the training loader (or note why it cannot apply); warn when the checkpoint's
        run seeded with another seed than this run's ``seed_everything`` gives."""
        applied = apply_sample_seeding(loader, self.seed)
        if not isinstance(applied, SampleSeeding):
            self.applied, self.problem = None, applied
            return
        self.applied, self.problem = applied, None
        saved = self.saved
        if saved is not None and saved[0] and saved[1] is not None and saved[1] != applied.seed:
            self.change = (saved[1], applied.seed)
            warn(f"ResumeStateCallback: the checkpoint's run seeded each sample with seed {saved[1]}, but"
                 f" seed_everything gave this run {applied.seed}, which per-sample seeding uses: every sample's"
                 " random augmentation differs from the interrupted run's from here on. To continue that run"
                 f" exactly, call seed_everything({saved[1]}) (or not at all: the checkpoint's seed is then used).",
                 RuntimeWarning, rank_zero=True)

    def saved_fields(self) -> dict[str, Any]:
        """What a checkpoint records of this run's seeding."""
        applied = self.applied
        return {"per_sample_seeding": applied is not None, "sample_seed": applied.seed if applied is not None else None}

    def release(self) -> None:
        self.applied = None


def run_seed(gather: Callable[[Any], list[Any]]) -> tuple[int, int | None]:
    """This run's per-sample seed, and the one ``seed_everything`` gave (None when it was not called): that one, or
    rank 0's ``torch.initial_seed()`` (every rank must seed alike; without any seeding it is random per process)."""
    given = os.environ.get("PL_GLOBAL_SEED")  # what seed_everything sets, in this process and those it starts
    try:
        explicit = None if given is None else int(given)
    except ValueError:
        explicit = None
    if explicit is not None:
        return explicit, explicit
    return int(gather(torch.initial_seed())[0]), None
