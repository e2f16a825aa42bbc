"""Compare-and-swap conformance: every backend really refuses a stale or duplicate write."""

from __future__ import annotations

import threading
import warnings

import fsspec
import pytest

from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import GCSStore, LocalStore, MemoryStore, S3Store, Store, open_store

EXPECTED = {"local": LocalStore, "memory": MemoryStore, "s3": S3Store, "gcs": GCSStore}


def store_for(backend) -> Store:
    return open_store(backend.root, backend.storage_options, RetryPolicy(attempts=2, base_delay=0.01))


def test_backend_gets_its_cas_store(backend):
    store = store_for(backend)
    assert type(store) is EXPECTED[backend.kind]
    assert store.supports_cas


def test_create_only_and_replace_if_version(backend):
    store = store_for(backend)
    assert store.read_versioned("p.json") is None
    assert store.write_if("p.json", b"one", None)
    assert not store.write_if("p.json", b"two", None), "create-only write over an existing object succeeded"
    data, v1 = store.read_versioned("p.json")
    assert data == b"one"
    assert store.write_if("p.json", b"three", v1)
    assert not store.write_if("p.json", b"four", v1), "write against a stale version succeeded"
    data, v3 = store.read_versioned("p.json")
    assert data == b"three" and v3 != v1


def test_a_conditional_write_returns_the_version_a_read_would(backend):
    """What a writer's next pointer update is tried against without reading first (``WriterFence.update``)."""
    store = store_for(backend)
    created = store.write_versioned("p.json", b"one", None)
    assert created and created == store.read_versioned("p.json")[1]
    assert store.write_versioned("p.json", b"again", None) is None
    replaced = store.write_versioned("p.json", b"two", created)
    assert replaced and replaced not in (created, None) and replaced == store.read_versioned("p.json")[1]
    assert store.write_versioned("p.json", b"three", created) is None  # the old version: refused
    assert store.write_versioned("p.json", b"three", replaced) == store.read_versioned("p.json")[1]


def test_concurrent_increments_lose_nothing(backend):
    """Threads racing read-modify-write through write_if: every increment survives exactly once."""
    store = store_for(backend)
    store.write_if("counter", b"0", None)
    per_thread, threads = 5, 4

    def bump() -> None:
        for _ in range(per_thread):
            while True:
                data, version = store.read_versioned("counter")
                if store.write_if("counter", str(int(data) + 1).encode(), version):
                    break

    workers = [threading.Thread(target=bump) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert int(store.read_versioned("counter")[0]) == per_thread * threads


def test_store_without_cas_warns_once_that_fencing_is_off(memory_backend):
    # DirFileSystem is a valid fsspec filesystem this package has no conditional write for.
    fs = fsspec.filesystem("dir", path="/nocas", fs=fsspec.filesystem("memory"))
    store = Store(fs, "dir://nocas", "root", RetryPolicy())
    with pytest.warns(RuntimeWarning, match="writer fencing is OFF"):
        assert store.write_if("p", b"1", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.write_if("p", b"2", "whatever")  # last writer wins, and no second warning
    assert store.read("p") == b"2"


def test_list_and_remove(backend):
    store = store_for(backend)
    store.write("a/c1/x.bin", b"x")
    store.write("a/c2/y.bin", b"y")
    store.write("b/z.bin", b"z")
    assert store.list_dir("") == ["a", "b"]
    assert store.list_dir("a") == ["c1", "c2"]
    assert store.list_dir("missing") == []
    store.remove("a/c1")
    store.remove("a/never-existed")
    assert store.list_dir("a") == ["c2"]
    assert store.is_file("b/z.bin") and not store.is_file("a")


def test_gather_reader_reads_and_seeks_across_pieces():
    from lightning_resilient.io.store import GatherReader

    data = bytes(range(200))
    view = memoryview(data)
    reader = GatherReader([view[:7], view[7:7], view[7:150], view[150:]])
    assert len(reader) == 200 and reader.seek(0, 2) == 200
    reader.seek(0)
    assert reader.read(5) + reader.read(100) + reader.read() == data
    reader.seek(148)
    assert reader.read(4) == data[148:152]
    reader.seek(-10, 2)
    assert reader.read() == data[190:] and reader.read(3) == b""


# -- URLs no store reads as meant ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("url", "meant"), [
    ("s3:/bucket/run", "s3://bucket/run"),  # one slash: fsspec would read the local folder ./s3:/bucket/run
    ("gs:/bucket/run", "gs://bucket/run"),
    ("file:/tmp/run", "/tmp/run"),
    ("S3://bucket/run", "s3://bucket/run"),  # protocols are lower case
    ("Gs://bucket/run", "gs://bucket/run"),
    ("s4://bucket/run", "s3://bucket/run"),  # a protocol fsspec does not know: the closest one
])
def test_a_url_no_store_reads_as_meant_is_refused_naming_the_url_meant(url, meant):
    from lightning_resilient.errors import StoreURLError
    from lightning_resilient.io.store import check_url

    with pytest.raises(StoreURLError) as info:
        check_url(url)
    message = str(info.value)
    assert message.startswith(f"cannot open {url!r}: ") and f"Did you mean {meant!r}?" in message
    assert "\n" not in message and info.value.cli_message == message  # the CLI prints the same one line


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://b/r", "memory://x", "/tmp/a:b/run", "relative/run",
                                 "C:/windows/drive", "run:1/ckpt", "simplecache::s3://bucket/run", "file:///tmp/x"])
