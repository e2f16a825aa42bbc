"""The origin records beside a root's pointer: one per writer epoch a claim made (``.lightning_resilient/origins``).

A claim records its epoch's origin (what its training continues, its writer, the root's incarnation) after its
pointer swap, so that a pointer lost later is rebuilt with the lineage, and so that a job fenced before its first save
can tell it is stale without a pointer (``WriterFence.check_current_by_records``). A record is created only if absent
(:meth:`OriginRecords.create`): one epoch, one writer. The rebuild reads them all (``RootReader.scan``); gc prunes
those of epochs no lineage reaches (``Retention``).
"""

from __future__ import annotations

import logging
import re

from lightning_resilient.errors import CheckpointError
from lightning_resilient.io.lineage import ORIGINS_DIR, Origin, origin_record_name
from lightning_resilient.io.store import Store

__all__ = ["OriginRecords"]

log = logging.getLogger(__name__)


class OriginRecords:
    """The origin records of one root."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def epochs(self) -> dict[int, str]:
        """Each recorded writer epoch and its record (root-relative); any other name in the folder is ignored."""
        found = ((re.fullmatch(r"e(\d+)\.json", r), r) for r in self.store.list_dir(ORIGINS_DIR))
        return {int(m.group(1)): f"{ORIGINS_DIR}/{r}" for m, r in found if m}

    def newest_epoch(self) -> int:
        """The highest writer epoch recorded (0: none)."""
        return max(self.epochs(), default=0)

    def newest(self) -> tuple[int, str]:
        """The highest writer epoch recorded and the root incarnation its record names (``""``: unknown)."""
        newest = self.newest_epoch()
        if not newest:
            return 0, ""
        name = origin_record_name(newest)
        try:
            _, _, root_id = Origin.from_record(self.store.read(name), where=self.store.url(name))
        except (CheckpointError, OSError, ValueError):
            return newest, ""
        return newest, root_id

    def create(self, epoch: int, origin: Origin, writer: str, root_id: str) -> str | None:
        """Record epoch ``epoch``'s origin, claimed by ``writer``, unless a record of that epoch exists. Returns the
        writer of an existing record of another writer (its claim got the same epoch), else None: recorded now, or
        by ``writer`` already (its own create landed, only the response was lost), or not at all (best effort: the
        manifests carry the origin too; logged)."""
        name = origin_record_name(epoch)
        try:
            if self.store.create(name, origin.record(epoch, writer, root_id)):
                return None
            holder = Origin.record_writer(self.store.read(name), where=self.store.url(name))
        except Exception as exc:
            log.warning("could not record the origin of writer epoch %d under %s: %s", epoch, self.store.url(""),
                        exc)
            return None
        return holder if holder != writer else None
