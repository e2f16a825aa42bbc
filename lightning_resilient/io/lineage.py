"""Lineage: which committed checkpoints belong to the run being resumed, and in which order.

Every job that writes a root claims a new writer epoch, and records where its training came from: a fresh start,
or the committed checkpoint it resumed from (its :class:`Origin`). A rollback (run A reached step 300, run B
resumes from A's step 250) therefore abandons A's checkpoints after step 250: B's lineage is B's own checkpoints,
then A's up to step 250, then whatever A itself resumed from, and so on back to a fresh start.

Everything that picks or drops checkpoints orders them the same way: by lineage membership first, then writer
epoch, then step, then creation time. The latest checkpoint, the fallback when one is damaged, ``keep_last``,
the scan of a root whose pointer is missing and ``repair_pointer`` all use :class:`Lineage`; checkpoints outside
it (an abandoned branch) are never chosen to resume and never counted by retention; ``gc --abandoned`` removes
them.

A job may also start from a checkpoint of *another* root (a fork: ``fit(ckpt_path=<a checkpoint of root X>)`` with
``ModelCheckpoint(dirpath=Y)``). Its origin then names that root too (:attr:`Origin.root`); within Y the lineage ends
there, as at a fresh start, and X is never written (only a fit that writes a root claims it).

Each origin of a resume also lists the whole chain it continues (:attr:`Origin.ancestors`: every writer epoch below
it with its highest step in the lineage, down to a fresh start or a fork), so the lineage stays exact when the
origins of old epochs are gone: the pointer prunes those no cataloged checkpoint needs, and ``gc`` their records.
Without it, a pointer rebuilt from the manifests after a loss, with an old job's stray manifest back in view, would
find an epoch of the chain without an origin and fall back to the rule below.

Roots written before lineage was recorded have no origins: an epoch whose origin is unknown (and that no origin
above it lists among its ancestors) is taken to continue every older epoch (the old order by step), so such roots
keep resuming as they did.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from lightning_resilient.errors import CheckpointCorruptedError
from lightning_resilient.io._sealed import seal, unseal

__all__ = ["Lineage", "ORIGINS_DIR", "Ordered", "Origin", "order", "origin_record_name"]

#: Under the root: one small immutable record per writer epoch, written when a job claims the root, so that the
#: lineage survives the loss of the pointer even for a job that died before its first commit.
ORIGINS_DIR = ".lightning_resilient/origins"
_RECORD_KIND = "lightning_resilient.origin"


def origin_record_name(writer_epoch: int) -> str:
    return f"{ORIGINS_DIR}/e{writer_epoch:010d}.json"


@dataclass(frozen=True)
class Origin:
    """Where the training of one writer epoch came from: a fresh start (``commit`` None), a resumed checkpoint of
    this root, or (``root`` set) a checkpoint of another root that this one was forked from."""

    commit: str | None = None
    writer_epoch: int = 0  # the writer epoch that committed ``commit``
    step: int = 0
    root: str | None = None  # the URL of the root holding ``commit``, when it is not this root (a fork)
    #: the chain this origin continues, newest first: each writer epoch from ``writer_epoch`` down to the chain's fresh
    #: start (or fork) with the highest step of it in the lineage; ``()`` for a fresh start or a fork, None when
    #: unknown (recorded before origins listed it, or a chain that reaches a root from before lineage). Derived
    #: from the origins below it, so two origins of the same checkpoint are equal whatever they know of it.
    ancestors: tuple[tuple[int, int], ...] | None = field(default=None, compare=False)

    @property
    def here(self) -> bool:
        """Whether the origin is a checkpoint of this root (not a fresh start, not a fork from another root)."""
        return self.commit is not None and self.root is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"commit": self.commit, "writer_epoch": self.writer_epoch, "step": self.step}
        if self.root is not None:  # only a fork has it: every other origin is stored as before
            out["root"] = self.root
        if self.ancestors is not None:  # (older readers ignore it: they fall back to the rule for older roots)
            # "epoch:step epoch:step ...": one string, about 10 bytes a resume (an indented JSON list takes 38)
            out["ancestors"] = " ".join(f"{epoch}:{step}" for epoch, step in self.ancestors)
        return out

    @classmethod
    def from_json(cls, raw: Any) -> Origin:
        if not isinstance(raw, dict):
            raise TypeError(f"an origin must be an object, got {raw!r}")
        commit, root, ancestors = raw["commit"], raw.get("root"), raw.get("ancestors")
        if ancestors is not None and not isinstance(ancestors, str):
            raise TypeError(f"an origin's ancestors must be a string of epoch:step pairs, got {ancestors!r}")
        return cls(commit=None if commit is None else str(commit), writer_epoch=int(raw["writer_epoch"]),
                   step=int(raw["step"]), root=None if root is None else str(root),
                   ancestors=None if ancestors is None else _pairs(ancestors))

    def with_ancestors(self, origins: Mapping[int, Origin]) -> Origin:
        """This origin with the chain it continues, as ``origins`` (a pointer's, the claim's view) tell it: ``()``
        for a fresh start or a fork; for a resume, the lineage below the resumed checkpoint when every epoch of it
        is known (else None: the rule for older roots then still applies below it)."""
        if not self.here:
            return replace(self, ancestors=())
        below = Lineage(origins, self.writer_epoch, self.step)
        if below.legacy_below is not None:
            return replace(self, ancestors=None)
        chain = sorted(((e, int(b)) for e, b in below.bounds.items()), reverse=True)
        return replace(self, ancestors=tuple(chain))

    def record(self, writer_epoch: int, writer: str, root_id: str = "") -> bytes:
        """The sealed record of writer epoch ``writer_epoch``'s origin (stored at :func:`origin_record_name`), with
        the incarnation of the root it was claimed in (``root_id``), which a pointer rebuilt after a loss keeps."""
        return seal({"kind": _RECORD_KIND, "format": 1, "writer_epoch": writer_epoch, "writer": writer,
                     "origin": self.to_json(), "root_id": root_id})

    @staticmethod
    def record_writer(data: bytes, *, where: str) -> str:
        """The writer that claimed the epoch of a record (``""`` when it does not say)."""
        return str(unseal(data, what="origin record", where=where).get("writer", ""))

    @classmethod
    def from_record(cls, data: bytes, *, where: str) -> tuple[int, Origin, str]:
        """Writer epoch, origin and root incarnation of a record (``""``: written before records carried it)."""
        raw = unseal(data, what="origin record", where=where)
        try:
            if raw["kind"] != _RECORD_KIND:
                raise ValueError(f"kind {raw['kind']!r}")
            return int(raw["writer_epoch"]), cls.from_json(raw["origin"]), str(raw.get("root_id", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptedError(f"origin record {where} is malformed ({exc})", object=where) from exc


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    """The ``epoch:step`` pairs of an origin's ancestors (ValueError when one is not two integers)."""
    pairs = []
    for pair in text.split():
        epoch, sep, step = pair.partition(":")
        if not sep:
            raise ValueError(f"an origin's ancestor {pair!r} is not epoch:step")
        pairs.append((int(epoch), int(step)))
    return tuple(pairs)


