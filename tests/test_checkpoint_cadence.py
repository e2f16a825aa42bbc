"""CheckpointCadence in real CPU training runs: one measurement per real save, formulas applied to them, adapt."""

from __future__ import annotations

import statistics
import warnings
from typing import Any, ClassVar

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient._units import format_duration
from lightning_resilient.checkpoint_cadence import CheckpointCadence
from lightning_resilient.planning import daly_interval, expected_waste, steps_for_interval, young_interval

from .models import TinyModel, tiny_loader
from .planning import conftest as planning_run
from .planning.conftest import MTBF_SECONDS, SlowIO

# The one CPU training run the TransferAudit tests share (tests/planning/conftest.py), a fixture found here by pytest.
cpu_run = planning_run.cpu_run


def test_one_measurement_per_real_save(cpu_run):
    measurements = cpu_run.cadence.measurements
    assert [m.global_step for m in measurements] == [2, 4, 6]
    assert len(cpu_run.io.durations) == len(measurements)
    for m, inside_io in zip(measurements, cpu_run.io.durations, strict=True):
        assert m.seconds > 0
        # The loop is blocked for the whole IO call, plus Lightning's own work around it (dump, barrier).
        assert m.seconds >= inside_io


def test_the_recommendation_is_the_formulas_applied_to_the_measurements(cpu_run):
    cadence = cpu_run.cadence
    for k, m in enumerate(cadence.measurements):
        # One save per step here, so the checkpoint cost is the median of the saves so far.
        assert m.checkpoint_seconds == statistics.median(x.seconds for x in cadence.measurements[: k + 1])
        assert m.step_seconds is not None and m.step_seconds > 0
        assert m.interval_seconds == daly_interval(m.checkpoint_seconds, MTBF_SECONDS)
        assert m.waste == expected_waste(m.interval_seconds, m.checkpoint_seconds, MTBF_SECONDS)
        assert m.interval_steps == steps_for_interval(m.interval_seconds, m.step_seconds)
        # The present cadence is ModelCheckpoint(every_n_train_steps=2): two steps of training.
        assert m.current_interval_seconds == 2 * m.step_seconds
        assert m.current_waste == expected_waste(2 * m.step_seconds, m.checkpoint_seconds, MTBF_SECONDS)
    # ModelCheckpoint runs after every other callback: at the last save all six steps had been timed.
    assert len(cadence.step_durations) == 6
    assert cadence.measurements[-1].step_seconds == statistics.median(cadence.step_durations)
    assert cadence.step_seconds == statistics.median(cadence.step_durations)
    assert cadence.checkpoint_seconds == cadence.measurements[-1].checkpoint_seconds


def test_a_short_log_line_per_save_and_metrics_on_the_next_step(cpu_run):
    lines = [line for line in cpu_run.logs if line.startswith("CheckpointCadence:")]
    assert [line.split(" save ")[0] for line in lines] == [f"CheckpointCadence: step {s}" for s in (2, 4, 6)]
    for line, m in zip(lines, cpu_run.cadence.measurements, strict=True):
        assert f"Daly: every {m.interval_steps} steps = " in line and "(now every 2 steps: " in line
        assert len(line) < 160  # it was two lines of about 400 characters; the figures are in explain()
    # log_metrics=True: the save at step 4 is logged on step 5; the one at step 6 had no step after it.
    logged = cpu_run.trainer.callback_metrics
    assert float(logged["cadence/interval_seconds"]) == pytest.approx(cpu_run.cadence.measurements[1].interval_seconds,
                                                                      rel=1e-6)
    assert float(logged["cadence/waste"]) == pytest.approx(cpu_run.cadence.measurements[1].waste, rel=1e-6)


def test_save_checkpoint_is_wrapped_only_during_the_run(cpu_run):
    assert cpu_run.probe.seen and all(seen["save_wrapped"] for seen in cpu_run.probe.seen)
    assert "save_checkpoint" not in vars(cpu_run.trainer)
    assert not cpu_run.cadence.decisions  # adapt is off: nothing was changed
    assert cpu_run.checkpoint._every_n_train_steps == 2


