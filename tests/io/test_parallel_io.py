"""Parallel sharded I/O: big tensors span objects, every chunk is read and verified in parallel, the resume
path makes no request it does not need, and nothing is held twice in host memory."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.reader import READ_SPAN
from lightning_resilient.testing import StoreProxy

from .helpers import assert_same, make_checkpoint, read_pointer

MiB = 2**20


def big_checkpoint(step: int = 1, *, mib: int = 4) -> dict[str, Any]:
    ckpt = make_checkpoint(step)
    g = torch.Generator().manual_seed(step)
    ckpt["state_dict"]["embedding"] = torch.randn(mib * MiB // 4, generator=g)
    ckpt["state_dict"]["head"] = torch.randn(1000, 3, generator=g).to(torch.bfloat16)
    return ckpt


def test_a_big_tensor_spans_objects_and_every_chunk_is_verified_in_parallel_reads(backend, make_io):
    io = make_io(backend, shard_size=MiB, chunk_size=256 * 1024, max_concurrency=4)
    ckpt = big_checkpoint()
    io.save_checkpoint(ckpt, backend.url("a.ckpt"))
    commit = read_pointer(backend).latest.commit
    manifest = json.loads(backend.fs().cat_file(backend.path(f"{commit}/{MANIFEST_NAME}")))["body"]
    assert len(manifest["stream"]) >= 4, "a 4 MiB tensor in 1 MiB objects spans at least four of them"
    chunks = sum(len(o["chunks"]) for o in manifest["objects"])
    reader = make_io(backend, claim_on_load=False, max_concurrency=4)
    loaded = reader.load_checkpoint(backend.url("a.ckpt"))
    assert_same(loaded, ckpt)
    stats = reader.last_load
    # Consecutive chunks are read with one request of at least READ_SPAN bytes (each chunk verified on its own):
    # the number of requests depends on the bytes, not on the chunk size.
    spans = sum(-(-o["size"] // max(READ_SPAN, manifest["chunk_size"])) for o in manifest["objects"])
    assert chunks > spans and stats is not None and stats.requests == spans
    # Each tensor owns a storage of exactly its size, as torch.load gives: no shared stream buffer to pin.
    emb = loaded["state_dict"]["embedding"]
    assert emb.untyped_storage().nbytes() == emb.numel() * 4
    assert stats.host_buffer_bytes == sum(t["nbytes"] for t in manifest["tensors"])


def test_resume_reads_pointer_then_manifest_then_chunks_and_nothing_else(s3_backend, make_io, plugins):
    io = make_io(s3_backend, shard_size=MiB, chunk_size=512 * 1024)
    io.save_checkpoint(big_checkpoint(1, mib=2), s3_backend.url("a.ckpt"))
    ckpt = big_checkpoint(2, mib=2)
    io.save_checkpoint(ckpt, s3_backend.url("b.ckpt"))
    with StoreProxy(s3_backend.endpoint) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}, "skip_instance_cache": True}
        latest = find_latest_checkpoint(s3_backend.root, options)
        assert [m for m, _ in proxy.requests] == ["GET", "GET"]  # the pointer, the newest manifest
        proxy.requests.clear()
        reader = plugins.track(AtomicCheckpointIO(storage_options=options, claim_on_load=False, chunk_size=512 * 1024))
        assert_same(reader.load_checkpoint(latest), ckpt)
        paths = [p for _, p in proxy.requests]
        methods = {m for m, _ in proxy.requests}
    assert methods == {"GET"}, proxy.requests  # no HEAD, no write on the way
    assert paths[0].endswith("/latest.json") and paths[1].endswith(f"/{MANIFEST_NAME}")
    # One listing of the commit folder checks every object's size before anything is allocated from the manifest.
    assert "list-type" in paths[2] and not any("list-type" in p for p in paths[3:])
    assert len(paths) == 3 + reader.last_load.requests
    assert not any(p.endswith((".json",)) for p in paths[3:])


def _peak_python_bytes(fn: Any) -> int:
    """Peak of memory allocated by Python objects (bytes, bytearrays, BytesIO) while ``fn`` runs; tensor storage
    is not counted, so this is exactly the extra copies a save or load makes of the checkpoint."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_save_and_load_never_hold_a_second_copy_of_the_checkpoint(local_backend, make_io):
    ckpt = big_checkpoint(mib=24)
    size = sum(t.numel() * t.element_size() for t in ckpt["state_dict"].values())
    io = make_io(local_backend, shard_size=8 * MiB, chunk_size=MiB, max_concurrency=4)
    save_peak = _peak_python_bytes(lambda: io.save_checkpoint(ckpt, local_backend.url("a.ckpt")))
    loaded: dict[str, Any] = {}
    load_peak = _peak_python_bytes(lambda: loaded.update(io.load_checkpoint(local_backend.url("a.ckpt"))))
    assert_same(loaded, ckpt)
    # Reads are handed on in 4 MiB pieces, one per read in flight; writes go out as views of the tensors.
    assert save_peak < 0.25 * size, (save_peak, size)
    assert load_peak < 0.25 * size + 4 * 4 * MiB, (load_peak, size)
    assert io.last_load.host_buffer_bytes < 1.01 * size

    # The same measurement on stock Lightning: its save serializes the whole checkpoint into memory.
    stock = TorchCheckpointIO()
    path = str(local_backend.path("stock.ckpt"))
    stock_peak = _peak_python_bytes(lambda: stock.save_checkpoint(ckpt, path))
    assert stock_peak > 0.9 * size, (stock_peak, size)


@pytest.mark.parametrize("map_location", ["meta", {"cpu": "meta"}, torch.device("meta")])
def test_a_load_places_every_tensor_on_the_map_location_device(local_backend, map_location, make_io):
    """The path a load to a GPU takes (verified host buffers, then the device), with ``meta`` as the device."""
    io = make_io(local_backend)
    ckpt = big_checkpoint(mib=1)
    io.save_checkpoint(ckpt, local_backend.url("a.ckpt"))
    loaded = make_io(local_backend, claim_on_load=False).load_checkpoint(local_backend.root, map_location=map_location)
    for key, value in ckpt["state_dict"].items():
        assert loaded["state_dict"][key].device.type == "meta"
        assert loaded["state_dict"][key].shape == value.shape and loaded["state_dict"][key].dtype == value.dtype
