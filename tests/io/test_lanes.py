"""At most N jobs of a list at once (io/_lanes.py), and the saves that use it: a save or a persist to a local disk
writes with as many threads as ``LocalStore.write_threads`` allows (half the cores), whatever ``max_concurrency``,
so a save behind training leaves the loop its cores (``benchmarks/step_time.py``); an object store gets them all."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from lightning_resilient import AtomicCheckpointIO
from lightning_resilient.io._lanes import map_in_lanes

from .helpers import make_checkpoint


class Overlap:
    """Counts how many calls of a function run at once (each lasts a little, so that overlaps happen)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = self.most = 0

    def wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(0.01)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.now -= 1

        return counted


@pytest.mark.parametrize("lanes", [1, 2, 3, 20])
def test_results_come_in_order_with_at_most_lanes_jobs_at_once(lanes):
    overlap = Overlap()
    with ThreadPoolExecutor(8) as pool:
        assert map_in_lanes(pool, overlap.wrap(lambda x: x * x), list(range(10)), lanes) == [x * x for x in range(10)]
    assert overlap.most <= min(lanes, 10)
    assert map_in_lanes(ThreadPoolExecutor(2), str, [], lanes) == []


def test_the_first_error_is_raised_once_every_lane_ended():
    ended: list[int] = []

    def job(x: int) -> int:
        if x == 1:
            raise ValueError("job 1")
        time.sleep(0.01)
        ended.append(x)
        return x

    with ThreadPoolExecutor(4) as pool, pytest.raises(ValueError, match="job 1"):
        map_in_lanes(pool, job, list(range(6)), 3)
    # The jobs begun before the error ran to their end; none began after it (they take 10 ms, the error none).
    assert 1 not in ended and len(ended) < 5


def test_a_slow_job_holds_back_no_other():
    """Each lane takes the next job no lane has taken: while one upload is slow, the other lane does the rest."""
    where: dict[int, str] = {}

    def job(x: int) -> int:
        where[x] = threading.current_thread().name
        time.sleep(0.5 if x == 0 else 0.001)
        return x

    with ThreadPoolExecutor(2) as pool:
        assert map_in_lanes(pool, job, list(range(10)), 2) == list(range(10))
    assert all(where[x] != where[0] for x in range(1, 10))


def _slots() -> int:
    """Half the cores this process may use (at least one): the page-cache copies a local disk takes at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // 2)


def test_a_save_and_a_persist_write_a_local_disk_with_twice_as_many_threads_as_copy_slots(tmp_path, local_backend,
                                                                                       memory_backend):
    io = AtomicCheckpointIO(max_concurrency=8, shard_size=2**20, local_tier=str(tmp_path / "nvme"))
    checkpoint = {**make_checkpoint(1), "big": torch.randn(2**20)}  # 4 MiB: 4+ objects of 1 MiB
    durable = io.tiers(local_backend.root)
    assert durable.local.store.write_threads(8) == durable.durable.store.write_threads(8) == min(8, 2 * _slots())
    writes = Overlap()
    for store in (durable.local.store, durable.durable.store):
        store._write = writes.wrap(store._write)  # type: ignore[method-assign]
    io.save_checkpoint(checkpoint, local_backend.url("step=1.ckpt"))  # the local commit, then its persist
    io.wait()
    assert durable.local.read_pointer()[0].latest.step == durable.durable.read_pointer()[0].latest.step == 1
    assert writes.most <= min(8, 2 * _slots()), writes.most
    # An object store's requests wait on the network: every upload thread is used.
    memory = AtomicCheckpointIO(max_concurrency=8).root(memory_backend.root).store
    assert memory.write_threads(8) == 8


def test_copies_into_the_page_cache_take_at_most_half_the_cores_and_an_fsync_takes_none(tmp_path, monkeypatch):
    """Writers past the copy slots wait for one; a writer in its fsync (the disk's time) holds none."""
    from lightning_resilient.io.store import local

    store = AtomicCheckpointIO().root(str(tmp_path / "root")).store
    copies = Overlap()
    during_copy: list[bool] = []
    real_fsync = os.fsync  # (local.os is the os module: patched for the whole process during this test)

    def fsync(fd: int) -> None:
        time.sleep(0.01)
        during_copy.append(copies.now > 0)  # another writer copies while this one waits on the disk
        real_fsync(fd)

    monkeypatch.setattr(local.os, "write", copies.wrap(os.write))
    monkeypatch.setattr(local.os, "fsync", fsync)
    data = memoryview(bytes(2**16))
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: store.write_pieces(f"c/{i}.bin", [data]), range(12)))
    assert all(store.read(f"c/{i}.bin") == bytes(data) for i in range(12))
    assert copies.most <= _slots(), copies.most
    assert any(during_copy)
