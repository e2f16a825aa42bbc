"""What may be deleted, and when: a lost pointer licenses nothing, a save in progress is never collected, a commit
never names an object that is gone, ``gc`` at any grace beside a running job breaks nothing, and a reader whose
checkpoint retention retires meanwhile reads the new latest instead of reporting corruption."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from lightning_resilient import AtomicCheckpointIO, CheckpointError, find_latest_checkpoint
from lightning_resilient.cli import main
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import POINTER_NAME
from lightning_resilient.testing import StoreProxy
from tests import procs

from .helpers import make_checkpoint, read_pointer
from .test_crash import _env, commit_folders
from .test_protocol import commits_on_store

CHILD = Path(__file__).with_name("crash_child.py")


def _options(backend) -> list[str]:
    return ["--storage-options", json.dumps(backend.storage_options)] if backend.storage_options else []


def test_a_missing_pointer_never_licenses_a_deletion(backend, capsys, make_io):
    io = make_io(backend)
    for step in (1, 2):
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    backend.fs().rm(backend.path(POINTER_NAME))
    committed = commits_on_store(backend)
    assert make_io(backend, orphan_grace_seconds=0).collect_garbage(backend.root) == []
    assert main(["gc", backend.root, "--grace", "0", *_options(backend)]) == 2
    assert "nothing is deleted under a root whose pointer is lost" in capsys.readouterr().err
    # The documented resume: find_latest_checkpoint scans (with a warning), the job loads, its first save claims
    # the root, which rebuilds the pointer from the manifests and collects garbage: nothing committed goes.
    with pytest.warns(RuntimeWarning, match="is missing"):
        latest = find_latest_checkpoint(backend.root, backend.storage_options)
    job = make_io(backend, orphan_grace_seconds=0, claim_on_load=True)  # a job that trains (outside Trainer.fit)
    assert job.load_checkpoint(latest)["global_step"] == 2
    job.save_checkpoint(make_checkpoint(3), backend.url("step=3.ckpt"))
    assert committed < commits_on_store(backend)
    pointer = read_pointer(backend)
    assert sorted(pointer.checkpoints) == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert [e.step for e in pointer.candidates()] == [3, 2, 1]
    # A fresh job's first save on a root whose pointer is gone: the same, its predecessors become abandoned.
    backend.fs().rm(backend.path(POINTER_NAME))
    committed = commits_on_store(backend)
    fresh = make_io(backend, orphan_grace_seconds=0)
    fresh.save_checkpoint(make_checkpoint(1, seed=5), backend.url("fresh.ckpt"))
    assert committed < commits_on_store(backend)
    assert [e.name for e in read_pointer(backend).candidates()] == ["fresh.ckpt"]


def test_gc_at_zero_grace_never_collects_a_save_still_uploading(s3_backend, make_io, plugins):
    """The save is slowed to a crawl by a loopback proxy while gc runs at grace 0 in a loop; the save commits
    with every object in place (on the code before this rule, gc deleted shards and the save committed anyway)."""
    with StoreProxy(s3_backend.endpoint, bandwidth=400_000) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}, "skip_instance_cache": True}
        writer = plugins.track(AtomicCheckpointIO(storage_options=options, shard_size=8192, max_concurrency=2,
                                                  retry_base_delay=0.01))
        writer.save_checkpoint(make_checkpoint(1, size=64), s3_backend.url("a.ckpt"))  # claims the root
        saving = threading.Thread(target=writer.save_checkpoint,
                                  args=(make_checkpoint(2, size=2048), s3_backend.url("b.ckpt")))
        saving.start()
        gc = make_io(s3_backend, orphan_grace_seconds=0)
        rounds = 0
        while saving.is_alive():
            gc.collect_garbage(s3_backend.root)
            rounds += 1
        saving.join()
    assert rounds >= 3
    latest = read_pointer(s3_backend).latest
    assert latest.name == "b.ckpt"
    gc.root(s3_backend.root).verify(latest.commit)  # every object of the committed save is there and intact


def test_a_commit_never_names_an_object_that_is_gone(backend, make_io):
    io = make_io(backend, shard_size=300)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    before = read_pointer(backend)
    root = io.root(backend.root)
    sync = root.store.sync_folder

    def delete_a_shard_first(rel: str) -> None:
        # The worst instant: everything is uploaded, the manifest is next. Someone deletes one object for real.
        if rel.startswith("b.ckpt/"):
            shard = next(p for p in backend.fs().find(backend.path(rel)) if "shard-00001" in p)
            backend.fs().rm(shard)
        sync(rel)

    root.store.sync_folder = delete_a_shard_first  # type: ignore[method-assign]
    with pytest.raises(CheckpointError, match=r"is missing just before .* was to be committed"):
        io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))
    after = read_pointer(backend)
    assert after.latest == before.latest and "b.ckpt" not in after.checkpoints
    assert not any(p.endswith(MANIFEST_NAME) for p in backend.fs().find(backend.path("b.ckpt")))


def _race(reader, backend, writer, steps):
    """Make ``reader``'s next read of a checkpoint happen after ``writer`` saved ``steps``: by then retention
    (keep_last=1) has deleted the checkpoint the reader resolved. Returns the commits the reader resolved."""
    root = reader.root(backend.root)
    read = root.load
    raced: list[str] = []

    def load_after_saves(commit: str, **kwargs):
        if not raced:
            raced.append(commit)
            for step in steps:
                writer.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
            assert not backend.fs().exists(backend.path(f"{commit}/{MANIFEST_NAME}"))
        return read(commit, **kwargs)

    root.load = load_after_saves  # type: ignore[method-assign]
    return raced


def test_a_reader_whose_checkpoint_is_retired_meanwhile_reads_the_new_latest(backend, make_io):
    writer = make_io(backend, keep_last=1)
    writer.save_checkpoint(make_checkpoint(1), backend.url("step=1.ckpt"))
    reader = make_io(backend)
    raced = _race(reader, backend, writer, (2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "corrupted" warning: a retired checkpoint is not a damaged one
        assert reader.load_checkpoint(backend.root)["global_step"] == 3
    assert len(raced) == 1
    # A URL naming that very commit cannot be read again: a clear error, not a corruption report.
    pinned = make_io(backend)
    _race(pinned, backend, writer, (4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FileNotFoundError, match="deleted by retention"):
            pinned.load_checkpoint(find_latest_checkpoint(backend.root, backend.storage_options))
    with pytest.raises(FileNotFoundError, match="no longer exists"):
        make_io(backend).load_checkpoint(backend.url(raced[0]))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_gc_and_readers_in_a_loop_beside_a_running_job(request, kind, make_io):
    """A careless operator runs ``gc --grace 0`` (and ``verify``, and read-only loads) in a loop while a training
    job saves every step with keep_last=1: the job ends normally, nothing reads as corrupted, every checkpoint
    verifies, and the rerun resumes the last step."""
    backend = request.getfixturevalue(f"{kind}_backend")
    env = _env(AWS_ENDPOINT_URL=backend.endpoint) if backend.endpoint else _env()
    job = procs.popen([sys.executable, str(CHILD), backend.root, json.dumps(backend.storage_options),
                       "--max-steps", "25" if kind == "local" else "14", "--keep-last", "1"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    options = _options(backend)
    reader = make_io(backend)
    problems: list[str] = []
    rounds = 0
    try:
        deadline = time.monotonic() + 240
        while job.poll() is None and time.monotonic() < deadline:
            rounds += 1
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if main(["gc", backend.root, "--grace", "0", *options]) != 0:
                    problems.append("gc failed")
                pointer = read_pointer_or_none(backend)
                if pointer is not None and pointer.candidates():  # once the job has committed a first checkpoint
                    if main(["verify", backend.root, "--no-progress", *options]) != 0:
                        problems.append("verify failed")
                    try:
                        reader.load_checkpoint(backend.root)
                    except Exception as exc:  # any failure of a read-only load is a finding
                        problems.append(f"load: {exc!r}")
            problems += [str(w.message) for w in seen if "corrupted" in str(w.message)]
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-3000:]
    assert rounds >= 5 and not problems, problems[:5]
    assert main(["verify", backend.root, "--all", "--no-progress", *options]) == 0
    latest = find_latest_checkpoint(backend.root, backend.storage_options)
    strict = make_io(backend, fallback_on_corruption=False)
    assert strict.load_checkpoint(latest)["global_step"] == (25 if kind == "local" else 14)
    pointer = read_pointer(backend)
    assert commit_folders(backend) <= pointer.live_folders() | set(pointer.retired)


def read_pointer_or_none(backend):
    try:
        return read_pointer(backend)
    except FileNotFoundError:
        return None


def test_find_latest_checkpoint_beside_retention_reads_the_pointer_again(backend, monkeypatch, make_io):
    """Between its pointer read and its manifest read, the checkpoint is retired (keep_last=1): not corruption."""
    from lightning_resilient.io.root import CheckpointRoot

    writer = make_io(backend, keep_last=1)
    writer.save_checkpoint(make_checkpoint(1), backend.url("step=1.ckpt"))
    read = CheckpointRoot.read_manifest
    raced: list[str] = []

    def after_two_saves(self, commit):
        if not raced:
            raced.append(commit)
            for step in (2, 3):
                writer.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
        return read(self, commit)

    monkeypatch.setattr(CheckpointRoot, "read_manifest", after_two_saves)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest = find_latest_checkpoint(backend.root, backend.storage_options)
    assert raced and raced[0].startswith("step=1.ckpt/") and latest.startswith(backend.url("step=3.ckpt/"))


def test_a_retired_checkpoint_waits_for_the_next_step_not_the_next_commit(local_backend, make_io):
    """save_last commits twice per save (top-k, then last.ckpt at the same step): what the first commit retires is
    still readable after the second, and goes with the next step's save."""
    backend = local_backend
    io = make_io(backend, keep_last=1)
    for step in (1, 2):
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
        io.save_checkpoint(make_checkpoint(step), backend.url("last.ckpt"))
    step1 = [c for c in commits_on_store(backend) if c.startswith("step=1.ckpt/")]
    assert step1 and step1[0] in read_pointer(backend).retired  # retired by step 2's saves, data kept
    io.save_checkpoint(make_checkpoint(3), backend.url("step=3.ckpt"))
    assert not [c for c in commits_on_store(backend) if c.startswith("step=1.ckpt/")]


