"""lightning_resilient: safe, cheap resumption for PyTorch Lightning on failure-prone nodes.

The public names below are imported on first use (PEP 562), so that a tool that needs only the storage protocol
(``lightning_resilient.io.root``, a subprocess of the tests, ``lightning-resilient --help``) does not pay for
importing Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_resilient._lazy import lazy_exports

__version__ = "0.1.0"

_WHERE = {
    "AccumulationAwareScheduler": "lightning_resilient.schedule",
    "AtomicCheckpointIO": "lightning_resilient.io.checkpoint_io",
    "AtomicFSDPStrategy": "lightning_resilient.strategies",
    "AtomicModelParallelStrategy": "lightning_resilient.strategies",
    "AutoPrecision": "lightning_resilient.precision",
    "BucketNotFoundError": "lightning_resilient.errors",
    "CheckpointCadence": "lightning_resilient.checkpoint_cadence",
    "CheckpointCorruptedError": "lightning_resilient.errors",
    "CheckpointError": "lightning_resilient.errors",
    "CollectiveError": "lightning_resilient.errors",
    "HangWatchdog": "lightning_resilient.watchdog",
    "PerSampleSeeded": "lightning_resilient.state",
    "PersistFailedError": "lightning_resilient.errors",
    "PreemptionCheckpoint": "lightning_resilient.preemption",
    "ResumeMismatchError": "lightning_resilient.errors",
    "ResumeStateCallback": "lightning_resilient.state",
    "RunExistsError": "lightning_resilient.errors",
    "SettingTypeError": "lightning_resilient.errors",
    "ShardedCheckpointError": "lightning_resilient.errors",
    "StaleWriterError": "lightning_resilient.errors",
    "StoreCredentialsError": "lightning_resilient.errors",
    "StorePermissionError": "lightning_resilient.errors",
    "StoreSetupError": "lightning_resilient.errors",
    "StoreURLError": "lightning_resilient.errors",
    "TransferAudit": "lightning_resilient.planning",
    "UnfencedStoreError": "lightning_resilient.errors",
    "UnsupportedFormatError": "lightning_resilient.errors",
    "export_checkpoint": "lightning_resilient.io.loading",
    "find_latest_checkpoint": "lightning_resilient.io.latest",
    "load_checkpoint": "lightning_resilient.io.loading",
    "load_from_checkpoint": "lightning_resilient.io.loading",
    "repair_pointer": "lightning_resilient.io.catalog",
    "select_precision": "lightning_resilient.precision",
    "warmup_schedule": "lightning_resilient.schedule",
}

__all__ = [
    "AccumulationAwareScheduler",
    "AtomicCheckpointIO",
    "AtomicFSDPStrategy",
    "AtomicModelParallelStrategy",
    "AutoPrecision",
    "BucketNotFoundError",
    "CheckpointCadence",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CollectiveError",
    "HangWatchdog",
    "PerSampleSeeded",
    "PersistFailedError",
    "PreemptionCheckpoint",
    "ResumeMismatchError",
    "ResumeStateCallback",
    "RunExistsError",
    "SettingTypeError",
    "ShardedCheckpointError",
    "StaleWriterError",
    "StoreCredentialsError",
    "StorePermissionError",
    "StoreSetupError",
    "StoreURLError",
    "TransferAudit",
    "UnfencedStoreError",
    "UnsupportedFormatError",
    "__version__",
    "export_checkpoint",
    "find_latest_checkpoint",
    "load_checkpoint",
    "load_from_checkpoint",
    "repair_pointer",
    "select_precision",
    "warmup_schedule",
]

if TYPE_CHECKING:
    from lightning_resilient.checkpoint_cadence import CheckpointCadence
    from lightning_resilient.errors import (
        BucketNotFoundError,
        CheckpointCorruptedError,
        CheckpointError,
        CollectiveError,
        PersistFailedError,
        ResumeMismatchError,
        RunExistsError,
        SettingTypeError,
        ShardedCheckpointError,
        StaleWriterError,
        StoreCredentialsError,
        StorePermissionError,
        StoreSetupError,
        StoreURLError,
        UnfencedStoreError,
        UnsupportedFormatError,
    )
    from lightning_resilient.io.catalog import repair_pointer
    from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO
    from lightning_resilient.io.latest import find_latest_checkpoint
    from lightning_resilient.io.loading import export_checkpoint, load_checkpoint, load_from_checkpoint
    from lightning_resilient.planning import TransferAudit
    from lightning_resilient.precision import AutoPrecision, select_precision
    from lightning_resilient.preemption import PreemptionCheckpoint
    from lightning_resilient.schedule import AccumulationAwareScheduler, warmup_schedule
    from lightning_resilient.state import PerSampleSeeded, ResumeStateCallback
    from lightning_resilient.strategies import AtomicFSDPStrategy, AtomicModelParallelStrategy
    from lightning_resilient.watchdog import HangWatchdog


__getattr__, __dir__ = lazy_exports('lightning_resilient', _WHERE, globals())
