"""fsspec ``memory://``: the store is process-global, so a process-wide lock makes the conditional write atomic."""

from __future__ import annotations

import threading

from lightning_resilient.io.store.base import Store, content_version

__all__ = ["MemoryStore"]

_memory_lock = threading.Lock()


class MemoryStore(Store):
    """fsspec ``memory://``: process-global, so a process-global lock makes the swap atomic."""

    supports_cas = True

    def check_fencing(self) -> str | None:
        return None  # the swap is this package's own process-wide lock

    def write_versioned(self, rel: str, data: bytes, expected: str | None) -> str | None:
        path = self.path(rel)

        def swap() -> str | None:
            with _memory_lock:
                try:
                    current: str | None = content_version(self.fs.cat_file(path))
                except FileNotFoundError:
                    current = None
                if current != expected:
                    return None
                self.fs.pipe_file(path, data)
                return content_version(data)

        return self._call("conditional write", rel, swap)
