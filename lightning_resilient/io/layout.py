"""How a checkpoint dict becomes stored objects, and back, without holding it twice in host memory.

The checkpoint is split into a *skeleton* (everything that is not a tensor, saved with ``torch.save`` and loaded
with the ``weights_only`` Lightning asks for) and a *stream*: every tensor's raw bytes, each at a 64-byte aligned
offset, one after the other. The stream is cut into fixed windows of ``shard_size`` bytes, one object each, so
a big tensor spreads over several objects that are uploaded and downloaded in parallel.

Nothing here materialises the stream on the way out: a window is a *gather list* of memoryviews over the
tensors' own bytes (or over one reusable snapshot buffer, for async saves), which the stores write piece by
piece. On the way in, each tensor gets its own buffer and the bytes read from the store are scattered straight
into them.
"""

from __future__ import annotations

import bisect
import copy
import io
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ALIGN",
    "MIN_PARALLEL_OBJECT",
    "Scatter",
    "Snapshot",
    "TensorSlot",
    "dtype_name",
    "flatten",
    "gather",
    "host_sources",
    "key_id",
    "load_skeleton",
    "object_size",
    "parse_dtype",
    "plan",
    "save_skeleton",
    "tensor_view",
    "unflatten",
    "windows",
]

# Offsets in the stream are aligned so every tensor can be viewed in place with its own dtype.
ALIGN = 64
_ZEROS = memoryview(bytes(ALIGN))

PathElem = list[str | int]  # ["s", "key"] | ["i", 3] | ["l", 0] | ["t", 0]
Pieces = list[memoryview]


@dataclass
class TensorSlot:
    """One tensor found in the checkpoint and where its bytes go in the stream."""

    key: list[PathElem]
    tensor: torch.Tensor  # where the checkpoint holds it (possibly on an accelerator)
    device: str
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def _storable(t: torch.Tensor) -> bool:
    # Sparse, quantized, nested and meta tensors have no plain byte layout; they stay in the skeleton.
    return t.layout == torch.strided and not t.is_quantized and not t.is_nested and t.device.type != "meta"


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview (a host tensor; a copy only when it is not contiguous)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def flatten(obj: Any) -> tuple[Any, list[TensorSlot]]:
    """Split ``obj`` into a tensor-free skeleton and the tensors it held, each with its key path."""
    slots: list[TensorSlot] = []

    def walk(node: Any, key: list[PathElem]) -> Any:
        if isinstance(node, torch.Tensor) and _storable(node):
            slots.append(TensorSlot(key, node.detach(), str(node.device)))
            return None
        if isinstance(node, dict):
            out = copy.copy(node)  # keeps the mapping's type and attributes (state_dict's ``_metadata``)
            for k, v in node.items():
                # An unusual key type keeps its value in the copy: pickled in the skeleton by torch.save.
                if not isinstance(k, bool) and isinstance(k, (str, int)):
                    out[k] = walk(v, [*key, ["s" if isinstance(k, str) else "i", k]])
            return out
        if isinstance(node, list):
            return [walk(v, [*key, ["l", i]]) for i, v in enumerate(node)]
        if type(node) is tuple:
            return tuple(walk(v, [*key, ["t", i]]) for i, v in enumerate(node))
        return node

    return walk(obj, []), slots


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Put the tensors back into the skeleton; ``tensors`` is keyed by :func:`key_id`."""
    remaining = dict(tensors)

    def walk(node: Any, key: list[PathElem]) -> Any:
        kid = key_id(key)
        if kid in remaining:
            return remaining.pop(kid)
        if isinstance(node, dict):
            for k in list(node.keys()):
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    continue
                node[k] = walk(node[k], [*key, ["s" if isinstance(k, str) else "i", k]])
            return node
        if isinstance(node, list):
            for i, v in enumerate(node):
                node[i] = walk(v, [*key, ["l", i]])
            return node
        if type(node) is tuple:
            return tuple(walk(v, [*key, ["t", i]]) for i, v in enumerate(node))
        return node

    result = walk(skeleton, [])
    if remaining:
        raise ValueError(f"manifest names tensors the skeleton has no place for: {sorted(remaining)[:3]}")
    return result


def key_id(key: list[PathElem]) -> str:
    return "\x1f".join(f"{kind}:{value}" for kind, value in key)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(slots: list[TensorSlot]) -> int:
    """Give each tensor its aligned offset in the stream; returns the stream's length."""
    end = 0
    for slot in slots:
        slot.offset = _align(end)
        end = slot.offset + slot.nbytes
    return end


# Below this, a stream is not cut into more objects just to have one per upload thread: a request costs more.
MIN_PARALLEL_OBJECT = 4 * 2**20


