"""Exact resume: RNG states and the data-loader position."""

from lightning_resilient.state.callback import ResumeStateCallback
from lightning_resilient.state.rng import capture_rng, restore_rng
from lightning_resilient.state.seeding import PerSampleSeeded, sample_seed

__all__ = ["PerSampleSeeded", "ResumeStateCallback", "capture_rng", "restore_rng", "sample_seed"]
