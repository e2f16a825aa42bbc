"""Background saves: the training loop waits only for a copy of the tensors into a reusable host buffer.

At most one save is in flight, because the next one reuses the same snapshot buffer: a save that finds the
previous one still uploading waits for it, and that wait is measured. The exception is a second save of the
same state (``ModelCheckpoint(save_last=True)`` right after a top-k save): it shares the buffer as it is and
queues behind the first, without waiting. The pointer moves when the upload has
completed (it is the last step of the background commit), so a crash or an error mid-upload leaves the
previous checkpoint latest. An error is never lost: it is raised by the next save, the next removal or load,
and by teardown, which also waits for the last save.

Removals that Lightning asks for right after a save (top-k rotation) run behind that save, and are dropped if
it failed: the checkpoint being replaced is only deleted once its replacement is committed.

Lightning's own ``AsyncCheckpointIO`` wrapped around the plugin is the other way to save in the background
(:class:`WrappedSaves`): it runs the plugin's saves on its one worker thread, while the removals reach the plugin on
the Trainer's thread, straight through the wrapper. The same rule holds there: each removal is queued on that worker
behind the saves submitted before it, and dropped if one of them failed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lightning_resilient.io import layout
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["AsyncSaver", "SaveStats", "WrappedSaves", "raise_from_background"]

log = logging.getLogger(__name__)


@dataclass
class SaveStats:
    """Timings of one save, in seconds. ``blocked`` is what the training loop waited for."""

    name: str
    step: int
    bytes: int = 0
    blocked: float = 0.0  # the whole save_checkpoint call
    waited: float = 0.0  # of which: waiting for the previous async save to finish
    snapshot: float = 0.0  # of which: copying tensors into the snapshot buffer (async) / nothing (sync)
    upload: float | None = None  # upload + commit; None while in flight
    committed: bool = False
    asynchronous: bool = False


def raise_from_background(error: BaseException | None, note: str) -> None:
    """Raise ``error`` (if any), an exception a background thread recorded: the original one (a StaleWriterError
    stays one), with ``note`` saying where it came from, added once."""
    if error is None:
        return
    if note not in getattr(error, "__notes__", []) and hasattr(error, "add_note"):
        error.add_note(note)
    raise error


class AsyncSaver:
    """One background commit at a time, for one :class:`~lightning_resilient.AtomicCheckpointIO`."""

    def __init__(self, *, pin_memory: bool) -> None:
        self.snapshot = layout.Snapshot(pin_memory=pin_memory)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lightning_resilient-async")
        return self._pool

    def save(self, root: CheckpointRoot, checkpoint: dict[str, Any], name: str, stats: SaveStats, *,
             reported: list[str] | None = None) -> None:
        """Snapshot ``checkpoint`` and commit it in the background; returns once training may go on (``reported``:
        see :meth:`CheckpointRoot.prepare`)."""
        started = time.perf_counter()
        self.raise_error()
        waited: list[float] = []

        def before_fill() -> None:
            # The snapshot buffer is about to be overwritten: the uploads still reading it must finish first.
            t0 = time.perf_counter()
            self.wait()
            self.raise_error()
            waited.append(time.perf_counter() - t0)

        prepared = root.prepare(checkpoint, name, snapshot=self.snapshot, before_fill=before_fill, reported=reported)
        stats.bytes = prepared.total + len(prepared.skeleton)
        stats.waited = sum(waited)
        stats.snapshot = time.perf_counter() - started - stats.waited
        stats.asynchronous = True

        def commit() -> None:
            t0 = time.perf_counter()
            try:
                root.commit(prepared)
            except BaseException as exc:
                with self._lock:
                    self._error = self._error or exc
                log.error("background save of %s failed; the previous checkpoint stays latest: %s",
                          root.store.url(name), exc)
                raise
            finally:
                stats.upload = time.perf_counter() - t0
            stats.committed = True

        self._pending = self._executor().submit(commit)

    def after_pending(self, action: Callable[[], None], what: str) -> None:
        """Run ``action`` once the save in flight is committed; drop it if that save failed."""
        if self._pending is None or self._pending.done():
            self.raise_error()
            action()
            return

        def guarded() -> None:
            with self._lock:
                failed = self._error is not None
            if failed:
                log.warning("not running %s: the save before it failed", what)
                return
            try:
                action()
            except BaseException as exc:
                with self._lock:
                    self._error = self._error or exc
                raise

        self._pending = self._executor().submit(guarded)

    def wait(self) -> None:
        """Block until nothing is in flight (errors are kept for :meth:`raise_error`)."""
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(BaseException):  # recorded by the job itself
                pending.result()
            self._pending = None

    def raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        raise_from_background(error, "raised by a background (async) checkpoint save or removal; nothing of it was"
                                     " committed")

    def close(self) -> None:
        """Wait for the last save, stop the thread, and raise any error not raised yet."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        self.raise_error()


