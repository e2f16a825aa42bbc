"""Running a list of jobs on a pool with at most N of them at a time, results in order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from typing import TypeVar

__all__ = ["map_in_lanes"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def map_in_lanes(pool: Executor, fn: Callable[[_T], _R], items: Sequence[_T], lanes: int) -> list[_R]:
    """``[fn(item) for item in items]``, run on ``pool`` by at most ``lanes`` jobs at once, whatever the pool's size: a
    save writes a local disk with fewer threads than an object store, from the same pool.

    Each lane takes the next item no lane has taken yet, so a slow upload holds back no other (a store that answers
    one request late, the last objects of a save). After an error no lane starts another item; the first error (in
    item order) is raised once every lane has ended."""
    lanes = max(1, min(lanes, len(items)))
    if lanes <= 1:
        return [fn(item) for item in items]
    out: list[_R] = [None] * len(items)  # type: ignore[list-item]
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    taken = 0

    def lane() -> None:
        nonlocal taken
        while True:
            with lock:
                if errors or taken == len(items):
                    return
                index, taken = taken, taken + 1
            try:
                out[index] = fn(items[index])
            except BaseException as exc:
                with lock:
                    errors[index] = exc
                return

    futures = [pool.submit(lane) for _ in range(lanes)]
    wait(futures)
    for future in futures:
        future.result()  # (a lane itself never raises: its errors are kept above)
    if errors:
        raise errors[min(errors)]
    return out