def test_a_job_whose_origin_was_retired_before_it_claimed_refuses_to_commit(local_backend, make_io):
    """A job that claims only at its first save (claim_on_load=False) while the old job, still running with
    keep_last=1, retires the checkpoint it resumed from: its save is refused with a clear error, nothing is
    committed, and the root still resumes the old job's newest checkpoint."""
    backend = local_backend
    old = make_io(backend, keep_last=1)
    old.save_checkpoint(make_checkpoint(1), backend.url("step=1.ckpt"))
    new = make_io(backend, claim_on_load=False)
    new.root(backend.root).resumed(read_pointer(backend).latest)  # what a resuming fit records (fit is not run here)
    for step in (2, 3):
        old.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    with pytest.raises(CheckpointError, match="the checkpoint this job resumed from, was deleted before this job"):
        new.save_checkpoint(make_checkpoint(2, seed=9), backend.url("new-step=2.ckpt"))
    assert read_pointer(backend).writer_epoch == 1  # the old job is not fenced by a claim that could not be made
    assert find_latest_checkpoint(backend.root).startswith(backend.url("step=3.ckpt/"))


def test_the_end_of_a_fit_deletes_what_it_retired_since_its_last_commit(backend, make_io):
    """keep_last=1: the last save retires the one before, whose data waits for a later commit; at the end of the fit
    (the plugin's teardown) there will be none, so it goes then, and its record leaves the pointer."""
    io = make_io(backend, keep_last=1)
    for step in (1, 2):
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    retired = [c for c in commits_on_store(backend) if c.startswith("step=1.ckpt/")]
    assert retired and retired[0] in read_pointer(backend).retired  # waiting for a commit that will not come
    io.teardown()
    pointer = read_pointer(backend)
    assert commits_on_store(backend) == pointer.live_folders() and not pointer.retired
    assert make_io(backend).load_checkpoint(backend.root)["global_step"] == 2