def _nothing() -> None:
    pass


class WrappedSaves:
    """The saves Lightning's ``AsyncCheckpointIO`` (``wrapper``) runs for the plugin on its worker thread, and the
    removals that must follow them.

    Lightning's wrapper hands each save to a one-thread executor and returns at once; ``ModelCheckpoint`` then asks
    for the removal of the checkpoint the new save replaces, and the wrapper passes that call straight to the plugin,
    on the Trainer's thread, without waiting. Run there, a removal may come before the save it follows has even
    started on the worker: the name is not committed yet (the removal does nothing, and the save then commits a
    checkpoint ModelCheckpoint believes deleted), or both find the root unclaimed. Queued on the wrapper's executor
    instead, it runs after every save submitted before it has returned (committed; with the plugin's own
    ``async_save``, queued behind that commit in turn). The order is the Trainer thread's own order of calls, one
    executor thread runs them first in, first out, so no timing of the two threads can reorder them. A removal that
    would follow a failed save is dropped (the wrapper raises that save's error at the next save and at teardown).

    A removal's own error is kept and raised by the plugin's next save (the wrapper raises it on the Trainer's thread
    at the save after), load, ``wait`` and ``teardown``. The executor exists from the wrapper's first save to its
    ``teardown``, which waits for it; without one, no save of the wrapper is in flight and a removal runs at once.
    """

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = weakref.ref(wrapper)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._failed = False  # a save on the worker failed: the removals queued behind it are dropped
        self._running = threading.local()  # ``job`` is set in a thread while it runs a save or a removal of the queue

    def wraps_for(self, wrapper: Any) -> bool:
        return self._wrapper() is wrapper

    def _queue(self) -> Executor | None:
        """The wrapper's executor (``AsyncCheckpointIO._executor``: made at its first save, dropped at its teardown
        once it has finished), or None when it has none now."""
        executor = getattr(self._wrapper(), "_executor", None)
        return executor if isinstance(executor, Executor) else None

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around one save the wrapper runs: raise a removal's error first; a failure drops the removals behind it."""
        self._running.job = True
        try:
            self.raise_error()
            yield
        except BaseException:
            with self._lock:
                self._failed = True
            raise
        finally:
            self._running.job = False

    def after_saves(self, action: Callable[[], None], what: str) -> None:
        """Run ``action`` (``what``: for messages) after every save the wrapper was handed before this call."""
        queue = self._queue()
        if queue is None:
            self.raise_error()
            action()
            return

        def guarded() -> None:
            with self._lock:
                failed = self._failed
            if failed:
                log.warning("not running %s: a checkpoint save before it failed", what)
                return
            self._running.job = True
            try:
                action()
            except BaseException as exc:  # the executor's future is never read: kept, raised by the plugin
                log.error("%s raised %s: %s", what, type(exc).__name__, exc)
                with self._lock:
                    self._error = self._error or exc
            finally:
                self._running.job = False

        queue.submit(guarded)

    def drain(self) -> None:
        """Wait until what the wrapper was handed so far (saves, and the removals queued behind them) has run."""
        queue = self._queue()
        if queue is None or getattr(self._running, "job", False):
            return  # (called by a job of the queue itself: the jobs before it have run, the rest would wait for it)
        with contextlib.suppress(RuntimeError):  # shut down meanwhile: by its teardown, which waited for it
            queue.submit(_nothing).result()

    def raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        raise_from_background(error, "raised by a checkpoint removal queued behind Lightning's AsyncCheckpointIO saves")
