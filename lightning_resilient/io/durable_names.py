"""What a tiered writer knows of its durable root's catalog without asking the store, and the removals from it that
wait for the store.

ModelCheckpoint asks at every save whether a name exists (for its ``-v1`` version counter), and Lightning removes the
name a new top-k save replaces. With a local tier, neither may wait for a durable store that is down: training goes on
from the local tier. :class:`DurableNames` answers from the names of the durable catalog as this writer last read or
wrote them (read once if never), and keeps a removal the store did not take (an outage) for after the next persist
that succeeds (one of the same name supersedes it). Nothing is lost by the wait: the name stays catalogued, and kept,
a little longer.
"""

from __future__ import annotations

import logging
import threading

from lightning_resilient.errors import StaleWriterError
from lightning_resilient.io.persist_health import PersistHealth
from lightning_resilient.io.retry import is_transient
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["DurableNames"]

log = logging.getLogger(__name__)


class DurableNames:
    """The durable root ``durable``'s checkpoint names as this writer knows them, and its deferred removals;
    ``health`` says whether the store answers."""

    def __init__(self, durable: CheckpointRoot, health: PersistHealth) -> None:
        self.durable = durable
        self._health = health
        self._lock = threading.Lock()
        # The durable catalog's names as this writer last read or wrote them (None: not read yet), so that
        # ModelCheckpoint's "does this name exist" never waits for a store that may be down (:meth:`knows`).
        self._names: set[str] | None = None
        # Lightning's removals of names from the durable tier that the store did not take (an outage), in order:
        # run after the next persist that succeeds (one of the same name supersedes its removal).
        self._deferred: list[str] = []

    def learned(self, names: set[str]) -> None:
        """The durable catalog holds ``names`` (read at a claim)."""
        with self._lock:
            self._names = names

    def knows(self, name: str) -> bool:
        """Whether the durable catalog holds ``name`` as far as this writer knows, without waiting for the store: as
        it last read or wrote it (read once if never; unknown while the store is down: no)."""
        with self._lock:
            names = None if self._names is None else set(self._names)
        if names is None:
            try:
                durable, _ = self.durable.read_pointer()
            except Exception as exc:  # an outage: the local tier answers alone
                log.info("the durable tier %s does not answer (%s): %s is looked up in the local tier only",
                         self.durable.url, exc, name)
                return False
            names = set(durable.checkpoints) if durable is not None else set()
            with self._lock:
                self._names = self._names if self._names is not None else names
        return name in names

    def persisted(self, name: str) -> None:
        """A persist of ``name`` succeeded: the durable catalog holds it, and a removal of it that waited (of an
        older save) is superseded."""
        with self._lock:
            self._deferred = [deferred for deferred in self._deferred if deferred != name]
            if self._names is not None:
                self._names.add(name)

    def remove(self, name: str) -> None:
        """Remove ``name`` from the durable catalog; while the store is down (the last request failed), or when
        this one fails, keep the removal for after the next persist that succeeds instead: each request to a store
        that is down waits out the client's retries, and a queue of them would hold up the persist behind them and
        the end of the fit."""
        if not self._health.unreachable:
            try:
                self.durable.remove(name)
            except StaleWriterError:
                raise
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._health.mark_unreachable()
                log.warning("the durable tier %s does not answer (%s): removing %s from it waits for the next"
                            " persist that succeeds", self.durable.url, exc, name)
            else:
                with self._lock:
                    if self._names is not None:
                        self._names.discard(name)
                return
        with self._lock:
            if name not in self._deferred:
                self._deferred.append(name)

    def run_deferred(self) -> None:
        """After a persist succeeded: the durable removals that waited for the store (see :meth:`remove`)."""
        with self._lock:
            names, self._deferred = self._deferred, []
        for name in names:
            self.remove(name)
