"""S3 uploads (issue 40): large objects as multipart uploads with parts in parallel, the client's connection pool and
signing, no request a save need not wait for.

Real parts only: moto on loopback, real s3fs, and the loopback proxy where a request must fail. S3's smallest part is
5 MiB, so these tests lower the multipart threshold to 5 MiB instead of writing objects above 16 MiB.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import replace
from urllib.parse import parse_qs, urlsplit

import boto3
import pytest
import torch
from fsspec.asyn import sync

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import GatherReader, S3Store, open_store, with_client_defaults
from lightning_resilient.io.store import s3 as s3_store
from lightning_resilient.io.store.s3 import POOL_CONNECTIONS, UNSIGNED_BODIES, slice_pieces
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
    own = {**s3_backend.storage_options, "config_kwargs": {"max_pool_connections": 3, "read_timeout": 9,
                                                           "s3": {"payload_signing_enabled": True}}}
    assert with_client_defaults(own) == own
    plain = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    merged = with_client_defaults({**plain, "config_kwargs": {"read_timeout": 9, "s3": {"addressing_style": "path"}}})
    assert merged == {**plain, "config_kwargs": {"read_timeout": 9, "max_pool_connections": POOL_CONNECTIONS,
                                                 "s3": {"addressing_style": "path", **UNSIGNED_BODIES}}}
    assert with_client_defaults({**plain, "config_kwargs": {"s3": None}})["config_kwargs"]["s3"] == UNSIGNED_BODIES
    odd = {**plain, "config_kwargs": {"s3": "not a dict"}}  # s3fs's (botocore's) own words will name it
    assert with_client_defaults(odd)["config_kwargs"]["s3"] == "not a dict"
    assert with_client_defaults({**plain, "config_kwargs": "not a dict"}) == {**plain, "config_kwargs": "not a dict"}


@pytest.mark.parametrize("where", ["https", "aws", "checksum off", "checksum off (environment)"])
def test_bodies_stay_signed_where_unsigning_saves_nothing_or_leaves_them_unchecked(monkeypatch, where):
    # Over HTTPS (an endpoint of one's own, or AWS's) botocore already sends upload bodies unsigned: changing the
    # config would only change how every other request is signed, which some S3-compatible stores refuse. Without
    # the body's CRC32 (request_checksum_calculation when_required), its signature is the store's only check.
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REQUEST_CHECKSUM_CALCULATION"):
        monkeypatch.delenv(name, raising=False)
    options: dict = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    if where == "https":
        options = {"endpoint_url": "https://s3.example.internal"}
    elif where == "aws":
        options = {}
    elif where == "checksum off":
        options["config_kwargs"] = {"request_checksum_calculation": "when_required"}
    else:
        monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "WHEN_REQUIRED")
    assert "s3" not in with_client_defaults(options)["config_kwargs"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")  # the environment's endpoint counts too
    assert ("s3" in with_client_defaults({})["config_kwargs"]) == (where != "checksum off (environment)")


def signed_bodies(store: S3Store) -> list[str]:
    """What each request that follows says of its body in its signature (``x-amz-content-sha256``), as sent."""
    seen: list[str] = []
    sync(store.fs.loop, store.fs.set_session)
    store.fs.s3.meta.events.register(
        "before-send.s3.*", lambda request, **_: seen.append(request.headers.get("x-amz-content-sha256", b"")))
    return seen


@pytest.mark.parametrize("size", [64 * 1024, 12 * MiB], ids=["put", "multipart"])
def test_uploads_are_not_hashed_into_their_signature_unless_the_options_ask(s3_backend, small_parts, size):
    # Over plain HTTP (moto here, an on-premises MinIO there) botocore would SHA-256 every uploaded byte for the
    # signature: about half the client's CPU of a save. The body still carries its CRC32 header, and the bytes
    # arrive whole.
    data = os.urandom(size)
    pieces = [memoryview(data)[: size // 3], memoryview(data)[size // 3 :]]
    store = open_store(s3_backend.root, {**s3_backend.storage_options, "skip_instance_cache": True}, RetryPolicy())
    seen = signed_bodies(store)
    store.write_pieces("u/obj.bin", pieces)
    uploads_sent = [h for h in seen if h]
    assert uploads_sent and set(uploads_sent) == {b"UNSIGNED-PAYLOAD"}
    assert store.read("u/obj.bin") == data
    # Asked for (the user's own s3 config): botocore signs the body again.
    own = {**s3_backend.storage_options, "skip_instance_cache": True,
           "config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    signing = open_store(s3_backend.root, own, RetryPolicy())
    seen = signed_bodies(signing)
    signing.write_pieces("u/signed.bin", pieces)
    step = s3_store.PART_SIZE if size > s3_store.MULTIPART_THRESHOLD else size
    bodies = {hashlib.sha256(data[a : a + step]).hexdigest().encode() for a in range(0, size, step)}
    assert bodies <= set(seen) and b"UNSIGNED-PAYLOAD" not in seen
    assert signing.read("u/signed.bin") == data


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


def test_a_first_save_into_a_new_root_asks_the_store_nothing_twice_over(s3_backend, make_io):
    # The first save claims the root first: ~20 requests one after another, each a round trip to the store (30 ms
    # and more to a cloud store). None may be spent on what the claim does not need: a listing of the root's parent
    # (s3fs's way of telling a missing folder from a file; a root's parent can be a bucket's whole top level), a
    # stat of the probe before deleting it, an existence check of the legacy pointer as HEAD then listing. Nor
    # may the deletion of what a save retired (behind the save, but a request all the same).
    options = {"client_kwargs": {"endpoint_url": None}, "skip_instance_cache": True}
    with StoreProxy(s3_backend.endpoint) as proxy:
        options["client_kwargs"]["endpoint_url"] = proxy.url
        io = AtomicCheckpointIO(storage_options=options)
        try:
            io.save_checkpoint(make_checkpoint(1), s3_backend.url("a.ckpt"))
            requests = list(proxy.requests)
            # The next save of that name retires the first: its manifest goes first, one object, one request.
            io.save_checkpoint(make_checkpoint(2), s3_backend.url("a.ckpt"))
            io.wait()
            retiring = proxy.requests[len(requests):]
            first, second = sorted({path.rsplit("/", 1)[0] for _, path in retiring if path.endswith("/manifest.json")})
            # The third deletes the first's folder (due now): its manifest went when it was retired, not again.
            ckpt = make_checkpoint(3)
            io.save_checkpoint(ckpt, s3_backend.url("a.ckpt"))
            io.wait()
            deleting = proxy.requests[len(requests) + len(retiring):]
        finally:
            io.teardown()
    assert [(m, path) for m, path in retiring if path.endswith("/manifest.json") and m != "PUT"] == [
        ("DELETE", f"{first}/manifest.json")]
    assert not [path for _, path in retiring if "manifest.json%2F" in path]  # no listing of it as a folder
    assert [path for m, path in deleting if m == "DELETE"] == [f"{second}/manifest.json"]
    assert [m for m, path in deleting if m == "POST" and path.endswith("?delete")] == ["POST"]  # first's folder
    _, prefix = s3_backend.path().split("/", 1)
    listed = [parse_qs(urlsplit(path).query).get("prefix", [""])[0] for method, path in requests
              if method == "GET" and "list-type=2" in path]
    assert listed and all(p.startswith(prefix + "/") for p in listed), listed
    probe = [method for method, path in requests if "fencing-probe-" in path]
    assert probe == ["PUT", "PUT", "PUT", "DELETE"]
    assert not [path for method, path in requests if method == "HEAD" and urlsplit(path).path.endswith(
        f"{prefix}/latest.json")]
    assert_same(make_io(s3_backend, claim_on_load=False).load_checkpoint(s3_backend.url("a.ckpt")), ckpt)
