"""The node-local cache: private to its user and job, verified against the store, refilled when damaged, never
deleting what it did not create, never changing a copy under a reader (in-process; the DDP tests use it for real)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lightning_resilient.io.node_cache import NodeCache
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.root import CheckpointRoot, RootSettings
from lightning_resilient.io.store import open_store

from .helpers import assert_same, make_checkpoint, read_pointer


def local_root(path: str) -> CheckpointRoot:
    return CheckpointRoot(open_store(path, {}, RetryPolicy()), RootSettings(None, 1, 0.0, True),
                          lambda: ThreadPoolExecutor(2))


def saved(make_io, backend, *steps: int) -> tuple[CheckpointRoot, list[str]]:
    io = make_io(backend, shard_size=1024)
    commits = []
    for step in steps:
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
        commits.append(read_pointer(backend).latest.commit)
    return make_io(backend).root(backend.root), commits


def load(cache: NodeCache, root: CheckpointRoot, commit: str):
    return cache.load(root, commit, local_root, map_location=None, weights_only=None).checkpoint


def copies(cache: NodeCache) -> list[str]:
    return sorted(e for e in os.listdir(cache.directory) if not e.endswith(".lock"))


def test_a_damaged_copy_is_refilled_from_the_store_never_trusted(memory_backend, tmp_path, make_io):
    """One file removed from the copy, one byte changed in another: the next loads still get the store's
    checkpoint (not an older one), verified against the store's manifest, and the copy is whole again."""
    root, (commit,) = saved(make_io, memory_backend, 20)
    cache = NodeCache(str(tmp_path), root.url, job="job-1")
    assert_same(load(cache, root, commit), make_checkpoint(20))
    (copy,) = copies(cache)
    shards = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(cache.directory, copy)) for f in fs
                    if f.startswith("shard-"))
    os.remove(shards[0])
    assert_same(load(cache, root, commit), make_checkpoint(20))
    with open(shards[1], "r+b") as f:  # a copy planted or damaged with bytes that are not the store's
        data = bytearray(f.read())
        data[0] ^= 1
        f.seek(0)
        f.write(data)
    assert_same(load(cache, root, commit), make_checkpoint(20))
    assert os.path.exists(shards[0])


def test_the_cache_is_private_and_refuses_a_planted_or_open_folder(memory_backend, tmp_path, make_io):
    root, _ = saved(make_io, memory_backend, 1)
    cache = NodeCache(str(tmp_path), root.url, job="job-1")
    private = os.path.dirname(cache.directory)
    assert os.stat(private).st_mode & 0o777 == 0o700 and os.stat(cache.directory).st_mode & 0o777 == 0o700
    # A symlink planted where the private folder goes (pointing at someone's files): refused, nothing touched.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(victim, elsewhere / f"lightning_resilient-{os.getuid()}")
    with pytest.raises(RuntimeError, match="is a symlink or not a folder"):
        NodeCache(str(elsewhere), root.url, job="job-1")
    assert (victim / "precious.txt").read_text() == "keep me"
    # A folder others can write into, or one that belongs to another user: refused.
    open_to_all = tmp_path / "open"
    (open_to_all / f"lightning_resilient-{os.getuid()}").mkdir(parents=True)
    os.chmod(open_to_all / f"lightning_resilient-{os.getuid()}", 0o777)
    with pytest.raises(RuntimeError, match="open to other users"):
        NodeCache(str(open_to_all), root.url, job="job-1")
    if os.getuid() == 0:  # only root can hand a folder to another user here
        theirs = tmp_path / "theirs"
        (theirs / "lightning_resilient-0").mkdir(parents=True, mode=0o700)
        os.chown(theirs / "lightning_resilient-0", 12345, 12345)
        with pytest.raises(RuntimeError, match="belongs to another user"):
            NodeCache(str(theirs), root.url, job="job-1")


def test_jobs_never_delete_each_others_copies(memory_backend, tmp_path, make_io):
    root, (first, second) = saved(make_io, memory_backend, 10, 20)
    a = NodeCache(str(tmp_path), root.url, job="job-a")
    b = NodeCache(str(tmp_path), root.url, job="job-b")
    assert a.directory != b.directory
    load(a, root, first)
    load(b, root, second)  # job b's fill: only job b's older copies may go
    assert len(copies(a)) == 1 and len(copies(b)) == 1
    load(a, root, second)  # job a moves on: its copy of the first checkpoint goes, job b's stays
    assert len(copies(a)) == 1 and len(copies(b)) == 1


def test_a_copy_is_never_deleted_while_a_reader_holds_it(memory_backend, tmp_path, make_io, request):
    root, (first, second) = saved(make_io, memory_backend, 10, 20)
    cache = NodeCache(str(tmp_path), root.url, job="job-1")
    load(cache, root, first)
    (copy,) = copies(cache)
    reading, release = threading.Event(), threading.Event()
    started: list[threading.Thread] = []

    def let_go() -> None:  # after a failed assertion, the reader would hold its lock (and block the fill) for 30 s
        release.set()
        for t in started:
            t.join(30)

    request.addfinalizer(let_go)

    def reader() -> None:  # holds the first copy's shared lock, as a rank reading it does
        fd = os.open(os.path.join(cache.directory, f"{copy}.lock"), os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_SH)
        reading.set()
        release.wait(30)
        assert os.path.isdir(os.path.join(cache.directory, copy))  # still there, whole, while read
        os.close(fd)

    thread = threading.Thread(target=reader)
    started.append(thread)
    thread.start()
    reading.wait(30)
    done = threading.Event()
    filler = threading.Thread(target=lambda: (load(cache, root, second), done.set()))
    started.append(filler)
    filler.start()
    assert not done.wait(1.0), "the copy being read was replaced under its reader"
    release.set()
    thread.join(30)
    filler.join(30)
    assert done.is_set() and copies(cache) != [copy]


@pytest.mark.parametrize("planted", ["copy", "lock"])
def test_a_symlink_planted_in_the_private_folder_is_never_followed_the_load_reads_the_store(
        s3_backend, tmp_path, make_io, planted):
    """A symlink where this checkpoint's copy (or its lock) goes, in the job's private folder: the load reads the
    store, with a warning that names the link, and writes nothing where the link points."""
    root, (commit,) = saved(make_io, s3_backend, 20)
    cache = NodeCache(str(tmp_path / "cache"), root.url, job="job-1")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    key = hashlib.sha256(commit.encode()).hexdigest()[:24]  # where NodeCache.load puts this commit's copy
    link = os.path.join(cache.directory, key if planted == "copy" else f"{key}.lock")
    os.symlink(victim if planted == "copy" else victim / "precious.txt", link)
    for _ in range(2):  # and again: still the store's checkpoint, still nothing followed
        with pytest.warns(RuntimeWarning, match=rf"{re.escape(link)} is a symlink.*read from the store.*remove it"):
            assert_same(load(cache, root, commit), make_checkpoint(20))
    assert sorted(os.listdir(victim)) == ["precious.txt"] and (victim / "precious.txt").read_text() == "keep me"
    assert os.path.islink(link)  # left for the user to look at: it is not ours
