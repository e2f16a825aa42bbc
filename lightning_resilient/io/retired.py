"""What one process deleted of the folders a root's pointer records as retired (``retention.py`` says when a
folder is retired and when it may be deleted).

The pointer records every retired folder until one of its writers has deleted it; :class:`RetiredDeletions` keeps
what this process deleted, so that its next pointer update drops those records, and which retired folders'
manifests it deleted when it retired them, so that the folder's deletion does not ask for them again. It is shared
by the writer's thread and the thread that deletes behind a commit (``CheckpointRoot.finish_later``), hence its
lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import Pointer
from lightning_resilient.io.store import Store

__all__ = ["RetiredDeletions"]

log = logging.getLogger(__name__)


class RetiredDeletions:
    """See the module docstring."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._deleted: set[str] = set()  # retired folders deleted: their records leave the pointer at its next update
        self._manifests: set[str] = set()  # retired folders whose manifest this process deleted on retiring them

    def deleted(self, folders: Iterable[str]) -> None:
        """Retired folders this process has deleted: their records leave the pointer at its next update."""
        with self._lock:
            self._deleted.update(folders)

    @property
    def any(self) -> bool:
        """Whether a deleted folder's record is still to leave the pointer."""
        with self._lock:
            return bool(self._deleted)

    def manifest_removed(self, folder: str) -> bool:
        """Whether this process deleted the manifest of the retired ``folder`` (when it retired it)."""
        with self._lock:
            return folder in self._manifests

    def remove_manifests(self, folders: Iterable[str]) -> None:
        """Delete the manifests of ``folders``, just retired. A retired folder stops being a checkpoint at once (its
        manifest goes now; a reader already reading it keeps its data until the next commit), so that a pointer
        rebuilt after a loss never takes it for a live checkpoint again. Never raises: a manifest left is deleted
        with its folder."""
        for folder in sorted(folders):
            try:
                self.store.remove_object(f"{folder}/{MANIFEST_NAME}")  # one object: one request (no listing, no stat)
            except Exception as exc:
                log.warning("could not delete %s: %s", self.store.url(f"{folder}/{MANIFEST_NAME}"), exc)
                continue
            with self._lock:
                self._manifests.add(folder)

    def manifest_written(self, folder: str) -> None:
        """``folder`` has a manifest again (published anew): its deletion deletes it first."""
        with self._lock:
            self._manifests.discard(folder)

    def prune(self, new: Pointer) -> None:
        """Drop from ``new`` (a pointer about to be written) the records of the folders this process deleted."""
        with self._lock:
            for folder in self._deleted & set(new.retired):
                del new.retired[folder]

    def written(self, base: Pointer, new: Pointer) -> None:
        """``new`` replaced ``base``: forget the deletions whose records it dropped, and the manifests of folders
        no longer retired (a folder referenced again may have a manifest again)."""
        with self._lock:
            self._deleted -= set(base.retired) - set(new.retired)
            self._manifests &= set(new.retired)
