"""The per-attempt record: its stored form (typed, versioned, damaged or newer records refused; the goodput ledger's
fields added to format 1 compatibly), how it is written (local disk: every step; object stores: by a background
thread, at most every N seconds or steps) and retention."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.io.folders import ATTEMPTS_DIR
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.state.attempts import (
    FORMAT,
    AttemptLog,
    AttemptRecord,
    AuditResult,
    Progress,
    StepDigest,
    StragglerReport,
    Timings,
    drop_old_attempts,
    end_kind,
    list_attempts,
    new_attempt_id,
    open_logs,
    parse_record,
    read_attempts,
    read_record,
    record_name,
)


def store_of(backend):
    return open_store(backend.root, backend.storage_options, RetryPolicy(attempts=2, base_delay=0.0))


def step(i: int, loss: float = 0.5) -> StepDigest:
    return StepDigest(0, i, i, f"{i:016x}", f"{i + 100:016x}", loss)


def record(attempt: str = "a000001-abcdef", **kwargs) -> AttemptRecord:
    return AttemptRecord(attempt, 0, 2, 1_700_000_000.0, **kwargs)


def test_a_record_round_trips_with_every_field_and_exact_floats():
    original = record(resumed_step=5, resumed_from="s3://b/root/last.ckpt", facts={"batch_size": 4},
                      audit=AuditResult("identical", "resume audit: ...", 3), ended="finished",
                      steps=[step(1, 0.1 + 0.2), step(2, math.inf), StepDigest(0, 3, 3, None, "ab", None),
                             StepDigest(0, 4, 4, "cd", "ef", 0.25, (4, "00ff00ff00ff00ff"))])
    back = parse_record(original.to_bytes(), "here")
    assert back == original
    assert len(step(1).to_json()) == 6  # a step without samples is stored as before (first versions read 6 items)
    assert back.steps[0].loss == 0.1 + 0.2  # bit for bit: the audit compares losses exactly
    assert math.isnan(parse_record(record(steps=[step(1, math.nan)]).to_bytes(), "here").steps[0].loss)


def test_header_fields_of_a_later_version_are_kept_and_updates_apply_in_order():
    lines = [json.dumps({**record().header(), "restore_seconds": 1.5}), json.dumps(step(1).to_json()),
             json.dumps({"audit": {"outcome": "nothing", "line": "resume audit: nothing", "compared": 0}}),
             json.dumps({"ended": "finished"})]
    back = parse_record(("\n".join(lines) + "\n").encode(), "here")
    assert back.extra == {"restore_seconds": 1.5} and back.ended == "finished"
    assert back.audit == AuditResult("nothing", "resume audit: nothing", 0) and back.steps == [step(1)]
    assert json.loads(back.to_bytes().decode().splitlines()[0])["restore_seconds"] == 1.5


def test_a_last_line_cut_short_is_ignored_but_damage_elsewhere_is_refused():
    data = record(steps=[step(1), step(2)]).to_bytes()
    assert parse_record(data[:-5], "here").steps == [step(1)]  # a write the process did not finish
    lines = data.decode().splitlines(keepends=True)
    damaged = (lines[0] + lines[1][:-8] + "\n" + lines[2]).encode()
    with pytest.raises(CheckpointCorruptedError, match="attempt record here is damaged at line 2"):
        parse_record(damaged, "here")
    with pytest.raises(CheckpointCorruptedError, match="is empty"):
        parse_record(b"", "here")
    with pytest.raises(CheckpointCorruptedError, match="line 1"):
        parse_record(b'{"something": "else"}\n', "here")


def test_a_newer_format_is_refused_naming_it():
    header = {**record().header(), "format": FORMAT + 1}
    with pytest.raises(UnsupportedFormatError, match=f"has format {FORMAT + 1}.*newer version"):
        parse_record((json.dumps(header) + "\n").encode(), "here")


def test_attempt_ids_order_attempts_and_retention_keeps_the_newest(local_backend):
    store = store_of(local_backend)
    assert new_attempt_id(store).startswith("a000001-")
    ids = []
    for _ in range(5):
        attempt = new_attempt_id(store)
        for rank in (0, 1):
            store.write(record_name(attempt, rank), record(attempt).to_bytes())
        ids.append(attempt)
    store.write(f"{ATTEMPTS_DIR}/notes.txt", b"not a record")  # other names are left alone
    assert list_attempts(store) == ids and [a[:7] for a in ids] == [f"a{i:06d}" for i in range(1, 6)]
    assert drop_old_attempts(store, keep=2) == ids[:3]
    assert list_attempts(store) == ids[3:] and store.exists(f"{ATTEMPTS_DIR}/notes.txt")
    assert [a for a, _ in read_attempts(store)] == ids[3:]


def test_local_disk_appends_every_step_and_a_prune_rewrites_the_file(local_backend):
    store = store_of(local_backend)
    log = AttemptLog(store, record(), flush_seconds=30.0, flush_steps=None)
    log.start()
    path = store.path(record_name("a000001-abcdef", 0))
    for i in range(1, 5):
        log.add(step(i))
        assert read_record(store, "a000001-abcdef", 0).steps == [step(j) for j in range(1, i + 1)]  # at once
    log.prune((0, 2))
    assert [s.batch for s in read_record(store, "a000001-abcdef", 0).steps] == [3, 4]
    log.add(step(5))
    log.update(audit=AuditResult("identical", "resume audit: fine", 2))
    log.close()
    back = read_record(store, "a000001-abcdef", 0)
    assert [s.batch for s in back.steps] == [3, 4, 5] and back.audit is not None and back.audit.compared == 2
    assert Path(path).read_text().count("\n") == 5  # header, 3 steps, the audit update


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_an_object_store_is_written_by_a_thread_every_n_steps_never_per_step(kind, request):
    backend = request.getfixturevalue(f"{kind}_backend")
    store = store_of(backend)
    log = AttemptLog(store, record(), flush_seconds=math.inf, flush_steps=3)
    log.start()
    try:
        for i in range(1, 3):
            log.add(step(i))
        assert log.writes == 0 and not store.exists(record_name("a000001-abcdef", 0))  # below the interval
        log.add(step(3))  # due: the thread writes, the training thread does not wait for it
        _wait(lambda: log.writes == 1)
        assert len(read_record(store, "a000001-abcdef", 0).steps) == 3
        for i in range(4, 6):
            log.add(step(i))
        assert log.writes == 1
    finally:
        log.close()
    assert len(read_record(store, "a000001-abcdef", 0).steps) == 5 and log.writes == 2  # close writes the rest


def test_by_default_an_object_store_is_written_by_time_not_per_step(memory_backend):
    store = store_of(memory_backend)
    log = AttemptLog(store, record(), flush_seconds=30.0, flush_steps=None)
    log.start()
    try:
        for i in range(1, 200):
            log.add(step(i))
        assert log.writes == 0  # the first write is due after 30 s
    finally:
        log.close()
    assert len(read_record(store, "a000001-abcdef", 0).steps) == 199


def test_a_failed_write_is_logged_and_written_again_later(s3_backend, caplog):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_backend.endpoint)
    bucket = s3_backend.root.split("/")[2]
    gone = s3_backend.root.replace(bucket, bucket + "-later")
    store = open_store(gone, s3_backend.storage_options, RetryPolicy(attempts=1))
    log = AttemptLog(store, record(), flush_seconds=math.inf, flush_steps=1)
    with caplog.at_level(logging.WARNING, logger="lightning_resilient.state.attempts"):
        log.start()
        log.add(step(1))  # the bucket does not exist yet: the write fails, training goes on
        _wait(lambda: any("could not write the attempt record" in r.getMessage() for r in caplog.records))
        client.create_bucket(Bucket=bucket + "-later")
        log.add(step(2))
        log.close()
    assert [s.batch for s in read_record(store, "a000001-abcdef", 0).steps] == [1, 2]
    assert any("writes the attempt record" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


def _wait(condition, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# -- the goodput ledger's fields --------------------------------------------------------------------------------
def ledger_record(**kwargs) -> AttemptRecord:
    timings = Timings(fit_started=1_700_000_000.0, first_step=5, first_step_at=1_700_000_003.5, restore_seconds=3.5,
                      load_seconds=1.25, resumed_commit="last.ckpt/c1-e1-ab", resumed_tier="local", steps=12,
                      step_seconds=0.5, own_seconds=0.25, save_seconds=2.0, saves=2,
                      checkpoints=((10, 1_700_000_006.0, 1.0), (15, 1_700_000_009.0, 1.0)))
    return record(resumed_step=5, progress=Progress(17, 1_700_000_010.0), timings=timings, end="hang",
                  ended="hang: no training progress", stragglers=[StragglerReport(15, 1, 0.5, 0.1, 8)], **kwargs)


def test_the_ledger_fields_round_trip_in_format_1():
    original = ledger_record(steps=[step(16)])
    data = original.to_bytes()
    assert json.loads(data.decode().splitlines()[0])["format"] == FORMAT == 1  # no new format for the new fields
    back = parse_record(data, "here")
    assert back == original and back.extra == {}
    assert back.stragglers[0].factor == 5.0 and "rank 1 is 5.0x slower" in back.stragglers[0].describe()


def test_a_record_written_before_the_ledger_reads_with_its_fields_empty():
    # What issue 26's version wrote: the header, steps, then the audit and "ended" as updates.
    old = (b'{"record":"lightning_resilient.attempt","format":1,"attempt":"a000001-abcdef","rank":0,"world_size":1,'
           b'"started":1700000000.0,"resumed_step":null,"resumed_from":null,"facts":{"batch_size":4}}\n'
           b'[0,0,0,"00000000000000aa","00000000000000bb",0.5]\n'
           b'{"ended":"stopped by PreemptedExit: 143"}\n')
    back = parse_record(old, "old")
    assert back.progress is None and back.timings is None and back.end is None and back.stragglers == []
    assert end_kind(back) == "preempted" and back.steps[0].loss == 0.5
    assert end_kind(record(ended="finished")) == "finished" and end_kind(record()) is None
    assert end_kind(record(ended="stopped by RuntimeError: boom")) == "error"


def test_a_later_versions_ledger_fields_are_kept_and_a_damaged_one_refuses_the_record():
    header = {**ledger_record().header(), "timings": {**ledger_record().timings.to_json(), "gpu_seconds": 3.0},
              "end": "migrated", "network": {"bytes": 1}}
    back = parse_record((json.dumps(header) + "\n").encode(), "here")
    assert back.timings == ledger_record().timings and back.end == "migrated"
    assert back.extra == {"network": {"bytes": 1}}
    for field_name, bad in [("timings", {"steps": "many"}), ("progress", [1]), ("stragglers", [[1, 2]]),
                            ("end", 3)]:
        damaged = {**ledger_record().header(), field_name: bad}
        with pytest.raises(CheckpointCorruptedError, match="damaged header"):
            parse_record((json.dumps(damaged) + "\n").encode(), "here")


def test_progress_is_appended_at_every_step_on_local_disk_and_the_updates_are_folded_in(local_backend):
    store = store_of(local_backend)
    log = AttemptLog(store, record(), flush_seconds=30.0, flush_steps=None)
    log.start()
    assert open_logs() == [log]
    path = Path(store.path(record_name("a000001-abcdef", 0)))
    for i in range(1, 4):
        log.progress(Progress(i, 1_700_000_000.0 + i))
        # On disk at once: a SIGKILL now (no close) loses nothing.
        assert read_record(store, "a000001-abcdef", 0).progress == Progress(i, 1_700_000_000.0 + i)
    for i in range(4, 1200):
        log.progress(Progress(i, 1_700_000_000.0 + i))
    assert path.read_text().count("\n") < 600  # folded into the header every 512 updates, not one line per step forever
    assert read_record(store, "a000001-abcdef", 0).progress == Progress(1199, 1_700_001_199.0)
    log.close()
    assert open_logs() == []


def test_on_an_object_store_progress_counts_toward_flush_steps(memory_backend):
    store = store_of(memory_backend)
    log = AttemptLog(store, record(), flush_seconds=math.inf, flush_steps=2)
    log.start()
    try:
        log.progress(Progress(1, 1.0))
        assert log.writes == 0
        log.progress(Progress(2, 2.0))  # due: written by the thread, without steps (the audit may be off)
        _wait(lambda: log.writes == 1)
        assert read_record(store, "a000001-abcdef", 0).progress == Progress(2, 2.0)
    finally:
        log.close()
