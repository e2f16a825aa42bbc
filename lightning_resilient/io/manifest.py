"""The manifest: written last in a checkpoint folder, it is what makes the checkpoint exist.

It lists every object of the checkpoint with its size and SHA-256, and describes each tensor (dtype, shape,
object, offset), so a reader can verify every byte and rebuild tensors without unpickling. Object paths are
relative to the checkpoint root and validated on read: a manifest can never point a load outside the root.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.io._paths import check_relative
from lightning_resilient.io._sealed import seal, unseal

__all__ = ["FORMAT", "Manifest", "ObjectEntry", "TensorEntry"]

FORMAT = 1
KIND = "lightning_resilient.checkpoint"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class ObjectEntry:
    path: str  # relative to the checkpoint root; may live in another commit's folder (deduplicated data)
    size: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    key: list[list[Any]]
    dtype: str
    shape: list[int]
    object: int
    offset: int
    nbytes: int
    device: str


@dataclass
class Manifest:
    name: str
    commit: str
    step: int
    epoch: int
    created: float
    writer_epoch: int
    skeleton: int  # index into objects
    objects: list[ObjectEntry] = field(default_factory=list)
    tensors: list[TensorEntry] = field(default_factory=list)

    @property
    def folders(self) -> list[str]:
        """Commit folders this checkpoint needs: its own (the manifest), and every one its objects live in."""
        return sorted({self.commit} | {o.path.rsplit("/", 1)[0] for o in self.objects})

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    def to_bytes(self) -> bytes:
        return seal({"format": FORMAT, "kind": KIND, **asdict(self)})

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
        try:
            objects = [ObjectEntry(check_relative(o["path"], where=f"{where} objects[{i}].path"), int(o["size"]),
                                   str(o["sha256"]))
                       for i, o in enumerate(raw["objects"])]
            tensors = [TensorEntry(list(t["key"]), str(t["dtype"]), [int(d) for d in t["shape"]], int(t["object"]),
                                   int(t["offset"]), int(t["nbytes"]), str(t["device"]))
                       for t in raw["tensors"]]
            manifest = cls(name=str(raw["name"]), commit=check_relative(raw["commit"], where=f"{where} commit"),
                           step=int(raw["step"]), epoch=int(raw["epoch"]), created=float(raw["created"]),
                           writer_epoch=int(raw["writer_epoch"]), skeleton=int(raw["skeleton"]),
                           objects=objects, tensors=tensors)
        except ValueError as exc:
            raise CheckpointCorruptedError(f"manifest {where} is invalid: {exc}", object=where) from exc
        except (KeyError, TypeError) as exc:
            raise CheckpointCorruptedError(f"manifest {where} is missing or mistypes field {exc}",
                                           object=where) from exc
        for i, t in enumerate(tensors):
            if not 0 <= t.object < len(objects) or t.offset < 0 or t.offset + t.nbytes > objects[t.object].size:
                raise CheckpointCorruptedError(f"manifest {where} tensors[{i}] lies outside its object", object=where)
        if not 0 <= manifest.skeleton < len(objects):
            raise CheckpointCorruptedError(f"manifest {where} names no valid skeleton object", object=where)
        return manifest
