"""lightning_resilient: safe, cheap resumption for PyTorch Lightning on failure-prone nodes."""

from lightning_resilient.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    ShardedCheckpointError,
    StaleWriterError,
    UnsupportedFormatError,
)
from lightning_resilient.io import AtomicCheckpointIO, find_latest_checkpoint, repair_pointer
from lightning_resilient.planning import CheckpointCadence, TransferAudit
from lightning_resilient.precision import AutoPrecision, select_precision
from lightning_resilient.state import PerSampleSeeded, ResumeStateCallback
from lightning_resilient.schedule import AccumulationAwareScheduler, warmup_schedule
from lightning_resilient.strategies import AtomicFSDPStrategy, AtomicModelParallelStrategy

__version__ = "0.1.0"

__all__ = [
    "AccumulationAwareScheduler",
    "AtomicCheckpointIO",
    "AtomicFSDPStrategy",
    "AtomicModelParallelStrategy",
    "AutoPrecision",
    "CheckpointCadence",
    "CheckpointCorruptedError",
    "CheckpointError",
    "PerSampleSeeded",
    "ResumeStateCallback",
    "ShardedCheckpointError",
    "StaleWriterError",
    "TransferAudit",
    "UnsupportedFormatError",
    "__version__",
    "find_latest_checkpoint",
    "repair_pointer",
    "select_precision",
    "warmup_schedule",
]