def test_adapt_sets_every_n_train_steps_from_the_measured_numbers(tmp_path):
    # An MTBF shorter than half a save (each save sleeps 20 ms): Daly's answer is "save every MTBF", a few steps
    # of the tiny model, so the adapted cadence is exercised by several checkpoints within 12 steps.
    mtbf = 0.005
    io = SlowIO()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    cadence = CheckpointCadence(mtbf_seconds=mtbf, adapt=True, min_steps=3)
    trainer = Trainer(accelerator="cpu", max_steps=12, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[checkpoint, cadence], plugins=[io])
    trainer.fit(TinyModel(), tiny_loader())

    measurements = cadence.measurements
    assert len(measurements) == len(io.durations) >= 2  # every real save, last.ckpt included
    # save_last=True writes a second file at the same step: one checkpoint costs both saves.
    first, second = measurements[0], measurements[1]
    assert first.global_step == second.global_step == 2
    assert second.checkpoint_seconds == first.seconds + second.seconds

    # Replay the rule on the recorded numbers: after each save, every_n_train_steps becomes the formula's value
    # (at least min_steps=3), and every later checkpoint falls on a multiple of the value then in force.
    in_force, expected, previous_step = 2, [], None
    for m in measurements:
        if m.global_step != previous_step:  # the first save of a checkpoint (last.ckpt follows at the same step)
            assert m.global_step % in_force == 0
            previous_step = m.global_step
        assert m.step_seconds is not None
        assert m.checkpoint_seconds >= 2 * mtbf and m.interval_seconds == mtbf == daly_interval(m.checkpoint_seconds,
                                                                                                mtbf)
        formula = steps_for_interval(m.interval_seconds, m.step_seconds)
        assert m.interval_steps == formula
        target = max(3, formula)
        if target != in_force:
            expected.append((m.global_step, in_force, target))
            in_force = target
    assert [(d.global_step, d.old_steps, d.new_steps) for d in cadence.decisions] == expected
    assert expected and expected[0][:2] == (2, 2)  # min_steps=3 forces a change away from 2 at the first save
    assert checkpoint._every_n_train_steps == in_force
    assert all("Daly interval 5 ms at MTBF 5 ms" in d.reason for d in cadence.decisions)


class FakeTrainer:
    """Just what the save wrapper touches."""

    global_step = 7
    is_global_zero = True
    checkpoint_callbacks: ClassVar[list[Any]] = []

    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_checkpoint(self, filepath: str, weights_only: bool | None = None, storage_options: Any = None) -> None:
        self.saved.append(filepath)


