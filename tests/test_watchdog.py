"""HangWatchdog: a step that stops making progress is reported with every thread's stack (in-process, with
``exit_code=None``); warm-up steps, saves, validation and slow hooks between epochs never look like a hang, while a
hang between epochs is still reported past its own bound; and, in a training subprocess, the process ends with its own
exit status and the goodput ledger records the hang as the attempt's end."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient import AtomicCheckpointIO, HangWatchdog
from lightning_resilient.cli import main
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.state.attempts import list_attempts, read_record
from lightning_resilient.watchdog import HANG_EXIT_CODE
from tests import procs

from .models import TinyModel, tiny_loader

TESTS = Path(__file__).parent


class Stalling(TinyModel):
    """Sleeps ``slow`` seconds in the training steps of ``slow_at``, and at ``hang_at`` waits until the watchdog has
    reported (as a hung step would, but it comes back, so the fit ends)."""

    def __init__(self, watchdog: HangWatchdog, *, hang_at: int | None = None, slow_at: tuple[int, ...] = (),
                 slow: float = 0.0, slow_validation: float = 0.0) -> None:
        super().__init__()
        self.watchdog, self.hang_at, self.slow_at, self.slow = watchdog, hang_at, slow_at, slow
        self.slow_validation = slow_validation

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step in self.slow_at:
            time.sleep(self.slow)
        if self.global_step == self.hang_at:
            deadline = time.monotonic() + 60
            while not self.watchdog.hangs and time.monotonic() < deadline:  # stuck until it is noticed
                time.sleep(0.01)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(self.slow_validation)
        self.slow_validation = 0.0  # the first one only


class SlowSaveIO(AtomicCheckpointIO):
    """Its first save is slow."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        time.sleep(self.seconds)  # a slow upload: the plugin's business, never a hang
        self.seconds = 0.0
        super().save_checkpoint(checkpoint, path, storage_options)


