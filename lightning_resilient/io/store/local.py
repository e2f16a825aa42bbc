"""Local (or shared POSIX) disk: the conditional write is an ``flock`` held across read-compare-replace, with a
temp file in the same folder, fsync and ``os.replace``; saves write straight to their unique names and fsync.

:func:`file_lock` is also the node cache's lock (one flock helper for the package).
"""

from __future__ import annotations

import fcntl
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from lightning_resilient.io.store.base import READ_PIECE, Pieces, Store, content_version

__all__ = ["LocalStore", "file_lock"]

_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)


# The descriptors of the flocks this process holds. A fork (a DataLoader's workers, started while a background thread
# holds one) copies them, and an flock belongs to the open file, not to a process: the children would hold it until
# they exit, and the parent's next write of that pointer would wait for them (a training that hangs mid-epoch). The
# child closes its copies at once.
_HELD: set[int] = set()
_HELD_LOCK = threading.Lock()


def _close_inherited_locks() -> None:
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()  # (another thread may have held it at the fork: the child's copy stays taken)
    for fd in list(_HELD):
        with suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


@contextmanager
def file_lock(path: str, mode: int = fcntl.LOCK_EX, *, private: bool = False) -> Iterator[None]:
    """Hold an ``flock`` on the file ``path`` (created if missing) for the block: processes on one host (or one
    POSIX shared filesystem) serialize on it; a process forked meanwhile does not hold it. ``private``: created mode
    0600, never opened through a symlink."""
    flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_NOFOLLOW", 0) if private else 0)
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with _HELD_LOCK:
        _HELD.add(fd)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        with _HELD_LOCK:
            _HELD.discard(fd)
        os.close(fd)  # closing releases the lock


def _usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform says), else the machine's."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


# Writes copying object bytes into the page cache at once, in this process (every root on local disk): half the
# cores, the others for training (see LocalStore.write_threads).
_COPY_SLOTS = max(1, _usable_cores() // 2)
_COPYING = threading.BoundedSemaphore(_COPY_SLOTS)


class LocalStore(Store):
    """Local (or shared POSIX) filesystem: fsync'ed temp file + ``os.replace`` under an ``flock``."""

    supports_cas = True

    def check_fencing(self) -> str | None:
        return None  # the swap is this package's own flock + os.replace

    def write_threads(self, wanted: int) -> int:
        """A local disk takes a save's bytes at the speed of the cores that copy them into the page cache: at most
        half this process's cores copy at once (``_COPYING``), so that a save behind training leaves the loop its
        cores (measured: ``benchmarks/step_time.py``), and twice as many writers as copy slots, so that one
        writer's fsync (the disk's time, no core's) overlaps the next one's copy."""
        return max(1, min(wanted, 2 * _COPY_SLOTS))

    def is_link(self, rel: str) -> bool:
        return os.path.islink(self.path(rel))

    def remove_stale_temp_files(self, rel: str) -> list[str]:
        # A conditional write holds the lock from its temp file's creation to its rename, so a temp file found
        # while holding the lock belongs to a writer that died: it can go. Without the lock, it may be a live one's.
        path = self.path(rel)
        removed = []
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with file_lock(path + ".lock"):
            directory = os.path.dirname(path)
            for name in os.listdir(directory) if os.path.isdir(directory) else []:
                if name.startswith(".tmp-") and name.endswith(f"-{os.path.basename(path)}"):
                    try:
                        os.unlink(os.path.join(directory, name))
                        removed.append(name)
                    except FileNotFoundError:
                        pass
        return removed

    def _write(self, path: str, pieces: Pieces) -> None:
        # Objects of a save are immutable and named uniquely: a crash mid-write leaves a short file in a folder
        # with no manifest, which nothing reads. So no temp file and rename: write, fsync, and the folder is
        # fsynced once (sync_folder) before the manifest refers to it. The pointer goes through write_if.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with _COPYING:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    while len(view):
                        view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_folder(self, rel: str) -> None:
        def sync() -> None:
            try:
                fd = os.open(self.path(rel), os.O_RDONLY)
            except FileNotFoundError:
                return  # nothing written there yet (a save whose data all lives in an earlier commit)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        self._call("sync", rel, sync)

    supports_read_into = True

    def read_into(self, rel: str, start: int, views: list[memoryview]) -> int:
        def read() -> int:
            total = 0
            with open(self.path(rel), "rb", buffering=0) as f:
                pending = [v for v in views if len(v)]
                pos = start
                while pending:
                    got = os.preadv(f.fileno(), pending[:_IOV_MAX], pos)
                    if got <= 0:
                        break  # the file is shorter than the manifest says: the caller's length check catches it
                    total += got
                    pos += got
                    while got and pending:  # drop what was filled; keep the unfilled tail of a partial view
                        if got >= len(pending[0]):
                            got -= len(pending.pop(0))
                        else:
                            pending[0] = pending[0][got:]
                            got = 0
            return total

        return self._call("read", rel, read)

    def _range_pieces(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        buf = bytearray(min(READ_PIECE, max(end - start, 0)))
        with open(path, "rb", buffering=0) as f:
            pos = start
            while pos < end:
                want = min(len(buf), end - pos)
                got = os.preadv(f.fileno(), [memoryview(buf)[:want]], pos)
                if got <= 0:
                    return  # the file is shorter than the manifest says
                yield memoryview(buf)[:got]
                pos += got

    def create(self, rel: str, data: bytes) -> bool:
        # A hard link fails if the name exists: an atomic create-if-absent that leaves nothing beside the object (no
        # lock file, unlike write_if). The temp file lies in the parent folder, so a crash never leaves a stray name
        # among the objects of ``rel``'s folder (an origin record folder is listed by name).
        path = self.path(rel)

        def create() -> bool:
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(os.path.dirname(directory), f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
            finally:
                with suppress(FileNotFoundError):
                    os.unlink(tmp)
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            return True

        return self._call("conditional write", rel, create)

    def write_versioned(self, rel: str, data: bytes, expected: str | None) -> str | None:
        path = self.path(rel)

        def swap() -> str | None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with file_lock(path + ".lock"):
                try:
                    with open(path, "rb") as f:
                        current: str | None = content_version(f.read())
                except FileNotFoundError:
                    current = None
                if current != expected:
                    return None
                _atomic_local_write(path, [memoryview(data)])
                return content_version(data)

        return self._call("conditional write", rel, swap)


def _atomic_local_write(path: str, pieces: Pieces) -> None:
    # Same-folder temp file: os.replace is atomic only within one filesystem, and a crash mid-write must
    # leave either the old object or nothing under the final name, never a torn one.
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable before anyone is told about it
    finally:
        os.close(dir_fd)
