"""Both tiers of a durable root as a resume reads them: which checkpoints a resume may load, and loading one.

The durable pointer gives the lineage (the authority: a local checkpoint outside it belongs to a job that was fenced or
a branch that was abandoned, and is never loaded), and the candidates are the durable lineage's checkpoints plus the
local ones inside it, newest first by (writer epoch, step) (:class:`TierView`). Each is read from the local tier when
it holds it and it verifies, else from the durable tier, else the next older candidate (:func:`load_tiered`). An
empty local tier (a new node) therefore resumes from the durable tier. :func:`resolve_tiered` says what a URL names
across the two tiers, :func:`find_latest_tiered` which checkpoint is the newest. It only reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_resilient._warnings import warn
from lightning_resilient.errors import CheckpointCorruptedError, CheckpointError
from lightning_resilient.io import paths
from lightning_resilient.io.catalog import NOT_FOUND, Together
from lightning_resilient.io.folders import TIER_RECORD, writer_epoch_of
from lightning_resilient.io.lineage import Lineage
from lightning_resilient.io.local_tier import durable_of, local_tier_url, tier_record
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import Entry, Pointer
from lightning_resilient.io.root import CheckpointRoot, Loaded

__all__ = ["TierView", "TieredResolved", "find_latest_tiered", "load_tiered", "resolve_tiered", "split_tiered"]

log = logging.getLogger(__name__)


@dataclass
class TierView:
    """Both tiers of one durable root as a resume sees them."""

    durable: CheckpointRoot
    local: CheckpointRoot
    durable_pointer: Pointer | None
    local_pointer: Pointer | None
    #: The local commits other nodes' local tiers hold (a job on several nodes: io/replicas.py), candidates too.
    others: list[Entry] = field(default_factory=list)

    @classmethod
    def read(cls, durable: CheckpointRoot, local: CheckpointRoot) -> TierView:
        pointer, _ = durable.read_pointer()
        if pointer is None:
            scan = durable.scan()
            if scan.manifests or scan.max_epoch:
                pointer = scan.pointer()
        return cls(durable, local, pointer, _local_pointer(local, pointer))

    @property
    def lineage(self) -> Lineage:
        """The durable root's current lineage: the authority on what a resume may continue."""
        return self.durable_pointer.lineage() if self.durable_pointer is not None else Lineage({}, 0)

    def local_entries(self) -> list[Entry]:
        """This node's local commits that may be resumed: under a writer epoch the durable root still knows
        (:meth:`_known_epoch`; any other may be a fenced job's, past its fork)."""
        return [e for e in (self.local_pointer.entries() if self.local_pointer is not None else [])
                if self._known_epoch(e.writer_epoch)]

    def _known_epoch(self, epoch: int) -> bool:
        """An epoch whose origin the durable pointer records, or one its current lineage reaches through an origin
        it records (bounded there by that origin's step: a chain of resumes of local-only checkpoints, whose older
        epochs the pointer's pruning forgot)."""
        origins = self.durable_pointer.origins if self.durable_pointer is not None else {}
        return epoch in origins or epoch in self.lineage.bounds

    def _entries(self) -> list[Entry]:
        durable = self.durable_pointer.entries() if self.durable_pointer is not None else []
        others = [e for e in self.others if self._known_epoch(e.writer_epoch)]
        seen: dict[str, Entry] = {}
        for entry in [*self.local_entries(), *others, *durable]:
            seen.setdefault(entry.commit, entry)
        return list(seen.values())

    def candidates(self) -> list[Entry]:
        """The checkpoints a resume may load, newest first: the durable lineage's, in either tier."""
        return self.lineage.members(self._entries())

    def local_only(self) -> list[Entry]:
        durable = {e.commit for e in self.durable_pointer.entries()} if self.durable_pointer is not None else set()
        return [e for e in self.candidates() if e.commit not in durable]

    def older(self, entry: Entry) -> list[Entry]:
        origins = dict(self.durable_pointer.origins) if self.durable_pointer is not None else {}
        return [e for e in Lineage.below(origins, entry).members(self._entries()) if e.commit != entry.commit]

    def entry(self, commit: str) -> Entry | None:
        for entry in self._entries():
            if entry.commit == commit:
                return entry
        for root in (self.local, self.durable):
            if root.store.exists(f"{commit}/{MANIFEST_NAME}"):
                try:
                    return Entry.from_manifest(root.read_manifest(commit))
                except CheckpointCorruptedError:
                    continue
        return None

    def holders(self, commit: str) -> list[CheckpointRoot]:
        """The tiers holding a committed copy of ``commit``, the local one first."""
        return [root for root in (self.local, self.durable) if root.store.exists(f"{commit}/{MANIFEST_NAME}")]