def object_size(total: int, shard_size: int, parallelism: int) -> int:
    """The size of the objects a stream of ``total`` bytes is cut into.

    At most ``shard_size``, and small enough that every upload thread gets an object (a 100 MB checkpoint in
    64 MiB objects would use 2 connections of 8), but not below :data:`MIN_PARALLEL_OBJECT`.
    """
    per_thread = _align(-(-total // max(1, parallelism)))
    return max(1, min(shard_size, max(MIN_PARALLEL_OBJECT, per_thread)))


def windows(total: int, shard_size: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of the stream that become one object each."""
    return [(start, min(start + shard_size, total)) for start in range(0, total, shard_size)]


class _Extents:
    """Sorted (offset, nbytes, index) of the tensors in a stream, for finding those that overlap a range."""

    def __init__(self, extents: list[tuple[int, int]]) -> None:
        # Empty tensors hold no byte of the stream: left out, so that one placed at the offset of a tensor (as an
        # incremental layout places them, at 0) never hides that tensor from the search below.
        order = sorted((i for i in range(len(extents)) if extents[i][1]), key=lambda i: extents[i][0])
        self.starts = [extents[i][0] for i in order]
        self.items = [(extents[i][0], extents[i][1], i) for i in order]

    def overlapping(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.items) and self.items[i][0] < end:
            offset, nbytes, index = self.items[i]
            if nbytes and offset + nbytes > start:
                yield offset, nbytes, index
            i += 1


def gather(slots: list[TensorSlot], sources: list[memoryview], start: int, end: int) -> Pieces:
    """The bytes of stream range ``[start, end)`` as memoryviews over ``sources`` (one per slot), padding
    included: no byte is copied."""
    pieces: Pieces = []
    pos = start
    extents = _Extents([(s.offset, s.nbytes) for s in slots])
    for offset, nbytes, index in extents.overlapping(start, end):
        if offset > pos:
            pieces.extend(_zeros(offset - pos))
            pos = offset
        stop = min(offset + nbytes, end)
        pieces.append(sources[index][pos - offset : stop - offset])
        pos = stop
    if pos < end:
        pieces.extend(_zeros(end - pos))
    return pieces


def _zeros(n: int) -> Pieces:
    # Gaps are alignment padding, shorter than ALIGN, except in a stream with empty tensors.
    out: Pieces = []
    while n > 0:
        out.append(_ZEROS[: min(n, ALIGN)])
        n -= ALIGN
    return out


def host_sources(slots: list[TensorSlot]) -> list[memoryview]:
    """Each slot's bytes on the host: CPU tensors as they are, accelerator tensors copied (a sync save)."""
    out = []
    for slot in slots:
        t = slot.tensor if slot.tensor.device.type == "cpu" else slot.tensor.to("cpu")
        out.append(raw_bytes(t))
    return out


class Snapshot:
    """A reusable host buffer holding a copy of every tensor of a checkpoint, laid out as the stream.

    Async saves copy the tensors here (device-to-host, non-blocking into pinned memory when it is pinned) and
    return to training; the upload then reads windows of this buffer. One buffer, grown when a checkpoint
    outgrows it and otherwise reused, so repeated saves allocate nothing.
    """

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffer: torch.Tensor | None = None
        self._event: Any = None
        self.allocations: list[int] = []  # sizes of every buffer allocated, for accounting
        # What the buffer holds: the tensors copied in (kept referenced, so no other tensor can take their
        # addresses), with their version counters at the time of the copy, and the step of that checkpoint.
        self._held: list[tuple[torch.Tensor, int, int, int]] = []
        self._step: int | None = None

    def match(self, slots: list[TensorSlot], step: int) -> list[bool] | None:
        """Which of ``slots`` the buffer already holds, unchanged, at their offsets; None when it holds another
        layout or step.

        A tensor counts as held when it is the very tensor copied in (same storage and view) and its version
        counter has not moved since (every in-place change bumps it). The step must match as well: between two
        saves of one step no optimizer step ran, as when ``ModelCheckpoint(save_last=True)`` saves twice.
        """
        if self._step != step or len(slots) != len(self._held):
            return None
        out = []
        for slot, (tensor, offset, nbytes, version) in zip(slots, self._held, strict=True):
            if slot.offset != offset or slot.nbytes != nbytes:
                return None
            t = slot.tensor
            try:
                same = (t.data_ptr() == tensor.data_ptr() and t.dtype == tensor.dtype and t.shape == tensor.shape
                        and t.stride() == tensor.stride() and t.device == tensor.device and t._version == version)
            except RuntimeError:  # inference tensors keep no version counter: never assume they are unchanged
                same = False
            out.append(same)
        return out

    def slot_view(self, offset: int, nbytes: int) -> memoryview:
        assert self._buffer is not None
        return self._buffer.numpy().data[offset : offset + nbytes]

    def fill(self, slots: list[TensorSlot], total: int, step: int | None = None, *,
             regions: list[tuple[int, int]] | None = None) -> None:
        """Copy ``slots`` into the buffer at their stream offsets, the padding between them zeroed. ``regions``
        (an incremental save): only these ``[start, end)`` spans of the stream are uploaded, and ``slots`` are the
        tensors inside them; padding is zeroed inside them only (the rest of the buffer is never read)."""
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # let the old one go before the new one is allocated
            self._buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=self.pin_memory)
            self.allocations.append(max(total, 1))
        buffer = self._buffer
        on_cuda = False
        ordered = sorted(slots, key=lambda s: s.offset)
        first = 0  # the first slot not before the region (regions come in stream order: one pass over the slots)
        for start, end in sorted(regions) if regions is not None else [(0, total)]:
            pos = start
            while first < len(ordered) and ordered[first].offset < start:
                first += 1
            for slot in itertools.islice(ordered, first, None):
                if slot.offset >= end:
                    break
                if slot.offset > pos:
                    buffer[pos : slot.offset].zero_()  # padding: the same bytes a synchronous save writes
                pos = max(pos, slot.offset + slot.nbytes)
                if not slot.nbytes:
                    continue
                src = slot.tensor.detach().resolve_conj().resolve_neg()
                dst = buffer[slot.offset : slot.offset + slot.nbytes].view(src.dtype).view(src.shape)
                on_cuda = on_cuda or src.device.type == "cuda"
                dst.copy_(src, non_blocking=self.pin_memory and src.device.type == "cuda")
            if regions is not None and end > pos:
                buffer[pos:end].zero_()  # the unit's own padding up to its end
        self._held = []
        for slot in slots:
            try:
                version = slot.tensor._version
            except RuntimeError:
                version = -1
            self._held.append((slot.tensor, slot.offset, slot.nbytes, version))
        self._step = step
        self._event = None
        if on_cuda:
            # Training kernels queued after these copies on the same stream run after them, so the loop may go
            # on at once; the uploader waits for this event before it reads the buffer.
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def sources(self, total: int) -> memoryview:
        assert self._buffer is not None
        return self._buffer.numpy().data[:total]

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()


# -- reading ------------------------------------------------------------------------------------------------------

class Scatter:
    """Destinations for the bytes of a stream being read: each tensor in a buffer of its own.

    :meth:`write` takes a piece of the stream at its stream offset and copies each part to the tensor it
    belongs to (padding is dropped), so a load holds every tensor once and nothing else but the pieces in
    flight. Tensors get separate storages, as ``torch.load`` gives them.
    """

    def __init__(self, extents: list[tuple[int, int]], *, allocate: Callable[[int], torch.Tensor]) -> None:
        self.buffers = [allocate(nbytes) if nbytes else torch.empty(0, dtype=torch.uint8) for _, nbytes in extents]
        self._views = [b.numpy().data if b.numel() else memoryview(b"") for b in self.buffers]
        self._extents = _Extents(extents)

    def views(self, stream_offset: int, length: int) -> list[memoryview]:
        """The destination of stream bytes ``[stream_offset, +length)``, in order: slices of the tensors' buffers,
        and scratch space for padding; reading into them fills the tensors with no copy in between."""
        out: list[memoryview] = []
        pos, end = stream_offset, stream_offset + length
        for offset, nbytes, index in self._extents.overlapping(stream_offset, end):
            if offset > pos:
                out.append(memoryview(bytearray(offset - pos)))
                pos = offset
            hi = min(offset + nbytes, end)
            out.append(self._views[index][pos - offset : hi - offset])
            pos = hi
        if pos < end:
            out.append(memoryview(bytearray(end - pos)))
        return out

    def write(self, stream_offset: int, piece: memoryview | bytes) -> None:
        view = memoryview(piece).cast("B")
        end = stream_offset + len(view)
        for offset, nbytes, index in self._extents.overlapping(stream_offset, end):
            lo = max(offset, stream_offset)
            hi = min(offset + nbytes, end)
            self._views[index][lo - offset : hi - offset] = view[lo - stream_offset : hi - stream_offset]


def tensor_view(buffer: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if buffer.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return buffer.view(dtype).reshape(shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def save_skeleton(skeleton: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def load_skeleton(data: bytes, *, weights_only: bool | None, map_location: Any) -> Any:
    kwargs: dict[str, Any] = {"map_location": map_location}
    if weights_only is not None:
        kwargs["weights_only"] = weights_only
    return torch.load(io.BytesIO(data), **kwargs)