def test_paths_and_urls_fsspec_knows_pass(url):
    from lightning_resilient.io.store import check_url

    check_url(url)


def test_every_entry_point_refuses_a_one_slash_url_before_touching_disk(tmp_path, monkeypatch):
    from lightning_resilient import AtomicCheckpointIO, StoreURLError, find_latest_checkpoint, load_checkpoint

    monkeypatch.chdir(tmp_path)
    for call in (lambda: find_latest_checkpoint("s3:/bucket/run"),
                 lambda: load_checkpoint("s3:/bucket/run/last.ckpt"),
                 lambda: AtomicCheckpointIO().save_checkpoint({"global_step": 1}, "s3:/bucket/run/last.ckpt")):
        with pytest.raises(StoreURLError, match="Did you mean 's3://bucket/run"):
            call()
    assert list(tmp_path.iterdir()) == []  # no local folder ./s3: was made


# -- local permissions are about the folder, never about cloud credentials ------------------------------------------
def test_a_local_permission_error_speaks_of_the_folder_and_a_cloud_one_of_credentials():
    from lightning_resilient.errors import StoreCredentialsError, StorePermissionError
    from lightning_resilient.io.store.errors import translate_error

    local = translate_error(PermissionError(13, "Permission denied"), "/data/run/ckpt/x", "write")
    assert isinstance(local, StorePermissionError) and isinstance(local, PermissionError)
    assert "permission denied to write /data/run/ckpt/x" in str(local) and "AWS" not in str(local)
    assert "credentials" not in str(local).lower()
    cloud = translate_error(PermissionError("Access Denied"), "s3://bucket/run/x", "write")
    assert isinstance(cloud, StoreCredentialsError) and "AWS_ACCESS_KEY_ID" in str(cloud)
    other = translate_error(PermissionError("Forbidden"), "https://host/run/x", "read")
    assert isinstance(other, StoreCredentialsError) and "AWS" not in str(other) and "storage_options" in str(other)


