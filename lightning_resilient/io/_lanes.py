"""Running a list of jobs on a pool with at most N of them at a time, results in order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from typing import TypeVar

__all__ = ["map_in_lanes"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def map_in_lanes(pool: Executor, fn: Callable[[_T], _R], items: Sequence[_T], lanes: int) -> list[_R]:
    """``[fn(item) for item in items]``, run on ``pool`` by at most ``lanes`` jobs at once (each takes every
    ``lanes``-th item, in order), whatever the pool's size: a save writes a local disk with fewer threads than an
    object store, from the same pool. The first exception is raised, once every lane has ended."""
    lanes = max(1, min(lanes, len(items)))
    if lanes <= 1:
        return [fn(item) for item in items]

    def lane(first: int) -> list[_R]:
        return [fn(items[i]) for i in range(first, len(items), lanes)]

    futures = [pool.submit(lane, first) for first in range(lanes)]
    wait(futures)
    done = [f.result() for f in futures]
    out: list[_R] = [None] * len(items)  # type: ignore[list-item]
    for first, results in enumerate(done):
        out[first::lanes] = results
    return out