def test_teardown_restores_the_method_and_leaves_a_later_wrapper_in_place():
    cadence = CheckpointCadence(mtbf_hours=1, method="young")
    trainer = FakeTrainer()
    cadence.setup(trainer, None, "fit")  # type: ignore[arg-type]
    trainer.save_checkpoint("a.ckpt")
    assert trainer.saved == ["a.ckpt"] and len(cadence.measurements) == 1
    m = cadence.measurements[0]
    assert m.interval_seconds == young_interval(m.checkpoint_seconds, 3600.0)
    assert m.step_seconds is None and m.interval_steps is None  # no step timed: seconds only
    cadence.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    assert "save_checkpoint" not in vars(trainer)

    cadence.setup(trainer, None, "fit")  # type: ignore[arg-type]
    ours = trainer.save_checkpoint
    calls: list[str] = []

    def theirs(filepath: str, *args: Any, **kwargs: Any) -> None:
        calls.append(filepath)
        ours(filepath, *args, **kwargs)

    trainer.save_checkpoint = theirs  # type: ignore[method-assign]
    cadence.on_exception(trainer, None, RuntimeError("boom"))  # type: ignore[arg-type]
    assert vars(trainer)["save_checkpoint"] is theirs  # not torn out from under the later wrapper
    trainer.save_checkpoint("b.ckpt")
    assert calls == ["b.ckpt"] and trainer.saved == ["a.ckpt", "b.ckpt"]
    assert len(cadence.measurements) == 1  # ours passes straight through once restored


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({}, ValueError, "exactly one of mtbf_hours=... or mtbf_seconds="),
    ({"mtbf_hours": 1, "mtbf_seconds": 3600}, ValueError, "exactly one of mtbf_hours"),
    ({"mtbf_hours": 0}, ValueError, "mtbf_hours must be > 0, got 0"),
    ({"mtbf_seconds": float("nan")}, ValueError, "mtbf_seconds must be a finite number"),
    ({"mtbf_hours": "2"}, TypeError, "mtbf_hours must be a number"),
    ({"mtbf_hours": 1, "restart_seconds": -5}, ValueError, "restart_seconds must be >= 0, got -5"),
    ({"mtbf_hours": 1, "method": "optimal"}, ValueError, "method must be 'daly' or 'young', got 'optimal'"),
    ({"mtbf_hours": 1, "adapt": "yes"}, TypeError, "adapt must be True or False"),
    ({"mtbf_hours": 1, "min_steps": 10}, ValueError, "min_steps=10 only bounds what adapt=True sets"),
    ({"mtbf_hours": 1, "adapt": True, "max_steps": 0}, ValueError, "max_steps must be an int >= 1, got 0"),
    ({"mtbf_hours": 1, "adapt": True, "min_steps": 2.5}, TypeError, "min_steps must be an int >= 1"),
    ({"mtbf_hours": 1, "adapt": True, "min_steps": 50, "max_steps": 10}, ValueError,
     r"min_steps \(50\) must be <= max_steps \(10\)"),
])
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        CheckpointCadence(**kwargs)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        CheckpointCadence(2.8)  # type: ignore[misc]


def test_adapt_without_a_step_based_checkpoint_warns_once_at_setup():
    cadence = CheckpointCadence(mtbf_hours=1, adapt=True)
    trainer = FakeTrainer()
    with pytest.warns(RuntimeWarning, match="adapt=True but no ModelCheckpoint saves by every_n_train_steps"):
        cadence.setup(trainer, None, "fit")  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.save_checkpoint("a.ckpt")  # measured, nothing to adapt, no second warning
    assert len(cadence.measurements) == 1 and not cadence.decisions
    cadence.teardown(trainer, None, "fit")  # type: ignore[arg-type]


def test_with_preemption_checkpoint_the_line_says_a_noticed_preemption_costs_one_save(tmp_path, caplog):
    from lightning_resilient import AtomicCheckpointIO, PreemptionCheckpoint

    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                      callbacks=[CheckpointCadence(mtbf_seconds=MTBF_SECONDS), PreemptionCheckpoint(),
                                 ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2)])
    with caplog.at_level("INFO"):
        trainer.fit(TinyModel(), tiny_loader())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CheckpointCadence:")]
    assert len(lines) == 2 and lines[0].startswith("CheckpointCadence: step 2 save ")
    assert "with PreemptionCheckpoint a preemption with notice loses one save, not half an interval" in lines[1]


