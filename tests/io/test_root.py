"""CheckpointRoot's settings and the one way a root is opened (the protocol itself: test_protocol*.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from lightning_resilient import SettingTypeError
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import POINTER_NAME
from lightning_resilient.io.root import INSPECTING, RootSettings, SerialExecutor, open_root

from .helpers import assert_same, make_checkpoint


@pytest.mark.parametrize(("field", "value", "error", "message"), [
    ("keep_last", 0, ValueError, "keep_last must be an int >= 1 or None, got 0"),
    ("keep_last", 1.5, SettingTypeError, "keep_last must be an int >= 1 or None, got 1.5"),
    ("shard_size", 6 * 2**30, ValueError, "shard_size must be a number of bytes from 1 to 5 GiB"),
    ("chunk_size", 0, ValueError, "chunk_size must be a positive number of bytes, got 0"),
    ("max_concurrency", True, SettingTypeError, "max_concurrency must be an int >= 1, got True"),
    ("orphan_grace_seconds", -1, ValueError, "orphan_grace_seconds must be a number >= 0, got -1"),
    ("fallback_on_corruption", "yes", SettingTypeError, "fallback_on_corruption must be True or False"),
])
def test_root_settings_refuse_a_bad_field_by_name(field, value, error, message):
    base = {"keep_last": None, "shard_size": 1, "orphan_grace_seconds": 0.0, "fallback_on_corruption": True}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        RootSettings(**{**base, field: value})


def test_a_setting_type_error_is_caught_as_either_built_in():
    with pytest.raises(TypeError):
        RootSettings(keep_last="3", shard_size=1, orphan_grace_seconds=0.0, fallback_on_corruption=True)
    with pytest.raises(ValueError):
        RootSettings(keep_last="3", shard_size=1, orphan_grace_seconds=0.0, fallback_on_corruption=True)


def test_a_root_opened_to_inspect_reads_in_the_calling_thread(backend, make_io):
    ckpt = make_checkpoint(3)
    make_io(backend).save_checkpoint(ckpt, backend.url("step=3.ckpt"))
    root = open_root(backend.root, backend.storage_options)
    assert root.settings == INSPECTING and root.writer_epoch is None  # reading claims nothing
    pointer, _ = root.read_pointer()
    assert pointer is not None and pointer.latest is not None
    readers: set[int] = set()
    for method in ("read_range", "read_into"):
        real = getattr(root.store, method)

        def recorded(*args, _real=real, **kwargs):
            readers.add(threading.get_ident())
            return _real(*args, **kwargs)

        setattr(root.store, method, recorded)
    loaded = root.load(pointer.latest.commit, map_location=None, weights_only=True)
    assert readers == {threading.get_ident()}  # every read in this thread: no pool was started
    assert_same(loaded.checkpoint["state_dict"], ckpt["state_dict"])


def test_the_serial_executor_completes_each_job_or_holds_its_error():
    with SerialExecutor() as pool:
        assert pool.submit(lambda a, b: a + b, 2, b=3).result() == 5
        failed = pool.submit(lambda: 1 / 0)
        assert isinstance(failed.exception(), ZeroDivisionError)
        assert list(pool.map(lambda x: x * 2, [1, 2])) == [2, 4]


def test_work_finished_later_goes_before_every_change_to_the_root_and_its_error_is_only_logged(tmp_path, caplog):
    """A restore's copy written behind training (``finish_later``): a claim, a save, a removal or a collection of
    the root waits for it, the work itself may change the root, and its failure leaves the root usable."""
    settings = RootSettings(keep_last=None, shard_size=1 << 20, orphan_grace_seconds=0.0,
                            fallback_on_corruption=True)
    root = open_root(str(tmp_path / "tier"), settings=settings)
    go, order = threading.Event(), []

    def work() -> None:
        go.wait(timeout=30)
        root.save(make_checkpoint(1), "step=1.ckpt")  # (in its own thread: settle does not wait for itself)
        order.append("work")

    root.finish_later(work, "a test copy")
    saver = threading.Thread(target=lambda: (root.save(make_checkpoint(2), "step=2.ckpt"), order.append("save")))
    saver.start()
    saver.join(timeout=0.5)
    assert saver.is_alive() and order == []  # the save waits for the work
    go.set()
    saver.join(timeout=30)
    assert order == ["work", "save"]
    pointer, _ = root.read_pointer()
    assert pointer is not None and sorted(e.step for e in pointer.entries()) == [1, 2]

    def fails() -> None:
        raise OSError("disk full")

    with caplog.at_level("WARNING", logger="lightning_resilient"):
        root.finish_later(fails, "a test copy")
        root.settle()
    assert "a test copy in " in caplog.text and "did not finish (disk full): a restart does it again" in caplog.text
    root.remove("step=1.ckpt")  # the root stays usable


@pytest.mark.parametrize("change", ["claim", "remove", "collect_garbage", "end_of_writer", "retain", "drop", "hold",
                                    "release"])
def test_every_change_to_a_root_waits_for_the_work_finished_later(tmp_path, change):
    settings = RootSettings(keep_last=None, shard_size=1 << 20, orphan_grace_seconds=0.0,
                            fallback_on_corruption=True)
    root = open_root(str(tmp_path / "tier"), settings=settings)
    root.save(make_checkpoint(1), "step=1.ckpt")
    go, done = threading.Event(), []
    root.finish_later(lambda: (go.wait(timeout=30), done.append("work")), "a test copy")
    calls = {"claim": lambda: root.claim(), "remove": lambda: root.remove("step=1.ckpt"),
             "collect_garbage": lambda: root.collect_garbage(), "end_of_writer": lambda: root.end_of_writer(),
             "retain": lambda: root.retain(1), "drop": lambda: root.drop(set()),
             "hold": lambda: root.hold([], "a test"), "release": lambda: root.release([])}
    changer = threading.Thread(target=lambda: (calls[change](), done.append(change)))
    changer.start()
    changer.join(timeout=0.3)
    assert changer.is_alive() and done == []  # (it cannot end before the work: with the wait it never does)
    go.set()
    changer.join(timeout=30)
    assert done == ["work", change]


def test_a_save_returns_before_deleting_what_it_retired_and_the_next_change_waits_for_that(tmp_path):
    """A commit deletes what it retired (the manifest of the checkpoint a save of the same name replaced, the
    folders due since the last commit) behind the save: on a cloud store a sync save returns a round trip or three
    sooner. The root's next change (the next commit) and ``settle`` wait for the deletion, which happens all the
    same. (On an object store: local disk deletes at once, see ``RootWriter.publish``.)"""
    settings = RootSettings(keep_last=None, shard_size=1 << 20, orphan_grace_seconds=0.0, fallback_on_corruption=True)
    root = open_root(f"memory://{tmp_path}/root", settings=settings)
    root.save(make_checkpoint(1), "last.ckpt")
    pointer, _ = root.read_pointer()
    assert pointer is not None and pointer.latest is not None
    first = pointer.latest.commit
    go, deleting, order = threading.Event(), threading.Event(), []
    remove_object = root.store.remove_object

    def held(rel: str) -> None:
        if rel.endswith(f"/{MANIFEST_NAME}") and not go.is_set():
            deleting.set()
            go.wait(timeout=10)
        remove_object(rel)
        order.append(f"deleted {rel}")

    root.store.remove_object = held  # type: ignore[method-assign]
    second = threading.Thread(target=lambda: (root.save(make_checkpoint(2), "last.ckpt"), order.append("saved 2")))
    second.start()
    assert deleting.wait(timeout=30)
    second.join(timeout=5)
    assert not second.is_alive() and order == ["saved 2"]  # returned while its deletion is held
    assert root.store.exists(f"{first}/{MANIFEST_NAME}")
    third = threading.Thread(target=lambda: (root.save(make_checkpoint(3), "last.ckpt"), order.append("saved 3")))
    third.start()
    third.join(timeout=0.3)
    assert third.is_alive()  # its commit waits for the deletion (with the wait it never ends before it)
    go.set()
    third.join(timeout=30)
    root.settle()
    assert order[:2] == ["saved 2", f"deleted {first}/{MANIFEST_NAME}"] and "saved 3" in order, order
    pointer, _ = root.read_pointer()
    assert pointer is not None and pointer.latest is not None and pointer.latest.step == 3
    # The first folder was due at the third commit (retired by the second): deleted (its record leaves the pointer
    # at the next update).
    assert not root.store.list_dir(first) and first in pointer.retired
    assert_same(root.load(pointer.latest.commit, map_location="cpu", weights_only=False).checkpoint,
                make_checkpoint(3))


def test_a_save_and_a_removal_that_find_the_root_unclaimed_make_one_claim(tmp_path):
    """Lightning's AsyncCheckpointIO saves on its worker thread while the Trainer's thread removes: both may find the
    root unclaimed. One claims; the other waits for that claim and goes on as its writer epoch. (Two claims fenced
    this process's own save: its folder named the first epoch, the fence held the second.)"""
    settings = RootSettings(keep_last=None, shard_size=1 << 20, orphan_grace_seconds=0.0, fallback_on_corruption=True)
    root = open_root(str(tmp_path / "root"), settings=settings)
    writing, go = threading.Event(), threading.Event()
    write_versioned = root.store.write_versioned

    def held(rel: str, data: bytes, expected: str | None) -> str | None:
        if rel == POINTER_NAME and not writing.is_set():  # the first claim's pointer write waits for the other thread
            writing.set()
            go.wait(timeout=30)
        return write_versioned(rel, data, expected)

    root.store.write_versioned = held  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> threading.Thread:
        def guarded() -> None:
            try:
                call()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=guarded)
        thread.start()
        return thread

    saver = run(lambda: root.save(make_checkpoint(1), "step=1.ckpt"))
    assert writing.wait(timeout=30)  # the save is claiming
    remover = run(lambda: root.remove("step=0.ckpt"))  # finds no pointer yet: it would claim too
    remover.join(timeout=0.3)  # (it cannot claim before the first claim is written: with the lock it waits for it)
    go.set()
    saver.join(timeout=30)
    remover.join(timeout=30)
    assert errors == []
    pointer, _ = root.read_pointer()
    assert pointer is not None and pointer.writer_epoch == root.writer_epoch == 1
    assert pointer.latest is not None and pointer.latest.name == "step=1.ckpt" and pointer.latest.writer_epoch == 1
    assert_same(root.load(pointer.latest.commit, map_location=None, weights_only=True).checkpoint, make_checkpoint(1))


