"""Exact resume, public names: :class:`ResumeStateCallback` (every RNG and the data position, per rank, per-sample
seeding and the resume audit), :func:`capture_rng`/:func:`restore_rng`, and :class:`PerSampleSeeded`/
:func:`sample_seed` (a sample's randomness as a function of seed, epoch and index).

The names are imported on first use (PEP 562), so that reading attempt records (``lightning-resilient ls``) does not
import Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_resilient._lazy import lazy_exports

_WHERE = {
    "PerSampleSeeded": "lightning_resilient.state.seeding",
    "ResumeStateCallback": "lightning_resilient.state.callback",
    "capture_rng": "lightning_resilient.state.rng",
    "restore_rng": "lightning_resilient.state.rng",
    "sample_seed": "lightning_resilient.state.seeding",
}

__all__ = ["PerSampleSeeded", "ResumeStateCallback", "capture_rng", "restore_rng", "sample_seed"]

if TYPE_CHECKING:
    from lightning_resilient.state.callback import ResumeStateCallback
    from lightning_resilient.state.rng import capture_rng, restore_rng
    from lightning_resilient.state.seeding import PerSampleSeeded, sample_seed

__getattr__, __dir__ = lazy_exports("lightning_resilient.state", _WHERE, globals())
