"""Holds on a local tier's folders: what keeps a local commit from local retention while it is copied.

A persist to the durable tier (from when it is queued), a copy to another node and a sharded save across nodes each
hold the folders of the commit they read (its own and those whose bytes it shares, ``last.ckpt`` and its top-k
twin). :class:`LocalHolds` counts the holds of one local tier per folder and writes a hold into the local pointer
only for a folder's first (``CheckpointRoot.hold``), and its release only once the last is released.
"""

from __future__ import annotations

import logging
import threading

from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["LocalHolds"]

log = logging.getLogger(__name__)


class LocalHolds:
    """The holds on the folders of the local tier root ``local``, counted per folder."""

    def __init__(self, local: CheckpointRoot) -> None:
        self.local = local
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # local folders held (persists, replication), with how many holds each

    def hold(self, entry: Entry, why: str) -> None:
        """Keep ``entry``'s local folders from local retention until :meth:`release` (each hold counted)."""
        with self._lock:
            first = [f for f in entry.folders if not self._held.get(f)]
            for folder in entry.folders:
                self._held[folder] = self._held.get(folder, 0) + 1
        if first:
            self.local.hold(first, why)

    def release(self, entry: Entry) -> None:
        """Drop one hold of ``entry``'s folders; a folder whose last hold goes is released in the local pointer."""
        with self._lock:
            released = []
            for folder in entry.folders:
                self._held[folder] -= 1
                if not self._held[folder]:
                    del self._held[folder]
                    released.append(folder)
        if released:
            try:
                self.local.release(released)
            except Exception as exc:  # the hold is dropped by the next adopt of this local tier at the latest
                log.warning("could not release %s: %s", self.local.store.url(entry.commit), exc)
