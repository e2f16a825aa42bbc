"""Exact resume, public names: :class:`ResumeStateCallback` (every RNG and the data position, per rank),
:func:`capture_rng`/:func:`restore_rng`, and :class:`PerSampleSeeded`/:func:`sample_seed` (a sample's randomness as a
function of seed, epoch and index)."""

from lightning_resilient.state.callback import ResumeStateCallback
from lightning_resilient.state.rng import capture_rng, restore_rng
from lightning_resilient.state.seeding import PerSampleSeeded, sample_seed

__all__ = ["PerSampleSeeded", "ResumeStateCallback", "capture_rng", "restore_rng", "sample_seed"]
