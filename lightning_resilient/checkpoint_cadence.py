"""``CheckpointCadence``: measure what each checkpoint really costs the training loop and say how often to save.

The cost that matters is the time the loop is blocked in ``trainer.save_checkpoint``: the whole write with a
synchronous CheckpointIO, only the hand-off (plus any wait for the previous save) with an asynchronous one. The
callback times every call, times the optimizer steps in between, and from a given MTBF computes the optimal
interval (:func:`~lightning_resilient.planning.cadence.daly_interval` by default) and the expected waste of the
present cadence. With ``adapt=True`` it also sets the interval, in steps, on the trainer's step-based
``ModelCheckpoint`` callbacks. With ``measured=True`` the MTBF is the one the goodput ledger of the checkpoint root
measured (``state/goodput.py``), once it has seen a failure; the given one until then.

This module owns the callback and its records (``SaveMeasurement``, ``CadenceDecision``); the formulas are
``planning/cadence.py``'s. It sits above both ``planning/`` and ``state/``, whose ledger it reads, so that
``planning/`` never imports ``state/``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient._checks import check_bool, check_non_negative, check_positive, check_positive_int
from lightning_resilient._namespaces import require_lightning_pytorch
from lightning_resilient._units import format_duration, format_percent, plural
from lightning_resilient._warnings import warn
from lightning_resilient.planning.cadence import daly_interval, expected_waste, steps_for_interval, young_interval
from lightning_resilient.state.goodput import measure_root

__all__ = ["CadenceDecision", "CheckpointCadence", "Method", "SaveMeasurement"]

log = logging.getLogger(__name__)

Method = Literal["daly", "young"]
_FORMULAS: dict[str, Callable[[float, float], float]] = {"daly": daly_interval, "young": young_interval}
_TITLES = {"daly": "Daly", "young": "Young"}
# Estimates are medians over recent history: robust to the first (cold) save, a step that ran validation, and
# slow drift of either cost over a long run.
_SAVE_WINDOW = 32  # checkpoint events (global steps with a save)
_STEP_WINDOW = 512  # optimizer steps


@dataclass(frozen=True)
class SaveMeasurement:
    """One real save, and the recommendation computed right after it.

    Attributes:
        global_step: the trainer's ``global_step`` at the save.
        seconds: how long this ``trainer.save_checkpoint`` call blocked the training loop.
        checkpoint_seconds: the estimate of ``C`` used below: the median, over recent steps with a save, of the
            blocking time of all saves at one step (``save_last=True`` writes twice per checkpoint).
        step_seconds: the estimate of one optimizer step's wall time (median of recent steps, saves excluded),
            or None before any step was timed.
        interval_seconds: the recommended compute time between checkpoints.
        interval_steps: that interval in optimizer steps (before ``min_steps``/``max_steps``), or None without a
            step time.
        waste: the expected waste at the recommended interval.
        current_interval_seconds: the present cadence in seconds (``every_n_train_steps`` x step time, or the
            observed time since the previous checkpoint), or None when unknown.
        current_waste: the expected waste at the present cadence, or None when unknown.
    """

    global_step: int
    seconds: float
    checkpoint_seconds: float
    step_seconds: float | None
    interval_seconds: float
    interval_steps: int | None
    waste: float
    current_interval_seconds: float | None
    current_waste: float | None


@dataclass(frozen=True)
class CadenceDecision:
    """A change ``adapt=True`` made to a ``ModelCheckpoint``'s ``every_n_train_steps``, and why."""

    global_step: int
    old_steps: int
    new_steps: int
    reason: str


