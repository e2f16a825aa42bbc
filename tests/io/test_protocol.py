"""The commit protocol, run identically on local disk, memory://, S3 (moto) and GCS (fake-gcs-server)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from lightning_resilient import (
    CheckpointCorruptedError,
    StaleWriterError,
    UnsupportedFormatError,
    find_latest_checkpoint,
    repair_pointer,
)
from lightning_resilient.io._sealed import seal
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import POINTER_NAME
from lightning_resilient.io.root import open_root

from .helpers import assert_same, make_checkpoint, put, read_pointer


def commits_on_store(backend) -> set[str]:
    """Every commit folder that exists in the store, as "name/commit"."""
    fs = backend.fs()
    base = backend.path()
    found = set()
    for path in fs.find(base):
        rel = path[len(base.rstrip("/")) + 1:] if path.startswith(base.rstrip("/")) else path
        parts = rel.split("/")
        if len(parts) == 3 and not parts[0].startswith("."):  # the protocol's own dot-folder holds no commit
            found.add("/".join(parts[:2]))
    return found


def test_save_load_roundtrip_bit_exact(backend, make_io):
    io = make_io(backend, shard_size=256)
    ckpt = make_checkpoint(3)
    ckpt["extra"] = {"bf16": torch.randn(5, dtype=torch.bfloat16), "bool": torch.tensor([True, False]),
                     "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64),
                     "strided": torch.arange(20.0).reshape(4, 5).t(), "tuple": (torch.ones(2), "x", 3),
                     "complex": torch.randn(3, dtype=torch.complex64), "int8": torch.arange(-4, 4, dtype=torch.int8)}
    io.save_checkpoint(ckpt, backend.url("epoch=0-step=3.ckpt"))
    loader = make_io(backend)
    loaded = loader.load_checkpoint(backend.url("epoch=0-step=3.ckpt"), weights_only=True)
    expected = dict(ckpt)
    expected["extra"] = dict(ckpt["extra"], strided=ckpt["extra"]["strided"].contiguous())
    assert_same(loaded, expected)


def test_tensors_are_raw_bytes_not_pickles(backend, make_io):
    io = make_io(backend, shard_size=1 << 20)
    ckpt = make_checkpoint(1, size=4096)
    io.save_checkpoint(ckpt, backend.url("a.ckpt"))
    manifest_path = next(p for p in backend.fs().find(backend.path()) if p.endswith(MANIFEST_NAME))
    manifest = json.loads(backend.fs().cat_file(manifest_path))["body"]
    skeleton = manifest["objects"][manifest["skeleton"]]
    weight = next(t for t in manifest["tensors"] if t["key"] == [["s", "state_dict"], ["s", "layer.weight"]])
    # The tensor stream is the stream objects' bytes in order; every tensor sits at its offset in it.
    stream = b"".join(backend.fs().cat_file(backend.path(manifest["objects"][i]["path"])) for i in manifest["stream"])
    raw = stream[weight["offset"]: weight["offset"] + weight["nbytes"]]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(4096, 8),
                       ckpt["state_dict"]["layer.weight"])
    assert skeleton["size"] < 4096, "tensor bytes leaked into the pickled skeleton"


def test_latest_follows_commits_and_root_resolves(backend, make_io):
    io = make_io(backend)
    assert find_latest_checkpoint(backend.root, backend.storage_options) is None
    for step in (10, 20, 30):
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    latest = find_latest_checkpoint(backend.root, backend.storage_options)
    assert latest.startswith(backend.url("step=30.ckpt/"))
    reader = make_io(backend, claim_on_load=False)
    assert reader.load_checkpoint(backend.root)["global_step"] == 30
    assert reader.load_checkpoint(latest)["global_step"] == 30
    assert reader.load_checkpoint(backend.url("step=10.ckpt"))["global_step"] == 10


def test_pointer_never_moves_to_a_lower_step_within_a_writer(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(50), backend.url("late.ckpt"))
    io.save_checkpoint(make_checkpoint(40), backend.url("early.ckpt"))  # e.g. a manual save of older state
    pointer = read_pointer(backend)
    assert pointer.latest.name == "late.ckpt"
    assert "early.ckpt" in pointer.checkpoints  # committed and loadable by name, just not latest


def test_reused_name_keeps_its_newest_commit_and_deletes_the_previous_one_a_save_later(backend, make_io):
    io = make_io(backend)
    commits = []
    for step in (1, 2, 3):
        io.save_checkpoint(make_checkpoint(step), backend.url("last.ckpt"))
        commits.append(read_pointer(backend).latest.commit)
    io.wait()  # (a commit deletes what it retired behind the save: wait() waits for that too)
    pointer = read_pointer(backend)
    # Save 2 retired commit 1, deleted after save 3; commit 2, retired by save 3, stays until the next save (a
    # reader that resolved it just before has a whole save interval to read it).
    assert commits_on_store(backend) == {commits[1], commits[2]}
    assert commits[1] in pointer.retired and commits[1] not in pointer.live_folders()
    assert make_io(backend).load_checkpoint(backend.url("last.ckpt"))["global_step"] == 3
    io.save_checkpoint(make_checkpoint(4), backend.url("last.ckpt"))
    io.wait()
    assert commits_on_store(backend) == {commits[2], read_pointer(backend).latest.commit}
    assert commits[0] not in read_pointer(backend).retired  # records of deleted folders are pruned


def test_save_last_does_not_upload_the_same_state_twice(backend, make_io):
    io = make_io(backend, shard_size=512)
    ckpt = make_checkpoint(7)
    io.save_checkpoint(ckpt, backend.url("epoch=0-step=7.ckpt"))
    ckpt["callbacks"] = {"ModelCheckpoint{}": {"last_model_path": "last.ckpt"}}  # only the small state differs
    io.save_checkpoint(ckpt, backend.url("last.ckpt"))
    io.wait()  # (a commit deletes what it retired behind the save)
    pointer = read_pointer(backend)
    last = pointer.checkpoints["last.ckpt"]
    files = list(backend.fs().find(backend.path(last.commit)))
    assert "shard" not in " ".join(f.rsplit("/", 1)[-1] for f in files), files
    assert pointer.checkpoints["epoch=0-step=7.ckpt"].commit in last.folders
    assert commits_on_store(backend) == read_pointer(backend).live_folders()
    # Orphan collection must not mistake the manifest-only folder of last.ckpt for debris.
    make_io(backend, orphan_grace_seconds=0).collect_garbage(backend.root)
    assert commits_on_store(backend) == read_pointer(backend).live_folders()
    # Removing the top-k name keeps the data last.ckpt shares with it.
    io.remove_checkpoint(backend.url("epoch=0-step=7.ckpt"))
    loaded = make_io(backend, claim_on_load=False).load_checkpoint(backend.url("last.ckpt"))
    assert_same(loaded, ckpt)
    # When last.ckpt moves on, the shared folder is no longer needed: retired, and deleted a save later.
    shared = set(last.folders)
    io.save_checkpoint(make_checkpoint(8), backend.url("last.ckpt"))
    io.wait()
    step8 = read_pointer(backend).latest.commit
    assert set(read_pointer(backend).retired) == shared and commits_on_store(backend) == shared | {step8}
    io.save_checkpoint(make_checkpoint(9), backend.url("last.ckpt"))
    io.wait()
    assert commits_on_store(backend) == {step8, read_pointer(backend).latest.commit}


def test_keep_last_retention(backend, make_io):
    io = make_io(backend, keep_last=2)
    for step in range(1, 6):
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    io.wait()  # (a commit deletes what it retired behind the save)
    pointer = read_pointer(backend)
    assert sorted(pointer.checkpoints) == ["step=4.ckpt", "step=5.ckpt"]
    # step 3, dropped by the last save, is deleted after the next one
    assert commits_on_store(backend) <= {e.commit for e in pointer.checkpoints.values()} | set(pointer.retired)
    assert {c.split("/")[0] for c in commits_on_store(backend)} == {"step=3.ckpt", "step=4.ckpt", "step=5.ckpt"}


def test_retention_and_topk_never_delete_the_resumed_from_checkpoint(backend, make_io):
    first = make_io(backend)
    for step in (1, 2):
        first.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    resumed = make_io(backend, keep_last=1, claim_on_load=True)  # a job that trains (outside Trainer.fit here)
    resumed.load_checkpoint(backend.url("step=2.ckpt"))
    for step in (3, 4):
        resumed.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    resumed.remove_checkpoint(backend.url("step=2.ckpt"))  # what top-k rotation would do
    pointer = read_pointer(backend)
    assert sorted(pointer.checkpoints) == ["step=2.ckpt", "step=4.ckpt"]
    assert make_io(backend, claim_on_load=False).load_checkpoint(backend.url("step=2.ckpt"))["global_step"] == 2


def test_remove_of_latest_keeps_its_data_until_latest_moves(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    io.remove_checkpoint(backend.url("a.ckpt"))
    latest = find_latest_checkpoint(backend.root, backend.storage_options)
    assert latest is not None and make_io(backend, claim_on_load=False).load_checkpoint(latest)["global_step"] == 1
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    io.wait()  # (a commit deletes what it retired behind the save)
    assert {c.split("/")[0] for c in commits_on_store(backend)} == {"a.ckpt", "b.ckpt"}  # a: retired
    io.save_checkpoint(make_checkpoint(3), backend.url("c.ckpt"))
    io.wait()
    assert {c.split("/")[0] for c in commits_on_store(backend)} == {"b.ckpt", "c.ckpt"}


def test_crashed_saves_of_a_fenced_writer_are_collected_never_the_current_writers(backend, make_io):
    """A folder without a manifest is collectable only once its writer epoch is fenced off: whatever its name's
    timestamp says (the writer's clock, here skewed by two hours) and whatever the grace, a save of the current
    writer is never touched; committed folders never are, pointer or not."""
    first = make_io(backend)
    first.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    ancient = f"c{int((time.time() - 7200) * 1000):013d}-e1-0000dead"  # a clock two hours behind
    put(backend, f"b.ckpt/{ancient}/shard-00000.bin", b"in progress, or crashed")
    put(backend, "notes/readme.txt", b"user file")
    gc = make_io(backend, orphan_grace_seconds=0)
    assert gc.collect_garbage(backend.root) == []  # epoch 1 is the current writer: it may still commit it
    assert f"b.ckpt/{ancient}" in commits_on_store(backend)
    second = make_io(backend, orphan_grace_seconds=0)
    second.save_checkpoint(make_checkpoint(2), backend.url("c.ckpt"))  # claims epoch 2: epoch 1 is fenced; collects
    remaining = commits_on_store(backend)
    assert f"b.ckpt/{ancient}" not in remaining
    assert {c.split("/")[0] for c in remaining} == {"a.ckpt", "c.ckpt"}  # a (committed, older job) is kept
    young = f"c{int(time.time() * 1000):013d}-e2-0000beef"
    put(backend, f"b.ckpt/{young}/shard-00000.bin", b"in progress")
    assert gc.collect_garbage(backend.root) == [] and f"b.ckpt/{young}" in commits_on_store(backend)
    assert backend.fs().cat_file(backend.path("notes/readme.txt")) == b"user file"


def test_orphan_grace_is_measured_with_the_stores_clock(local_backend, make_io):
    """Among crashed saves of a fenced writer, the grace keeps those the store wrote recently; ages compare the
    store's timestamps (the folder's newest object against the pointer's last write), not this host's clock."""
    import os

    backend = local_backend
    io = make_io(backend, orphan_grace_seconds=3600)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    old, young = "c0000000000001-e1-0000dead", "c9999999999999-e1-0000beef"  # names carry nonsense times
    put(backend, f"b.ckpt/{old}/shard-00000.bin", b"partial")
    put(backend, f"b.ckpt/{young}/shard-00000.bin", b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(backend.path(f"b.ckpt/{old}/shard-00000.bin"), (two_hours_ago, two_hours_ago))
    later = make_io(backend, orphan_grace_seconds=3600)
    later.save_checkpoint(make_checkpoint(2), backend.url("c.ckpt"))  # claims epoch 2 and collects
    remaining = commits_on_store(backend)
    assert f"b.ckpt/{old}" not in remaining and f"b.ckpt/{young}" in remaining


def test_stale_writer_is_fenced(backend, make_io):
    """The old job keeps running and reaches higher steps; latest always names the newer job's checkpoint."""
    old = make_io(backend)
    for step in (1, 2):
        old.save_checkpoint(make_checkpoint(step, seed=1), backend.url(f"step={step}.ckpt"))
    new = make_io(backend)
    new.load_checkpoint(find_latest_checkpoint(backend.root, backend.storage_options))  # resumes
    for step in (3, 4, 5):
        new.save_checkpoint(make_checkpoint(step, seed=2), backend.url(f"step={step}.ckpt"))  # the first claims
        with pytest.raises(StaleWriterError, match="another job resumed"):
            old.save_checkpoint(make_checkpoint(step + 100, seed=1), backend.url(f"step={step + 100}.ckpt"))
        pointer = read_pointer(backend)
        assert pointer.latest.name == f"step={step}.ckpt" and pointer.writer_epoch == 2
    with pytest.raises(StaleWriterError):
        old.remove_checkpoint(backend.url("step=3.ckpt"))
    assert not any(n.startswith("step=10") for n in read_pointer(backend).checkpoints)
    assert not any(c.startswith("step=10") for c in commits_on_store(backend)), "stale writer left its data"
    loaded = make_io(backend, claim_on_load=False).load_checkpoint(backend.root)
    assert_same(loaded, make_checkpoint(5, seed=2))


def test_new_job_supersedes_an_older_writers_higher_step(backend, make_io):
    old = make_io(backend)
    old.save_checkpoint(make_checkpoint(90), backend.url("step=90.ckpt"))
    fresh = make_io(backend)  # a new job that starts without resuming claims on its first save
    fresh.save_checkpoint(make_checkpoint(5), backend.url("step=5.ckpt"))
    assert read_pointer(backend).latest.name == "step=5.ckpt"



def test_a_root_deleted_and_recreated_fences_the_job_that_wrote_it_before(backend, make_io):
    """Job A writes the root; the root is deleted and job C starts on it. Both hold writer epoch 1, but not of the
    same incarnation of the root (its root_id): A's next save and removal are refused, A's save leaves nothing
    behind, and a restart of C resumes C's checkpoint."""
    a = make_io(backend)
    for step in (1, 2):
        a.save_checkpoint(make_checkpoint(step, seed=1), backend.url(f"step={step}.ckpt"))
    backend.fs().rm(backend.path(), recursive=True)
    c = make_io(backend)
    c.save_checkpoint(make_checkpoint(1, seed=2), backend.url("step=1.ckpt"))
    assert read_pointer(backend).writer_epoch == 1  # the epoch A holds
    with pytest.raises(StaleWriterError, match="deleted and written again"):
        a.save_checkpoint(make_checkpoint(3, seed=1), backend.url("step=3.ckpt"))
    with pytest.raises(StaleWriterError, match="deleted and written again"):
        a.remove_checkpoint(backend.url("step=1.ckpt"))
    pointer = read_pointer(backend)
    assert list(pointer.checkpoints) == ["step=1.ckpt"] and pointer.latest.name == "step=1.ckpt"
    assert commits_on_store(backend) == {pointer.latest.commit}  # A's refused save left nothing
    c.save_checkpoint(make_checkpoint(2, seed=2), backend.url("step=2.ckpt"))  # C goes on
    latest = find_latest_checkpoint(backend.root, backend.storage_options)
    assert_same(make_io(backend).load_checkpoint(latest), make_checkpoint(2, seed=2))  # C's restart resumes C's


def test_a_writer_whose_pointer_was_lost_keeps_its_incarnation(backend, make_io):
    """Only the pointer lost (not the root): the writer rebuilds it from the manifests and goes on, as the same
    incarnation of the root, and a job that claims after it fences it by writer epoch as usual."""
    a = make_io(backend)
    a.save_checkpoint(make_checkpoint(1), backend.url("step=1.ckpt"))
    root_id = read_pointer(backend).root_id
    backend.fs().rm(backend.path(POINTER_NAME))
    with pytest.warns(RuntimeWarning, match="is missing"):
        latest = find_latest_checkpoint(backend.root, backend.storage_options)
    a.save_checkpoint(make_checkpoint(2), backend.url("step=2.ckpt"))
    pointer = read_pointer(backend)
    assert pointer.root_id == root_id and [e.step for e in pointer.candidates()] == [2, 1]
    b = make_io(backend, claim_on_load=True)
    b.load_checkpoint(latest)
    with pytest.raises(StaleWriterError, match="another job resumed"):
        a.save_checkpoint(make_checkpoint(3), backend.url("step=3.ckpt"))

def test_a_claim_whose_epoch_is_claimed_again_after_the_pointer_is_lost_is_fenced(backend, make_io):
    """Job B's claim swaps the pointer to epoch 2 and stalls before it records that epoch; the pointer is lost then,
    with no trace of epoch 2 anywhere (no record, no folder), so job C's claim rebuilds it and gets epoch 2 again.
    Two writers of one epoch would pass each other's fence: B's record of epoch 2 is created only if absent, finds
    C's, and B is fenced for good (its save and every later one); C goes on. (Soak seed 842471445: B SIGKILLed
    there was harmless; a B that was only stalled kept writing.)"""
    a = make_io(backend)
    a.save_checkpoint(make_checkpoint(1, seed=1), backend.url("step=1.ckpt"))
    b = make_io(backend)
    fence = b.root(backend.root).fence
    record, stalled, go = fence._record_origin, threading.Event(), threading.Event()

    def late(epoch: int, origin: object) -> None:
        stalled.set()
        go.wait(30)
        record(epoch, origin)

    fence._record_origin = late  # type: ignore[method-assign]
    raised: list[BaseException] = []

    def save_b() -> None:
        try:
            b.save_checkpoint(make_checkpoint(2, seed=2), backend.url("step=2.ckpt"))
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=save_b)
    thread.start()
    assert stalled.wait(30)
    assert read_pointer(backend).writer_epoch == 2  # B's claim swapped the pointer
    backend.fs().rm(backend.path(POINTER_NAME))  # lost: nothing says epoch 2 was claimed
    c = make_io(backend)
    with pytest.warns(RuntimeWarning, match="started from scratch"):  # (C is a fresh start over A's run)
        c.save_checkpoint(make_checkpoint(2, seed=3), backend.url("step=2.ckpt"))
    assert read_pointer(backend).writer_epoch == 2  # C claimed epoch 2 again
    go.set()
    thread.join(30)
    assert len(raised) == 1 and isinstance(raised[0], StaleWriterError), raised
    assert "claimed this epoch again after the pointer was lost" in str(raised[0])
    with pytest.raises(StaleWriterError, match="claimed this epoch again"):
        b.save_checkpoint(make_checkpoint(3, seed=2), backend.url("step=3.ckpt"))
    c.save_checkpoint(make_checkpoint(3, seed=3), backend.url("step=3.ckpt"))
    pointer = read_pointer(backend)
    assert pointer.latest.name == "step=3.ckpt" and pointer.writer_epoch == 2
    assert_same(make_io(backend).load_checkpoint(backend.url("step=2.ckpt")), make_checkpoint(2, seed=3))
    assert_same(make_io(backend).load_checkpoint(backend.url("step=3.ckpt")), make_checkpoint(3, seed=3))


