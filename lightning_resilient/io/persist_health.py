"""How the persists of one local tier to its durable root fare: failures in a row, backoff, the outage bounds, the
fatal error a save raises, and the persist status beside the local tier.

A persist that fails (the store is down) never stops training by itself: :class:`PersistHealth` reports it (a warning
at the first failure of an outage, a log line at each later one, and the status ``ls --local-tier`` shows:
:data:`PERSIST_STATUS`, :func:`write_status`, :func:`read_status`) and schedules its retry with a doubling backoff.
Only past a bound (``max_persist_failures`` failures in a row, or ``max_seconds_without_durable`` since the last
durable commit) does it hold a :class:`~lightning_resilient.PersistFailedError` for the next save to raise; a fenced
job's :class:`~lightning_resilient.StaleWriterError` is held the same way, whatever the bounds. It also keeps whether
the durable store answered the last request (:attr:`PersistHealth.unreachable`), so that requests a store that is
down would only time out wait for the backoff instead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from lightning_resilient._warnings import warn
from lightning_resilient.errors import PersistFailedError
from lightning_resilient.io.async_save import raise_from_background
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.retry import is_transient
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["PERSIST_STATUS", "PersistHealth", "read_status", "write_status"]

log = logging.getLogger(__name__)

#: Beside a local tier root: the persist status of the job writing it (``ls --local-tier`` shows it).
PERSIST_STATUS = ".lightning_resilient/persist.json"
_MAX_RETRY_DELAY = 600.0  # the longest wait before a failed persist is tried again
_FROM_BACKGROUND = "raised by a background persist to the durable tier; the durable tier keeps its previous checkpoint"


class PersistHealth:
    """The failures, backoff and bounds of the persists from ``local`` to the durable root ``durable_url`` (see the
    module docstring). ``retry_delay``: the first backoff after a failed persist; it doubles per failure in a row."""

    def __init__(self, durable_url: str, local: CheckpointRoot, *, max_persist_failures: int | None = None,
                 max_seconds_without_durable: float | None = None, retry_delay: float = 10.0) -> None:
        self.durable_url = durable_url
        self.local = local
        self.max_persist_failures = max_persist_failures
        self.max_seconds_without_durable = max_seconds_without_durable
        self.retry_delay = retry_delay
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # fatal: raised by the next save (a fenced job, a bound passed)
        # Failed persists in a row, the last one's error, since when they fail, when the next retry is due, and when
        # this writer last had a checkpoint made durable (or first asked for one).
        self._failures = 0
        self._failure: BaseException | None = None
        self._failing_since: float | None = None
        self._retry_at = 0.0
        self._durable_at: float | None = None
        self._unreachable = False  # the durable store failed the last request this writer sent it (cleared on success)

    def saved(self) -> bool:
        """A save was committed to the local tier (the clock of ``max_seconds_without_durable`` starts with the first):
        whether a failed persist is due for its retry (its backoff has passed)."""
        with self._lock:
            retry = self._failures > 0 and time.monotonic() >= self._retry_at
            if self._durable_at is None:
                self._durable_at = time.time()
        return retry

    def backing_off(self) -> bool:
        """Whether the store failed the last persist and its backoff has not passed: another persist now would wait
        out the client's retries only to fail too."""
        with self._lock:
            return self._unreachable and time.monotonic() < self._retry_at

    def succeeded(self) -> int:
        """A persist succeeded: the failures, the clock and a bound's error not raised yet are reset, and the store
        answers. Returns how many persists had failed in a row before it."""
        with self._lock:
            recovered, self._failures, self._failure, self._failing_since = self._failures, 0, None, None
            self._durable_at = time.time()
            if isinstance(self._error, PersistFailedError):  # the store is back before a save raised it
                self._error = None
            self._unreachable = False
        return recovered

    def failed(self, entry: Entry, exc: BaseException) -> None:
        """The persist of ``entry`` failed (after the store's own retries): report it, schedule its retry, check the
        bounds."""
        now = time.time()
        with self._lock:
            self._unreachable = is_transient(exc)
            self._failures += 1
            self._failure = exc
            self._failing_since = self._failing_since or now
            failures = self._failures
            delay = min(self.retry_delay * 2 ** (failures - 1), _MAX_RETRY_DELAY)
            self._retry_at = time.monotonic() + delay
        self.status("failed", entry, exc)
        message = (f"persisting {entry.commit} (step {entry.step}) to the durable tier {self.durable_url} failed"
                   f" ({failures} in a row): {exc}. Training goes on from the local tier; the newest state is"
                   f" persisted again at the first save after {delay:.0f} s")
        log.warning(message)
        if failures == 1:  # once per outage: each later failure is logged
            warn(message, RuntimeWarning)
        self.check_bounds()

    def mark_unreachable(self) -> None:
        """A request to the durable store failed with a transient error (a removal): it is taken to be down until a
        persist succeeds."""
        with self._lock:
            self._unreachable = True

    @property
    def unreachable(self) -> bool:
        """Whether the durable store failed the last request this writer sent it (an outage, until a persist
        succeeds)."""
        with self._lock:
            return self._unreachable

    @property
    def failures(self) -> int:
        """Persists that failed in a row (0 once one succeeds)."""
        return self._failures

    def check_bounds(self) -> None:
        """Past ``max_persist_failures`` failed persists in a row, or ``max_seconds_without_durable`` without a
        durable commit while persists fail: the next save raises (the durable tier is too far behind to go on)."""
        with self._lock:
            if self._error is not None or self._failure is None:
                return
            failures, since = self._failures, self._durable_at
            limit = self.max_persist_failures
            seconds = self.max_seconds_without_durable
            why = None
            if limit is not None and failures >= limit:
                why = f"{failures} persists in a row failed (max_persist_failures={limit})"
            elif seconds is not None and since is not None and time.time() - since > seconds:
                why = (f"no checkpoint was made durable for {time.time() - since:.3g} s"
                       f" (max_seconds_without_durable={seconds:g})")
            if why is None:
                return
            error = PersistFailedError(
                f"the durable tier {self.durable_url} does not take checkpoints: {why}; the last failure:"
                f" {self._failure}. The local tier {self.local.url} holds the newest checkpoints (resume from it on"
                " this node); fix the store, or raise the bound, and resume.")
            error.__cause__ = self._failure
            self._error = error

    def fatal(self, error: BaseException) -> None:
        """Hold ``error`` (a fenced job's) for the next save to raise, unless one is held already."""
        with self._lock:
            self._error = self._error or error

    def raise_error(self) -> None:
        """Raise a fatal error of a background persist (a fenced job, a bound passed): what a save raises."""
        with self._lock:
            error, self._error = self._error, None
        raise_from_background(error, _FROM_BACKGROUND)

    def raise_failure(self) -> None:
        """Raise a fatal error, else the failure of the last persist if it failed: what a caller that waits for the
        durable tier (the end of a fit, an emergency save, :meth:`AtomicCheckpointIO.wait`) must hear."""
        self.raise_error()
        with self._lock:
            failure = self._failure
        raise_from_background(failure, _FROM_BACKGROUND)

    def status(self, state: str, entry: Entry, error: BaseException | None = None) -> None:
        """Record the persist status beside the local tier (``ls --local-tier`` shows it): never fails a save."""
        with self._lock:
            error = error if error is not None else self._failure  # a retry pending: the failure it retries
            status = {"state": state, "commit": entry.commit, "step": entry.step, "at": time.time(),
                      "failures": self._failures, "failing_since": self._failing_since,
                      "error": f"{type(error).__name__}: {error}" if error is not None else None,
                      "durable": self.durable_url}
        try:
            write_status(self.local, status)
        except OSError as exc:
            log.debug("could not record the persist status: %s", exc)


def write_status(local: CheckpointRoot, status: dict[str, Any]) -> None:
    """Replace the persist status beside ``local`` (a local folder): written whole, then renamed over the old one."""
    path = local.store.path(PERSIST_STATUS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def read_status(local: CheckpointRoot) -> dict[str, Any] | None:
    """The persist status beside ``local``, or None when no job recorded one (or it cannot be read)."""
    try:
        raw = json.loads(local.store.read(PERSIST_STATUS))
    except (FileNotFoundError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
