"""The storage interface the checkpoint protocol sees, and the generic fsspec backend behind it.

Everything above the store package sees one small interface (:class:`Store`): read and write whole objects, list a
folder, delete, and a compare-and-swap write (``write_if``) for the pointer. This generic class serves any fsspec
filesystem without a conditional write that we know of: ``write_if`` is last-writer-wins, with a one-time warning
that writer fencing is off. The backends that enforce the swap subclass it, one module each (``local``,
``memory``, ``s3``, ``gcs``).

Every call goes through :class:`~lightning_resilient.io.retry.RetryPolicy`, and backend errors are mapped (in
``errors.py``) to built-in exceptions whose messages name the URL and what to fix.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import fsspec

from lightning_resilient._warnings import warn
from lightning_resilient.io.paths import join
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store.errors import translate_error

__all__ = ["Conditions", "ObjectInfo", "PROTOCOL_DIR", "Pieces", "READ_PIECE", "Store", "content_version",
           "probe_fencing", "probe_write"]

log = logging.getLogger(__name__)
T = TypeVar("T")
Pieces = list[memoryview]
Consume = Callable[[Iterable[memoryview]], T]

# Ranged reads hand their bytes on in pieces of this size, so a read in flight holds one piece, not its range.
READ_PIECE = 4 * 2**20

_warned_no_cas: set[str] = set()
_warned_lock = threading.Lock()

#: Under the root, the folder for the protocol's own objects other than the pointer (probes, ...). Listings of
#: the root skip dot-names, so nothing in it is ever taken for a checkpoint.
PROTOCOL_DIR = ".lightning_resilient"


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says of one stored object: its size, and when the store last wrote it (the store's clock).

    ``size`` is None when the listing does not say (a static HTTP server's folder listing): unknown, never 0
    (:meth:`Store.size` asks the store for it)."""

    size: int | None
    modified: float | None