class CheckpointCadence(Callback):
    """Measure the real cost of each checkpoint and recommend (or, with ``adapt=True``, set) how often to save.

    Every ``trainer.save_checkpoint`` call is timed (the wall time the training loop waits, sync or async
    CheckpointIO alike), and so is every optimizer step. From them and the given MTBF it computes the optimal
    interval (Daly 2006 by default, Young 1974 with ``method="young"``) in seconds and steps, and the expected waste
    at that interval and at the present cadence. With ``adapt=True`` it sets that many steps on every
    ``ModelCheckpoint`` that saves by ``every_n_train_steps``, within ``min_steps``/``max_steps``. Under DDP rank 0's
    decision is broadcast, so every rank saves at the same steps.

    It logs one short line per checkpoint (all the saves of one step, such as a ``save_last`` copy, together), once
    they are done: ``CheckpointCadence: step 200 save 1.2 s; Daly: every 850 steps = 738.0 s (12.3 min), wastes
    1.20% (now every 100 steps: 2.90%)``, plus the change ``adapt`` made. The reasoning behind each number (the
    checkpoint cost and step time estimates, the MTBF) goes to the ``lightning_resilient.checkpoint_cadence``
    logger at DEBUG level, and :meth:`explain` gives it for the latest save; :attr:`measurements` and
    :attr:`decisions` hold every figure.

    Example::

        cadence = CheckpointCadence(mtbf_hours=2.8, restart_seconds=120, adapt=True, min_steps=50)
        trainer = Trainer(callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=500), cadence])
        trainer.fit(model)
        print(cadence.measurements[-1].interval_seconds, cadence.decisions)

    A changed ``every_n_train_steps`` takes effect at its next multiple of the global step (Lightning saves when
    ``global_step % every_n_train_steps == 0``), and is not stored in the checkpoint: a resumed run starts from the
    configured value and adapts again after its first save.

    Measured MTBF (``measured=True``): when training starts, the goodput ledger that ``ResumeStateCallback`` keeps in
    the first ``ModelCheckpoint``'s dirpath is read (one record per earlier attempt, on global rank 0, broadcast),
    and once it has seen a failure without notice (an attempt killed, or ended by an error or a hang, or preempted
    without an emergency save) its MTBF (the attempts' time over their failures) replaces the given one for this
    fit; the given ``mtbf_hours``/``mtbf_seconds`` is the estimate until then. One line says which is used
    (:attr:`mtbf_source`). A ledger that cannot be read is reported and the given MTBF used; training goes on.

    Args:
        mtbf_hours: the job's mean time between failures (of all its nodes together), in hours...
        mtbf_seconds: ...or in seconds; give exactly one.
        restart_seconds: time from a failure to training again (reschedule, start, load); changes the waste,
            not the optimal interval.
        method: ``"daly"`` (higher order, the default) or ``"young"``.
        adapt: set the recommended interval on the step-based ``ModelCheckpoint`` callbacks.
        min_steps: with ``adapt``, never save less than this many steps apart.
        max_steps: with ``adapt``, never save more than this many steps apart.
        log_metrics: also ``pl_module.log`` ``cadence/save_seconds``, ``cadence/interval_seconds``,
            ``cadence/waste`` (and ``cadence/current_waste``) on the training step after each save.
        measured: use the MTBF measured by the checkpoint root's goodput ledger once it has one (see above); the
            given MTBF until then.
    """

    def __init__(
        self,
        *,
        mtbf_hours: float | None = None,
        mtbf_seconds: float | None = None,
        restart_seconds: float = 0.0,
        method: Method = "daly",
        adapt: bool = False,
        min_steps: int | None = None,
        max_steps: int | None = None,
        log_metrics: bool = False,
        measured: bool = False,
    ) -> None:
        super().__init__()
        if (mtbf_hours is None) == (mtbf_seconds is None):
            raise ValueError("give exactly one of mtbf_hours=... or mtbf_seconds=... (the job's mean time between"
                             f" failures), got mtbf_hours={mtbf_hours!r}, mtbf_seconds={mtbf_seconds!r}")
        if mtbf_hours is not None:
            self.mtbf_seconds = check_positive("mtbf_hours", mtbf_hours) * 3600.0
        else:
            self.mtbf_seconds = check_positive("mtbf_seconds", mtbf_seconds)
        self.restart_seconds = check_non_negative("restart_seconds", restart_seconds)
        self.measured = check_bool("measured", measured)
        #: The MTBF given (``mtbf_hours``/``mtbf_seconds``); :attr:`mtbf_seconds` is the one in use.
        self.given_mtbf_seconds = self.mtbf_seconds
        #: Where :attr:`mtbf_seconds` comes from: ``"given"``, or what the ledger measured it from.
        self.mtbf_source = "given"
        if method not in _FORMULAS:
            raise ValueError(f"method must be 'daly' or 'young', got {method!r}")
        adapt = check_bool("adapt", adapt)
        log_metrics = check_bool("log_metrics", log_metrics)
        for name, bound in (("min_steps", min_steps), ("max_steps", max_steps)):
            if bound is not None:
                check_positive_int(name, bound)
                if not adapt:
                    raise ValueError(f"{name}={bound} only bounds what adapt=True sets: pass adapt=True or drop it")
        if min_steps is not None and max_steps is not None and min_steps > max_steps:
            raise ValueError(f"min_steps ({min_steps}) must be <= max_steps ({max_steps})")
        self.method: Method = method
        self.adapt = adapt
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.log_metrics = log_metrics
        self.measurements: list[SaveMeasurement] = []
        self.decisions: list[CadenceDecision] = []
        self.step_durations: deque[float] = deque(maxlen=_STEP_WINDOW)
        self._events: deque[tuple[int, float]] = deque(maxlen=_SAVE_WINDOW)  # (global_step, summed blocking s)
        self._trainer: Trainer | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._replaced: Any = None  # what trainer.save_checkpoint was as an instance attribute, if anything
        self._had_instance_attr = False
        self._mark: tuple[float, int] | None = None  # (time, global_step) at the last timed step boundary
        self._blocked_since_mark = 0.0
        self._last_event_end: float | None = None
        self._observed_interval: float | None = None
        self._logged = 0  # measurements already sent to pl_module.log
        self._warned_nothing_to_adapt = False
        self._pending: int | None = None  # the step of saves not said yet (a save_last copy may follow at that step)
        self._noted_preemption = False

    # -- estimates -----------------------------------------------------------------------------------------------
    @property
    def checkpoint_seconds(self) -> float | None:
        """The current estimate of ``C``: median blocking time per checkpoint (all saves at one step summed)."""
        return statistics.median(s for _, s in self._events) if self._events else None

    @property
    def step_seconds(self) -> float | None:
        """The current estimate of one optimizer step's wall time (saves excluded), or None before one was timed."""
        return statistics.median(self.step_durations) if self.step_durations else None

    # -- hooks ---------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_lightning_pytorch(trainer, "CheckpointCadence")
        self._restore()
        self._trainer = trainer
        self._had_instance_attr = "save_checkpoint" in vars(trainer)
        self._replaced = vars(trainer).get("save_checkpoint")
        inner = trainer.save_checkpoint

        def timed_save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            if self._wrapper is not timed_save_checkpoint:  # restored underneath another wrapper: stay out of it
                return inner(*args, **kwargs)
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            end = time.perf_counter()
            self._on_save(trainer, start, end)
            return result

        self._wrapper = timed_save_checkpoint
        # An instance attribute shadows the method: every caller (ModelCheckpoint, user code) goes through it.
        trainer.save_checkpoint = timed_save_checkpoint  # type: ignore[method-assign]
        if self.adapt and not self._step_checkpoints(trainer):
            self._warned_nothing_to_adapt = True
            warn("CheckpointCadence: adapt=True but no ModelCheckpoint saves by every_n_train_steps, so there"
                 " is nothing to adapt; use ModelCheckpoint(every_n_train_steps=...) to let it set the"
                 " cadence", RuntimeWarning, rank_zero=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.mtbf_seconds, self.mtbf_source = self.given_mtbf_seconds, "given"
        if self.measured:
            self._use_measured_mtbf(trainer)
        now = time.perf_counter()
        self._mark = (now, trainer.global_step)
        self._blocked_since_mark = 0.0
        self._last_event_end = now

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning runs ModelCheckpoint after every other callback, so a save at this step has not happened yet:
        # it lands in the next span and is subtracted there. The saves of an earlier step are all done.
        if self._pending is not None and self._pending != trainer.global_step:
            self._say(trainer)
        now = time.perf_counter()
        if self._mark is not None and trainer.global_step > self._mark[1]:
            steps = trainer.global_step - self._mark[1]  # > 1 never happens per batch; accumulation gives 0 or 1
            self.step_durations.append(max(0.0, now - self._mark[0] - self._blocked_since_mark) / steps)
            self._mark = (now, trainer.global_step)
            self._blocked_since_mark = 0.0
        if self.log_metrics and self._logged < len(self.measurements):
            self._logged = len(self.measurements)
            m = self.measurements[-1]
            metrics = {"cadence/save_seconds": m.checkpoint_seconds, "cadence/interval_seconds": m.interval_seconds,
                       "cadence/waste": m.waste}
            if m.current_waste is not None:
                metrics["cadence/current_waste"] = m.current_waste
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._say(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._say(trainer)
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._say(trainer)  # an emergency save, then its exit: said too
        self._restore()  # Lightning skips teardown hooks when fit raises

    def explain(self) -> str:
        """The latest save's recommendation with the figures behind it (what DEBUG logging shows per save)."""
        if not self.measurements:
            return "no save measured yet"
        m = self.measurements[-1]
        every_n = [cb._every_n_train_steps for cb in self._step_checkpoints(self._trainer)] if self._trainer else []
        return self._describe(m, every_n)

    # -- internals -----------------------------------------------------------------------------------------------
    def _use_measured_mtbf(self, trainer: Trainer) -> None:
        """The MTBF of the root's goodput ledger, read on rank 0 and broadcast (every rank reaches this hook)."""
        found: tuple[float | None, str] | None = None
        if trainer.is_global_zero:
            found = _measured_mtbf(trainer)
        found = trainer.strategy.broadcast(found, src=0)
        if found is None:
            return
        mtbf, why = found
        given = format_duration(self.given_mtbf_seconds)
        if mtbf is None:
            rank_zero_info(f"CheckpointCadence: {why}: using the MTBF given, {given}")
            return
        self.mtbf_seconds, self.mtbf_source = mtbf, why
        rank_zero_info(f"CheckpointCadence: MTBF {format_duration(mtbf)}, {why} (instead of the {given} given)")

    def _restore(self) -> None:
        trainer, wrapper = self._trainer, self._wrapper
        self._trainer = self._wrapper = None
        if trainer is None or wrapper is None:
            return
        if vars(trainer).get("save_checkpoint") is wrapper:
            if self._had_instance_attr:
                trainer.save_checkpoint = self._replaced  # type: ignore[method-assign]
            else:
                del trainer.save_checkpoint
        # Otherwise someone wrapped it after us; removing ours would drop theirs. Ours now passes straight through.

    @staticmethod
    def _step_checkpoints(trainer: Trainer) -> list[ModelCheckpoint]:
        return [cb for cb in trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb._every_n_train_steps >= 1]

    def _on_save(self, trainer: Trainer, start: float, end: float) -> None:
        seconds = end - start
        step = trainer.global_step
        self._blocked_since_mark += seconds
        if self._events and self._events[-1][0] == step:  # a second save at the same step (e.g. save_last)
            self._events[-1] = (step, self._events[-1][1] + seconds)
        else:
            if self._last_event_end is not None:
                self._observed_interval = max(0.0, start - self._last_event_end)
            self._events.append((step, seconds))
        self._last_event_end = end

        c = self.checkpoint_seconds
        assert c is not None
        c = max(c, 1e-9)  # a save too fast for the clock still costs something; keeps the formulas defined
        step_s = self.step_seconds
        interval = _FORMULAS[self.method](c, self.mtbf_seconds)
        waste = expected_waste(interval, c, self.mtbf_seconds, self.restart_seconds)
        interval_steps = steps_for_interval(interval, step_s) if step_s else None
        every_n = [cb._every_n_train_steps for cb in self._step_checkpoints(trainer)]
        current: float | None
        current = min(every_n) * step_s if every_n and step_s else self._observed_interval or None
        current_waste = (expected_waste(current, c, self.mtbf_seconds, self.restart_seconds)
                         if current else None)
        m = SaveMeasurement(global_step=step, seconds=seconds, checkpoint_seconds=c, step_seconds=step_s,
                            interval_seconds=interval, interval_steps=interval_steps, waste=waste,
                            current_interval_seconds=current, current_waste=current_waste)
        self.measurements.append(m)
        if trainer.is_global_zero:
            log.debug("CheckpointCadence: %s", self._describe(m, every_n))
        if self.adapt:
            self._adapt(trainer, m)
        self._pending = step

    def _say(self, trainer: Trainer) -> None:
        """One short line for the saves of the pending step, now that they are all done (see the class)."""
        step, self._pending = self._pending, None
        if step is None or not self.measurements:
            return
        m = self.measurements[-1]  # its estimates include every save of the step
        first = next(x for x in self.measurements if x.global_step == step)  # the cadence in force before them
        changes = [d for d in self.decisions if d.global_step == step]
        blocked = next((s for at, s in reversed(self._events) if at == step), m.seconds)  # all saves at that step
        steps = f"every {plural(m.interval_steps, 'step')} = {format_duration(m.interval_seconds)}" \
            if m.interval_steps is not None else f"every {format_duration(m.interval_seconds)}"
        line = (f"CheckpointCadence: step {step} save {format_duration(blocked)}; {_TITLES[self.method]}: {steps},"
                f" wastes {format_percent(m.waste)}")
        if first.current_interval_seconds:
            every_n = [cb._every_n_train_steps for cb in self._step_checkpoints(trainer)]
            before = changes[0].old_steps if changes else min(every_n) if every_n else None
            now = plural(before, "step") if before and m.step_seconds else format_duration(
                first.current_interval_seconds)
            waste = expected_waste(first.current_interval_seconds, m.checkpoint_seconds, self.mtbf_seconds,
                                   self.restart_seconds)
            line += f" (now every {now}: {format_percent(waste)})"
        if changes:
            line += f"; set every_n_train_steps {changes[0].old_steps} -> {changes[-1].new_steps}"
        rank_zero_info(line)
        if not self._noted_preemption and any(type(cb).__name__ == "PreemptionCheckpoint"
                                              for cb in getattr(trainer, "callbacks", [])):
            # The interval guards against failures without warning; a preemption with a notice costs the
            # emergency save instead of half an interval of recomputation. Said once.
            self._noted_preemption = True
            rank_zero_info("CheckpointCadence: with PreemptionCheckpoint a preemption with notice loses one save,"
                           " not half an interval: count only failures without notice in the MTBF")

    def _describe(self, m: SaveMeasurement, every_n: list[int]) -> str:
        step_part = f", step {format_duration(m.step_seconds)}" if m.step_seconds else ""
        steps_part = f" ({plural(m.interval_steps, 'step')})" if m.interval_steps is not None else ""
        if m.current_interval_seconds is None:
            present = "present cadence unknown"
        else:
            how = f"every {plural(min(every_n), 'step')}, " if every_n and m.step_seconds else ""
            present = (f"present cadence ({how}{format_duration(m.current_interval_seconds)}) wastes"
                       f" {format_percent(m.current_waste or 0.0)}")
        return (f"save at step {m.global_step} blocked the loop {format_duration(m.seconds)} (checkpoint cost"
                f" {format_duration(m.checkpoint_seconds)}{step_part}, MTBF {format_duration(self.mtbf_seconds)});"
                f" {_TITLES[self.method]} interval {format_duration(m.interval_seconds)}{steps_part} wastes"
                f" {format_percent(m.waste)}; {present}")

    def _adapt(self, trainer: Trainer, m: SaveMeasurement) -> None:
        targets = self._step_checkpoints(trainer)
        if not targets:
            if not self._warned_nothing_to_adapt:
                self._warned_nothing_to_adapt = True
                warn("CheckpointCadence: adapt=True but no ModelCheckpoint saves by every_n_train_steps;"
                     " nothing to adapt", RuntimeWarning, rank_zero=True)
            return
        if m.interval_steps is None:
            rank_zero_info("CheckpointCadence: keeping every_n_train_steps for now: no optimizer step timed yet")
            return
        new = m.interval_steps
        why = (f"{_TITLES[self.method]} interval {format_duration(m.interval_seconds)} at MTBF"
               f" {format_duration(self.mtbf_seconds)}, checkpoint {format_duration(m.checkpoint_seconds)}, step"
               f" {format_duration(m.step_seconds or 0.0)} -> {new} step{'' if new == 1 else 's'}")
        if self.min_steps is not None and new < self.min_steps:
            new, why = self.min_steps, f"{why}, raised to min_steps={self.min_steps}"
        if self.max_steps is not None and new > self.max_steps:
            new, why = self.max_steps, f"{why}, capped at max_steps={self.max_steps}"
        # Ranks time slightly different saves and steps; all of them must save at the same steps (a save is a
        # collective), so rank 0 decides. Every rank gets here: saves happen on all ranks at the same step.
        new = int(trainer.strategy.broadcast(new, src=0))
        for cb in targets:
            old = cb._every_n_train_steps
            if old == new:
                continue
            cb._every_n_train_steps = new
            self.decisions.append(CadenceDecision(global_step=m.global_step, old_steps=old, new_steps=new,
                                                  reason=why))
            if trainer.is_global_zero:
                log.debug("CheckpointCadence: every_n_train_steps %d -> %d at step %d (%s)", old, new,
                          m.global_step, why)


def _measured_mtbf(trainer: Trainer) -> tuple[float | None, str]:
    """(the MTBF the goodput ledger of the trainer's checkpoint root measured, or None; where it came from, or why
    there is none). Never raises: a ledger that cannot be read leaves the given MTBF in use."""
    root = next((str(cb.dirpath) for cb in trainer.checkpoint_callbacks
                 if isinstance(cb, ModelCheckpoint) and cb.dirpath), None)
    if root is None:
        return None, "measured=True, but no ModelCheckpoint has a dirpath whose goodput ledger could be read"
    plugin = trainer.strategy.checkpoint_io
    while not hasattr(plugin, "storage_options") and hasattr(plugin, "checkpoint_io"):  # AsyncCheckpointIO
        plugin = plugin.checkpoint_io
    try:
        ledger = measure_root(root, getattr(plugin, "storage_options", None))
    except Exception as exc:  # the ledger never stops training
        log.warning("CheckpointCadence: the goodput ledger of %s could not be read (%s)", root, exc)
        return None, f"the goodput ledger of {root} could not be read"
    for why in ledger.skipped:
        log.warning("CheckpointCadence: skipped in the goodput ledger of %s: %s", root, why)
    attempts = sum(a.seconds for a in ledger.attempts)
    if ledger.mtbf_seconds is None:
        return None, (f"no failure without notice in the goodput ledger of {root} yet"
                      f" ({plural(len(ledger.attempts), 'attempt')}, {format_duration(attempts)})")
    return ledger.mtbf_seconds, (f"measured by the goodput ledger of {root}:"
                                 f" {plural(ledger.failures, 'failure')} without notice in"
                                 f" {format_duration(attempts)} of {plural(len(ledger.attempts), 'attempt')}")