@dataclass
class TieredResolved:
    durable_url: str
    entry: Entry
    fallbacks: list[Entry]


def resolve_tiered(url: str, local_tier: str, root_for: Callable[[str], CheckpointRoot], *,
                   shown: str | None = None, others: list[Entry] | None = None) -> TieredResolved | None:
    """What ``url`` names across the two tiers of its durable root; None when neither tier knows it (the caller's
    single-tier resolution then handles it: a plain file, a stock checkpoint, the error message).

    ``url`` may name the durable root (its newest checkpoint in either tier), a name in it, a commit folder in it, or
    the same in its local tier root (``<local_tier>/<...>``). ``shown``: ``url`` as the caller gave it, for messages.
    ``others``: the local commits of other nodes of the job (see :attr:`TierView.others`).
    """
    durable_url, rel = split_tiered(url, local_tier, root_for)
    if durable_url is None:
        return None
    view = TierView.read(root_for(durable_url), root_for(local_tier_url(local_tier, durable_url)))
    view.others = list(others or [])
    if rel == "":
        candidates = view.candidates()
        if not candidates:
            return None
        return TieredResolved(durable_url, candidates[0], candidates[1:])
    if writer_epoch_of(rel) is not None:
        entry = view.entry(rel)
        if entry is None:
            raise FileNotFoundError(f"{NOT_FOUND}{shown or url}. Neither {durable_url} nor its local tier"
                                    f" {view.local.url} holds a committed {rel!r}")
        return TieredResolved(durable_url, entry, view.older(entry))
    candidates = view.candidates()
    named = [e for e in candidates if e.name == rel]
    if named:
        return TieredResolved(durable_url, named[0], view.older(named[0]))
    if rel.startswith("last") and candidates:
        # ModelCheckpoint's last.ckpt (last-v1.ckpt, ...) means the newest: when the run's lineage has no checkpoint
        # of that name yet (a rollback or a fresh start, whose last.ckpt is not persisted yet), the name in the
        # catalogs is an abandoned branch's, never what "last" should resume.
        log.info("%s: no %s in the current lineage of %s yet; resuming its newest checkpoint, %s", url, rel,
                 durable_url, candidates[0].commit)
        return TieredResolved(durable_url, candidates[0], candidates[1:])
    return None


def _local_pointer(local: CheckpointRoot, durable: Pointer | None) -> Pointer | None:
    """The local tier's pointer when it belongs to this incarnation of the durable root; else None (ignored)."""
    if durable is None or not local.store.exists(""):
        return None
    record = tier_record(local)
    if record is None or not durable.root_id or record["root_id"] != durable.root_id:
        return None  # another incarnation of the root (or none recorded): never this run's
    try:
        pointer, _ = local.read_pointer()
    except CheckpointError as exc:
        warn(f"the local tier {local.url} is unreadable ({exc}); resuming from the durable tier. The next"
             " job that saves moves it aside.", RuntimeWarning)
        return None
    return pointer


