"""Exact resume: RNG states and the data-loader position."""

from lightning_resilient.state.callback import ResumeStateCallback
from lightning_resilient.state.rng import capture_rng, restore_rng

__all__ = ["ResumeStateCallback", "capture_rng", "restore_rng"]
