"""The goodput ledger, read back (``state/goodput.py``) and printed (``lightning-resilient goodput``): each attempt's
restore, save stalls, lost work and productive time, the totals, the measured MTBF and the interval they give;
damaged or newer records reported and skipped. The ledger of a real killed-and-resumed run is checked at the end (and
under torchrun in tests/test_restarts.py)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from lightning_resilient.cli import main
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.planning.cadence import daly_interval, young_interval
from lightning_resilient.state.attempts import (
    AttemptRecord,
    Progress,
    StragglerReport,
    Timings,
    list_attempts,
    record_name,
)
from lightning_resilient.state.goodput import measure, printable

from .matrix import Config, run

T0 = 1_700_000_000.0


def attempt(n: int, *, resumed: int | None, started: float, restore: float, first: int, progress: tuple[int, float],
            checkpoints: tuple[tuple[int, float, float], ...], end: str | None, rank: int = 0,
            stragglers: list[StragglerReport] | None = None) -> AttemptRecord:
    """An attempt's record as the callback leaves it (times relative to T0)."""
    timings = Timings(fit_started=T0 + started, first_step=first, first_step_at=T0 + started + restore,
                      restore_seconds=restore, steps=progress[0] - first, step_seconds=0.1,
                      save_seconds=sum(c[2] for c in checkpoints), saves=len(checkpoints),
                      checkpoints=tuple((s, T0 + at, b) for s, at, b in checkpoints))
    return AttemptRecord(f"a{n:06d}-abcdef", rank, 2, T0 + started + restore, resumed_step=resumed,
                         progress=Progress(progress[0], T0 + progress[1]), timings=timings, end=end,
                         ended=end, stragglers=stragglers or [])


# Killed at step 250 (its last save: step 200, which the next attempt resumes), then preempted right after an
# emergency save at step 400, then finished.
KILLED: dict[str, Any] = {"resumed": None, "started": 0.0, "restore": 10.0, "first": 0, "progress": (250, 240.0),
                          "checkpoints": ((100, 110.0, 2.0), (200, 212.0, 2.0)), "end": None}
PREEMPTED: dict[str, Any] = {"resumed": 200, "started": 300.0, "restore": 20.0, "first": 200,
                             "progress": (400, 350.0), "checkpoints": ((400, 352.0, 2.0),), "end": "preempted"}
FINISHED: dict[str, Any] = {"resumed": 400, "started": 360.0, "restore": 5.0, "first": 400, "progress": (500, 400.0),
                            "checkpoints": ((500, 402.0, 2.0),), "end": "finished",
                            "stragglers": [StragglerReport(450, 1, 0.05, 0.01, 40),
                                           StragglerReport(500, 1, 0.06, 0.01, 64)]}


def write(store, record: AttemptRecord) -> None:
    store.write(record_name(record.attempt, record.rank), record.to_bytes())


def store_of(path):
    return open_store(str(path), {}, RetryPolicy())


@pytest.fixture
def store(tmp_path):
    return store_of(tmp_path)


def test_each_attempt_splits_into_restore_stalls_lost_work_and_productive_time(store):
    for n, kwargs in enumerate((KILLED, PREEMPTED, FINISHED), start=1):
        write(store, attempt(n, **kwargs))
    ledger = measure(store)
    killed, preempted, finished = ledger.attempts
    assert (killed.lost_steps, preempted.lost_steps, finished.lost_steps) == (50, 0, 0)  # 250 - 200 recomputed
    assert killed.lost_seconds == 28.0  # from the step-200 save's end (212) to its last record (240)
    assert killed.productive_seconds == 230.0 - 4.0 - 28.0  # first step to last record, less stalls and lost work
    assert (preempted.downtime_seconds, finished.downtime_seconds) == (60.0, 8.0)  # last record -> next fit start
    assert (killed.restore_seconds, preempted.restore_seconds) == (10.0, 20.0)
    assert ledger.wall_seconds == 240.0 + 52.0 + 42.0 + 60.0 + 8.0  # every second is in exactly one part
    assert ledger.wall_seconds == pytest.approx(ledger.productive_seconds + ledger.lost_seconds + ledger.restore_seconds
                                                + ledger.save_seconds + ledger.downtime_seconds)
    assert ledger.goodput == pytest.approx((198.0 + 30.0 + 35.0) / 402.0)
    # The kill is a failure without notice; the preemption saved everything; the newest attempt is never counted.
    assert (ledger.failures, ledger.preemptions) == (1, 1)
    assert ledger.mtbf_seconds == 240.0 + 52.0 + 42.0
    assert ledger.save_cost_seconds == 2.0 and ledger.restart_seconds == (80.0 + 13.0) / 2
    interval = ledger.interval()
    assert interval is not None and interval.seconds == daly_interval(2.0, 334.0)  # the existing planner's
    assert interval.young_seconds == young_interval(2.0, 334.0) and interval.steps == round(interval.seconds / 0.1)
    as_json = json.loads(json.dumps(ledger.to_json()))
    assert as_json["lost_steps"] == 50 and as_json["goodput"] == ledger.goodput and len(as_json["attempts"]) == 3
    assert as_json["attempts"][0]["end"] is None and as_json["interval"]["seconds"] == interval.seconds
    assert [s["step"] for s in as_json["stragglers"]] == [450, 500]


