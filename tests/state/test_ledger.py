"""The goodput ledger's measurements (``state/ledger.py``): what each hook of an attempt adds to the rank's record,
with a clock the test moves; the straggler rule; how an exception is taken for an attempt's end."""

from __future__ import annotations

import logging

import pytest

from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.state.attempts import AttemptLog, AttemptRecord, Progress, StragglerReport, read_record
from lightning_resilient.state.ledger import AttemptTimer, end_of, find_stragglers


class Clock:
    """A clock the test moves: ``wall`` (time.time) and ``mono`` (perf_counter) advance together."""

    def __init__(self) -> None:
        self.now = 1000.0

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now

    def mono(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def timer_with_log(tmp_path, rank: int = 0) -> tuple[AttemptTimer, AttemptLog, Clock]:
    clock = Clock()
    store = open_store(str(tmp_path), {}, RetryPolicy())
    log = AttemptLog(store, AttemptRecord("a000001-abcdef", rank, 2, clock.wall()), flush_seconds=30.0,
                     flush_steps=None)
    log.start()
    timer = AttemptTimer(rank=rank, clock=clock.wall, monotonic=clock.mono)
    return timer, log, clock


def batch(timer: AttemptTimer, clock: Clock, step: int, *, fetch: float, forward: float, rest: float) -> None:
    """One training batch that ends at global step ``step``."""
    clock.tick(fetch)
    timer.batch_started(step - 1)
    clock.tick(forward)
    timer.before_backward()
    clock.tick(rest)
    timer.batch_ended(step)


def test_an_attempt_records_its_restore_progress_steps_and_save_stalls(tmp_path):
    timer, log, clock = timer_with_log(tmp_path)
    timer.fit_started()
    clock.tick(4.0)  # the checkpoint loads, the loaders start
    timer.attach(log, loaded=("last.ckpt/c1-e1-ab", "local", 1.5))
    clock.tick(1.0)
    batch(timer, clock, 6, fetch=0.0, forward=0.1, rest=0.4)  # the first batch: resumed at step 5
    assert timer.timings().restore_seconds == 5.0 and timer.timings().first_step == 5
    for step in (7, 8):
        batch(timer, clock, step, fetch=0.1, forward=0.2, rest=0.2)
    # A save of two files at step 8 (save_last beside the top-k save): one checkpoint, 3 s of stall.
    for seconds in (2.0, 1.0):
        started = timer.save_started()
        clock.tick(seconds)
        timer.save_ended(8, started)
    saved_at = clock.wall()
    batch(timer, clock, 9, fetch=0.1, forward=0.2, rest=0.2)  # after a save: its step is not timed, its fetch is
    timer.paused()  # a validation
    clock.tick(30.0)
    timer.resumed()
    batch(timer, clock, 10, fetch=0.1, forward=0.2, rest=0.2)
    batch(timer, clock, 11, fetch=0.1, forward=0.2, rest=0.2)
    t = timer.timings()
    assert t.steps == 6 and t.saves == 1 and t.save_seconds == 3.0
    assert t.checkpoints == ((8, saved_at, 3.0),)  # (its step, when it ended, its stall)
    assert t.step_seconds == pytest.approx(0.5)  # the saves and the validation are in no step's time
    assert t.own_seconds == pytest.approx(0.3)  # fetch + forward, also for the batches after the save and validation
    assert (t.resumed_commit, t.resumed_tier, t.load_seconds) == ("last.ckpt/c1-e1-ab", "local", 1.5)
    # What a SIGKILL now leaves on local disk: the last step reached, when, and the timings of the last save.
    on_disk = read_record(log.store, "a000001-abcdef", 0)
    assert on_disk.progress == Progress(11, clock.wall())
    assert on_disk.timings is not None and on_disk.timings.save_seconds == 3.0 and on_disk.timings.saves == 1
    log.close()


def test_stragglers_are_ranks_consistently_slower_than_the_median_of_the_others():
    reports = find_stragglers([0.010, 0.011, 0.030, 0.010], step=40, factor=1.5, batches=[8, 8, 8, 8])
    assert reports == [StragglerReport(40, 2, 0.030, 0.010, 8)]
    assert find_stragglers([0.010, 0.014], step=1, factor=1.5) == []  # 1.4x: within the factor
    assert find_stragglers([0.0001, 0.0005], step=1, factor=1.5) == []  # 5x, but 0.4 ms: the timer's noise
    assert find_stragglers([0.010, None, 0.050], step=1, factor=1.5)[0].rank == 2  # a rank not timed enough yet
    assert find_stragglers([0.050], step=1, factor=1.5) == []  # alone: slower than no one


def test_the_straggler_check_gathers_every_rank_and_rank_0_logs_and_records_it(tmp_path, caplog):
    timer, log, clock = timer_with_log(tmp_path)
    timer.attach(log)
    for step in range(1, 8):
        batch(timer, clock, step, fetch=0.001, forward=0.002, rest=0.01)
    gathered = []

    def gather(mine):  # the job's all-gather: rank 1 timed 7 batches of 30 ms
        gathered.append(mine)
        return [mine, (0.030, 7)]

    with caplog.at_level(logging.DEBUG, logger="lightning_resilient.state.ledger"):
        first = timer.check_stragglers(gather, step=7, factor=1.5)
        timer.check_stragglers(gather, step=8, factor=1.5)
    assert gathered[0] == (pytest.approx(0.003), 6)  # the first batch has no fetch of its own
    assert [r.rank for r in first] == [1] and first[0].others == pytest.approx(0.003)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "straggler: rank 1 is 10.0x slower than the others at step 7" in warnings[0].message
    assert "over its last 7 batches" in warnings[0].message
    assert [r.step for r in read_record(log.store, "a000001-abcdef", 0).stragglers] == [7, 8]
    log.close()


def test_another_rank_finds_the_same_straggler_but_neither_logs_nor_records_it(tmp_path, caplog):
    timer, log, _ = timer_with_log(tmp_path, rank=1)
    timer.attach(log)
    with caplog.at_level(logging.DEBUG, logger="lightning_resilient.state.ledger"):
        reports = timer.check_stragglers(lambda mine: [(0.030, 9), mine, (0.001, 9)], step=3, factor=1.5)
    assert [r.rank for r in reports] == [0] and not caplog.records
    assert read_record(log.store, "a000001-abcdef", 1).stragglers == []
    log.close()


def test_how_an_exception_ends_an_attempt():
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_resilient.preemption import PreemptedExit

    assert end_of(None) == "finished"
    assert end_of(PreemptedExit(143)) == "preempted" and end_of(SIGTERMException()) == "preempted"
    assert end_of(KeyboardInterrupt()) == "interrupted" and end_of(RuntimeError("gloo")) == "error"


@pytest.mark.parametrize("cadence_first", [True, False], ids=["cadence first", "resume state first"])
def test_the_ledger_and_checkpoint_cadence_time_the_same_saves_and_leave_no_wrapper(tmp_path, cadence_first):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_resilient import AtomicCheckpointIO, CheckpointCadence, ResumeStateCallback
    from lightning_resilient.state.attempts import list_attempts

    from ..models import TinyModel, tiny_loader

    cadence, state = CheckpointCadence(mtbf_hours=1), ResumeStateCallback()
    callbacks = [cadence, state] if cadence_first else [state, cadence]
    trainer = Trainer(accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                      callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(TinyModel(), tiny_loader())
    assert "save_checkpoint" not in vars(trainer)  # both wrappers gone, in either order: the Trainer pickles
    store = open_store(str(tmp_path), {}, RetryPolicy())
    (attempt,) = list_attempts(store)
    timings = read_record(store, attempt, 0).timings
    assert timings is not None and timings.saves == len(cadence.measurements) == 3
    assert [c[0] for c in timings.checkpoints] == [m.global_step for m in cadence.measurements]
