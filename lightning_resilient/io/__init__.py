"""Atomic, verified, fenced checkpoint storage on any fsspec filesystem.

``AtomicCheckpointIO`` (which imports Lightning) is imported on first use, so the protocol modules below it load
without Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_resilient._lazy import lazy_exports

_WHERE = {
    "AtomicCheckpointIO": "lightning_resilient.io.checkpoint_io",
    "RetryPolicy": "lightning_resilient.io.retry",
    "find_latest_checkpoint": "lightning_resilient.io.latest",
    "repair_pointer": "lightning_resilient.io.catalog",
}

__all__ = ["AtomicCheckpointIO", "RetryPolicy", "find_latest_checkpoint", "repair_pointer"]

if TYPE_CHECKING:
    from lightning_resilient.io.catalog import repair_pointer
    from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO
    from lightning_resilient.io.latest import find_latest_checkpoint
    from lightning_resilient.io.retry import RetryPolicy


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())
