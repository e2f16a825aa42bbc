"""One real CPU training run shared by the callback tests: CheckpointCadence and TransferAudit side by side (the
TransferAudit tests here, the CheckpointCadence tests in tests/test_checkpoint_cadence.py, which import it)."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_resilient.checkpoint_cadence import CheckpointCadence
from lightning_resilient.planning import TransferAudit

from ..models import TinyModel, tiny_loader

MTBF_SECONDS = 60.0
SLEEP = 0.02  # makes each save clearly dearer than a training step of the tiny model


class SlowIO(TorchCheckpointIO):
    """Stock torch.save IO that sleeps first, and times its own work from the inside."""

    def __init__(self) -> None:
        super().__init__()
        self.durations: list[float] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        start = time.perf_counter()
        time.sleep(SLEEP)
        super().save_checkpoint(checkpoint, path, storage_options)
        self.durations.append(time.perf_counter() - start)


class Probe(Callback):
    """What the trainer looks like from inside the run, each training batch."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen.append({"save_wrapped": "save_checkpoint" in vars(trainer),
                          "transfer_wrapped": "batch_to_device" in vars(trainer.strategy),
                          "showwarning": warnings.showwarning})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass
class CpuRun:
    trainer: Trainer
    io: SlowIO
    checkpoint: ModelCheckpoint
    cadence: CheckpointCadence
    audit: TransferAudit
    probe: Probe
    logs: list[str] = field(default_factory=list)
    showwarning_before: Any = None
    caught: list[warnings.WarningMessage] = field(default_factory=list)


@pytest.fixture(scope="session")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuRun]:
    """Six optimizer steps, a save every two (at steps 2, 4, 6), both callbacks observing."""
    root: Path = tmp_path_factory.mktemp("planning-run")
    records = _Records()
    # rank_zero_info logs through the logger of whichever rank_zero module was imported last (each sets
    # lightning_utilities' module logger to its own): lightning's two, or, once any test imported pytorch_lightning,
    # the standalone packages' two. Listen on all of them, so the records do not depend on what ran before.
    loggers = [logging.getLogger(name) for name in ("lightning.fabric.utilities.rank_zero",
                                                     "lightning.pytorch.utilities.rank_zero",
                                                     "lightning_fabric.utilities.rank_zero",
                                                     "pytorch_lightning.utilities.rank_zero",
                                                     "lightning_utilities.core.rank_zero")]
    for lg in loggers:
        lg.addHandler(records)
    io, probe = SlowIO(), Probe()
    checkpoint = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    cadence = CheckpointCadence(mtbf_seconds=MTBF_SECONDS, log_metrics=True)
    audit = TransferAudit()
    trainer = Trainer(accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[checkpoint, cadence, audit, probe], plugins=[io])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = warnings.showwarning
            trainer.fit(TinyModel(), tiny_loader())
            ours = [f for f in warnings.filters if f[1] is not None and "synchronizing" in f[1].pattern]
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    assert not ours, f"TransferAudit left its warnings filter behind: {ours}"
    yield CpuRun(trainer=trainer, io=io, checkpoint=checkpoint, cadence=cadence, audit=audit, probe=probe,
                 logs=records.messages, showwarning_before=before, caught=caught)
