"""The tensor stream: gathered for upload without copies, scattered on load into one buffer per tensor."""

from __future__ import annotations

import hashlib

import blake3
import pytest
import torch

from lightning_resilient.io import layout
from lightning_resilient.io.manifest import chunk_digests


def _slots() -> list[layout.TensorSlot]:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=g), torch.tensor(3, dtype=torch.int64), torch.empty(0, 4),
               torch.randn(7, 3, generator=g).to(torch.bfloat16), torch.arange(50, dtype=torch.int8),
               torch.randn(4096, generator=g).double(), torch.tensor([True, False, True])]
    _, slots = layout.flatten({"t": tensors})
    return slots


def _stream(slots: list[layout.TensorSlot], total: int, shard_size: int) -> bytes:
    sources = layout.host_sources(slots)
    out = bytearray()
    for start, end in layout.windows(total, shard_size):
        pieces = layout.gather(slots, sources, start, end)
        assert sum(len(p) for p in pieces) == end - start
        out += b"".join(pieces)
    return bytes(out)


@pytest.mark.parametrize("shard_size", [1, 100, 4096, 10**9])
def test_gather_then_scatter_roundtrips_every_tensor(shard_size):
    slots = _slots()
    total = layout.plan(slots)
    assert all(s.offset % layout.ALIGN == 0 for s in slots)
    stream = _stream(slots, total, shard_size)
    assert len(stream) == total
    scatter = layout.Scatter([(s.offset, s.nbytes) for s in slots],
                             allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    for start in range(0, total, 777):  # pieces cut anywhere, as reads hand them on
        scatter.write(start, memoryview(stream)[start : start + 777])
    for slot, buffer in zip(slots, scatter.buffers, strict=True):
        rebuilt = layout.tensor_view(buffer, slot.tensor.dtype, list(slot.tensor.shape))
        assert torch.equal(rebuilt, slot.tensor)
    # One storage per tensor, exactly its size: nothing else is held after a load.
    assert [b.numel() for b in scatter.buffers] == [s.nbytes for s in slots]


def test_gather_copies_no_tensor_bytes():
    t = torch.zeros(1024)
    _, slots = layout.flatten({"w": t})
    total = layout.plan(slots)
    pieces = layout.gather(slots, layout.host_sources(slots), 0, total)
    t.fill_(7.0)  # the pieces view the tensor itself, so they see the change
    assert torch.equal(torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.float32), t)


def test_snapshot_is_a_copy_and_its_buffer_is_reused():
    w = torch.randn(300)
    snapshot = layout.Snapshot(pin_memory=False)
    for step in range(3):
        _, slots = layout.flatten({"w": w, "b": torch.full((5,), float(step))})
        total = layout.plan(slots)
        snapshot.fill(slots, total)
        expected = _stream(slots, total, 64)
        w.add_(1.0)  # training goes on and changes the weights...
        assert bytes(snapshot.sources(total)) == expected  # ...the snapshot keeps the saved values
    assert snapshot.allocations == [total], "one buffer, allocated once and reused by every save"


def test_chunk_digests_do_not_depend_on_how_the_bytes_are_split():
    data = bytes(range(256)) * 41
    expected = [blake3.blake3(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    view = memoryview(data)
    for cuts in ([len(data)], [1, 999, 1, 5000], [3000, 3000, 4496]):
        pieces, pos = [], 0
        for n in cuts:
            pieces.append(view[pos : pos + n])
            pos += n
        pieces.append(view[pos:])
        assert chunk_digests(pieces, 1000) == expected
    assert chunk_digests([], 1000) == [blake3.blake3(b"").hexdigest()]
    assert chunk_digests([view[:10]], 4, "sha256") == [hashlib.sha256(data[i : min(i + 4, 10)]).hexdigest()
                                                       for i in range(0, 10, 4)]


def test_a_small_stream_is_cut_so_every_upload_thread_gets_an_object():
    mib = 2**20
    assert layout.object_size(100 * mib, 64 * mib, 8) == 100 * mib // 8  # 8 objects, not 2 of 64 MiB
    assert layout.object_size(4 * 2**30, 64 * mib, 8) == 64 * mib  # big: shard_size rules
    assert layout.object_size(10 * mib, 64 * mib, 8) == layout.MIN_PARALLEL_OBJECT  # not below 4 MiB
    assert layout.object_size(10_000, 256, 8) == 256  # an explicit small shard_size still rules
    assert layout.object_size(0, 64 * mib, 8) >= 1


def test_scatter_views_are_the_destination_itself():
    slots = _slots()
    total = layout.plan(slots)
    stream = _stream(slots, total, 10**9)
    scatter = layout.Scatter([(s.offset, s.nbytes) for s in slots],
                             allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    for start in range(0, total, 500):
        end = min(start + 500, total)
        views = scatter.views(start, end - start)
        assert sum(len(v) for v in views) == end - start
        pos = start
        for view in views:  # filling the views fills the tensors, padding goes to scratch
            view[:] = stream[pos : pos + len(view)]
            pos += len(view)
    for slot, buffer in zip(slots, scatter.buffers, strict=True):
        assert torch.equal(layout.tensor_view(buffer, slot.tensor.dtype, list(slot.tensor.shape)), slot.tensor)
