"""S3 uploads (issue 40): large objects as multipart uploads with parts in parallel, the client's connection pool.

Real parts only: moto on loopback, real s3fs, and the loopback proxy where a request must fail. S3's smallest part is
5 MiB, so these tests lower the multipart threshold to 5 MiB instead of writing objects above 16 MiB.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import boto3
import pytest
import torch

from lightning_resilient import find_latest_checkpoint
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import GatherReader, S3Store, open_store, with_connections
from lightning_resilient.io.store import s3 as s3_store
from lightning_resilient.io.store.s3 import POOL_CONNECTIONS, slice_pieces
from lightning_resilient.testing import StoreProxy

from .helpers import assert_same, make_checkpoint, read_pointer

MiB = 2**20
NO_CLIENT_RETRIES = {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
                     "skip_instance_cache": True}


@pytest.fixture
def small_parts(monkeypatch):
    """Objects above 5 MiB are multipart uploads of 5 MiB parts (S3's smallest)."""
    monkeypatch.setattr(s3_store, "MULTIPART_THRESHOLD", 5 * MiB)
    monkeypatch.setattr(s3_store, "PART_SIZE", 5 * MiB)


def big_checkpoint(step: int) -> dict:
    ckpt = make_checkpoint(step)
    ckpt["state_dict"]["big"] = torch.randn(6 * MiB // 4, generator=torch.Generator().manual_seed(step))  # 6 MiB
    ckpt["state_dict"]["bigger"] = torch.randn(5 * MiB // 4 + 123, generator=torch.Generator().manual_seed(-step))
    return ckpt


def uploads(backend) -> list[dict]:
    client = boto3.client("s3", endpoint_url=backend.endpoint)
    bucket, prefix = backend.path().split("/", 1)
    return client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def stored_keys(backend) -> list[str]:
    client = boto3.client("s3", endpoint_url=backend.endpoint)
    bucket, prefix = backend.path().split("/", 1)
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def test_slice_pieces_views_a_range_across_pieces_without_copying():
    data = bytes(range(256)) * 40
    pieces = [memoryview(data)[:1000], memoryview(data)[1000:1001], memoryview(data)[1001:7000],
              memoryview(data)[7000:]]
    for start, end in [(0, len(data)), (0, 1), (999, 1002), (1000, 1001), (500, 7500), (7000, len(data)), (5, 5)]:
        views = slice_pieces(pieces, start, end)
        assert b"".join(views) == data[start:end]
        assert all(v.obj is data for v in views)  # views into the caller's buffer
        reader = GatherReader(views)
        assert reader.read() == data[start:end]


def test_an_s3_client_keeps_enough_connections_for_a_save_unless_told_otherwise(s3_backend):
    store = open_store(s3_backend.root, s3_backend.storage_options, RetryPolicy())
    assert isinstance(store, S3Store) and store.fs.config_kwargs["max_pool_connections"] == POOL_CONNECTIONS
    own = {**s3_backend.storage_options, "config_kwargs": {"max_pool_connections": 3, "read_timeout": 9}}
    assert with_connections(own) == own
    merged = with_connections({"config_kwargs": {"read_timeout": 9}})
    assert merged == {"config_kwargs": {"read_timeout": 9, "max_pool_connections": POOL_CONNECTIONS}}


def test_a_multipart_object_round_trips_bit_exact(s3_backend, small_parts):
    store = open_store(s3_backend.root, s3_backend.storage_options, RetryPolicy())
    data = os.urandom(12 * MiB + 77)
    # Pieces whose edges fall inside parts and across part boundaries.
    cuts = [0, 3, 5 * MiB - 1, 5 * MiB + 10, 11 * MiB, len(data)]
    pieces = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]
    store.write_pieces("c/obj.bin", pieces)
    assert store.read("c/obj.bin") == data
    client = boto3.client("s3", endpoint_url=s3_backend.endpoint)
    bucket, key = s3_backend.path("c/obj.bin").split("/", 1)
    assert client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"').endswith("-3")  # three parts
    assert uploads(s3_backend) == []


def test_a_save_of_multipart_objects_loads_bit_exact(s3_backend, small_parts, make_io):
    io = make_io(s3_backend, shard_size=12 * MiB, max_concurrency=2)  # two objects of 5.5 MiB: two parts each
    ckpt = big_checkpoint(3)
    io.save_checkpoint(ckpt, s3_backend.url("a.ckpt"))
    manifest = io.root(s3_backend.root).read_manifest(read_pointer(s3_backend).checkpoints["a.ckpt"].commit)
    assert len([o for o in manifest.objects if o.size > 5 * MiB]) == 2
    assert_same(make_io(s3_backend, claim_on_load=False).load_checkpoint(s3_backend.url("a.ckpt")), ckpt)
    assert uploads(s3_backend) == []


def test_a_failed_part_commits_nothing_and_leaves_no_upload(s3_backend, small_parts, make_io):
    failing: list[bool] = []
    with StoreProxy(s3_backend.endpoint,
                    fail_if=lambda method, path: bool(failing) and method == "PUT" and "partNumber=2" in path) as p:
        through = replace(s3_backend, storage_options={"client_kwargs": {"endpoint_url": p.url}, **NO_CLIENT_RETRIES})
        io = make_io(through, shard_size=12 * MiB, max_concurrency=2, retry_attempts=1)
        first = big_checkpoint(1)
        io.save_checkpoint(first, s3_backend.url("a.ckpt"))
        before = set(stored_keys(s3_backend))
        failing.append(True)
        with pytest.raises(OSError):
            io.save_checkpoint(big_checkpoint(2), s3_backend.url("b.ckpt"))
        assert p.counts["503"] >= 1
    assert uploads(s3_backend) == []  # aborted at once
    assert {k for k in stored_keys(s3_backend) if "/b.ckpt/" in k} == set()  # the failed save's folder is gone
    assert set(stored_keys(s3_backend)) >= before
    assert find_latest_checkpoint(s3_backend.root, s3_backend.storage_options).startswith(s3_backend.url("a.ckpt/"))
    assert_same(make_io(s3_backend, claim_on_load=False).load_checkpoint(s3_backend.root), first)


def test_a_multipart_upload_left_behind_is_aborted_by_gc(s3_backend, small_parts, make_io):
    """A writer killed mid-upload (here: a part fails and so does the abort) leaves an incomplete multipart upload:
    its parts are stored, but no object. Nothing names it; garbage collection aborts it."""
    def failing(method: str, path: str) -> bool:
        return (method == "PUT" and "partNumber=2" in path) or (method == "DELETE" and "uploadId=" in path)

    with StoreProxy(s3_backend.endpoint, fail_if=failing) as p:
        through = replace(s3_backend, storage_options={"client_kwargs": {"endpoint_url": p.url}, **NO_CLIENT_RETRIES})
        io = make_io(through, shard_size=12 * MiB, max_concurrency=2, retry_attempts=1)
        with pytest.raises(OSError):
            io.save_checkpoint(big_checkpoint(2), s3_backend.url("b.ckpt"))
    left = uploads(s3_backend)
    assert left and find_latest_checkpoint(s3_backend.root, s3_backend.storage_options) is None
    make_io(s3_backend, orphan_grace_seconds=0).collect_garbage(s3_backend.root)
    assert uploads(s3_backend) == []


@pytest.mark.slow
def test_a_writer_killed_mid_multipart_upload_loses_nothing_and_gc_aborts_its_upload(s3_backend, make_io):
    """A real SIGKILL while parts of a multipart upload are in flight (a slow proxy): the committed checkpoint stays
    the latest and loads bit-exact, the upload left behind holds parts but makes no object, garbage collection aborts
    it, and the next writer commits."""
    import signal
    import subprocess
    import sys
    import time

    with StoreProxy(s3_backend.endpoint, bandwidth=1.5e6) as p:  # a 5 MiB part takes ~3.5 s
        child = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "multipart_child.py"),
                                  s3_backend.root, p.url], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "COMMITTED"
            deadline = time.monotonic() + 120
            while not uploads(s3_backend):  # the first multipart upload has begun: its parts are on their way
                assert child.poll() is None and time.monotonic() < deadline, "no multipart upload began"
                time.sleep(0.05)
            time.sleep(0.5)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
    assert uploads(s3_backend)  # left behind, invisible: no object, no manifest
    assert find_latest_checkpoint(s3_backend.root, s3_backend.storage_options).startswith(s3_backend.url("a.ckpt/"))
    assert_same(make_io(s3_backend, claim_on_load=False).load_checkpoint(s3_backend.url("a.ckpt")),
                make_checkpoint(1))
    make_io(s3_backend, orphan_grace_seconds=0).collect_garbage(s3_backend.root)
    assert uploads(s3_backend) == []
    nxt = make_io(s3_backend, orphan_grace_seconds=0)
    nxt.load_checkpoint(find_latest_checkpoint(s3_backend.root, s3_backend.storage_options))  # resume, then save
    nxt.save_checkpoint(make_checkpoint(3), s3_backend.url("c.ckpt"))
    assert find_latest_checkpoint(s3_backend.root, s3_backend.storage_options).startswith(s3_backend.url("c.ckpt/"))
    # The restart's claim fenced the killed writer off and collected what its save had stored (its skeleton).
    assert {k for k in stored_keys(s3_backend) if "/b.ckpt/" in k} == set()
