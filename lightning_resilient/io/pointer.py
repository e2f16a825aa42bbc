"""The pointer (``latest.json``): the only object of a root that is ever overwritten.

It names the latest committed checkpoint, the catalog of live checkpoints by name, and the writer epoch used
for fencing. It is replaced only by a conditional write against the version that was read, so two writers
can never both believe they moved it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.io._paths import check_relative
from lightning_resilient.io._sealed import seal, unseal

__all__ = ["POINTER_NAME", "Entry", "Pointer"]

POINTER_NAME = "latest.json"
FORMAT = 1
KIND = "lightning_resilient.pointer"


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint as the pointer records it."""

    name: str  # the name Lightning used, e.g. "epoch=1-step=20.ckpt"
    commit: str  # root-relative folder holding its manifest
    step: int
    epoch: int
    created: float
    writer_epoch: int
    folders: tuple[str, ...]  # commit folders its objects live in (its own, plus any it shares data with)
    size: int = 0

    @property
    def order(self) -> tuple[int, float]:
        return (self.step, self.created)


@dataclass
class Pointer:
    writer_epoch: int = 0
    writer: str = ""
    latest: Entry | None = None
    checkpoints: dict[str, Entry] = field(default_factory=dict)
    protected: dict[str, str] = field(default_factory=dict)  # commit -> why (e.g. resumed from it)
    txn: str = ""  # unique per write: lets a writer recognise its own write after a lost response

    def live_folders(self) -> set[str]:
        entries = list(self.checkpoints.values()) + ([self.latest] if self.latest else [])
        folders = {f for e in entries for f in e.folders}
        return folders | set(self.protected)

    def candidates(self) -> list[Entry]:
        """Committed checkpoints, newest first: latest, then the catalog by step and time."""
        seen: set[str] = set()
        out: list[Entry] = []
        rest = sorted(self.checkpoints.values(), key=lambda e: e.order, reverse=True)
        for entry in ([self.latest] if self.latest else []) + rest:
            if entry.commit not in seen:
                seen.add(entry.commit)
                out.append(entry)
        return out

    def copy(self) -> Pointer:
        return replace(self, checkpoints=dict(self.checkpoints), protected=dict(self.protected))

    def to_bytes(self) -> bytes:
        return seal({"format": FORMAT, "kind": KIND, **asdict(self)})

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Pointer:
        hint = (" Nothing committed is lost: the checkpoints are still there. Call"
                f" lightning_resilient.repair_pointer({where.rsplit('/', 1)[0]!r}) to rebuild the pointer from"
                " their manifests.")
        raw = unseal(data, what="pointer", where=where, hint=hint)
        if raw.get("kind") != KIND or not isinstance(raw.get("format"), int):
            raise CheckpointCorruptedError(f"{where} is not a lightning_resilient pointer.{hint}", object=where)
        if raw["format"] > FORMAT:
            raise UnsupportedFormatError(
                f"pointer {where} has format {raw['format']}, but this lightning_resilient reads formats up to"
                f" {FORMAT}: a newer version wrote it. Upgrade lightning_resilient to use this root."
            )
        try:
            def entry(e: dict[str, Any], what: str) -> Entry:
                return Entry(name=str(e["name"]), commit=check_relative(e["commit"], where=f"{where} {what}"),
                             step=int(e["step"]), epoch=int(e["epoch"]), created=float(e["created"]),
                             writer_epoch=int(e["writer_epoch"]),
                             folders=tuple(check_relative(f, where=f"{where} {what}") for f in e["folders"]),
                             size=int(e.get("size", 0)))

            return cls(
                writer_epoch=int(raw["writer_epoch"]),
                writer=str(raw["writer"]),
                latest=entry(raw["latest"], "latest") if raw["latest"] is not None else None,
                checkpoints={str(k): entry(v, f"checkpoints[{k!r}]") for k, v in raw["checkpoints"].items()},
                protected={check_relative(k, where=f"{where} protected"): str(v) for k, v in raw["protected"].items()},
                txn=str(raw["txn"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptedError(f"pointer {where} is malformed ({type(exc).__name__}: {exc}).{hint}",
                                           object=where) from exc