def _timestamp(detail: dict[str, Any]) -> float | None:
    """The store's modification time in a listing entry, whatever the backend calls it."""
    for key in ("mtime", "LastModified", "updated", "created", "timeCreated"):
        value = detail.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def content_version(data: bytes) -> str:
    """The version token of a store whose conditional write compares contents (local disk, ``memory://``)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Conditions:
    """How a store words its conditional writes, for messages: the create-only condition, the replace condition,
    and what the version is called (S3: ``If-None-Match: *``, ``If-Match``, ETag; GCS: ``ifGenerationMatch=0``,
    ``ifGenerationMatch``, generation)."""

    create: str
    replace: str
    version: str


def _joined(pieces: Pieces) -> bytes | memoryview:
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class Store:
    """Generic fsspec backend: no conditional write, so ``write_if`` is last-writer-wins."""

    supports_cas = False
    #: How the store words its conditional writes (messages about them); None: it has none, or they need no words.
    conditions: Conditions | None = None

    def __init__(self, fs: fsspec.AbstractFileSystem, root_url: str, root_path: str, retry: RetryPolicy) -> None:
        self.fs = fs
        self.root_url = root_url
        self.root_path = root_path
        self.retry = retry

    # -- helpers ------------------------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """Backend path of a root-relative object."""
        return join(self.root_path, rel) if rel else self.root_path

    def url(self, rel: str = "") -> str:
        return join(self.root_url, rel) if rel else self.root_url

    def endpoint(self) -> str | None:
        """The server this store's client talks to where the URL does not say it (an S3-compatible server, an
        emulator), else None: two roots of one URL on two servers are two roots (a node's spool of their attempt
        records keeps them apart)."""
        return None

    def _call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        try:
            return self.retry.call(f"{what} {self.url(rel)}", fn)
        except Exception as exc:
            raise translate_error(exc, self.url(rel), what) from exc

    # -- plain objects -----------------------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        data: bytes = self._call("read", rel, lambda: self.fs.cat_file(self.path(rel)))
        return data

    def read_range(self, rel: str, start: int, end: int, consume: Consume[T]) -> T:
        """Read bytes ``[start, end)`` of ``rel`` and pass them, as consecutive pieces, to ``consume``.

        A retry re-runs ``consume`` over a fresh stream, so it must not depend on an earlier, failed attempt
        (writing each piece at its absolute offset is fine). An object shorter than ``end`` yields fewer
        bytes; the caller's checksum catches that.
        """
        return self._call("read", rel, lambda: consume(self._range_pieces(self.path(rel), start, end)))

    def _range_pieces(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        if end > start:
            yield memoryview(self.fs.cat_file(path, start=start, end=end))

    def write(self, rel: str, data: bytes | bytearray | memoryview) -> None:
        """Write an immutable object (its name is unique to one save, so a retry rewrites the same bytes)."""
        self.write_pieces(rel, [memoryview(data)])

    def sync_folder(self, rel: str) -> None:
        """Make the objects written under ``rel`` durable before anything refers to them (local disk only)."""

    def write_threads(self, wanted: int) -> int:
        """How many objects of one save (or persist) to write at once, of the ``wanted`` (``max_concurrency``): an
        object store's requests wait on the network, so all of them."""
        return wanted

    # Reading straight into the caller's buffers (no intermediate copy), where the backend can: local disk.
    supports_read_into = False

    def read_into(self, rel: str, start: int, views: list[memoryview]) -> int:
        """Fill ``views`` in order with the object's bytes from ``start``; returns how many bytes were read."""
        raise NotImplementedError

    def write_pieces(self, rel: str, pieces: Pieces) -> None:
        """Write an immutable object whose bytes are ``pieces`` in order, copying them only if the client must."""
        self._call("write", rel, lambda: self._write(self.path(rel), pieces))

    def _write(self, path: str, pieces: Pieces) -> None:
        self.fs.pipe_file(path, _joined(pieces))

    def exists(self, rel: str) -> bool:
        return self._call("stat", rel, lambda: self._exists(self.path(rel)))

    def remove_object(self, rel: str) -> None:
        """Delete one object (never a folder or a prefix of the same name); a missing one is fine."""

        def rm() -> None:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            with suppress(FileNotFoundError):
                self.fs.rm_file(path)

        self._call("delete", rel, rm)

    def move(self, rel: str, to: str) -> None:
        """Move one object (a rename on disk, a copy then a delete on object stores)."""

        def mv() -> None:
            source, target = self.path(rel), self.path(to)
            self.fs.invalidate_cache(source)
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            self.fs.mv(source, target)

        self._call("move", rel, mv)

    def is_link(self, rel: str) -> bool:
        """Whether ``rel`` is a symbolic link (local disk: ``ModelCheckpoint(save_last="link")``); never elsewhere."""
        return False

    def _exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def is_file(self, rel: str) -> bool:
        def isfile() -> bool:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            return bool(self.fs.isfile(path))

        return self._call("stat", rel, isfile)

    def size(self, rel: str) -> int | None:
        """The stored size of ``rel``; None when the store cannot tell."""
        size = self._call("stat", rel, lambda: self.fs.size(self.path(rel)))
        return None if size is None else int(size)

    def root_is_file(self) -> bool:
        """Whether the root URL names a file (an object), not a folder that holds checkpoints."""
        return self.is_file("")

    def _name(self, listed: str) -> str:
        """The name of an entry of a listing (fsspec lists full paths)."""
        return listed.rstrip("/").rsplit("/", 1)[-1]

    def list_dir(self, rel: str) -> list[str]:
        """Names directly under ``rel``; empty when it does not exist."""

        def ls() -> list[str]:
            return sorted({self._name(str(e.get("name", ""))) for e in self._entries(self.path(rel))} - {""})

        return self._call("list", rel, ls)

    def _entries(self, path: str) -> list[dict[str, Any]]:
        """fsspec's detailed listing of the folder ``path``, fresh (not from the filesystem's cache); [] when it
        does not exist."""
        self.fs.invalidate_cache(path)
        try:
            return list(self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return []

    def list_detail(self, rel: str) -> dict[str, ObjectInfo]:
        """The objects directly under ``rel`` (not sub-folders) with their sizes and store timestamps."""

        def ls() -> dict[str, ObjectInfo]:
            out = {}
            for e in self._entries(self.path(rel)):
                name = self._name(str(e.get("name", "")))
                size = e.get("size")
                if name and e.get("type", "file") == "file":
                    out[name] = ObjectInfo(None if size is None else int(size), _timestamp(e))
            return out

        return self._call("list", rel, ls)

    def modified(self, rel: str) -> float | None:
        """When the store last wrote ``rel``, by the store's own clock; None when it does not exist."""

        def info() -> float | None:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            try:
                return _timestamp(self.fs.info(path))
            except FileNotFoundError:
                return None

        return self._call("stat", rel, info)

    def check_fencing(self) -> str | None:
        """Whether this store enforces :meth:`write_if`: None when it does, else what it does not enforce."""
        return f"the {type(self.fs).__name__} filesystem has no conditional write that lightning_resilient knows"

    def remove_stale_temp_files(self, rel: str) -> list[str]:
        """Delete temp files left by interrupted :meth:`write_if` calls on ``rel``; returns their names."""
        return []

    def remove(self, rel: str) -> None:
        """Delete an object or a folder recursively; a missing one is fine."""

        def rm() -> None:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            with suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)

        self._call("delete", rel, rm)

    def abort_stale_uploads(self, older_than: float) -> list[str]:
        """Abort incomplete multipart uploads under the root started before ``older_than``; S3 only."""
        return []

    def bucket_exists(self, bucket: str) -> bool:
        """Whether ``bucket`` exists; missing credentials raise (a clear PermissionError), they are not a "no"."""
        return bool(self._call("stat bucket", "", lambda: self.fs.exists(bucket)))

    # -- the pointer -------------------------------------------------------------------------------------------
    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        """The object's bytes and a version token for :meth:`write_if`, or None when it does not exist."""

        def read() -> tuple[bytes, str] | None:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            try:
                data = self.fs.cat_file(path)
            except (FileNotFoundError, NotADirectoryError):  # a parent that is a file: nothing there either
                return None
            return data, content_version(data)

        return self._call("read", rel, read)

    def create(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if it does not exist (with the store's conditional create); False when it does. A store
        without conditional writes just writes it (see :meth:`write_if`)."""
        return self.write_if(rel, data, None)

    def write_if(self, rel: str, data: bytes, expected: str | None) -> bool:
        """Replace ``rel`` with ``data`` only if its version is still ``expected`` (None: it must not exist).

        Returns False when the condition failed (someone else wrote first); the caller re-reads and retries.
        """
        return self.write_versioned(rel, data, expected) is not None

    def write_versioned(self, rel: str, data: bytes, expected: str | None) -> str | None:
        """:meth:`write_if`, returning the version of what it wrote (the token :meth:`read_versioned` would return
        for it: the writer's next conditional write needs no read first), "" when the store did not say, or None
        when the condition failed. Each store implements this one."""
        key = f"{type(self.fs).__name__}:{self.root_url}"
        with _warned_lock:
            first = key not in _warned_no_cas
            _warned_no_cas.add(key)
        if first:
            warn(f"the {type(self.fs).__name__} filesystem behind {self.root_url!r} has no conditional write that"
                 " lightning_resilient knows how to use: writer fencing is OFF (last writer wins). Two jobs"
                 " writing this root at once can overwrite each other's pointer. Use local disk, S3 or GCS for"
                 " fenced writes.", RuntimeWarning)
        self.write(rel, data)
        return ""  # (no conditional write: nothing to write against next time)


def probe_write(store: Store) -> None:
    """Write a probe object under :data:`PROTOCOL_DIR` and delete it, so that a root this process may not write (a
    read-only folder, credentials that may read but not write) is refused now, in the store's words (``errors.py``:
    folder permissions on local disk, credentials on a cloud store), rather than at the first save. A probe that
    cannot be deleted is a warning: saves work, but retention and ``gc`` will not be able to delete anything."""
    rel = f"{PROTOCOL_DIR}/write-probe-{uuid.uuid4().hex}"
    store.write(rel, b"probe")
    try:
        store.remove_object(rel)
    except Exception as exc:
        warn(f"{store.root_url} can be written but the probe {store.url(rel)} could not be deleted ({exc}):"
             " checkpoints will be saved, but keep_last, Lightning's top-k removals and gc cannot delete"
             " anything there", RuntimeWarning)


def probe_fencing(store: Store, bogus_version: str, conditions: Conditions) -> str | None:
    """Check with a probe object that ``store`` really refuses conditional writes it must refuse.

    A store (or a proxy in front of it) may accept conditional writes and ignore their conditions: both jobs would
    then "fence" each other while both write. Writes a probe under :data:`PROTOCOL_DIR`, then a create of the
    existing object and a replace against a wrong version (both must be refused), and deletes it. Returns None when
    both were refused, else what was not enforced, in the store's own words (``conditions``).
    """
    rel = f"{PROTOCOL_DIR}/fencing-probe-{uuid.uuid4().hex}"
    try:
        if not store.write_if(rel, b"probe 1", None):
            return f"a create-only write ({conditions.create}) of a new object was refused"
        if store.write_if(rel, b"probe 2", None):
            return f"a create-only write ({conditions.create}) replaced an existing object"
        if store.write_if(rel, b"probe 3", bogus_version):
            return f"a replace against a wrong {conditions.version} ({conditions.replace}) was accepted"
        return None
    finally:
        try:
            # One object: a delete request of its own (a recursive remove would list and stat it first, two more
            # round trips in every claim).
            store.remove_object(rel)
        except Exception as exc:  # a leftover probe is harmless: dot-folders are never read as checkpoints
            log.warning("could not delete the fencing probe %s: %s", store.url(rel), exc)
