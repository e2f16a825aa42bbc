"""The durable work of a local tier, run in order behind training: one background thread per :class:`PersistQueue`.

A tiered root (``io/tiered.py``) queues each persist to the durable tier and each of Lightning's removals from it
here, so that a removal never overtakes the persist queued before it (a persist would resurrect the name). The thread
starts with the first job and ends when the queue is empty (nothing lingers between persists), and is not a daemon:
an interpreter that exits normally first finishes the persists it queued. A job that meets a
:class:`~lightning_resilient.StaleWriterError` (a newer job claimed the durable root) hands it to the owner, which
raises it at its next save; any other error of a job is logged (a removal from a store that is down). The queue also
keeps when the durable work last moved, so that the end of a fit can wait for a slow store as long as it moves and
give up on one that stopped answering (:meth:`PersistQueue.wait` with ``stall``, then :meth:`PersistQueue.abandon`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from lightning_resilient.errors import StaleWriterError

__all__ = ["PersistQueue"]

log = logging.getLogger(__name__)


class PersistQueue:
    """Jobs on the durable tier (persists, removals), run one after another in a background thread.

    ``on_stale`` gets the :class:`~lightning_resilient.StaleWriterError` of a job: the owner's fatal error.
    """

    def __init__(self, on_stale: Callable[[BaseException], None]) -> None:
        self._on_stale = on_stale
        self._lock = threading.Lock()
        self._jobs: deque[tuple[Callable[[], None], str]] = deque()
        self._thread: threading.Thread | None = None
        self._progress_at = time.monotonic()  # when the durable work last moved (see wait's stall)

    def submit(self, job: Callable[[], None], what: str) -> None:
        """Run ``job`` after the jobs queued before it, in one background thread that ends when the queue is empty
        (so nothing lingers between persists), and is not a daemon: an interpreter that exits normally first
        finishes the persists it queued. ``what`` names the job in messages."""
        with self._lock:
            self._jobs.append((job, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="lightning_resilient-persist")
                self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job, what = self._jobs.popleft()
                self._progress_at = time.monotonic()
            try:
                job()
            except StaleWriterError as exc:  # a newer job claimed the durable root: this one must stop
                self._on_stale(exc)
                log.error("%s failed; the durable tier keeps its previous checkpoint: %s", what, exc)
            except Exception as exc:  # a removal from a store that is down: it stays in the durable catalog for now
                log.warning("%s failed (training goes on; the durable tier's retention catches up later): %s",
                            what, exc)

    def progress(self) -> None:
        """The job running made progress (an object copied): a stalled wait counts from now."""
        with self._lock:
            self._progress_at = time.monotonic()

    def wait(self, *, stall: float | None = None) -> bool:
        """Block until every queued job has run (their errors are the owner's, see ``on_stale``); True. With
        ``stall``: False as soon as none of them made progress (started, copied an object, ended) for that many
        seconds."""
        while True:
            with self._lock:
                thread, progress = self._thread, self._progress_at
            if thread is None:
                return True
            if stall is None:
                thread.join()
                continue
            thread.join(timeout=min(1.0, stall))
            with self._lock:
                progress = max(progress, self._progress_at)
            if thread.is_alive() and time.monotonic() - progress > stall:
                return False

    def abandon(self, durable_url: str) -> None:
        """Give up the durable work still queued (the end of a fit whose store ``durable_url`` stopped answering):
        the job running ends with its request (the client's own timeouts); what was queued behind it is dropped, its
        holds left to the next job's adoption of the local tier."""
        with self._lock:
            dropped, self._jobs = list(self._jobs), deque()
        for _, what in dropped:
            log.warning("not waiting for the %s: the durable tier %s does not answer", what, durable_url)
