"""The pointer (``latest.json``): the only object of a root that is ever overwritten.

It names the latest committed checkpoint, the catalog of live checkpoints by name, the writer epoch used for
fencing, where each writer epoch's training came from (its origin: the lineage), and the folders retired by
retention that are still waiting to be deleted. It is replaced only by a conditional write against the version
that was read, so two writers can never both believe they moved it.

Fields added after the first release (``origins``, ``saves``, ``last_saved``, ``retired``, ``root_id``, ``reported``)
are optional on read, so pointers written before them still load (their epochs have no known origin: see
:mod:`~lightning_resilient.io.lineage`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.io._sealed import seal, unseal
from lightning_resilient.io.lineage import Lineage, Origin, order
from lightning_resilient.io.manifest import Manifest
from lightning_resilient.io.paths import check_relative

__all__ = ["Entry", "LEGACY_NAMES", "LEGACY_POINTER_NAME", "POINTER_NAME", "Pointer"]

# The pointer lives in the root's dot-folder, beside the origin records: a listing of the checkpoint folder shows
# checkpoint names only, to people and to Lightning (its version counter and "directory is not empty" checks).
POINTER_NAME = ".lightning_resilient/latest.json"
# Where releases up to 0.1 kept it (and its lock file, on local disk): still read, replaced by the first update.
LEGACY_POINTER_NAME = "latest.json"
LEGACY_NAMES = frozenset({LEGACY_POINTER_NAME, f"{LEGACY_POINTER_NAME}.lock"})
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

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> Entry:
        return cls(name=manifest.name, commit=manifest.commit, step=manifest.step, epoch=manifest.epoch,
                   created=manifest.created, writer_epoch=manifest.writer_epoch, folders=tuple(manifest.folders),
                   size=manifest.total_bytes)

    @property
    def order(self) -> tuple[int, int, float]:
        """Lineage order: writer epoch, then step, then creation time (see :mod:`~lightning_resilient.io.lineage`)."""
        return order(self)


@dataclass
class Pointer:
    writer_epoch: int = 0
    writer: str = ""
    latest: Entry | None = None
    checkpoints: dict[str, Entry] = field(default_factory=dict)
    protected: dict[str, str] = field(default_factory=dict)  # commit -> why (e.g. resumed from it)
    txn: str = ""  # unique per write: lets a writer recognise its own write after a lost response
    origins: dict[int, Origin] = field(default_factory=dict)  # writer epoch -> where its training came from
    # Saves of distinct checkpoints (a top-k save and save_last at the same step count once): the clock that
    # retirement counts in, and the (writer epoch, step) of the last one.
    saves: int = 0
    last_saved: list[int] = field(default_factory=list)
    # folder -> the value of ``saves`` when retention dropped it. A retired folder's data is deleted only once the
    # root has saved another step, so a reader that resolved it just before has a whole save interval to read it.
    retired: dict[str, int] = field(default_factory=dict)
    # Random, set by the first write of a pointer to this root: which incarnation of the root this is. A root deleted
    # and written again under the same URL gets a new one, so a node-local tier of the old one is never taken for
    # the new one's (io/tiered.py), and a job of the old one is fenced (io/fencing.py). Every origin record carries
    # it, so a pointer rebuilt from the manifests keeps it (a root whose records predate it gets a new one).
    root_id: str = ""
    # The names the run's ModelCheckpoints report (best_model_path, best_k_models, last_model_path), as the newest save
    # that carried their state recorded them (its manifest's ``reported``: see io/reported.py). Retention never drops
    # the checkpoints they catalog (``keep_last``, ``gc --keep-last``, ``gc --abandoned``, in any process).
    reported: list[str] = field(default_factory=list)

    def entries(self) -> list[Entry]:
        """Every checkpoint the pointer names (latest and the catalog), each once."""
        seen: dict[str, Entry] = {}
        for entry in ([self.latest] if self.latest else []) + list(self.checkpoints.values()):
            seen.setdefault(entry.commit, entry)
        return list(seen.values())

    def live_folders(self) -> set[str]:
        folders = {f for e in self.entries() for f in e.folders}
        return folders | set(self.protected)

    def lineage(self) -> Lineage:
        """The lineage of the current writer epoch: what a resume of this root continues."""
        return Lineage(self.origins, self.writer_epoch)

    def candidates(self) -> list[Entry]:
        """The committed checkpoints a resume may load, newest first: the current lineage's, in lineage order."""
        return self.lineage().members(self.entries())

    def abandoned(self) -> list[Entry]:
        """Checkpoints the pointer names that belong to an abandoned branch (a rollback left them behind)."""
        return self.lineage().outside(self.entries())

    def retired_due(self) -> set[str]:
        """Retired folders whose deletion may go ahead: another step was saved since they were retired."""
        return {folder for folder, at in self.retired.items() if self.saves > at}

    @classmethod
    def rebuilt(cls, manifests: list[Manifest], max_epoch: int, origins: dict[int, Origin] | None = None, *,
                root_id: str = "") -> Pointer:
        """A pointer rebuilt from the committed manifests of a root whose pointer is missing or damaged.

        Lineage comes from the origin records of the writer epochs (``origins``) and from the manifests (each
        records its writer epoch's origin). Each name catalogs its newest
        commit of the current lineage (or, for a name only an abandoned branch used, that branch's newest), latest
        is the lineage's newest, and the writer epoch is ``max_epoch``, the highest any commit folder carries, so a
        job still writing with it continues and the next claim fences them all. Nothing is retired or protected:
        a rebuild never makes anything deletable. ``root_id`` is the incarnation the origin records name (a lost
        pointer is no new incarnation: a job of a deleted one stays fenced, a local tier of this one stays valid).
        """
        pointer = cls(writer="rebuilt from the manifests", root_id=root_id)
        pointer.origins = {**(origins or {}), **{m.writer_epoch: m.origin for m in manifests if m.origin is not None}}
        pointer.writer_epoch = max([max_epoch, *(m.writer_epoch for m in manifests)])
        if manifests:
            head = max(m.writer_epoch for m in manifests)
            if pointer.writer_epoch > head and pointer.writer_epoch not in pointer.origins:
                # The newest epoch committed nothing (it died before its first save): it most likely resumed the
                # newest checkpoint of the lineage before it, which keeps that lineage current.
                newest = Lineage(pointer.origins, head).members(manifests)
                if newest:
                    n = newest[0]
                    pointer.origins[pointer.writer_epoch] = Origin(n.commit, n.writer_epoch, n.step)
        lineage = pointer.lineage()
        members = lineage.members(manifests)
        # Abandoned branches first, then the lineage, each oldest first: a name both used ends up naming the
        # lineage's newest commit of it.
        for manifest in [*reversed(lineage.outside(manifests)), *reversed(members)]:
            pointer.checkpoints[manifest.name] = Entry.from_manifest(manifest)
        pointer.latest = Entry.from_manifest(members[0]) if members else None
        # What the ModelCheckpoints reported at the lineage's newest save stays kept (a rebuild only ever keeps more).
        pointer.reported = list(members[0].reported or []) if members else []
        return pointer

    def copy(self) -> Pointer:
        return replace(self, checkpoints=dict(self.checkpoints), protected=dict(self.protected),
                       origins=dict(self.origins), retired=dict(self.retired), last_saved=list(self.last_saved),
                       reported=list(self.reported))

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["origins"] = {str(k): v.to_json() for k, v in self.origins.items()}
        return seal({"format": FORMAT, "kind": KIND, **body})

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Pointer:
        # The root: the pointer lives in its dot-folder (a release-0.1 pointer directly in it).
        root = where[: -len(POINTER_NAME) - 1] if where.endswith(f"/{POINTER_NAME}") else where.rsplit("/", 1)[0]
        hint = (" Nothing committed is lost: the checkpoints are still there. Call"
                f" lightning_resilient.repair_pointer({root!r}) to rebuild the pointer from their manifests.")
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
                origins={int(k): Origin.from_json(v) for k, v in raw.get("origins", {}).items()},
                saves=int(raw.get("saves", 0)),
                last_saved=[int(v) for v in raw.get("last_saved", [])],
                retired={check_relative(k, where=f"{where} retired"): int(v)
                         for k, v in raw.get("retired", {}).items()},
                root_id=str(raw.get("root_id", "")),
                reported=[str(n) for n in raw.get("reported", [])],  # names, never made into a path
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptedError(f"pointer {where} is malformed ({type(exc).__name__}: {exc}).{hint}",
                                           object=where) from exc