# -- HTTP(S): read-only loads from a static server -------------------------------------------------------------------
@pytest.fixture
def http_served(tmp_path):
    """``tmp_path`` served by Python's static HTTP server on loopback: folder listings without sizes, URL-quoted
    names, and no Range support (every ranged GET answers with the whole file)."""
    import functools
    import http.server

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, name="http-server", daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def _tree(folder) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_root_served_over_http_loads_lists_and_verifies_read_only(http_served, plugins, capsys):
    import torch

    from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint, load_checkpoint
    from lightning_resilient.cli import main
    from lightning_resilient.io.pointer import POINTER_NAME, Pointer
    from lightning_resilient.io.store import HTTPStore

    from .helpers import assert_same, make_checkpoint

    folder, base = http_served
    root = folder / "root"
    # Objects of 8 MiB in 1 MiB chunks: each is read in two ranged requests (READ_SPAN is 4 MiB), so a server that
    # ignores Range must not hand the second request the object's first bytes.
    io = plugins.track(AtomicCheckpointIO(shard_size=8 * 2**20, chunk_size=2**20))
    saved = {step: make_checkpoint(step, size=200_000) for step in (1, 2)}
    for step, checkpoint in saved.items():
        io.save_checkpoint(checkpoint, str(root / f"epoch=0-step={step}.ckpt"))
    url = f"{base}/root"
    latest = Pointer.from_bytes((root / POINTER_NAME).read_bytes(), where=str(root)).latest
    before = _tree(root)

    assert find_latest_checkpoint(url) == f"{url}/{latest.commit}"
    for target, step in ((url, 2), (f"{url}/epoch=0-step=1.ckpt", 1), (f"{url}/{latest.commit}", 2)):
        loaded = load_checkpoint(target)
        assert_same(loaded, saved[step])
        assert torch.equal(loaded["state_dict"]["layer.weight"], saved[step]["state_dict"]["layer.weight"])
    assert main(["verify", f"{url}/epoch=0-step=1.ckpt", "--no-progress"]) == 0
    assert main(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "| epoch=0-step=2.ckpt (latest) | 2 |" in out and out.count("| yes |") == 2
    assert _tree(root) == before  # read-only: not one object written or touched

    # What the listing says of sizes is "unknown", never 0; a load asks the server for them.
    store = open_store(url, {}, RetryPolicy())
    assert isinstance(store, HTTPStore)
    listed = store.list_detail(latest.commit)
    assert listed and all(info.size is None for info in listed.values())
    # Names unquoted (the index page links epoch%3D0-step%3D1.ckpt/)
    assert [n for n in store.list_dir("") if not n.startswith(".")] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]


def test_a_ranged_read_from_a_server_that_ignores_range_gets_the_range(http_served):
    folder, base = http_served
    (folder / "blob").write_bytes(bytes(range(256)) * 64)
    store = open_store(base, {}, RetryPolicy())
    got = store.read_range("blob", 1000, 1010, lambda pieces: b"".join(bytes(p) for p in pieces))
    assert got == (bytes(range(256)) * 64)[1000:1010]


def test_a_one_slash_url_made_a_local_path_is_refused_too():
    """ModelCheckpoint(dirpath="s3:/bucket/run") makes it the absolute local path <cwd>/s3:/bucket/run."""
    from lightning_resilient.errors import StoreURLError
    from lightning_resilient.io.store import check_url

    with pytest.raises(StoreURLError, match="Did you mean 's3://bucket/run'"):
        check_url("/home/me/s3:/bucket/run")
    check_url("/home/me/run:1/ckpt")  # a colon in a folder name that is no protocol: a path like any other


def test_a_process_forked_while_a_thread_holds_a_file_lock_does_not_keep_it(tmp_path):
    """A DataLoader's workers forked while the persist thread writes the local tier's pointer: an flock belongs to the
    open file, so the workers held it until they exited and the next save waited for them (a hang mid-epoch)."""
    import fcntl
    import os
    import threading

    from lightning_resilient.io.store.local import file_lock

    path = str(tmp_path / "latest.json.lock")
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with file_lock(path):
            taken.set()
            release.wait(timeout=30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(timeout=30)
    child = os.fork()
    if child == 0:  # the forked worker lives on (10 s) while the parent saves again
        threading.Event().wait(10)
        os._exit(0)
    try:
        release.set()
        holder.join(timeout=30)
        fd = os.open(path, os.O_RDWR)
        try:
            # (the child closes its copy as it starts: a moment after the fork returned here)
            for _attempt in range(50):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    threading.Event().wait(0.1)
            else:
                raise AssertionError("the forked process still holds the lock 5 s after the fork")
        finally:
            os.close(fd)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
