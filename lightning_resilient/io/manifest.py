"""The manifest: written last in a checkpoint folder, it is what makes the checkpoint exist.

It lists every object of the checkpoint with its size and the digest of each ``chunk_size`` piece of it (BLAKE3:
cryptographic, and about four times faster than SHA-256 here, so verifying every byte on load costs little;
ranged reads of one object are verified independently, in parallel), names the objects that form the tensor
stream in order, and describes each tensor by dtype, shape and offset in that stream, so a reader can verify
every byte and rebuild tensors without unpickling. Object paths are relative to the checkpoint root and
validated on read: a manifest can never point a load outside the root.

Format 1 (one SHA-256 per object, tensors addressed by object and offset) is still read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import blake3

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.io._sealed import seal, unseal
from lightning_resilient.io.lineage import Origin
from lightning_resilient.io.paths import check_relative

__all__ = ["FORMAT", "HASH", "MANIFEST_NAME", "Manifest", "ObjectEntry", "ShardedRecord", "TensorEntry",
           "chunk_digests", "hasher",
           "object_digest"]

FORMAT = 2
KIND = "lightning_resilient.checkpoint"
MANIFEST_NAME = "manifest.json"


HASH = "blake3"


class _Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


# The blake3 binding releases the GIL on large updates, so chunks hash in parallel threads.
_HASHES: dict[str, Callable[[], _Hasher]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}


def hasher(name: str = HASH) -> _Hasher:
    """A new hasher for the digest algorithm ``name`` a manifest names."""
    try:
        return _HASHES[name]()
    except KeyError:
        raise ValueError(f"unknown digest algorithm {name!r}") from None


def object_digest(chunks: list[str]) -> str:
    """An object's identity: the digest of its chunk digests (equal objects have equal chunk lists)."""
    h = hasher()
    h.update(b"".join(bytes.fromhex(c) for c in chunks))
    return h.hexdigest()


def chunk_digests(pieces: list[memoryview], chunk_size: int, algorithm: str = HASH) -> list[str]:
    """The digest of each ``chunk_size`` piece of the bytes ``pieces`` hold in order (one digest for no bytes)."""
    digests: list[str] = []
    current, filled = hasher(algorithm), 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while len(view):
            take = min(chunk_size - filled, len(view))
            current.update(view[:take])
            filled += take
            view = view[take:]
            if filled == chunk_size:
                digests.append(current.hexdigest())
                current, filled = hasher(algorithm), 0
    if filled or not digests:
        digests.append(current.hexdigest())
    return digests


@dataclass(frozen=True)
class ObjectEntry:
    path: str  # relative to the checkpoint root; may live in another commit's folder (deduplicated data)
    size: int
    digest: str  # object_digest(chunks)
    chunks: list[str] = field(default_factory=list)  # the digest of each chunk_size piece, in order


@dataclass(frozen=True)
class TensorEntry:
    key: list[list[Any]]
    dtype: str
    shape: list[int]
    offset: int  # in the stream
    nbytes: int
    device: str


@dataclass(frozen=True)
class ShardedRecord:
    """Where a sharded (``torch.distributed.checkpoint``) save keeps its parts: DCP's metadata object and each
    rank's stream of objects. The manifest's own stream and tensors hold the rest (loops, callbacks, ...)."""

    world_size: int  # processes that wrote it (a load may use another number: DCP reshards)
    metadata: int  # index into Manifest.objects: DCP's pickled Metadata
    ranks: list[list[int]]  # ranks[r]: indices into Manifest.objects, rank r's stream in order
    # The global ranks of each node that wrote it, by node (written with a local tier, whose parts are per node: see
    # io/parts.py); empty: not recorded (one node, or a save without a local tier). Added later: optional on read.
    nodes: list[list[int]] = field(default_factory=list)


