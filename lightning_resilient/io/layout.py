"""How a checkpoint dict becomes stored objects: tensors as raw bytes in shards, the rest as a skeleton.

The skeleton is the checkpoint with every tensor replaced by ``None``; it is saved with ``torch.save`` and
loads with the ``weights_only`` Lightning asks for. Tensor bytes go into shards, described by the manifest
(dtype, shape, shard, offset), so reading them needs no unpickling at all.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Shard", "TensorSlot", "flatten", "pack", "tensor_from_bytes", "unflatten"]

# Offsets inside a shard are aligned so each tensor can be viewed in place with its own dtype (and, later,
# copied straight into pinned or device memory).
ALIGN = 64

PathElem = list  # ["s", "key"] | ["i", 3] | ["l", 0] | ["t", 0]


@dataclass
class TensorSlot:
    """One tensor found in the checkpoint and where it goes."""

    key: list[PathElem]
    tensor: torch.Tensor
    device: str = "cpu"  # where the tensor lived before it was copied to the host for writing
    shard: int = -1
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class Shard:
    slots: list[TensorSlot]
    size: int

    def buffers(self) -> Iterator[tuple[int, memoryview]]:
        for slot in self.slots:
            yield slot.offset, _raw_bytes(slot.tensor)

    def to_bytes(self) -> bytes | memoryview:
        if len(self.slots) == 1 and self.slots[0].offset == 0:
            return _raw_bytes(self.slots[0].tensor)  # one big tensor: no copy into a shard buffer
        out = bytearray(self.size)
        for offset, raw in self.buffers():
            out[offset : offset + len(raw)] = raw
        return out


def _storable(t: torch.Tensor) -> bool:
    # Sparse, quantized, nested and meta tensors have no plain byte layout; they stay in the skeleton.
    return t.layout == torch.strided and not t.is_quantized and not t.is_nested and t.device.type != "meta"


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def flatten(obj: Any) -> tuple[Any, list[TensorSlot]]:
    """Split ``obj`` into a tensor-free skeleton and the tensors it held, each with its key path."""
    slots: list[TensorSlot] = []

    def walk(node: Any, key: list[PathElem]) -> Any:
        if isinstance(node, torch.Tensor) and _storable(node):
            t = node.detach()
            device = str(t.device)
            if t.device.type != "cpu":
                t = t.to("cpu")
            slots.append(TensorSlot(key, t, device))
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


def pack(slots: list[TensorSlot], shard_size: int) -> list[Shard]:
    """Assign tensors to shards of about ``shard_size`` bytes, in order; a bigger tensor gets its own."""
    shards: list[Shard] = []
    current: Shard | None = None
    for slot in slots:
        n = slot.nbytes
        if current is None or (current.size and current.size + n > shard_size):
            current = Shard([], 0)
            shards.append(current)
        slot.shard = len(shards) - 1
        slot.offset = current.size
        current.slots.append(slot)
        current.size = _align(current.size + n)
    for shard in shards:  # the last tensor needs no padding after it
        last = shard.slots[-1]
        shard.size = last.offset + last.nbytes
    return shards


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def tensor_from_bytes(buf: bytearray, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor viewing ``buf`` (no copy); ``buf`` stays alive as long as the tensor does."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).reshape(shape)


def save_skeleton(skeleton: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def load_skeleton(data: bytes, *, weights_only: bool | None, map_location: Any) -> Any:
    kwargs: dict[str, Any] = {"map_location": map_location}
    if weights_only is not None:
        kwargs["weights_only"] = weights_only
    return torch.load(io.BytesIO(data), **kwargs)
