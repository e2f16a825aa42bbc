"""The per-attempt record: its stored form (typed, versioned, damaged or newer records refused; the goodput ledger's
fields added to format 1 compatibly), how it is written (local disk: every step; object stores: by a background
thread, at most every N seconds or steps) and retention."""

from __future__ import annotations

import json
import logging
import math
import os
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
    spool_folder,
)


def store_of(backend):
    return open_store(backend.root, backend.storage_options, RetryPolicy(attempts=2, base_delay=0.0))


def step(i: int, loss: float = 0.5) -> StepDigest:
    return StepDigest(0, i, i, f"{i:016x}", f"{i + 100:016x}", loss)


def record(attempt: str = "a000001-abcdef", **kwargs) -> AttemptRecord:
    return AttemptRecord(attempt, 0, 2, 1_700_000_000.0, **kwargs)


def test_a_record_round_trips_with_every_field_and_exact_floats():
    original = record(resumed_step=1, resumed_from="s3://b/root/last.ckpt", facts={"batch_size": 4},
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


# -- issue 39: a malformed or hostile record is damaged, never believed ----------------------------------------------
def line_of(value) -> bytes:
    return (json.dumps(value) + "\n").encode()


@pytest.mark.parametrize(("field_name", "bad"), [
    ("attempt", "a000001-abcdef\n| a000009-ffffff | forged row |"), ("attempt", "a000001-abcdef\n"),
    ("attempt", "../a000001-abcdef"), ("attempt", 7), ("rank", -1), ("rank", True), ("rank", 2), ("rank", "0"),
    ("world_size", 0), ("world_size", 2.0), ("started", "yesterday"), ("started", math.inf), ("started", None),
    ("resumed_step", -3), ("resumed_step", 2.5), ("resumed_step", "4"), ("resumed_step", True),
    ("resumed_from", 12), ("facts", [1, 2]), ("facts", {"batch_size": [4]}), ("facts", {"seed": math.nan}),
    ("ended", {"text": "finished"}),
])
def test_a_header_field_that_is_not_what_a_writer_writes_makes_the_record_damaged(field_name, bad):
    header = {**record(resumed_step=2).header(), field_name: bad}  # (rank 0 of 2)
    with pytest.raises(CheckpointCorruptedError, match=f"damaged header.*{field_name}"):
        parse_record(line_of(header), "here")
    del header[field_name]
    if field_name not in ("resumed_step", "resumed_from", "facts", "ended"):  # (those may be left out)
        with pytest.raises(CheckpointCorruptedError, match=f"damaged header.*{field_name}"):
            parse_record(line_of(header), "here")


@pytest.mark.parametrize("bad", [[-1, 0, 0, None, None, None], [0, -1, 0, None, None, None],
                                 [0, 0, -1, None, None, None], [0, 0, 0, None, None, None, [-4, "00ff00ff00ff00ff"]],
                                 "nested"])
def test_a_step_with_a_negative_number_or_nested_too_deep_makes_the_record_damaged(bad):
    line = b"[" * 100_000 + b"\n" if bad == "nested" else line_of(bad)  # (deeper than json reads: no crash either)
    data = line_of(record().header()) + line_of(step(1).to_json()) + line + line_of(step(3).to_json())
    with pytest.raises(CheckpointCorruptedError, match="damaged at line 3" + ("" if bad == "nested" else ".*>= 0")):
        parse_record(data, "here")


@pytest.mark.parametrize(("field_name", "other"), [
    ("record", "lightning_resilient.other"), ("format", 0), ("attempt", "a000009-ffffff"), ("rank", 1),
    ("world_size", 4), ("started", 1_800_000_000.0), ("resumed_step", 0), ("resumed_step", None),
    ("resumed_from", "s3://b/other/last.ckpt"), ("facts", {"batch_size": 8}),
])
def test_a_later_line_that_changes_what_the_attempt_is_makes_the_record_damaged(field_name, other):
    header = record(resumed_step=5, resumed_from="s3://b/root/last.ckpt", facts={"batch_size": 4}).header()
    data = line_of(header) + line_of(step(5).to_json()) + line_of({"ended": "finished", field_name: other})
    with pytest.raises(CheckpointCorruptedError, match=f"here is damaged at line 3: it changes {field_name}"):
        parse_record(data, "here")
    # The same value again changes nothing; the fields that are updated by design (and a later version's) are.
    same = line_of(header) + line_of(step(5).to_json()) + line_of({"ended": "finished", field_name: header[field_name]})
    assert parse_record(same, "here").ended == "finished"
    updates = [{"audit": {"outcome": "identical", "line": "resume audit: the 1 replayed ...", "compared": 1}},
               {"progress": [6, 1_700_000_001.0]}, {"timings": Timings(first_step=5, steps=1).to_json()},
               {"stragglers": [[6, 1, 0.5, 0.1, 8]]}, {"end": "finished", "ended": "finished"}, {"network": 1},
               {"network": 2}]
    back = parse_record(line_of(header) + line_of(step(5).to_json()) + b"".join(map(line_of, updates)), "here")
    assert (back.progress, back.end, back.extra, back.stragglers[0].rank) == (
        Progress(6, 1_700_000_001.0), "finished", {"network": 2}, 1)


def test_a_forged_resumed_step_past_what_the_record_itself_reached_makes_it_damaged():
    """resumed_step moves the lost steps the goodput ledger counts for the attempt before: one past the record's
    own first step, progress or first step timed cannot be what the attempt resumed from."""
    assert parse_record(ledger_record(steps=[step(16)]).to_bytes(), "here").resumed_step == 5  # first step 5, at 17
    for forged, what in [(17, "first recorded step"), (18, "progress"), (6, "first step timed")]:
        data = ledger_record(steps=[step(16)] if forged == 17 else []).to_bytes()
        header, rest = data.split(b"\n", 1)
        forged_header = {**json.loads(header), "resumed_step": forged}
        with pytest.raises(CheckpointCorruptedError, match=f"resumed_step {forged} is past .*{what}"):
            parse_record(line_of(forged_header) + rest, "here")


def test_a_record_whose_header_names_another_attempt_or_rank_than_its_name_is_damaged(local_backend):
    store = store_of(local_backend)
    store.write(record_name("a000002-abcdef", 0), record("a000001-abcdef").to_bytes())  # a copy, or a forgery
    with pytest.raises(CheckpointCorruptedError, match="attempt is 'a000001-abcdef', but the record is a000002-abcdef"):
        read_record(store, "a000002-abcdef", 0)
    store.write(record_name("a000001-abcdef", 1), record("a000001-abcdef").to_bytes())  # rank 0's, as rank 1's
    with pytest.raises(CheckpointCorruptedError, match="rank is 0, but the record is rank 1's"):
        read_record(store, "a000001-abcdef", 1)
    assert isinstance(dict(read_attempts(store))["a000002-abcdef"], CheckpointCorruptedError)  # reported, skipped


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_what_attempt_log_writes_today_passes_the_checks(kind, request, tmp_path):
    """Every update AttemptLog makes (the audit, the ledger's timings, progress and stragglers, the end, a prune's
    rewrite) reads back through the checks: on local disk (appended lines, a rewrite) and on an object store (whole
    objects written by the thread, and this node's spool of appended lines)."""
    store = store_of(request.getfixturevalue(f"{kind}_backend"))
    spool = None if kind == "local" else spool_folder(store.url(), str(tmp_path))
    first = AttemptRecord("a000002-abcdef", 1, 2, 1_700_000_000.0, resumed_step=5, resumed_from="last.ckpt",
                          facts={"world_size": 2, "batch_size": 4, "dataset": "Augmented[64]", "sample_seed": None,
                                 "per_sample_seeding": True, "accumulate_grad_batches": 1})
    log = AttemptLog(store, first, flush_seconds=math.inf, flush_steps=3, spool=spool)
    log.start()
    try:
        log.update(timings=Timings(fit_started=1_700_000_000.0, first_step=5, first_step_at=1_700_000_002.0))
        for i in range(5, 12):
            log.add(StepDigest(0, i, i, f"{i:016x}", f"{i + 100:016x}", 0.5, (4, f"{i + 200:016x}")))
            log.progress(Progress(i + 1, 1_700_000_002.0 + i))
            if i == 8:
                log.prune((0, 6))  # a save: the steps up to the one before it are forgotten
        log.update(audit=AuditResult("identical", "resume audit: the 2 replayed training step(s) ...", 2))
        log.update(stragglers=[StragglerReport(9, 1, 0.5, 0.1, 8)])
        log.update(ended="stopped by RuntimeError: boom", end="error",
                   timings=Timings(fit_started=1_700_000_000.0, first_step=5, steps=7, saves=1))
    finally:
        log.close()
    expected = log.record
    assert [s.batch for s in expected.steps] == list(range(7, 12)) and expected.end == "error"
    assert read_record(store, "a000002-abcdef", 1) == expected  # the store's copy
    if spool is not None:  # the spool's appended lines
        with open(os.path.join(spool, "a000002-abcdef.r1.jsonl"), "rb") as f:
            assert parse_record(f.read(), "spooled", attempt="a000002-abcdef", rank=1) == expected


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_one_url_on_two_servers_has_two_spools(kind, request, tmp_path, monkeypatch):
    """A node's spool of attempt records is per root: one URL on another server (an emulator started again, as each
    demo run does, or a staging beside a production server) must not share attempt numbers or records with it."""
    backend = request.getfixturevalue(f"{kind}_backend")
    store = store_of(backend)
    assert store.endpoint() == backend.endpoint  # the client's server, as the plugin's options give it
    here = spool_folder(store.url(), str(tmp_path), store.endpoint())
    assert spool_folder(store.url(), str(tmp_path), store.endpoint()) == here
    assert spool_folder(store.url(), str(tmp_path), "http://127.0.0.1:1") != here
    assert spool_folder(store.url(), str(tmp_path), f"{store.endpoint()}/".upper()) == here  # one server, spelled so
    # Without a server of its own (AWS's, Google's), the key is the URL as before.
    assert spool_folder(store.url(), str(tmp_path), None) == spool_folder(store.url(), str(tmp_path))
    if kind == "s3":  # the environment's endpoint, which botocore uses when the options name none
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        options = {k: v for k, v in backend.storage_options.items() if k != "client_kwargs"}
        plain = open_store(backend.root, options, RetryPolicy(attempts=1))
        assert plain.endpoint() == "http://127.0.0.1:9"
