"""lightning_resilient: safe, cheap resumption for PyTorch Lightning on failure-prone nodes."""

from lightning_resilient.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    StaleWriterError,
    UnsupportedFormatError,
)
from lightning_resilient.io import AtomicCheckpointIO, find_latest_checkpoint, repair_pointer

__version__ = "0.1.0"

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointCorruptedError",
    "CheckpointError",
    "StaleWriterError",
    "UnsupportedFormatError",
    "__version__",
    "find_latest_checkpoint",
    "repair_pointer",
]
