"""Atomic, verified, fenced checkpoint storage on any fsspec filesystem."""

from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO, find_latest_checkpoint, repair_pointer
from lightning_resilient.io.retry import RetryPolicy

__all__ = ["AtomicCheckpointIO", "RetryPolicy", "find_latest_checkpoint", "repair_pointer"]