class SlowHooks(Callback):
    """Sleeps ``seconds`` in each hook of ``hooks`` once, the first time it runs past the first (warm-up) step: the
    work a job legitimately does between two training batches (a metric over the epoch, artifacts logged, a dataset
    rebuilt), which is not a hang. With ``until_reported``, waits instead until the watchdog has reported (a hook
    that hangs, but comes back so that the fit ends)."""

    def __init__(self, hooks: tuple[str, ...], seconds: float, *, until_reported: HangWatchdog | None = None) -> None:
        self.pending, self.seconds, self.until_reported = set(hooks), seconds, until_reported

    def sleep(self, hook: str, trainer: Trainer) -> None:
        if hook not in self.pending or trainer.global_step == 0:
            return
        self.pending.discard(hook)
        if self.until_reported is None:
            time.sleep(self.seconds)
            return
        deadline = time.monotonic() + 60
        while not self.until_reported.hangs and time.monotonic() < deadline:
            time.sleep(0.01)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.sleep("on_train_epoch_start", trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.sleep("on_train_epoch_end", trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.sleep("on_train_end", trainer)


class SlowHooksModel(Stalling):
    """A :class:`Stalling` whose own epoch and end hooks run ``slow``'s."""

    def __init__(self, watchdog: HangWatchdog, slow: SlowHooks, **kwargs: Any) -> None:
        super().__init__(watchdog, **kwargs)
        self.slow_hooks = slow

    def on_train_epoch_start(self) -> None:
        self.slow_hooks.sleep("on_train_epoch_start", self.trainer)

    def on_train_epoch_end(self) -> None:
        self.slow_hooks.sleep("on_train_epoch_end", self.trainer)

    def on_train_end(self) -> None:
        self.slow_hooks.sleep("on_train_end", self.trainer)


def fit(tmp_path: Path, model: Stalling, watchdog: HangWatchdog, *, io: AtomicCheckpointIO | None = None,
        val: Any = None, **trainer: Any) -> None:
    callbacks = [watchdog, ModelCheckpoint(dirpath=tmp_path / "root", every_n_train_steps=3, save_top_k=-1)]
    Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, plugins=[io or AtomicCheckpointIO()], callbacks=callbacks,
            **{"max_steps": 10, "limit_val_batches": 0, **trainer}).fit(model, tiny_loader(n=96), val)


def test_a_hung_step_is_reported_with_every_threads_stack(tmp_path, caplog):
    watchdog = HangWatchdog(timeout_seconds=1.0, warmup_steps=1, exit_code=None)
    with caplog.at_level(logging.ERROR, logger="lightning_resilient.watchdog"):
        fit(tmp_path, Stalling(watchdog, hang_at=6), watchdog)
    assert [(step, timeout) for step, _, timeout in watchdog.hangs] == [(6, 1.0)]
    (record,) = [r for r in caplog.records if r.name == "lightning_resilient.watchdog"]
    message = record.getMessage()
    assert message.startswith("HangWatchdog: no training progress for ") and "on rank 0" in message
    assert "at global step 6: a hang (timeout 1.0 s, from timeout_seconds); not exiting (exit_code=None)" in message
    # The stuck thread's stack, innermost last: the training step, waiting.
    main_thread = message.split("--- thread MainThread")[1].split("--- thread")[0]
    assert "in training_step" in main_thread and "time.sleep(0.01)" in main_thread.splitlines()[-1]
    assert "--- thread lightning_resilient-watchdog" not in message  # its own thread is not a suspect


def test_warm_up_steps_saves_and_validation_never_look_like_a_hang(tmp_path, caplog):
    # A warm-up step, a save and a validation each take three timeouts; then a real hang, which must still be caught
    # (the watchdog was on all along).
    watchdog = HangWatchdog(timeout_seconds=0.4, warmup_steps=1, exit_code=None)
    model = Stalling(watchdog, hang_at=8, slow_at=(0,), slow=1.2, slow_validation=1.2)
    fit(tmp_path, model, watchdog, io=SlowSaveIO(1.2), val=tiny_loader(n=8), val_check_interval=4,
        limit_val_batches=1)
    assert [step for step, _, _ in watchdog.hangs] == [8]


@pytest.mark.parametrize("where", ["module", "callback before the watchdog", "callback after the watchdog"])
@pytest.mark.parametrize("hook", ["on_train_epoch_end", "on_train_epoch_start", "on_train_end"])
def test_slow_hooks_between_epochs_and_at_the_end_never_look_like_a_hang(tmp_path, where, hook):
    # 4 batches an epoch, 10 steps: epoch 0's end (step 4), epoch 1's start, a real hang at step 6 (which must still
    # be caught), the end of training mid-epoch 2 (max_steps). The hook takes three timeouts, once. No save at an
    # epoch's end (a save pauses the clock by itself, which would hide the point).
    watchdog = HangWatchdog(timeout_seconds=0.5, warmup_steps=1, exit_code=None)
    slow = SlowHooks((hook,), 1.5)
    model = SlowHooksModel(watchdog, slow if where == "module" else SlowHooks((), 0), hang_at=6)
    callbacks: list[Callback] = {"module": [watchdog], "callback before the watchdog": [slow, watchdog],
                                 "callback after the watchdog": [watchdog, slow]}[where]
    Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, callbacks=callbacks, max_steps=10).fit(model, tiny_loader(n=32))
    assert not slow.pending  # it did sleep
    assert [step for step, _, _ in watchdog.hangs] == [6]


def test_validation_at_an_epochs_end_does_not_restart_the_step_clock(tmp_path):
    # Validation ends before the epoch-end hooks run: the slow hook after it is still between epochs (placed before the
    # watchdog, whose own on_train_epoch_end would otherwise say so).
    watchdog = HangWatchdog(timeout_seconds=0.5, warmup_steps=1, exit_code=None)
    slow = SlowHooks(("on_train_epoch_end",), 1.5)
    Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=1, callbacks=[slow, watchdog],
            max_steps=10).fit(Stalling(watchdog, hang_at=6), tiny_loader(n=32), tiny_loader(n=8))
    assert not slow.pending
    assert [step for step, _, _ in watchdog.hangs] == [6]


