"""Stock Lightning files directly in a root, which a save of the same name replaces.

A root can hold what stock Lightning wrote before this plugin was added: a ``last.ckpt`` file, a
``save_last="link"`` symlink. Stock Lightning overwrites such a file when it saves that name again; a commit of ours
replaces it too, but only once it is committed, so that the file stays a resumable checkpoint until then. A link
holds no data and goes at once. On local disk, where a file and a folder cannot share a name, the file waits in the
dot-folder (``REPLACED_DIR``, where ``find_latest_checkpoint`` still finds it, and from where a failed save puts it
back); on an object store the key and our prefix coexist, and the key is deleted after the commit. Stock files are
found by one listing of the root per process.
"""

from __future__ import annotations

import logging

from lightning_resilient.io.fencing import WriterFence
from lightning_resilient.io.folders import REPLACED_DIR
from lightning_resilient.io.pointer import LEGACY_NAMES
from lightning_resilient.io.retention import Retention
from lightning_resilient.io.store import LocalStore, Store

__all__ = ["StockFiles"]

log = logging.getLogger(__name__)


class StockFiles:
    """The stock files of one root as one writer sees them (see the module docstring)."""

    def __init__(self, store: Store, fence: WriterFence, retention: Retention) -> None:
        self.store = store
        self.fence = fence
        self.retention = retention
        self._stock: set[str] | None = None  # listed at this process's first save
        self._aside: dict[str, str] = {}  # name -> where a save moved its stock file until it commits
        self._leftover: dict[str, str] = {}  # name -> stock file a save that never committed moved aside

    def make_room(self, name: str) -> None:
        """Before a save of ``name``: clear it of what stock Lightning left there, as stock Lightning would overwrite
        it (a link goes; a file goes aside until :meth:`replaced` or :meth:`put_back`)."""
        if self.store.is_link(name):
            self.store.remove_object(name)  # the link, never what it points to
            return
        if self._stock is None:
            self._stock = self._list()
        if name in self._leftover:  # moved aside by a save that never committed: this one replaces it
            self._aside[name] = self._leftover.pop(name)
        if name not in self._stock:
            return
        self._stock.discard(name)
        if isinstance(self.store, LocalStore):
            aside = f"{REPLACED_DIR}/{name}"
            self.store.move(name, aside)
            log.info("moved the stock checkpoint %s aside until a committed save of the same name replaces it",
                     self.store.url(name))
            self._aside[name] = aside
        else:
            self._aside[name] = name

    def _list(self) -> set[str]:
        names = {n for n in self.store.list_detail("") if not n.startswith(".") and n not in LEGACY_NAMES}
        pointer, _ = self.fence.read_pointer()
        committed = set(pointer.checkpoints) if pointer is not None else set()
        for name in self.store.list_detail(REPLACED_DIR):
            if name in committed:  # its replacement committed; the process died before deleting it
                self.store.remove_object(f"{REPLACED_DIR}/{name}")
            else:
                self._leftover[name] = f"{REPLACED_DIR}/{name}"
        return names

    def replaced(self, name: str) -> None:
        """A save of ``name`` committed: the stock file it replaces is deleted."""
        aside = self._aside.pop(name, None)
        if aside is not None:
            self.store.remove_object(aside)

    def put_back(self, name: str) -> None:
        """The save of ``name`` failed: a stock file moved aside for it goes back where it was."""
        aside = self._aside.pop(name, None)
        if aside is None or aside == name:
            return
        try:
            self.retention.tidy_names({name})  # the failed save's now empty name folder, where the file goes back
            self.store.move(aside, name)
        except OSError as exc:  # still in the dot-folder, where find_latest_checkpoint finds it
            log.warning("could not put the stock checkpoint %s back: %s", self.store.url(aside), exc)

    def forget(self, name: str) -> bool:
        """Delete ``name`` when it is a stock Lightning file or link (``remove_checkpoint`` of a path this plugin did
        not write, as stock Lightning deletes it): that one object only, never a checkpoint of ours of that name."""
        if self.store.is_link(name) or self.store.is_file(name):
            self.store.remove_object(name)
            if self._stock is not None:
                self._stock.discard(name)
            return True
        return False