@dataclass
class Manifest:
    name: str
    commit: str
    step: int
    epoch: int
    created: float
    writer_epoch: int
    chunk_size: int  # bytes each chunk digest covers (the last chunk of an object may be shorter)
    skeleton: int  # index into objects
    hash: str = HASH  # the chunk digests' algorithm
    stream: list[int] = field(default_factory=list)  # indices into objects: the tensor stream, in order
    objects: list[ObjectEntry] = field(default_factory=list)
    tensors: list[TensorEntry] = field(default_factory=list)
    sharded: ShardedRecord | None = None  # a sharded (torch.distributed.checkpoint) save's parts
    # Where the training of this checkpoint's writer epoch came from (its lineage, recorded in every checkpoint so
    # that a root whose pointer is lost still knows which branch is current). None: written before lineage was
    # recorded.
    origin: Origin | None = None
    # The incarnation of the root whose lineage this is (its pointer's ``root_id``; a local tier's commits carry the
    # durable root's): a pointer rebuilt after a loss ignores the commits of a deleted incarnation that a job of it
    # wrote into the recreated root. "": written before manifests carried it.
    root_id: str = ""
    # The names in this root that the run's ModelCheckpoints reported when it was saved (best_model_path, best_k_models,
    # last_model_path: see io/reported.py); retention keeps them. None: the save carried no ModelCheckpoint state (or
    # was written before manifests recorded it).
    reported: list[str] | None = None

    def rank_offsets(self, rank: int) -> list[int]:
        """Where each object of rank ``rank``'s stream starts in that stream (sharded saves)."""
        assert self.sharded is not None
        out, pos = [], 0
        for i in self.sharded.ranks[rank]:
            out.append(pos)
            pos += self.objects[i].size
        return out

    @property
    def folders(self) -> list[str]:
        """Commit folders this checkpoint needs: its own (the manifest), and every one its objects live in."""
        return sorted({self.commit} | {o.path.rsplit("/", 1)[0] for o in self.objects})

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def stream_bytes(self) -> int:
        return sum(self.objects[i].size for i in self.stream)

    def stream_offsets(self) -> list[int]:
        """Where each object of :attr:`stream` starts in the stream."""
        out, pos = [], 0
        for i in self.stream:
            out.append(pos)
            pos += self.objects[i].size
        return out

    def chunk_count(self, index: int) -> int:
        """How many chunk digests object ``index`` has (one for an empty object), by arithmetic: a declared size
        is never trusted to size a structure before it has been compared with what is stored."""
        return max(1, -(-self.objects[index].size // self.chunk_size))

    def chunk_ranges(self, index: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` byte ranges of object ``index`` that each chunk digest covers (only once the
        object's declared size has been checked: see ``RootReader.check_sizes``)."""
        size = self.objects[index].size
        return [(a, min(a + self.chunk_size, size)) for a in range(0, size, self.chunk_size)] or [(0, 0)]

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["origin"] = self.origin.to_json() if self.origin is not None else None
        return seal({"format": FORMAT, "kind": KIND, **body})

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        raw = unseal(data, what="manifest", where=where)
        if raw.get("kind") != KIND:
            raise CheckpointCorruptedError(f"{where} is not a lightning_resilient manifest", object=where)
        fmt = raw.get("format")
        if not isinstance(fmt, int):
            raise CheckpointCorruptedError(f"manifest {where} has no integer 'format'", object=where)
        if fmt > FORMAT:
            raise UnsupportedFormatError(
                f"manifest {where} has format {fmt}, but this lightning_resilient reads formats up to {FORMAT}:"
                " it was written by a newer version. Upgrade lightning_resilient to load it."
            )
        if fmt < FORMAT:
            # Format 1 (one SHA-256 per object) was only ever written by development builds before the first
            # release; nothing released reads or writes it. Kept, never deleted: it is not ours to judge.
            raise UnsupportedFormatError(
                f"manifest {where} has format {fmt}, written by a development build of lightning_resilient before its"
                f" first release; this version reads format {FORMAT} only. Load it with the build that wrote it and"
                " save it again, or delete it.")
        try:
            manifest = _parse(raw, where)
        except ValueError as exc:
            raise CheckpointCorruptedError(f"manifest {where} is invalid: {exc}", object=where) from exc
        except (KeyError, TypeError) as exc:
            raise CheckpointCorruptedError(f"manifest {where} is missing or mistypes field {exc}",
                                           object=where) from exc
        _check_consistent(manifest, where)
        return manifest


def _header(raw: dict[str, Any], where: str) -> dict[str, Any]:
    return {"name": str(raw["name"]), "commit": check_relative(raw["commit"], where=f"{where} commit"),
            "step": int(raw["step"]), "epoch": int(raw["epoch"]), "created": float(raw["created"]),
            "writer_epoch": int(raw["writer_epoch"]), "skeleton": int(raw["skeleton"])}


def _parse(raw: dict[str, Any], where: str) -> Manifest:
    objects = [ObjectEntry(check_relative(o["path"], where=f"{where} objects[{i}].path"), int(o["size"]),
                           str(o["digest"]), [str(c) for c in o["chunks"]])
               for i, o in enumerate(raw["objects"])]
    tensors = [TensorEntry(list(t["key"]), str(t["dtype"]), [int(d) for d in t["shape"]], int(t["offset"]),
                           int(t["nbytes"]), str(t["device"]))
               for t in raw["tensors"]]
    chunk_size = int(raw["chunk_size"])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    algorithm = str(raw["hash"])
    hasher(algorithm)  # an unknown algorithm is a clear error here, not at the first chunk
    raw_sharded = raw.get("sharded")
    sharded = None if raw_sharded is None else ShardedRecord(
        int(raw_sharded["world_size"]), int(raw_sharded["metadata"]),
        [[int(i) for i in r] for r in raw_sharded["ranks"]],
        [[int(r) for r in node] for node in raw_sharded.get("nodes") or []])
    origin = raw.get("origin")
    reported = raw.get("reported")
    return Manifest(**_header(raw, where), chunk_size=chunk_size, hash=algorithm,
                    stream=[int(i) for i in raw["stream"]], objects=objects, tensors=tensors, sharded=sharded,
                    origin=Origin.from_json(origin) if origin is not None else None,
                    root_id=str(raw.get("root_id", "")),
                    # (names, compared with the catalog's: never made into a path)
                    reported=None if reported is None else [str(n) for n in reported])


def _check_consistent(manifest: Manifest, where: str) -> None:
    objects = manifest.objects
    if not 0 <= manifest.skeleton < len(objects):
        raise CheckpointCorruptedError(f"manifest {where} names no valid skeleton object", object=where)
    if any(not 0 <= i < len(objects) or i == manifest.skeleton for i in manifest.stream) \
            or len(set(manifest.stream)) != len(manifest.stream):
        raise CheckpointCorruptedError(f"manifest {where} has an invalid stream", object=where)
    for i, obj in enumerate(objects):
        # Counted, not listed: a manifest declaring 1e15 bytes would otherwise cost 6e7 ranges before it is refused.
        if obj.size < 0 or len(obj.chunks) != manifest.chunk_count(i):
            raise CheckpointCorruptedError(f"manifest {where} objects[{i}] has {len(obj.chunks)} chunk digest(s)"
                                           f" for {obj.size} bytes", object=where)
    if manifest.sharded is not None:
        used = [manifest.sharded.metadata, *(i for r in manifest.sharded.ranks for i in r)]
        nodes = [r for node in manifest.sharded.nodes for r in node]
        if any(not 0 <= i < len(objects) for i in used) or len(manifest.sharded.ranks) != manifest.sharded.world_size \
                or (nodes and sorted(nodes) != list(range(manifest.sharded.world_size))):
            raise CheckpointCorruptedError(f"manifest {where} has an invalid sharded record", object=where)
    total = manifest.stream_bytes
    for i, t in enumerate(manifest.tensors):
        if t.offset < 0 or t.nbytes < 0 or t.offset + t.nbytes > total:
            raise CheckpointCorruptedError(f"manifest {where} tensors[{i}] lies outside the stream", object=where)