def test_a_reader_of_what_the_end_of_a_fit_deletes_reads_the_new_latest(backend, make_io):
    """The reader-safety argument of ``Retention.end_of_writer``: a reader that resolved the checkpoint before it was
    retired and deleted at the end of the fit resolves the root again, and never reports corruption."""
    writer = make_io(backend, keep_last=1)
    writer.save_checkpoint(make_checkpoint(1), backend.url("step=1.ckpt"))
    reader = make_io(backend)
    root = reader.root(backend.root)
    read = root.load
    raced: list[str] = []

    def load_after_the_fit_ended(commit: str, **kwargs):
        if not raced:
            raced.append(commit)
            writer.save_checkpoint(make_checkpoint(2), backend.url("step=2.ckpt"))  # retires step 1: data kept
            assert backend.fs().exists(backend.path(f"{commit}/skeleton.pt"))
            writer.teardown()  # the fit ends: step 1 is deleted now
            assert not backend.fs().exists(backend.path(commit))
        return read(commit, **kwargs)

    root.load = load_after_the_fit_ended  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "corrupted" warning
        assert reader.load_checkpoint(backend.root)["global_step"] == 2
    assert raced and raced[0].startswith("step=1.ckpt/")


def test_a_fenced_writer_leaves_what_it_retired_to_the_newer_one(local_backend, make_io):
    backend = local_backend
    old = make_io(backend, keep_last=1)
    for step in (1, 2):
        old.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    new = make_io(backend, claim_on_load=True)
    new.load_checkpoint(backend.root)  # claims the root: the old job is fenced off
    old.teardown()
    assert [c for c in commits_on_store(backend) if c.startswith("step=1.ckpt/")]  # not the old job's to delete now
    new.save_checkpoint(make_checkpoint(3), backend.url("step=3.ckpt"))  # the newer writer's commit deletes it
    new.wait()  # (behind the save)
    assert not [c for c in commits_on_store(backend) if c.startswith("step=1.ckpt/")]