def test_the_table_names_each_attempt_the_totals_and_the_interval(store):
    for n, kwargs in enumerate((KILLED, PREEMPTED, FINISHED), start=1):
        write(store, attempt(n, **kwargs))
    table = measure(store).table()
    rows = [line for line in table.splitlines() if line.startswith("| a00000")]
    assert len(rows) == 3
    assert "| fresh start | 0 -> 250 | killed | - | 10.0 s | 4.0 s (2) | 50 | 28.0 s | 3.3 min |" in rows[0]
    assert "| step 200 | 200 -> 400 | preempted | 60.0 s | 20.0 s | 2.0 s (1) | 0 | 0 s | 30.0 s |" in rows[1]
    assert "goodput: 65.4%" in table and "lost work 50 step(s) recomputed (28.0 s)" in table
    assert "failures without notice: 1 in 5.6 min of attempts: measured MTBF 5.6 min" in table
    assert "Young/Daly from these: checkpoint every 35.2 s = 352 step(s) (Daly; Young 36.6 s)" in table
    assert "preemptions with an emergency save (no step lost): 1" in table
    # The same rank found at two saves: said once, with the latest figures.
    (straggler,) = [line for line in table.splitlines() if line.startswith("straggler")]
    assert "rank 1 is 6.0x slower" in straggler and "found at 2 saves, from step 450" in straggler


def test_without_a_failure_there_is_no_mtbf_and_a_running_attempt_is_no_failure(store):
    write(store, attempt(1, **{**KILLED, "end": "finished"}))
    write(store, attempt(2, **{**PREEMPTED, "end": None}))  # the newest: killed, or still running
    ledger = measure(store)
    assert ledger.failures == 0 and ledger.mtbf_seconds is None and ledger.interval() is None
    assert "no MTBF is measured yet" in ledger.table() and "| killed (or running) |" in ledger.table()


def test_a_damaged_or_newer_record_is_reported_and_skipped(store):
    write(store, attempt(1, **KILLED))
    write(store, attempt(2, **PREEMPTED))
    write(store, attempt(2, **PREEMPTED, rank=1))
    write(store, attempt(3, **FINISHED))
    two, three = list_attempts(store)[1:]
    store.write(record_name(two, 0), b'{"record": "lightning_resilient.attempt", "format": 1, "attempt"')  # cut
    newer = json.loads(store.read(record_name(three, 0)).decode().splitlines()[0])
    store.write(record_name(three, 0), (json.dumps({**newer, "format": 2}) + "\n").encode())
    ledger = measure(store)
    assert [a.attempt for a in ledger.attempts] == list_attempts(store)[:2]  # the third: no readable record
    assert ledger.attempts[1].rank == 1  # the second: read from rank 1's record
    assert len(ledger.skipped) == 2
    assert ledger.skipped[0].startswith(f"{two} (rank 0): attempt record") and "damaged" in ledger.skipped[0]
    assert ledger.skipped[1].startswith(f"{three} (rank 0)") and "format 2" in ledger.skipped[1]
    assert "newer version" in ledger.skipped[1]
    assert f"skipped: {three} (rank 0)" in ledger.table()