def split_tiered(url: str, local_tier: str, root_for: Callable[[str], CheckpointRoot]) -> tuple[str | None, str]:
    """(durable root URL, path relative to it) for a URL in a durable root or in a local tier root."""
    base = os.path.realpath(os.path.expanduser(local_tier))
    plain = url[len("file://"):] if url.startswith("file://") else url
    if paths.split_protocol(url)[0] in (None, "file", "local") and \
            os.path.realpath(plain).startswith(base + os.sep):
        inside = os.path.relpath(os.path.realpath(plain), base).split(os.sep)
        durable = durable_of(root_for(os.path.join(base, inside[0])))
        return durable, "/".join(inside[1:])
    name = paths.basename(url)
    if writer_epoch_of(name) is not None:
        return paths.dirname(paths.dirname(url)), f"{paths.basename(paths.dirname(url))}/{name}"
    if _has_pointer(root_for(url)) or root_for(local_tier_url(local_tier, url)).store.exists(TIER_RECORD):
        return url, ""
    parent = paths.dirname(url)
    return parent, name


def _has_pointer(root: CheckpointRoot) -> bool:
    pointer, _ = root.read_pointer()
    return pointer is not None


def load_tiered(found: TieredResolved, local_tier: str, root_for: Callable[[str], CheckpointRoot],
                load_for: Callable[[CheckpointRoot], Callable[..., Loaded]], *, fallback: bool,
                together: Together | None, **load_kwargs: Any) -> tuple[Entry, CheckpointRoot, Loaded]:
    """Load ``found`` (falling back to older candidates when ``fallback``): from the local tier when it holds a
    copy that verifies, else from the durable tier. With ``together`` every rank loads the same commit (each from
    its own node's local tier or from the durable one); returns (entry, the tier it was read from, loaded)."""
    durable = root_for(found.durable_url)
    local = root_for(local_tier_url(local_tier, found.durable_url))
    candidates = [found.entry, *(found.fallbacks if fallback else [])]
    first: str | None = None
    last_error: BaseException | None = None
    for candidate in candidates:
        loaded: Loaded | None = None
        source: CheckpointRoot | None = None
        errors: list[str] = []
        for root in (local, durable):
            if not root.store.exists(f"{candidate.commit}/{MANIFEST_NAME}"):
                continue
            try:
                loaded = (root.load if root is local else load_for(root))(candidate.commit, **load_kwargs)
                source = root
                break
            except CheckpointCorruptedError as exc:
                errors.append(f"{root.store.url(candidate.commit)}: {exc}")
                last_error = exc
                message = f"checkpoint {root.store.url(candidate.commit)} is corrupted and was NOT loaded: {exc}"
                log.error(message)
                warn(message, RuntimeWarning)
        ok = loaded is not None
        if together is not None:
            ok = together.all_true(ok)
        if ok:
            assert loaded is not None and source is not None
            log.info("read %s (step %d) from the %s tier, %s", candidate.commit, candidate.step,
                     "local" if source is local else "durable", source.url)
            if first is not None:
                message = (f"loaded the previous committed checkpoint {candidate.commit} (step {candidate.step}) of"
                           f" {found.durable_url} instead of {first}, which no tier could load")
                log.error(message)
                warn(message, RuntimeWarning)
            return candidate, source, loaded
        first = first or candidate.commit
        if not errors and loaded is None:
            log.warning("%s is in neither tier this process can read (%s, %s)", candidate.commit, local.url,
                        durable.url)
    raise CheckpointCorruptedError(
        f"no valid checkpoint to load from {found.durable_url} or its local tier: tried {len(candidates)}, the last"
        f" being {candidates[-1].commit}" + (f" ({last_error})" if last_error is not None else ""),
        object=None)


def find_latest_tiered(durable: CheckpointRoot, local: CheckpointRoot) -> str | None:
    """The newest checkpoint of the durable root's lineage in either tier, as a URL in the durable root (a plugin
    with the local tier reads it from there); None when neither tier holds one."""
    view = TierView.read(durable, local)
    for entry in view.candidates():
        for root in view.holders(entry.commit):
            try:
                root.read_manifest(entry.commit)
            except CheckpointCorruptedError as exc:
                warn(f"skipping {root.store.url(entry.commit)}: {exc}", RuntimeWarning)
                continue
            return durable.store.url(entry.commit)
    return None