class Ordered(Protocol):
    """What lineage needs of a checkpoint record (a pointer ``Entry`` or a ``Manifest``): read-only, so frozen
    records qualify."""

    @property
    def writer_epoch(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def created(self) -> float: ...


def order(record: Ordered) -> tuple[int, int, float]:
    """The order of checkpoints within one lineage: writer epoch, then step, then creation time."""
    return (record.writer_epoch, record.step, record.created)


class Lineage:
    """The checkpoints a run continues: those of ``head`` (up to step ``bound``), then its origin's, and so on."""

    def __init__(self, origins: Mapping[int, Origin], head: int, bound: float = math.inf) -> None:
        self.head = head
        #: writer epoch -> the highest step of that epoch that belongs to the lineage
        self.bounds: dict[int, float] = {}
        #: epochs below this one, whose origins are unknown (a root from before lineage), all belong up to
        #: ``legacy_bound``
        self.legacy_below: int | None = None
        self.legacy_bound = math.inf
        epoch = head
        listed: tuple[tuple[int, int], ...] | None = None  # the chain below, as the first origin that lists it says
        cap = bound  # (the bound where that origin was met: its ancestors' bounds are no higher)
        while True:
            self.bounds[epoch] = bound
            origin = origins.get(epoch)
            if origin is None:
                if listed is not None:  # pruned, but an origin above listed it: the chain is known to its start
                    for e, b in listed:
                        self.bounds.setdefault(e, min(b, cap))
                else:
                    self.legacy_below, self.legacy_bound = epoch, bound
                break
            if listed is None and origin.ancestors is not None:
                listed, cap = origin.ancestors, bound
            if not origin.here or origin.writer_epoch >= epoch:  # a fresh start, a fork (or a looping record)
                break
            bound = min(bound, origin.step)
            epoch = origin.writer_epoch

    @classmethod
    def below(cls, origins: Mapping[int, Origin], record: Ordered) -> Lineage:
        """The lineage that ``record`` itself continues (what a resume of it falls back to)."""
        return cls(origins, record.writer_epoch, record.step)

    def contains(self, record: Ordered) -> bool:
        return self.holds(record.writer_epoch, record.step)

    def holds(self, writer_epoch: int, step: int) -> bool:
        """Whether the checkpoint of ``writer_epoch`` at ``step`` belongs to this lineage."""
        bound = self.bounds.get(writer_epoch)
        if bound is None and self.legacy_below is not None and writer_epoch < self.legacy_below:
            bound = self.legacy_bound
        return bound is not None and step <= bound

    def members(self, records: Iterable[Any]) -> list[Any]:
        """The records of this lineage, newest first."""
        return sorted((r for r in records if self.contains(r)), key=order, reverse=True)

    def outside(self, records: Iterable[Any]) -> list[Any]:
        """The records of abandoned branches (not in this lineage), newest first."""
        return sorted((r for r in records if not self.contains(r)), key=order, reverse=True)
