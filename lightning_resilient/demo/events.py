"""``AnnouncingCheckpointIO``: AtomicCheckpointIO that tells the demo driver what it is doing.

The driver kills the training job in the middle of a checkpoint upload; to aim, it needs to see saves begin,
objects land and commits complete. Events go, one line each, to the file descriptor named by
``LR_DEMO_EVENTS_FD`` (a pipe from the driver); without it the class is a plain ``AtomicCheckpointIO``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, TextIO

from typing_extensions import override

from lightning_resilient.io import AtomicCheckpointIO
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.root import CheckpointRoot, Prepared

__all__ = ["AnnouncingCheckpointIO", "announce"]

_stream: TextIO | None = None
_lock = threading.Lock()


def announce(kind: str, *fields: object) -> None:
    """Send one event line (``@kind field ...``) to the driver, if one is listening."""
    global _stream
    fd = os.environ.get("LR_DEMO_EVENTS_FD")
    if not fd:
        return
    with _lock:
        if _stream is None:
            _stream = os.fdopen(int(fd), "w", buffering=1)
        _stream.write(" ".join([f"@{kind}", *(str(f) for f in fields)]) + "\n")
        _stream.flush()


# The roots whose saves are announced already (a root is opened once per URL, and again after a new fit reopens it).
_ANNOUNCING: weakref.WeakSet[CheckpointRoot] = weakref.WeakSet()


class AnnouncingCheckpointIO(AtomicCheckpointIO):
    """An :class:`~lightning_resilient.AtomicCheckpointIO` that reports saves, stored objects, commits and loads.

    It takes the same arguments; only the demo needs it (its config names it where yours names
    ``lightning_resilient.AtomicCheckpointIO``).
    """

    @override
    def root(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> CheckpointRoot:
        root = super().root(url, storage_options)
        if root not in _ANNOUNCING:
            store, write_pieces, commit = root.store, root.store.write_pieces, root.commit

            def announced_write(rel: str, pieces: Any) -> None:
                write_pieces(rel, pieces)
                announce("object", rel)

            def announced_commit(prepared: Prepared, **options: Any) -> Entry:
                started = time.perf_counter()
                entry = commit(prepared, **options)
                announce("commit", prepared.step, prepared.name, f"{time.perf_counter() - started:.4f}")
                return entry

            store.write_pieces = announced_write  # type: ignore[method-assign]
            root.commit = announced_commit  # type: ignore[method-assign]
            _ANNOUNCING.add(root)
        return root

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        announce("save-begin", checkpoint.get("global_step"), path)
        super().save_checkpoint(checkpoint, path, storage_options)
        announce("save-end", checkpoint.get("global_step"), f"{self.save_stats[-1].blocked:.4f}")

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        loaded = self.last_load.commit if self.last_load is not None else None  # the commit a root resolved to
        announce("load", f"{str(path).rstrip('/')}/{loaded}" if loaded and loaded not in str(path) else path,
                 checkpoint.get("global_step"))
        return checkpoint

    @override
    def teardown(self) -> None:
        super().teardown()
        stats = list(self.save_stats)
        announce("teardown", len(stats), f"{sum(s.blocked for s in stats):.4f}",
                 f"{sum(s.upload or 0.0 for s in stats):.4f}")