def test_a_job_that_dies_before_the_deletion_behind_its_commit_leaves_it_to_the_next_job(tmp_path):
    """The worst instant of the deletion behind a commit: the process dies after its pointer moved and before the
    deletion ran (here its deletions never reach the store). Nothing committed is lost; the next job resumes the
    newest commit, and its own commits delete what the dead one retired, manifest first."""
    settings = RootSettings(keep_last=None, shard_size=1 << 20, orphan_grace_seconds=0.0, fallback_on_corruption=True)
    url = f"memory://{tmp_path}/root"
    dead = open_root(url, settings=settings)
    dead.save(make_checkpoint(1), "last.ckpt")
    dead.save(make_checkpoint(2), "last.ckpt")  # retires step 1's commit
    dead.settle()

    dead.writer._behind = lambda work, what: None  # (killed: the work behind the commit never runs)
    dead.save(make_checkpoint(3), "last.ckpt")  # committed; retiring step 2 and deleting step 1 never happen
    dead.settle()
    pointer, _ = dead.read_pointer()
    assert pointer is not None and pointer.latest is not None and pointer.latest.step == 3
    left = set(pointer.retired)
    assert len(left) == 2 and all(dead.store.list_dir(folder) for folder in left)  # both still stored

    job = open_root(url, settings=settings)
    latest = job.load(pointer.latest.commit, map_location="cpu", weights_only=False)
    assert_same(latest.checkpoint, make_checkpoint(3))
    job.resumed(pointer.checkpoints["last.ckpt"])
    for step in (4, 5):
        job.save(make_checkpoint(step), "last.ckpt")
    job.settle()
    assert not any(job.store.list_dir(folder) for folder in left)  # deleted by the next job's commits
    pointer, _ = job.read_pointer()
    assert pointer is not None and pointer.latest is not None and pointer.latest.step == 5
    assert_same(job.load(pointer.latest.commit, map_location="cpu", weights_only=False).checkpoint,
                make_checkpoint(5))
