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
