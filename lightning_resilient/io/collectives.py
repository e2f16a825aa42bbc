"""The collectives this package runs between the processes of a job, named: each waits at most its group's timeout,
and a failure or timeout raises :class:`~lightning_resilient.CollectiveError` saying which rank, in which operation,
and what bounds the wait, instead of torch's bare ``RuntimeError`` (or a hang).

Every group this package makes has an explicit timeout (``AtomicCheckpointIO(collective_timeout=...)``, see
``io/replicas.py``); the few collectives on Lightning's own group (the resume decision, ``io/resume_path.py``) are
bounded by the job's process-group timeout, which the user sets on the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from lightning_resilient.errors import CollectiveError

__all__ = ["named"]


@contextlib.contextmanager
def named(operation: str, rank: int, bound: str) -> Iterator[None]:
    """Run the collective(s) inside as ``operation`` of ``rank``: a failure or a timeout is raised as a
    :class:`~lightning_resilient.CollectiveError` naming both, and ``bound`` (what limits the wait: "collective_timeout
    = 1800 s")."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (DistBackendError) on a timeout or a lost peer
        text = str(exc)
        what = "timed out" if "timed out" in text.lower() or "timeout" in text.lower() else "failed"
        raise CollectiveError(
            f"rank {rank}: {operation} {what} ({bound}): {text.strip().splitlines()[0] if text.strip() else exc!r}. The"
            " job's other processes did not all join it: one of them took another path, ended, or hangs (see their"
            " logs; HangWatchdog dumps a hung rank's stacks). Every process must run the same fit with the same"
            " checkpoint settings.") from exc