class EndsEpochEarly(Stalling):
    """Ends epoch 0 at its third batch from ``on_train_batch_start`` (-1: no ``on_train_batch_end`` for it)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch == 0 and batch_idx == 2 else None


def test_an_epoch_ended_by_on_train_batch_start_is_between_epochs_from_the_watchdogs_epoch_end(tmp_path):
    # The last batch's end cannot tell: the watchdog's own on_train_epoch_end does (the callbacks after it are safe).
    watchdog = HangWatchdog(timeout_seconds=0.5, warmup_steps=1, exit_code=None)
    slow = SlowHooks(("on_train_epoch_end",), 1.5)
    Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, callbacks=[watchdog, slow], max_steps=8).fit(
        EndsEpochEarly(watchdog, hang_at=4), tiny_loader(n=32))
    assert not slow.pending
    assert [step for step, _, _ in watchdog.hangs] == [4]


@pytest.mark.parametrize(("step_timeout", "boundary_timeout", "why"), [
    (0.2, 0.6, "from epoch_boundary_timeout_seconds, between epochs"),
    (0.6, 0.2, "from timeout_seconds, above epoch_boundary_timeout_seconds 0.2 s, between epochs"),
])
def test_a_hang_between_epochs_is_reported_past_its_own_bound(tmp_path, caplog, step_timeout, boundary_timeout,
                                                              why):
    # A hook that never returns (a collective one rank never joins, a stuck upload) is a hang too: past
    # epoch_boundary_timeout_seconds, never less than the step timeout.
    watchdog = HangWatchdog(timeout_seconds=step_timeout, epoch_boundary_timeout_seconds=boundary_timeout,
                            warmup_steps=1, exit_code=None)
    stuck = SlowHooks(("on_train_epoch_end",), 0, until_reported=watchdog)
    with caplog.at_level(logging.ERROR, logger="lightning_resilient.watchdog"):
        Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, callbacks=[stuck, watchdog], max_steps=6).fit(Stalling(watchdog),
                                                                                         tiny_loader(n=32))
    assert [(step, timeout) for step, _, timeout in watchdog.hangs] == [(4, 0.6)]
    (record,) = [r for r in caplog.records if r.name == "lightning_resilient.watchdog"]
    message = record.getMessage()
    assert f"at global step 4: a hang (timeout 0.6 s, {why}" in message
    main_thread = message.split("--- thread MainThread")[1].split("--- thread")[0]
    assert "in on_train_epoch_end" in main_thread  # where it was stuck


def test_the_timeout_follows_the_step_times(tmp_path, caplog):
    # Steps of at least 20 ms: 50 of them are at least 1 s, above the 0.1 s floor.
    watchdog = HangWatchdog(factor=50, min_timeout_seconds=0.1, warmup_steps=2, exit_code=None)
    with caplog.at_level(logging.ERROR, logger="lightning_resilient.watchdog"):
        fit(tmp_path, Stalling(watchdog, hang_at=7, slow_at=tuple(range(7)), slow=0.02), watchdog)
    ((step, idle, timeout),) = watchdog.hangs
    assert step == 7 and timeout >= 50 * 0.02 and idle > timeout
    (record,) = [r for r in caplog.records if r.name == "lightning_resilient.watchdog"]
    assert f"(timeout {timeout:.1f} s, from max(50 x median step " in record.getMessage()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"timeout_seconds": 0}, "timeout_seconds must be > 0"),
    ({"factor": 1}, "factor must be > 1"),
    ({"warmup_steps": -1}, "warmup_steps must be"),
    ({"exit_code": 0}, "exit_code must be"),
    ({"exit_code": 256}, "exit_code must be"),
    ({"window": 0}, "window must be"),
    ({"startup_timeout_seconds": -5}, "startup_timeout_seconds must be > 0"),
    ({"epoch_boundary_timeout_seconds": 0}, "epoch_boundary_timeout_seconds must be > 0"),
])
def test_bad_settings_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HangWatchdog(**kwargs)


@pytest.mark.slow
def test_a_hang_ends_the_process_with_its_exit_status_and_the_ledger_records_it(tmp_path):
    root = tmp_path / "root"
    options = {"max_steps": 20, "every": 2, "hang_at": 5, "hang_timeout": 1.0}
    proc = procs.run([sys.executable, str(TESTS / "restart_child.py"), str(root), str(tmp_path / "run"),
                      json.dumps(options)], capture_output=True, text=True, timeout=240,
                     env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    assert proc.returncode == HANG_EXIT_CODE == 75, proc.stderr[-3000:]
    assert "HANGING at step 5" in proc.stdout
    err = proc.stderr
    assert "HangWatchdog: no training progress for " in err and "at global step 5: a hang" in err
    assert f"exiting with status {HANG_EXIT_CODE}" in err
    assert "in training_step" in err and "time.sleep(600)" in err  # where it was stuck
    store = open_store(str(root), {}, RetryPolicy())
    (attempt,) = list_attempts(store)
    record = read_record(store, attempt, 0)
    assert record.end == "hang" and record.ended is not None and record.ended.startswith("hang: no training progress")
    assert record.progress is not None and record.progress.step == 5
    assert main(["goodput", str(root), "--json"]) == 0
