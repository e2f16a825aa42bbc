"""Lines a child process writes to a pipe, read as they come by a thread of their own.

The caller never blocks on the pipe (it waits for a line it wants, with a timeout) and the child never blocks on a
full one. Used by the demo (its training job's events) and by the tests that SIGKILL a training child at an
instant chosen from what it printed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TextIO, TypeVar

__all__ = ["LineReader"]

T = TypeVar("T")


class LineReader(Generic[T]):
    """Every line of ``stream``, as ``parse(line)`` (``on_item`` is called with each, in the reading thread), until
    the stream closes (the child exited or closed it)."""

    def __init__(self, stream: TextIO, parse: Callable[[str], T],
                 on_item: Callable[[T], None] | None = None) -> None:
        self._items: list[T] = []
        # Reentrant: a test given to wait_for may itself look at items().
        self._cond = threading.Condition(threading.RLock())
        self._thread = threading.Thread(target=self._pump, args=(stream, parse, on_item), daemon=True,
                                        name="line-reader")
        self._thread.start()

    def _pump(self, stream: TextIO, parse: Callable[[str], T], on_item: Callable[[T], None] | None) -> None:
        try:
            with stream:
                for line in stream:
                    item = parse(line)
                    if on_item is not None:
                        on_item(item)
                    with self._cond:
                        self._items.append(item)
                        self._cond.notify_all()
        finally:
            with self._cond:
                self._cond.notify_all()  # closed: a waiter stops waiting

    def items(self) -> list[T]:
        """What was read so far, in order."""
        with self._cond:
            return list(self._items)

    @property
    def closed(self) -> bool:
        """The stream has ended and every line of it is in :meth:`items`."""
        return not self._thread.is_alive()

    def wait_for(self, test: Callable[[T], bool], timeout: float) -> T | None:
        """The first item read (so far or from now on) for which ``test`` is true; None when the stream ends, or
        ``timeout`` seconds pass, without one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for item in self._items:
                    if test(item):
                        return item
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self._cond.wait(min(left, 0.5))

    def join(self, timeout: float | None = None) -> None:
        """Wait until the stream has ended (after the child exits)."""
        self._thread.join(timeout)
