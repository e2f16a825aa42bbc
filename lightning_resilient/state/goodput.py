"""The goodput ledger, read back: what each attempt of a training run cost, added up from the attempt records.

Each attempt's figures come from its attempt record (``state/attempts.py``; rank 0's, or the lowest rank with a
readable one; ``state/ledger.py`` says how each is measured). An attempt's time splits into:

- **restore**: from the fit's start to its first training step (the checkpoint's load and the loaders' start; for
  the first attempt, its startup);
- **save stalls**: the time ``trainer.save_checkpoint`` blocked the loop;
- **lost work**: what the next attempt recomputed: the steps from the checkpoint it resumed to the last progress
  this attempt recorded, and their time (from that checkpoint's save to the attempt's last record, less the save
  stalls in it; by the median step time where that checkpoint is not among the record's newest);
- **productive**: the rest of its time from the first training step to its last record (validation included);

and between attempts, **downtime**: from one attempt's last record to the next one's fit start (detecting the
failure, rescheduling, starting the process, importing, building the model). The wall time is the sum of all of
these; goodput is productive time over wall time. Each host's clock is used for its own attempt's times; a gap
between attempts that comes out negative (clock skew, two jobs at once) counts as none.

Failures without notice (an attempt killed, or ended by an error or a hang, or preempted without an emergency save,
so that work was recomputed) give the measured MTBF: the attempts' time over their number. The newest attempt,
which may still be running, is never counted as one. With the median save cost (per checkpoint) they give
Young's and Daly's interval (``planning/cadence.py``), which ``lightning-resilient goodput`` prints and
``CheckpointCadence(measured=True)`` uses.

A record that cannot be read (damaged, or written by a newer version) is reported and skipped: the attempt is read
from another rank's record, or left out with the reason. A record is checked as it is read (``attempts.parse_record``:
a header field that is not what a writer writes, a ``resumed_step`` past what the record itself reached, a later
line that changes what the record is), and whatever text of a record is printed goes through :func:`printable`, so
that a damaged or hostile record can neither move the figures unnoticed nor add a row or a line.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_resilient.io.store import Store
from lightning_resilient.planning.cadence import daly_interval, expected_waste, steps_for_interval, young_interval
from lightning_resilient.state.attempts import AttemptRecord, StragglerReport, end_kind, list_records, read_record

__all__ = ["AttemptCost", "Goodput", "Interval", "measure", "measure_root", "printable"]


def printable(value: object) -> str:
    """``value`` (text read from an attempt record: an attempt id, how it ended, a path, a fact, why it was skipped)
    as it may be printed in one table cell or on one line: every character that is not printable (a newline, a tab,
    a terminal's escape sequence, a bidirectional override, a line separator) escaped as a Python string literal
    writes it (backslash-n, backslash-x1b, ...), ``|`` and the backslash itself behind a backslash, so that no record
    adds a row or a line, or moves the terminal's cursor. Used by the ``goodput`` table and by ``ls``."""
    text = str(value)
    if text.isprintable() and "|" not in text and "\\" not in text:
        return text
    return "".join("\\" + c if c in "\\|" else c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


@dataclass(frozen=True)
class AttemptCost:
    """One attempt in the ledger (durations in seconds; clock times as recorded, by the attempt's host)."""

    attempt: str
    rank: int  # the rank whose record it was read from
    world_size: int
    started: float  # the fit's start
    resumed_step: int | None  # None: a fresh start
    resumed_commit: str | None  # the commit folder it loaded, where AtomicCheckpointIO said
    first_step: int  # the global step its first training batch started from
    last_step: int | None  # the global step reached (its last progress record); None: no step recorded
    last_at: float  # its last record: progress, or the end of its last save
    end: str | None  # how it ended (attempts.END_KINDS), None: killed (or running)
    ended: str | None  # the recorded text
    restore_seconds: float
    save_seconds: float
    saves: int
    step_seconds: float | None
    lost_steps: int  # steps of this attempt the next one recomputed
    lost_seconds: float
    downtime_seconds: float  # from the previous attempt's last record to this one's start
    productive_seconds: float
    stragglers: list[StragglerReport] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """The attempt's own time: from its start to its last record."""
        return max(0.0, self.last_at - self.started)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "stragglers"}
        out["seconds"] = self.seconds
        out["stragglers"] = [_straggler_json(s) for s in self.stragglers]
        return out


@dataclass(frozen=True)
class Interval:
    """The checkpoint interval the measured figures give."""

    method: str  # "daly"
    seconds: float  # compute seconds between checkpoints
    steps: int | None  # that many optimizer steps, at the measured step time
    waste: float  # expected fraction of the wall time lost at that interval (Daly's model)
    young_seconds: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Goodput:
    """The ledger of one root: every attempt, the totals, and what they say about the checkpoint interval."""

    root: str
    attempts: list[AttemptCost]
    skipped: list[str]  # "attempt (rank r): why", for each record that could not be read
    wall_seconds: float
    productive_seconds: float
    lost_steps: int
    lost_seconds: float
    restore_seconds: float
    save_seconds: float
    downtime_seconds: float
    failures: int  # attempts that failed without notice (see the module docstring)
    preemptions: int  # attempts that ended on a preemption notice with nothing lost
    mtbf_seconds: float | None  # None: no failure measured yet
    save_cost_seconds: float | None  # median time one checkpoint blocked the loop
    step_seconds: float | None  # median optimizer step
    restart_seconds: float | None  # median downtime + restore of the attempts that resumed

    @property
    def goodput(self) -> float | None:
        return self.productive_seconds / self.wall_seconds if self.wall_seconds > 0 else None

    def interval(self) -> Interval | None:
        """Daly's (and Young's) interval from the measured save cost and MTBF; None until both are measured."""
        c, m = self.save_cost_seconds, self.mtbf_seconds
        if c is None or m is None or m <= 0:
            return None
        c = max(c, 1e-9)  # a save too fast for the clock still costs something
        seconds = daly_interval(c, m)
        steps = steps_for_interval(seconds, self.step_seconds) if self.step_seconds else None
        return Interval("daly", seconds, steps, expected_waste(seconds, c, m, self.restart_seconds or 0.0),
                        young_interval(c, m))

    @property
    def stragglers(self) -> list[tuple[str, StragglerReport]]:
        return [(a.attempt, s) for a in self.attempts for s in a.stragglers]

    def to_json(self) -> dict[str, Any]:
        interval = self.interval()
        return {
            "root": self.root, "attempts": [a.to_json() for a in self.attempts], "lost_steps": self.lost_steps,
            "goodput": self.goodput, "wall_seconds": self.wall_seconds, "productive_seconds": self.productive_seconds,
            "lost_seconds": self.lost_seconds, "restore_seconds": self.restore_seconds,
            "save_seconds": self.save_seconds, "downtime_seconds": self.downtime_seconds, "failures": self.failures,
            "preemptions": self.preemptions, "mtbf_seconds": self.mtbf_seconds,
            "save_cost_seconds": self.save_cost_seconds, "step_seconds": self.step_seconds,
            "restart_seconds": self.restart_seconds, "interval": None if interval is None else interval.to_json(),
            "stragglers": [{"attempt": a, **_straggler_json(s)} for a, s in self.stragglers],
            "skipped": list(self.skipped)}

    def table(self) -> str:
        """The ledger as the ``goodput`` command prints it: a table per attempt, then the totals."""
        out = [f"goodput ledger of {self.root}: {len(self.attempts)} attempt(s), oldest first", "",
               ("| attempt | started | ranks | resumed | steps | ended | downtime before | restore | save stalls |"
                " lost steps | lost time | productive |"),
               "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for i, a in enumerate(self.attempts):
            resumed = "fresh start" if a.resumed_step is None else f"step {a.resumed_step}"
            steps = "-" if a.last_step is None else f"{a.first_step} -> {a.last_step}"
            newest = i == len(self.attempts) - 1
            ended = printable(a.end) if a.end else "killed (or running)" if newest else "killed"
            lost = "-" if newest and a.end is None else str(a.lost_steps)
            out.append(f"| {printable(a.attempt)} | {_when(a.started)} | {a.world_size} | {resumed} | {steps} |"
                       f" {ended} | {_duration(a.downtime_seconds) if i else '-'} | {_duration(a.restore_seconds)} |"
                       f" {_duration(a.save_seconds)} ({a.saves}) | {lost} | {_duration(a.lost_seconds)} |"
                       f" {_duration(a.productive_seconds)} |")
        share = self.goodput
        out += ["", (f"wall time {_duration(self.wall_seconds)}: productive {_duration(self.productive_seconds)},"
                     f" lost work {self.lost_steps} step(s) recomputed ({_duration(self.lost_seconds)}), restore"
                     f" {_duration(self.restore_seconds)}, save stalls {_duration(self.save_seconds)}, downtime"
                     f" between attempts {_duration(self.downtime_seconds)}"),
                f"goodput: {'-' if share is None else f'{share * 100:.1f}%'}"]
        attempts_time = sum(a.seconds for a in self.attempts)
        if self.mtbf_seconds is not None:
            out.append(f"failures without notice: {self.failures} in {_duration(attempts_time)} of attempts: measured"
                       f" MTBF {_duration(self.mtbf_seconds)}"
                       + (f"; restart (downtime + restore) {_duration(self.restart_seconds)}"
                          if self.restart_seconds is not None else ""))
        else:
            out.append(f"failures without notice: none in {_duration(attempts_time)} of attempts (the newest attempt is"
                       " never counted: it may be running), so no MTBF is measured yet")
        if self.preemptions:
            out.append(f"preemptions with an emergency save (no step lost): {self.preemptions}")
        cost = "-" if self.save_cost_seconds is None else _duration(self.save_cost_seconds)
        step = "-" if self.step_seconds is None else _duration(self.step_seconds)
        out.append(f"checkpoint cost (median time one checkpoint blocked the loop): {cost}; optimizer step: {step}")
        interval = self.interval()
        if interval is not None:
            steps = f" = {interval.steps} step(s)" if interval.steps is not None else ""
            out.append(f"Young/Daly from these: checkpoint every {_duration(interval.seconds)}{steps} (Daly; Young"
                       f" {_duration(interval.young_seconds)}), expected waste {interval.waste * 100:.2f}%;"
                       " CheckpointCadence(measured=True, adapt=True) sets it")
        elif self.save_cost_seconds is not None:
            out.append("Young/Daly: needs a measured MTBF (above); until then give CheckpointCadence your estimate"
                       " (mtbf_hours=...)")
        seen: dict[tuple[str, int], list[StragglerReport]] = {}
        for attempt, s in self.stragglers:
            seen.setdefault((attempt, s.rank), []).append(s)
        for (attempt, _), reports in seen.items():  # the latest report of each rank, and how often it was found
            again = f" (found at {len(reports)} saves, from step {reports[0].step})" if len(reports) > 1 else ""
            out.append(f"straggler in {printable(attempt)}: {reports[-1].describe()}{again}")
        out.extend(f"skipped: {printable(why)}" for why in self.skipped)
        return "\n".join(out)


def measure(store: Store) -> Goodput:
    """The ledger of the root ``store`` is opened on (reads one record per attempt)."""
    skipped: list[str] = []
    records: list[AttemptRecord] = []
    for attempt, ranks in list_records(store).items():
        for rank in ranks:
            try:
                records.append(read_record(store, attempt, rank))
                break
            except Exception as exc:  # damaged, newer, unreadable: reported and skipped
                skipped.append(f"{attempt} (rank {rank}): {exc}")
        # (An attempt none of whose records could be read is left out; each failed record is named above.)
    return _add_up(store.url(), records, skipped)


def measure_root(url: str, storage_options: Mapping[str, Any] | None = None) -> Goodput:
    """:func:`measure` of the root at ``url`` (a path, ``s3://...``, ``gs://...``)."""
    from lightning_resilient.io.catalog import normalize
    from lightning_resilient.io.retry import RetryPolicy
    from lightning_resilient.io.store import open_store

    return measure(open_store(normalize(url), dict(storage_options or {}), RetryPolicy()))


def _add_up(root: str, records: list[AttemptRecord], skipped: list[str]) -> Goodput:
    attempts: list[AttemptCost] = []
    for i, record in enumerate(records):
        following = records[i + 1] if i + 1 < len(records) else None
        previous_end = attempts[-1].last_at if attempts else None
        attempts.append(_cost(record, following, previous_end))
    newest = len(attempts) - 1
    failures = preemptions = 0
    for i, a in enumerate(attempts):
        if i == newest:
            continue  # it may be running: neither a failure nor a preemption yet
        if a.end in (None, "error", "hang") or (a.end == "preempted" and a.lost_steps):
            failures += 1
        elif a.end == "preempted":
            preemptions += 1
    attempts_time = sum(a.seconds for a in attempts)
    checkpoints = [c[2] for r in records if r.timings is not None for c in r.timings.checkpoints]
    steps = [a.step_seconds for a in attempts if a.step_seconds is not None]
    restarts = [a.downtime_seconds + a.restore_seconds for a in attempts if a.resumed_step is not None]
    return Goodput(
        root=root, attempts=attempts, skipped=skipped,
        wall_seconds=sum(a.seconds + a.downtime_seconds for a in attempts),
        productive_seconds=sum(a.productive_seconds for a in attempts),
        lost_steps=sum(a.lost_steps for a in attempts), lost_seconds=sum(a.lost_seconds for a in attempts),
        restore_seconds=sum(a.restore_seconds for a in attempts), save_seconds=sum(a.save_seconds for a in attempts),
        downtime_seconds=sum(a.downtime_seconds for a in attempts), failures=failures, preemptions=preemptions,
        mtbf_seconds=attempts_time / failures if failures and attempts_time > 0 else None,
        save_cost_seconds=statistics.median(checkpoints) if checkpoints else None,
        step_seconds=statistics.median(steps) if steps else None,
        restart_seconds=statistics.median(restarts) if restarts else None)


def _cost(record: AttemptRecord, following: AttemptRecord | None, previous_end: float | None) -> AttemptCost:
    t = record.timings
    started = t.fit_started if t is not None and t.fit_started is not None else record.started
    first_at = t.first_step_at if t is not None and t.first_step_at is not None else started
    first_step = t.first_step if t is not None else None
    if first_step is None:
        first_step = record.resumed_step or 0
    checkpoints = t.checkpoints if t is not None else ()
    last_step = record.progress.step if record.progress is not None else None
    last_at = max([first_at, *(c[1] for c in checkpoints),
                   *([record.progress.at] if record.progress is not None else [])])
    restore = t.restore_seconds if t is not None and t.restore_seconds is not None else max(0.0, first_at - started)
    save_seconds = t.save_seconds if t is not None else 0.0
    step_seconds = t.step_seconds if t is not None else None
    if step_seconds is None and t is not None and t.steps and last_at > first_at:
        step_seconds = (last_at - first_at) / t.steps  # a mean, where no step was timed alone
    lost_steps, lost_seconds = 0, 0.0
    if following is not None and last_step is not None:
        resumed = following.resumed_step or 0
        lost_steps = max(0, last_step - max(resumed, first_step))
        if lost_steps:
            lost_seconds = _lost_seconds(checkpoints, resumed, last_at, lost_steps, step_seconds)
    training = max(0.0, last_at - first_at)
    lost_seconds = min(lost_seconds, training)
    downtime = max(0.0, started - previous_end) if previous_end is not None else 0.0
    return AttemptCost(
        attempt=record.attempt, rank=record.rank, world_size=record.world_size, started=started,
        resumed_step=record.resumed_step, resumed_commit=t.resumed_commit if t is not None else None,
        first_step=first_step, last_step=last_step,
        last_at=last_at, end=end_kind(record), ended=record.ended, restore_seconds=restore,
        save_seconds=save_seconds, saves=t.saves if t is not None else 0, step_seconds=step_seconds,
        lost_steps=lost_steps, lost_seconds=lost_seconds, downtime_seconds=downtime,
        productive_seconds=max(0.0, training - save_seconds - lost_seconds), stragglers=list(record.stragglers))


def _lost_seconds(checkpoints: tuple[tuple[int, float, float], ...], resumed: int, last_at: float, lost_steps: int,
                  step_seconds: float | None) -> float:
    """The time of the steps after the checkpoint of step ``resumed``: from its save's end to the attempt's last
    record, less the saves in between (counted as save stalls); by the step time where that save is not recorded."""
    at = next((c[1] for c in reversed(checkpoints) if c[0] == resumed), None)
    if at is not None:
        return max(0.0, last_at - at - sum(c[2] for c in checkpoints if c[1] > at))
    return lost_steps * step_seconds if step_seconds is not None else 0.0


def _straggler_json(s: StragglerReport) -> dict[str, Any]:
    return {"step": s.step, "rank": s.rank, "seconds": s.seconds, "others": s.others, "factor": s.factor,
            "batches": s.batches}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == 0:
        return "0 s"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120.0:
        return f"{seconds:.1f} s"
    if seconds < 7200.0:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _when(clock: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(clock)) if clock == clock else "?"  # NaN: unknown