def test_the_goodput_command_prints_the_table_or_json_and_refuses_bad_input(tmp_path, capsys):
    cfg = Config("goodput")
    run(cfg, tmp_path / "part", 1, resume=False)  # stopped two batches after its step-5 save, at step 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(cfg, tmp_path / "part", None, resume=True)
    capsys.readouterr()
    assert main(["goodput", str(tmp_path / "part")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| a00000")]
    assert len(rows) == 2 and "| fresh start | 0 -> 7 | error |" in rows[0] and "| 2 |" in rows[0]
    assert "| step 5 | 5 -> 30 | finished |" in rows[1]
    assert "lost work 2 step(s) recomputed" in out
    assert main(["goodput", str(tmp_path / "part"), "--json"]) == 0
    ledger = json.loads(capsys.readouterr().out)
    assert ledger["lost_steps"] == 2 and 0 < ledger["goodput"] < 1 and len(ledger["attempts"]) == 2
    first, second = ledger["attempts"]
    assert (first["last_step"], second["resumed_step"], second["end"]) == (7, 5, "finished")
    assert second["resumed_commit"].startswith("epoch=0-step=5.ckpt/c")  # the commit the plugin loaded
    assert first["saves"] == 1 and second["saves"] == 5 and first["ended"].startswith("stopped by Stop")
    assert main(["goodput", str(tmp_path / "empty")]) == 0
    assert "no attempts recorded under" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    for bad in ("s3:/bucket/run", str(tmp_path / "file")):
        assert main(["goodput", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lightning-resilient goodput: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_hostile_record_adds_no_row_and_moves_no_lost_step(store):
    """Issue 39: an attempt id with a newline and ``|`` injected a table row, and a forged ``resumed_step`` silently
    changed the lost steps. Each such record is reported and skipped (the attempt read from another rank's record),
    and what a record says is printed escaped."""
    write(store, attempt(1, **KILLED))  # killed at 250, the next attempt resumed its checkpoint of step 200: 50 lost
    forged = attempt(2, **PREEMPTED)
    forged.resumed_step = 250  # past the step it started from (200): would make the killed attempt lose none
    write(store, forged)
    write(store, attempt(2, **PREEMPTED, rank=1))
    injected = attempt(3, **FINISHED)
    injected.attempt = "a000003-abcdef\n| a000009-ffffff | 2023-11-14 | 2 | fresh start | 0 -> 9 | finished |"
    store.write(record_name("a000003-abcdef", 0), injected.to_bytes())
    odd = attempt(4, **{**FINISHED, "started": 410.0, "resumed": 500, "first": 500, "progress": (510, 420.0)})
    odd.end = "finished\n| a000009-ffffff | 2023-11-14 | 2 | fresh start | 0 -> 9 | finished | \x1b[2J"
    write(store, odd)
    ledger = measure(store)
    assert [(a.attempt, a.rank) for a in ledger.attempts] == [
        ("a000001-abcdef", 0), ("a000002-abcdef", 1), ("a000004-abcdef", 0)]
    assert ledger.attempts[0].lost_steps == 50
    assert len(ledger.skipped) == 2
    assert ledger.skipped[0].startswith("a000002-abcdef (rank 0): attempt record") and (
        "resumed_step 250 is past the first step timed in its timings, global step 200") in ledger.skipped[0]
    assert ledger.skipped[1].startswith("a000003-abcdef (rank 0): attempt record") and "attempt is an attempt id" in (
        ledger.skipped[1])
    table = ledger.table()
    assert not [line for line in table.splitlines() if line.startswith("| a000009")]
    rows = [line for line in table.splitlines() if line.startswith("| a0")]
    assert len(rows) == 3 and all(row.count("|") - row.count("\\|") == 13 for row in rows)  # 12 cells each
    assert "| finished\\n\\| a000009-ffffff \\| 2023-11-14 \\|" in rows[2] and "\\x1b[2J |" in rows[2]
    assert "\x1b" not in table
    assert [line for line in table.splitlines() if line.startswith("skipped: ")] == [
        f"skipped: {printable(why)}" for why in ledger.skipped]


def test_printable_escapes_what_would_end_a_cell_or_a_line():
    assert printable("a000001-abcdef") == "a000001-abcdef"
    assert printable("a|b\\c\nd\te\x1b[2J\u202efin\u2028") == "a\\|b\\\\c\\nd\\te\\x1b[2J\\u202efin\\u2028"
    assert printable(3) == "3" and printable("stopped by RuntimeError: élan") == "stopped by RuntimeError: élan"