def test_one_line_per_checkpoint_with_its_change_and_the_figures_behind_it_at_debug_level(tmp_path, caplog):
    # save_last=True saves twice per checkpoint, and adapt changes the cadence at each: once two long lines each.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    cadence = CheckpointCadence(mtbf_seconds=0.005, adapt=True, min_steps=3)
    trainer = Trainer(accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[checkpoint, cadence], plugins=[SlowIO()])
    with caplog.at_level("DEBUG"):
        trainer.fit(TinyModel(), tiny_loader())
    info = [r.getMessage() for r in caplog.records
            if r.levelname == "INFO" and r.getMessage().startswith("CheckpointCadence:")]
    steps = sorted({m.global_step for m in cadence.measurements})  # the adapted cadence decides the later ones
    assert len(steps) >= 2 and len(cadence.measurements) == 2 * len(steps)  # two saves per checkpoint
    assert [line.split(" save ")[0] for line in info] == [f"CheckpointCadence: step {s}" for s in steps]
    first = [m for m in cadence.measurements if m.global_step == 2]
    assert info[0].startswith(f"CheckpointCadence: step 2 save {format_duration(first[1].checkpoint_seconds)};")
    at_2 = [d for d in cadence.decisions if d.global_step == 2]  # min_steps=3 moves it away from 2 at once
    assert info[0].endswith(f"; set every_n_train_steps 2 -> {at_2[-1].new_steps}")
    assert "(now every 2 steps: " in info[0]
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"
             and r.name == "lightning_resilient.checkpoint_cadence"]
    assert len([line for line in debug if "blocked the loop" in line]) == len(cadence.measurements)
    assert any(line.startswith(f"CheckpointCadence: every_n_train_steps 2 -> {at_2[0].new_steps} at step 2")
               for line in debug)
    assert cadence.explain().startswith(f"save at step {steps[-1]} blocked the loop")
    assert "checkpoint cost" in cadence.explain() and "MTBF 5 ms" in cadence.explain()


# -- measured=True: the MTBF of the root's goodput ledger -------------------------------------------------------
def fit_with_ledger(root, cadence: CheckpointCadence, caplog) -> list[str]:
    trainer = Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[SlowIO()],
                      callbacks=[cadence, ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)])
    with caplog.at_level("INFO"):
        trainer.fit(TinyModel(), tiny_loader())
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("CheckpointCadence: MTBF")
            or "using the MTBF given" in r.getMessage()]


def test_measured_uses_the_mtbf_the_roots_goodput_ledger_measured(tmp_path, caplog):
    from lightning_resilient.state.goodput import measure_root

    from .state.test_goodput import FINISHED, KILLED, attempt, store_of, write

    store = store_of(tmp_path / "root")
    write(store, attempt(1, **KILLED))  # killed: a failure without notice
    write(store, attempt(2, **{**FINISHED, "resumed": 200}))
    measured = measure_root(str(tmp_path / "root")).mtbf_seconds
    assert measured is not None and measured != 24 * 3600
    cadence = CheckpointCadence(mtbf_hours=24, measured=True)
    (line,) = fit_with_ledger(tmp_path / "root", cadence, caplog)
    assert cadence.mtbf_seconds == measured and cadence.given_mtbf_seconds == 24 * 3600
    assert line.startswith(f"CheckpointCadence: MTBF {format_duration(measured)}, measured by the goodput ledger of")
    assert "1 failure without notice in" in line and "(instead of the 86400 s (24.0 h) given)" in line
    m = cadence.measurements[0]
    assert m.interval_seconds == daly_interval(m.checkpoint_seconds, measured)


def test_measured_keeps_the_given_mtbf_until_a_failure_and_when_the_ledger_is_damaged(tmp_path, caplog):
    from .state.test_goodput import FINISHED, KILLED, attempt, store_of, write

    cadence = CheckpointCadence(mtbf_hours=24, measured=True)
    (line,) = fit_with_ledger(tmp_path / "fresh", cadence, caplog)  # no earlier attempt at all
    assert cadence.mtbf_seconds == 24 * 3600 and "no failure without notice in the goodput ledger" in line
    caplog.clear()
    store = store_of(tmp_path / "damaged")
    write(store, attempt(1, **KILLED))
    write(store, attempt(2, **{**FINISHED, "resumed": 200}))
    store.write(".lightning_resilient/attempts/a000001-abcdef.r0.jsonl", b"[1, 2]\n")  # the failure's record
    cadence = CheckpointCadence(mtbf_hours=24, measured=True)
    (line,) = fit_with_ledger(tmp_path / "damaged", cadence, caplog)
    assert cadence.mtbf_seconds == 24 * 3600 and "using the MTBF given" in line  # training went on
    assert any("skipped in the goodput ledger" in r.getMessage() and "a000001-abcdef (rank 0)" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