# -- corruption ------------------------------------------------------------------------------------------------

def _objects(backend, commit):
    return sorted(p for p in backend.fs().find(backend.path(commit)))


def _damage(fs, path, how):
    data = fs.cat_file(path)
    if how == "truncate":
        data = data[: max(0, len(data) // 2)]
    else:
        i = len(data) // 2
        data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
    fs.pipe_file(path, data)


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
def test_every_kind_of_object_damage_is_detected(backend, how, make_io):
    io = make_io(backend, shard_size=300)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    target = read_pointer(backend).latest.commit
    paths = _objects(backend, target)
    assert {p.rsplit("/", 1)[-1].split("-")[0] for p in paths} == {"manifest.json", "shard", "skeleton.pt"}
    # Every kind of object, and shards at both ends and in the middle of the stream (the 15 shards differ only in
    # their offsets): each costs two loads, and a load on S3 is tens of requests.
    shards = [p for p in paths if "/shard-" in p]
    assert len(shards) >= 3
    fs = backend.fs()
    for path in [p for p in paths if "/shard-" not in p] + [shards[0], shards[len(shards) // 2], shards[-1]]:
        original = fs.cat_file(path)
        _damage(fs, path, how)
        strict = make_io(backend, claim_on_load=False, fallback_on_corruption=False)
        with pytest.raises(CheckpointCorruptedError) as info:
            strict.load_checkpoint(backend.root)
        assert info.value.object is not None and info.value.object.endswith(path.rsplit("/", 2)[-2] + "/" +
                                                                           path.rsplit("/", 1)[-1])
        lenient = make_io(backend, claim_on_load=False)
        with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):
            assert lenient.load_checkpoint(backend.root)["global_step"] == 1  # the previous committed one
        fs.pipe_file(path, original)


def test_corruption_with_no_valid_fallback_raises_naming_the_object(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    commit = read_pointer(backend).latest.commit
    shard = next(p for p in _objects(backend, commit) if "shard-" in p)
    _damage(backend.fs(), shard, "bitflip")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointCorruptedError, match="blake3 checksum") as info:
        make_io(backend, claim_on_load=False).load_checkpoint(backend.root)
    assert info.value.object == backend.url(f"{commit}/shard-00000.bin")


def test_missing_object_makes_the_resume_fall_back(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    commit = read_pointer(backend).latest.commit
    backend.fs().rm(backend.path(f"{commit}/shard-00000.bin"))
    # Resolving the latest reads only the pointer and the manifest; the missing object shows when it is read.
    latest = find_latest_checkpoint(backend.root, backend.storage_options)
    assert latest == backend.url(commit)
    with pytest.warns(RuntimeWarning, match="is missing"):
        assert make_io(backend, claim_on_load=False).load_checkpoint(latest)["global_step"] == 1
    with pytest.raises(CheckpointCorruptedError, match="is missing") as info:
        make_io(backend, claim_on_load=False, fallback_on_corruption=False).load_checkpoint(latest)
    assert info.value.object == backend.url(f"{commit}/shard-00000.bin")


def test_missing_manifest_is_skipped_by_find_latest(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    commit = read_pointer(backend).latest.commit
    backend.fs().rm(backend.path(f"{commit}/{MANIFEST_NAME}"))
    with pytest.warns(RuntimeWarning, match="is missing"):
        latest = find_latest_checkpoint(backend.root, backend.storage_options)
    assert latest.startswith(backend.url("a.ckpt/"))


# -- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("garbage", [b"", b'{"format": 1, "kind": "lightning_res', b"\x00\xff garbage", b"[]"])
def test_garbage_pointer_is_a_clear_error_and_loses_nothing(backend, garbage, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    backend.fs().pipe_file(backend.path(POINTER_NAME), garbage)
    with pytest.raises(CheckpointCorruptedError, match="repair_pointer") as info:
        find_latest_checkpoint(backend.root, backend.storage_options)
    assert info.value.object == backend.url(POINTER_NAME)
    assert f"repair_pointer({backend.root!r})" in str(info.value)  # the root, not the folder the pointer is in
    writer = make_io(backend)
    with pytest.raises(CheckpointCorruptedError, match="Nothing committed is lost"):
        writer.save_checkpoint(make_checkpoint(3), backend.url("c.ckpt"))
    assert backend.fs().cat_file(backend.path(POINTER_NAME)) == garbage  # the save did not overwrite it
    latest = repair_pointer(backend.root, backend.storage_options)
    assert latest.startswith(backend.url("b.ckpt/"))
    assert make_io(backend, claim_on_load=False).load_checkpoint(backend.root)["global_step"] == 2


def test_missing_pointer_with_checkpoints_still_finds_them(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(4), backend.url("a.ckpt"))
    backend.fs().rm(backend.path(POINTER_NAME))
    with pytest.warns(RuntimeWarning, match="is missing but 1 committed"):
        latest = find_latest_checkpoint(backend.root, backend.storage_options)
    assert make_io(backend, claim_on_load=False).load_checkpoint(latest)["global_step"] == 4


def _rewrite_manifest(backend, edit):
    commit = read_pointer(backend).latest.commit
    path = backend.path(f"{commit}/{MANIFEST_NAME}")
    body = json.loads(backend.fs().cat_file(path))["body"]
    edit(body)
    backend.fs().pipe_file(path, seal(body))  # a consistent document: only its content is wrong


def test_manifest_of_a_newer_format_is_refused_not_skipped(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    _rewrite_manifest(backend, lambda m: m.update(format=99))
    with pytest.raises(UnsupportedFormatError, match=r"format 99.*Upgrade lightning_resilient"):
        make_io(backend, claim_on_load=False).load_checkpoint(backend.root)


@pytest.mark.parametrize("bad", ["../../elsewhere/shard-00000.bin", "/etc/passwd", "s3://other-bucket/x",
                                 "a.ckpt/./x", "a.ckpt//x"])
def test_manifest_entries_escaping_the_root_are_rejected(backend, bad, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))

    def escape(m):
        m["objects"][0]["path"] = bad

    _rewrite_manifest(backend, escape)
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointCorruptedError, match="checkpoint root"):
        make_io(backend, claim_on_load=False).load_checkpoint(backend.root)


def test_load_of_a_missing_path_says_what_it_looked_for(backend, make_io):
    io = make_io(backend)
    with pytest.raises(FileNotFoundError, match="not a checkpoint root"):
        io.load_checkpoint(backend.url("nothing-here"))
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    with pytest.raises(FileNotFoundError,
                       match=r"^Checkpoint file not found: .*No committed checkpoint is named 'typo.ckpt'.*'a.ckpt'"):
        io.load_checkpoint(backend.url("typo.ckpt"))


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
def test_damaged_pointer_is_detected_even_when_it_still_parses(backend, how, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    path = backend.path(POINTER_NAME)
    body = backend.fs().cat_file(path)
    # Flip a digit of the step, so the JSON stays valid and only the digest can tell.
    if how == "bitflip":
        i = body.index(b'"step": 1')
        damaged = body[: i + 8] + b"7" + body[i + 9:]
        assert json.loads(damaged)
    else:
        damaged = body[: len(body) // 2]
    backend.fs().pipe_file(path, damaged)
    with pytest.raises(CheckpointCorruptedError, match="pointer") as info:
        find_latest_checkpoint(backend.root, backend.storage_options)
    assert info.value.object == backend.url(POINTER_NAME)


def test_identical_resave_is_manifest_only_and_survives_collection(backend, make_io):
    """Same state under a second name: every object is shared, only the manifest is new, and the folder
    holding just that manifest is live (not debris for orphan collection)."""
    io = make_io(backend)
    ckpt = make_checkpoint(3)
    io.save_checkpoint(ckpt, backend.url("epoch=0-step=3.ckpt"))
    io.save_checkpoint(ckpt, backend.url("last.ckpt"))
    last = read_pointer(backend).checkpoints["last.ckpt"]
    assert [p.rsplit("/", 1)[-1] for p in backend.fs().find(backend.path(last.commit))] == [MANIFEST_NAME]
    make_io(backend, orphan_grace_seconds=0).collect_garbage(backend.root)
    assert commits_on_store(backend) == read_pointer(backend).live_folders()
    strict = make_io(backend, claim_on_load=False, fallback_on_corruption=False)
    assert_same(strict.load_checkpoint(backend.url("last.ckpt")), ckpt)
    io.save_checkpoint(make_checkpoint(4), backend.url("last.ckpt"))  # superseding it retires it
    io.save_checkpoint(make_checkpoint(5), backend.url("last.ckpt"))  # and the next save deletes it
    assert last.commit not in commits_on_store(backend)


def test_incomplete_multipart_uploads_under_the_root_are_aborted(s3_backend, make_io):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_backend.endpoint)
    bucket, prefix = s3_backend.path().split("/", 1)
    inside = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/b.ckpt/c0000000000001-e1-00000000/x")
    outside = client.create_multipart_upload(Bucket=bucket, Key="other-run/big.bin")
    # moto reports every upload as initiated in 2010, so only the "old enough" side can be shown here.
    io = make_io(s3_backend, orphan_grace_seconds=60)
    io.save_checkpoint(make_checkpoint(1), s3_backend.url("a.ckpt"))  # the first save claims, and collects
    left = {u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
    assert left == {outside["UploadId"]} and inside["UploadId"] not in left


def test_a_format_1_manifest_is_refused_by_name_and_never_collected(backend, make_io):
    """Format 1 (one SHA-256 per object) was only written by development builds before the first release: a load
    says so and what to do, and garbage collection leaves such a folder alone (not ours to judge)."""
    commit = "old.ckpt/c1700000000000-e1-0123abcd"
    put(backend, f"{commit}/shard-00000.bin", bytes(64))
    manifest = {"format": 1, "kind": "lightning_resilient.checkpoint", "name": "old.ckpt", "commit": commit, "step": 5,
                "epoch": 0, "created": 1.7e9, "writer_epoch": 1, "skeleton": 0, "objects": [], "tensors": []}
    put(backend, f"{commit}/{MANIFEST_NAME}", seal(manifest))
    with pytest.raises(UnsupportedFormatError, match=r"format 1, written by a development build .* reads format 2"):
        make_io(backend, claim_on_load=False).load_checkpoint(backend.url(commit))
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(7), backend.url("new.ckpt"))  # a newer writer epoch: e1 is fenced
    io.collect_garbage(backend.root)
    assert backend.fs().exists(backend.path(f"{commit}/{MANIFEST_NAME}"))


def test_a_commit_writes_the_pointer_against_its_own_last_write_and_never_loses_another_writers_change(
        backend, make_io):
    """A writer's commit writes the pointer conditionally on the version of its own last write, without reading it
    first (one round trip less per save). When another process wrote it since (an operator's retention: the root's
    writer is not fenced by it), the condition fails, the commit reads the pointer and keeps that change."""
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    store = io.root(backend.root).store
    reads: list[str] = []
    read_versioned = store.read_versioned

    def counted(rel: str) -> tuple[bytes, str] | None:
        reads.append(rel)
        return read_versioned(rel)

    store.read_versioned = counted  # type: ignore[method-assign]
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    assert POINTER_NAME not in reads
    operator = open_root(backend.root, backend.storage_options)
    assert [e.name for e in operator.retain(1)] == ["a.ckpt"]  # (the pointer changed under the writer)
    io.save_checkpoint(make_checkpoint(3), backend.url("c.ckpt"))
    assert POINTER_NAME in reads  # its guess failed: it read the pointer
    assert sorted(read_pointer(backend).checkpoints) == ["b.ckpt", "c.ckpt"]  # the operator's drop kept
    assert_same(make_io(backend, claim_on_load=False).load_checkpoint(backend.url("c.ckpt")), make_checkpoint(3))


def test_a_store_without_enforced_conditions_gets_no_guessed_pointer_write(tmp_path):
    """On a store whose conditional writes are not enforced (the generic fsspec store: last writer wins), an update
    always reads the pointer first, so a job a newer claim fenced is still refused, as far as a read can tell."""
    import fsspec

    from lightning_resilient.io.retry import RetryPolicy
    from lightning_resilient.io.root import CheckpointRoot, RootSettings, SerialExecutor
    from lightning_resilient.io.store.base import Store

    fs = fsspec.filesystem("memory")
    settings = RootSettings(keep_last=None, shard_size=1 << 20, orphan_grace_seconds=3600.0,
                            fallback_on_corruption=False)

    def job() -> CheckpointRoot:
        return CheckpointRoot(Store(fs, f"memory://{tmp_path}/nocas", f"{tmp_path}/nocas", RetryPolicy()), settings,
                              SerialExecutor)

    with pytest.warns(RuntimeWarning, match="no conditional write"):
        old = job()
        old.save(make_checkpoint(1), "a.ckpt")
    job().claim()  # a newer job
    with pytest.raises(StaleWriterError):
        old.save(make_checkpoint(2), "b.ckpt")
