"""The goodput ledger's measurements: where one rank's attempt spent its time, kept in its attempt record.

:class:`AttemptTimer` is fed by ``ResumeStateCallback``'s hooks and writes into the rank's
:class:`~lightning_resilient.state.attempts.AttemptLog` (the record the resume audit keeps; there is no second one).
``state/goodput.py`` reads the records back and adds them up. What is measured, and how:

- **startup** (a restore, when the attempt resumed): from the fit's start (the callback's ``setup``, before Lightning
  loads the checkpoint) to its first training batch: the checkpoint's load, the loaders' start, the sanity check.
  Where ``AtomicCheckpointIO`` loaded the checkpoint, its own load time (``LoadStats``), commit and tier are kept too.
  What happened before the fit (the process's start, imports, the model's construction) shows as the gap between
  attempts.
- **progress**: at the end of every optimizer step, the global step and this host's clock
  (:meth:`AttemptLog.progress`: on local disk every step, on an object store with the record's next flush). A
  restart recomputes the steps from the checkpoint it resumes to the last progress of the attempt before.
- **step time**: between the ends of consecutive optimizer steps, unless a save or a validation ran between them
  (their time is not a step's); the median of the last :data:`WINDOW`.
- **own time**: a batch's fetch (from the previous batch's end, or from the end of the save or validation that ran
  after it) plus its forward (to the first ``backward``). Under data parallelism this is the part of a step each
  rank does alone: the backward waits for the slowest rank's gradients, so whole steps take the same time on every
  rank and only this part tells a slow rank from the others. (The first batch of a fit has no fetch of its own: the
  loader's start.)
- **save stalls**: each ``trainer.save_checkpoint`` call, timed around, as ``CheckpointCadence`` times it: what the
  loop waits for (the whole write with a synchronous plugin, the hand-off and any wait for the previous upload with an
  asynchronous one). The saves of one global step (``save_last`` beside a top-k save) are one checkpoint.

Stragglers (:func:`find_stragglers`): at each save every rank's median own time is gathered (one small collective);
a rank whose median exceeds ``factor`` times the median of the other ranks' medians (and by more than the timer's
noise) is reported: in the log (a warning the first time for a rank, then at DEBUG) and in rank 0's record.

Nothing here raises into training, and nothing imports torch or Lightning (the records are read by the CLI).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lightning_resilient.state.attempts import AttemptLog, Progress, StragglerReport, Timings

__all__ = ["AttemptTimer", "WINDOW", "end_of", "find_stragglers"]

log = logging.getLogger(__name__)

WINDOW = 64  # recent steps (and batches) the medians are taken over
_CHECKPOINTS = 16  # newest checkpoints kept in the record: what a restart's lost work is measured from
_STRAGGLERS = 16  # newest straggler reports kept in rank 0's record
_MIN_SAMPLES = 5  # batches a rank must have timed before it is compared with the others
_MIN_GAP = 0.002  # seconds: a difference below this is the timer's noise, whatever the ratio


def end_of(exception: BaseException | None) -> str:
    """How a fit that raised ``exception`` (None: returned) ended, as one of ``attempts.END_KINDS``."""
    if exception is None:
        return "finished"
    names = {cls.__name__ for cls in type(exception).__mro__}
    if names & {"PreemptedExit", "SIGTERMException"}:  # PreemptionCheckpoint's exit; Lightning's SIGTERM handling
        return "preempted"
    return "interrupted" if isinstance(exception, KeyboardInterrupt) else "error"


def find_stragglers(seconds: Sequence[float | None], *, step: int, factor: float, min_gap: float = _MIN_GAP,
                    batches: Sequence[int] | None = None) -> list[StragglerReport]:
    """The ranks whose median own time (``seconds[rank]``; None: not enough batches timed) exceeds ``factor`` times
    the median of the other ranks' medians, and by at least ``min_gap`` seconds (``batches[rank]``: how many batches
    each median is over, for the report)."""
    known = [(rank, value) for rank, value in enumerate(seconds) if value is not None]
    if len(known) < 2:
        return []
    out = []
    for rank, value in known:
        others = statistics.median(v for r, v in known if r != rank)
        if value > factor * others and value - others >= min_gap:
            out.append(StragglerReport(step, rank, value, others, batches[rank] if batches is not None else None))
    return out


class AttemptTimer:
    """One rank's timings of one attempt (see the module docstring), written into its attempt record.

    The callback calls :meth:`fit_started` at its setup, :meth:`attach` once the record is open, then per batch
    :meth:`batch_started`, :meth:`before_backward` and :meth:`batch_ended`; :meth:`paused` and :meth:`resumed`
    around a validation; :meth:`save_started`/:meth:`save_ended` around each save, then :meth:`check_stragglers`
    (a collective).
    """

    def __init__(self, *, rank: int, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.perf_counter) -> None:
        self.rank = rank
        self._clock, self._mono = clock, monotonic
        self.log: AttemptLog | None = None
        self._fit_wall: float | None = None
        self._fit_mono: float | None = None
        self._first: tuple[int, float, float | None] | None = None  # (global step, clock, seconds since fit start)
        self._load: tuple[str | None, str | None, float | None] = (None, None, None)  # (commit, tier, seconds)
        self._steps = 0
        self._last_step: int | None = None
        self._step_mark: float | None = None  # the last optimizer step's end; None after a pause (save, validation)
        self._batch_end: float | None = None  # the last batch's end; None after a pause
        self._batch_start: float | None = None
        self._fetch: float | None = None  # this batch's fetch, when it was timed
        self._forward_timed = True
        self.step_durations: deque[float] = deque(maxlen=WINDOW)
        self.own_durations: deque[float] = deque(maxlen=WINDOW)
        self._save_seconds = 0.0
        self._saves = 0
        self._checkpoints: deque[tuple[int, float, float]] = deque(maxlen=_CHECKPOINTS)
        self.stragglers: list[StragglerReport] = []
        self._warned: set[int] = set()

    # -- the attempt ---------------------------------------------------------------------------------------------
    def fit_started(self) -> None:
        self._fit_wall, self._fit_mono = self._clock(), self._mono()

    def attach(self, log: AttemptLog | None, *, loaded: tuple[str | None, str | None, float | None] | None = None
               ) -> None:
        """Write into ``log`` from now on; ``loaded``: (commit, tier, seconds) of the checkpoint plugin's load."""
        self.log = log
        if loaded is not None:
            self._load = loaded
        self._write()

    def timings(self) -> Timings:
        first = self._first
        commit, tier, load = self._load
        return Timings(
            fit_started=self._fit_wall, first_step=first[0] if first else None,
            first_step_at=first[1] if first else None,
            restore_seconds=first[2] if first else None, load_seconds=load, resumed_commit=commit, resumed_tier=tier,
            steps=self._steps, step_seconds=_median(self.step_durations), own_seconds=_median(self.own_durations),
            save_seconds=self._save_seconds, saves=self._saves, checkpoints=tuple(self._checkpoints))

    def _write(self) -> None:
        if self.log is not None:
            self.log.update(timings=self.timings())

    # -- each batch ----------------------------------------------------------------------------------------------
    def batch_started(self, step: int) -> None:
        now = self._mono()
        if self._first is None:  # (its fetch is the loader's start: not a step's fetch)
            since = None if self._fit_mono is None else now - self._fit_mono
            self._first = (step, self._clock(), since)
            self._last_step = step
            self._batch_end = None
            self._write()
        self._fetch = None if self._batch_end is None else now - self._batch_end
        self._batch_start = now
        self._forward_timed = False

    def before_backward(self) -> None:
        if self._forward_timed or self._batch_start is None:
            return  # a later backward of the same batch (manual optimization): its forward is timed once
        self._forward_timed = True
        if self._fetch is not None:
            self.own_durations.append(self._fetch + self._mono() - self._batch_start)

    def batch_ended(self, step: int) -> None:
        now = self._mono()
        last = self._last_step
        if last is not None and step > last:
            if self._step_mark is not None:
                self.step_durations.append((now - self._step_mark) / (step - last))
            self._steps += step - last
            self._step_mark = now
            self._last_step = step
            if self.log is not None:
                self.log.progress(Progress(step, self._clock()))
        self._batch_end = now

    def paused(self) -> None:
        """A validation (or a save) starts: the time until the next batch is not a step's, nor a fetch's until
        :meth:`resumed`."""
        self._step_mark = None
        self._batch_end = None

    def resumed(self) -> None:
        """The validation (or save) is over: the next batch's fetch starts now (its step is still not timed)."""
        self._batch_end = self._mono()

    # -- saves ---------------------------------------------------------------------------------------------------
    def save_started(self) -> float:
        return self._mono()

    def save_ended(self, step: int, started: float) -> None:
        blocked = self._mono() - started
        self._save_seconds += blocked
        if self._checkpoints and self._checkpoints[-1][0] == step:  # another save of the same checkpoint
            self._checkpoints[-1] = (step, self._clock(), self._checkpoints[-1][2] + blocked)
        else:
            self._checkpoints.append((step, self._clock(), blocked))
            self._saves += 1
        self.paused()
        self.resumed()
        self._write()

    def check_stragglers(self, gather: Callable[[Any], list[Any]], *, step: int,
                         factor: float) -> list[StragglerReport]:
        """Compare every rank's median own time (``gather`` is the job's all-gather: every rank calls this at the
        same save); rank 0 logs what it finds and keeps it in its record. Returns the reports (on every rank)."""
        count = len(self.own_durations)
        gathered = gather((_median(self.own_durations) if count >= _MIN_SAMPLES else None, count))
        medians = [g[0] if isinstance(g, tuple) and isinstance(g[0], float) else None for g in gathered]
        counts = [g[1] if isinstance(g, tuple) else 0 for g in gathered]
        reports = find_stragglers(medians, step=step, factor=factor, batches=counts)
        if not reports or self.rank != 0:
            return reports
        for report in reports:
            first = report.rank not in self._warned
            self._warned.add(report.rank)
            log.log(logging.WARNING if first else logging.DEBUG, "straggler: %s%s", report.describe(),
                    "; kept in the goodput ledger (lightning-resilient goodput ROOT); said again at DEBUG level"
                    if first else "")
        self.stragglers = [*self.stragglers, *reports][-_STRAGGLERS:]
        if self.log is not None:
            self.log.update(stragglers=list(self.stragglers))
        return reports


def _median(values: Sequence[float] | deque[float]) -> float | None:
    return statistics.median(values) if values else None
