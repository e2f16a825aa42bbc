"""Incremental saves (``dedup``): a tensor stream laid out so that unchanged tensors keep byte-identical objects, and
the writer's record of what it stored, so that such an object is referenced by the next commit instead of written.

Layout (:meth:`StoredUnits.plan`). The stream is made of *units*, each starting at an aligned offset and padded to
a multiple of :data:`~lightning_resilient.io.layout.ALIGN`, cut into objects from its own start: an object never holds
bytes of two units. A tensor of at least ``own`` bytes is a unit of its own (one object per ``shard`` bytes of it),
so a big frozen tensor keeps its objects from the first save on; smaller ones are packed, in checkpoint order, into
units of up to ``pack`` bytes, the tensors found unchanged since this writer last stored them apart from the others
(at the first save nothing is known, so the second rewrites the small frozen ones once, in packs of their own). A
unit of the last commit whose tensors are all unchanged is laid out as it was stored, and its objects are referenced.

Unchanged, cheaply (:func:`identify`): a tensor is unchanged when it is the very storage recorded when its bytes were
read for a commit (a weak reference to that storage, still alive and the same object), at the same data pointer,
device, dtype, shape, stride and conj/neg bits, and its version counter equals the one recorded then (every in-place
change through torch bumps it: optimizer steps, ``copy_``, ``load_state_dict``). No byte is read, copied to the host
or hashed for it. A tensor without a version counter (an inference tensor), a storage torch cannot name, a tensor the
checkpoint holds twice, or one whose counter moved while its bytes were uploaded is never taken as unchanged: it is
read, hashed and written (the writer still references a byte-identical object of its own by digest, which is the
fallback when identities are lost, as with a clone per save).

Not seen by the counter: a change made through ``tensor.data`` (a tensor of its own counter: DINO's and many EMA
teachers' ``p.data.mul_(m).add_(...)``), through a numpy or DLPack view, or by a custom kernel writing in place
without telling autograd. So the counter only nominates: a tensor it finds unchanged is confirmed by its
:func:`fingerprint`, two sums of its bytes computed where the tensor lives (on a GPU: no copy to the host, two
numbers back), against the fingerprint of the bytes the commit stored. The fingerprint reads the tensor once at
memory speed, which is what "cheap" costs here: far less than copying, hashing and uploading. It is taken only where
it can pay off (at the first sight of a tensor, and for one the counter finds unchanged), never for a tensor the
counter saw change, so a full fine-tune pays it at its first save only. What it cannot see is a change whose
differences cancel in every 4 KiB block and in every place across blocks (see :func:`fingerprint`).

The guard on references (:meth:`StoredUnits.keep`): only objects in folders the pointer keeps live, written under this
writer's epoch, are referenced; the pointer update of the commit checks again that every folder it references is still
live (``RootWriter.publish``), and the manifest lists each referenced object with its digests, so a commit still
loads, verifies and exports alone.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_resilient.io import layout
from lightning_resilient.io.folders import writer_epoch_of
from lightning_resilient.io.manifest import ObjectEntry

__all__ = ["OWN", "PACK", "Plan", "RankStreams", "StoredUnits", "Unit", "fingerprint", "identify"]

# A tensor of this many bytes or more gets objects of its own; smaller ones are packed into objects of up to PACK.
OWN = 2**20
PACK = 4 * 2**20

Ident = tuple[Any, ...]
Print = tuple[int, int]

_BLOCK = 512  # words per block of the fingerprint (4 KiB of 8-byte words)
_CHUNK = 2**22  # words per step (32 MiB of 8-byte words)
_MIX = 0x9E3779B97F4A7C15 - 2**64  # an odd 64-bit constant (as int64) that chains the chunks' sums in order
_WEIGHTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed pseudo-random odd int64 weights (the same in every process): one per place in a block, one per block
    of a chunk (and one for the chunk's tail)."""
    key = str(device)
    if key not in _WEIGHTS:
        g = torch.Generator().manual_seed(0x5EED41)

        def draw(n: int) -> torch.Tensor:
            return torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) * 2 + 1

        _WEIGHTS[key] = (draw(_BLOCK).to(device), draw(_CHUNK // _BLOCK + 1).to(device))
    return _WEIGHTS[key]


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat tensor of the widest integer words that tile them (on ``t``'s device)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if flat.numel() % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two wrapping 64-bit sums of ``t``'s raw bytes, as an int64 tensor of two on ``t``'s device (read back with
    others at once). The words are seen as rows of 4 KiB blocks: the first value is the plain sum; the second weights
    each block's sum (a row) by a fixed pseudo-random odd weight for the block's place, and each place's sum across
    the blocks (a column) by one for that place, the chunks chained in order. Two reductions over the bytes, no
    product of their size: about 6 GB/s on this project's 2-core CPU.

    A change goes unseen only if its differences cancel in every block and in every place across the blocks (a
    rectangle of compensating changes, or differences that cancel under the weights): a count moved between two
    bins, two words swapped, two blocks swapped, a row of counts shifted are all seen. Not a cryptographic digest
    (the manifest's digests check the stored bytes): it only confirms that a tensor the version counter found
    unchanged was not written behind torch's back."""
    words = _words(t)
    wide = words.dtype == torch.int64
    place_w, block_w = _weights(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    placed = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK]
        whole = chunk.numel() // _BLOCK * _BLOCK
        grid = chunk[:whole].view(-1, _BLOCK)
        rows = grid.sum(1) if wide else grid.sum(1, dtype=torch.int64)
        cols = grid.sum(0) if wide else grid.sum(0, dtype=torch.int64)
        tail = chunk[whole:].to(torch.int64)
        total += rows.sum() + tail.sum()
        placed = (placed * _MIX + (rows * block_w[: rows.numel()]).sum() + (cols * place_w).sum()
                  + (tail * place_w[: tail.numel()]).sum() * block_w[-1])
    return torch.stack([total, placed])


def fingerprints(tensors: dict[int, torch.Tensor]) -> dict[int, Print]:
    """:func:`fingerprint` of each tensor, read back once per device."""
    by_device: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for i, t in tensors.items():
        by_device.setdefault(str(t.device), []).append((i, t))
    out: dict[int, Print] = {}
    for pairs in by_device.values():
        with torch.no_grad():
            values = torch.stack([fingerprint(t) for _, t in pairs]).tolist()
        out.update((i, (int(a), int(b))) for (i, _), (a, b) in zip(pairs, values, strict=True))
    return out


@dataclass(frozen=True)
class Seen:
    """A tensor as found at a save: who it is, its version counter, its storage (held only while the save runs)."""

    ident: Ident
    version: int
    storage: Any


def identify(t: torch.Tensor) -> Seen | None:
    """Who ``t`` is, for telling it unchanged later; None when that cannot be told (then it is never reused)."""
    try:
        version = t._version
        storage = t.untyped_storage()
        weakref.ref(storage)
        ptr = t.data_ptr()
    except (RuntimeError, TypeError, NotImplementedError):  # inference tensors keep no counter; exotic subclasses
        return None
    if ptr == 0 or t.numel() == 0:
        return None
    return Seen((ptr, str(t.device), t.dtype, tuple(t.shape), tuple(t.stride()), t.is_conj(), t.is_neg()), version,
                storage)


def version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:
        return None


def _gone() -> None:
    return None


@dataclass(frozen=True)
class _Member:
    ident: Ident | None  # None: a tensor that can never be told unchanged (see StoredUnits.record)
    version: int
    storage: Callable[[], Any]  # a weak reference to the storage read
    offset: int  # in the unit
    nbytes: int
    print: Print | None  # the fingerprint of the bytes stored (None: not taken; the counter saw the tensor change)

    def matches(self, seen: Seen | None, nbytes: int) -> bool:
        """Whether the version counter and the storage say the tensor is unchanged (the fingerprint confirms)."""
        return (self.ident is not None and seen is not None and seen.ident == self.ident
                and seen.version == self.version and nbytes == self.nbytes and self.storage() is seen.storage)


@dataclass(frozen=True)
class StoredUnit:
    """A unit as a commit of this writer stored it: its tensors as they were read, and its objects."""

    members: tuple[_Member, ...]
    objects: tuple[ObjectEntry, ...]

    @property
    def length(self) -> int:
        return sum(o.size for o in self.objects)


@dataclass
class Unit:
    """One unit of a planned stream: its tensors (indices into the save's slots, in order) and its objects."""

    members: list[int]
    start: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)  # each object's [start, end) in the stream
    reuse: StoredUnit | None = None  # referenced as stored (no byte read)


@dataclass
class Plan:
    """The layout of one incremental save."""

    units: list[Unit]
    total: int
    seen: list[Seen | None]  # per slot
    prints: dict[int, Print] = field(default_factory=dict)  # slot -> fingerprint, where taken

    def objects(self) -> list[tuple[tuple[int, int], ObjectEntry | None]]:
        """Each object of the stream, in order: its span, and the stored object it references (None: written)."""
        out: list[tuple[tuple[int, int], ObjectEntry | None]] = []
        for unit in self.units:
            if unit.reuse is not None:
                out += list(zip(unit.spans, unit.reuse.objects, strict=True))
            else:
                out += [(span, None) for span in unit.spans]
        return out

    @property
    def referenced_bytes(self) -> int:
        return sum(u.reuse.length for u in self.units if u.reuse is not None)


def _pack_offsets(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for n in sizes:
        start = layout._align(end)
        offsets.append(start)
        end = start + n
    return offsets, layout._align(end)


class StoredUnits:
    """What this writer's last commit stored, unit by unit: what the next save may reference."""

    def __init__(self) -> None:
        self._units: list[StoredUnit] = []

    def __len__(self) -> int:
        return len(self._units)

    def clear(self) -> None:
        self._units = []

    def keep(self, live: set[str], epoch: int | None) -> None:
        """Forget every unit with an object outside ``live`` (folders the pointer keeps) or written under another
        writer epoch than ``epoch`` (this writer's; None: none yet, so nothing may be referenced)."""
        def ok(obj: ObjectEntry) -> bool:
            folder = obj.path.rsplit("/", 1)[0]
            return folder in live and epoch is not None and writer_epoch_of(folder) == epoch

        self._units = [u for u in self._units if all(ok(o) for o in u.objects)]

    def plan(self, slots: list[layout.TensorSlot], *, own: int, pack: int, shard: int) -> Plan:
        """Lay out ``slots`` (setting each one's stream offset) as units; those unchanged since stored are reused."""
        seen = [identify(s.tensor) if s.nbytes else None for s in slots]
        twice = Counter(s.ident for s in seen if s is not None)
        seen = [s if s is not None and twice[s.ident] == 1 else None for s in seen]
        where = {s.ident: i for i, s in enumerate(seen) if s is not None}
        # The fingerprint is taken of each tensor the counter finds unchanged (to confirm it) and of each seen for
        # the first time (to confirm it at the next save); never of one the counter saw change.
        stored_as = {m.ident: m for u in self._units for m in u.members if m.ident is not None}
        wanted = {i: slots[i].tensor for i, s in enumerate(seen) if s is not None
                  and (s.ident not in stored_as or stored_as[s.ident].matches(s, slots[i].nbytes))}
        prints = fingerprints(wanted)
        units: list[Unit] = []
        taken: set[int] = set()
        known: set[int] = set()  # slots unchanged since stored, in a unit that is not reused as a whole
        for stored in self._units:
            idx = [where.get(m.ident) if m.ident is not None else None for m in stored.members]
            same = [i is not None and m.matches(seen[i], slots[i].nbytes) and m.print is not None
                    and prints.get(i) == m.print for m, i in zip(stored.members, idx, strict=True)]
            if all(same) and not taken.intersection(i for i in idx if i is not None):
                members = [i for i in idx if i is not None]
                offsets, length = _pack_offsets([slots[i].nbytes for i in members])
                if (offsets, length) == ([m.offset for m in stored.members], stored.length):
                    units.append(Unit(members, reuse=stored))
                    taken.update(members)
                    continue
            known.update(i for i, ok in zip(idx, same, strict=True) if ok and i is not None)
        small: dict[bool, list[int]] = {True: [], False: []}
        for i, slot in enumerate(slots):
            if i in taken or not slot.nbytes:
                continue
            if slot.nbytes >= own:
                units.append(Unit([i]))
            else:
                small[i in known].append(i)
        for group in (small[True], small[False]):
            current: list[int] = []
            end = 0  # where the current pack's last tensor ends (as _pack_offsets lays it out), kept as it grows
            for i in group:
                nbytes = slots[i].nbytes
                if current and layout._align(layout._align(end) + nbytes) > pack:
                    units.append(Unit(current))
                    current, end = [], 0
                current.append(i)
                end = layout._align(end) + nbytes
            if current:
                units.append(Unit(current))
        units.sort(key=lambda u: u.members[0])
        pos = 0
        for unit in units:
            unit.start = pos
            offsets, length = _pack_offsets([slots[i].nbytes for i in unit.members])
            for i, offset in zip(unit.members, offsets, strict=True):
                slots[i].offset = pos + offset
            if unit.reuse is not None:
                bounds, at = [], pos
                for obj in unit.reuse.objects:
                    bounds.append((at, at + obj.size))
                    at += obj.size
                unit.spans = bounds
            else:
                unit.spans = [(pos + a, pos + b) for a, b in layout.windows(length, shard)]
            pos += length
        for i, slot in enumerate(slots):
            if not slot.nbytes:
                slot.offset = 0  # no bytes: any offset inside the stream
            elif i not in taken and all(i not in u.members for u in units):  # pragma: no cover - every slot is placed
                raise AssertionError("a tensor was left out of the incremental layout")
        return Plan(units, pos, seen, prints)

    def record(self, plan: Plan, slots: list[layout.TensorSlot], objects: list[ObjectEntry]) -> None:
        """After ``plan`` was committed with the stream ``objects``: remember its units. A tensor of a unit counts
        as stored only if it is still the one planned, at the version planned (its bytes were read unchanged);
        another (one that could not be identified, or changed while uploaded) is remembered as one never found
        unchanged, so its unit is never reused whole, while the unit's unchanged tensors are still known at the
        next save (which packs them apart: a first save packs every small tensor together, the RNG states too)."""
        units: list[StoredUnit] = []
        at = 0
        for unit in plan.units:
            mine = objects[at : at + len(unit.spans)]
            at += len(unit.spans)
            members = []
            for i in unit.members:
                seen = plan.seen[i]
                offset, nbytes = slots[i].offset - unit.start, slots[i].nbytes
                if seen is None or version_of(slots[i].tensor) != seen.version:
                    members.append(_Member(None, -1, _gone, offset, nbytes, None))
                else:
                    members.append(_Member(seen.ident, seen.version, weakref.ref(seen.storage), offset, nbytes,
                                           plan.prints.get(i)))
            units.append(StoredUnit(tuple(members), tuple(mine)))
        self._units = units


class RankStreams:
    """What one rank of a sharded save (``io/sharded.py``) stored in its streams, for its next save to reference: its
    shards and its whole items are two streams, each with its own units. A rank learns that the save committed only
    when DCP's save returns on it (the coordinator publishes), so what a save wrote waits in :meth:`wrote` until
    :meth:`committed`; a save that failed forgets everything (:meth:`failed`: the next save writes every tensor)."""

    def __init__(self) -> None:
        self._streams: dict[str, StoredUnits] = {}
        self._pending: list[tuple[str, Plan, list[layout.TensorSlot], list[ObjectEntry]]] = []

    def begin(self) -> None:
        """A new save: what an earlier one wrote without hearing its outcome is dropped."""
        self._pending.clear()

    def plan(self, stream: str, slots: list[layout.TensorSlot], *, live: set[str], epoch: int | None, own: int,
             pack: int, shard: int) -> Plan:
        """Lay out ``slots`` as stream ``stream`` of this save, referencing units its last commit stored that are
        unchanged, in folders ``live`` of writer epoch ``epoch`` (:meth:`StoredUnits.plan`)."""
        stored = self._streams.setdefault(stream, StoredUnits())
        stored.keep(live, epoch)
        return stored.plan(slots, own=own, pack=pack, shard=shard)

    def wrote(self, stream: str, plan: Plan, slots: list[layout.TensorSlot], objects: list[ObjectEntry]) -> None:
        self._pending.append((stream, plan, slots, objects))

    def committed(self) -> None:
        for stream, plan, slots, objects in self._pending:
            self._streams[stream].record(plan, slots, objects)
        self._pending.clear()

    def failed(self) -> None:
        self._streams.clear()
        self._pending.clear()

    @contextlib.contextmanager
    def outcome(self) -> Iterator[None]:
        """Around a rank's whole sharded save (DCP's save, which returns on every rank once the coordinator
        committed, and raises on every rank otherwise): :meth:`committed` or :meth:`failed`."""
        try:
            yield
        except BaseException:
            self.failed()
            raise
        self.committed()
