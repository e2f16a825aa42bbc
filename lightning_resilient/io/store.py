"""The few storage operations the checkpoint protocol needs, per fsspec backend.

Everything above this module sees one small interface: read and write whole objects, list a folder, delete,
and a compare-and-swap write (``write_if``) for the pointer. Each backend implements the swap with what the
store really enforces:

- local disk: an ``flock`` held across read-compare-replace, temp file in the same folder, fsync, ``os.replace``;
- ``memory://``: a process-wide lock (the memory store is process-global too);
- S3: ``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace (single-part PUT: the pointer is small);
- GCS: ``ifGenerationMatch`` (0 to create);
- anything else: last writer wins, with a one-time warning that writer fencing is off.

Every call goes through :class:`~lightning_resilient.io.retry.RetryPolicy`, and backend errors are mapped to
built-in exceptions whose messages name the URL and what to fix.
"""

from __future__ import annotations

import base64
import bisect
import fcntl
import hashlib
import io
import json
import logging
import os
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import sync
from fsspec.core import url_to_fs

from lightning_resilient.errors import BucketNotFoundError, StoreCredentialsError, StoreSetupError, StoreURLError
from lightning_resilient.io._paths import join, split_protocol
from lightning_resilient.io.retry import RetryPolicy

__all__ = ["GCSStore", "GatherReader", "LocalStore", "MemoryStore", "ObjectInfo", "PROTOCOL_DIR", "S3Store", "Store",
           "check_default_client", "file_lock", "open_store"]

log = logging.getLogger(__name__)
T = TypeVar("T")
Pieces = list[memoryview]
Consume = Callable[[Iterable[memoryview]], T]

# Ranged reads hand their bytes on in pieces of this size, so a read in flight holds one piece, not its range.
READ_PIECE = 4 * 2**20
_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)

_warned_no_cas: set[str] = set()
_warned_lock = threading.Lock()

#: Under the root, the folder for the protocol's own objects other than the pointer (probes, ...). Listings of
#: the root skip dot-names, so nothing in it is ever taken for a checkpoint.
PROTOCOL_DIR = ".lightning_resilient"


@contextmanager
def file_lock(path: str, mode: int = fcntl.LOCK_EX, *, private: bool = False) -> Iterator[None]:
    """Hold an ``flock`` on the file ``path`` (created if missing) for the block: processes on one host (or one
    POSIX shared filesystem) serialize on it. ``private``: created mode 0600, never opened through a symlink."""
    flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_NOFOLLOW", 0) if private else 0)
    fd = os.open(path, flags, 0o600 if private else 0o644)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says of one stored object: its size, and when the store last wrote it (the store's clock)."""

    size: int
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


def _content_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store:
    """Generic fsspec backend: no conditional write, so ``write_if`` is last-writer-wins."""

    supports_cas = False

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

    def _call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        try:
            return self.retry.call(f"{what} {self.url(rel)}", fn)
        except Exception as exc:
            raise _translate(exc, self.url(rel), what) from exc

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

    def size(self, rel: str) -> int:
        return int(self._call("stat", rel, lambda: self.fs.size(self.path(rel))))

    def list_dir(self, rel: str) -> list[str]:
        """Names directly under ``rel``; empty when it does not exist."""

        def ls() -> list[str]:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

        return self._call("list", rel, ls)

    def list_detail(self, rel: str) -> dict[str, ObjectInfo]:
        """The objects directly under ``rel`` (not sub-folders) with their sizes and store timestamps."""

        def ls() -> dict[str, ObjectInfo]:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return {}
            out = {}
            for e in entries:
                name = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
                if name and e.get("type", "file") == "file":
                    out[name] = ObjectInfo(int(e.get("size") or 0), _timestamp(e))
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
            return data, _content_version(data)

        return self._call("read", rel, read)

    def write_if(self, rel: str, data: bytes, expected: str | None) -> bool:
        """Replace ``rel`` with ``data`` only if its version is still ``expected`` (None: it must not exist).

        Returns False when the condition failed (someone else wrote first); the caller re-reads and retries.
        """
        key = f"{type(self.fs).__name__}:{self.root_url}"
        with _warned_lock:
            first = key not in _warned_no_cas
            _warned_no_cas.add(key)
        if first:
            warnings.warn(
                f"the {type(self.fs).__name__} filesystem behind {self.root_url!r} has no conditional write that"
                " lightning_resilient knows how to use: writer fencing is OFF (last writer wins). Two jobs"
                " writing this root at once can overwrite each other's pointer. Use local disk, S3 or GCS for"
                " fenced writes.",
                RuntimeWarning,
                stacklevel=3,
            )
        self.write(rel, data)
        return True


class LocalStore(Store):
    """Local (or shared POSIX) filesystem: fsync'ed temp file + ``os.replace`` under an ``flock``."""

    supports_cas = True

    def check_fencing(self) -> str | None:
        return None  # the swap is this package's own flock + os.replace

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

    def write_if(self, rel: str, data: bytes, expected: str | None) -> bool:
        path = self.path(rel)

        def swap() -> bool:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with file_lock(path + ".lock"):
                try:
                    with open(path, "rb") as f:
                        current: str | None = _content_version(f.read())
                except FileNotFoundError:
                    current = None
                if current != expected:
                    return False
                _atomic_local_write(path, [memoryview(data)])
                return True

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


_memory_lock = threading.Lock()


class MemoryStore(Store):
    """fsspec ``memory://``: process-global, so a process-global lock makes the swap atomic."""

    supports_cas = True

    def check_fencing(self) -> str | None:
        return None  # the swap is this package's own process-wide lock

    def write_if(self, rel: str, data: bytes, expected: str | None) -> bool:
        path = self.path(rel)

        def swap() -> bool:
            with _memory_lock:
                try:
                    current: str | None = _content_version(self.fs.cat_file(path))
                except FileNotFoundError:
                    current = None
                if current != expected:
                    return False
                self.fs.pipe_file(path, data)
                return True

        return self._call("conditional write", rel, swap)


def _precondition_failed(exc: BaseException) -> bool:
    current: BaseException | None = exc
    while current is not None:
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            if response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                return True
            if response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                return True
        current = current.__cause__
    return False


def probe_fencing(store: Store, bogus_version: str) -> str | None:
    """Check with a probe object that ``store`` really refuses conditional writes it must refuse.

    An S3-compatible server may accept ``If-Match`` / ``If-None-Match`` and ignore them: both jobs would then
    "fence" each other while both write. Writes a probe under :data:`PROTOCOL_DIR`, then a create of the existing
    object and a replace against a wrong version (both must be refused), and deletes it. Returns None when both
    were refused, else what was not enforced.
    """
    rel = f"{PROTOCOL_DIR}/fencing-probe-{uuid.uuid4().hex}"
    try:
        if not store.write_if(rel, b"probe 1", None):
            return "a create-only write of a new object was refused"
        if store.write_if(rel, b"probe 2", None):
            return "a create-only write (If-None-Match: *) replaced an existing object"
        if store.write_if(rel, b"probe 3", bogus_version):
            return "a replace against a wrong version (If-Match / ifGenerationMatch) was accepted"
        return None
    finally:
        try:
            store.remove(rel)
        except Exception as exc:  # a leftover probe is harmless: dot-folders are never read as checkpoints
            log.warning("could not delete the fencing probe %s: %s", store.url(rel), exc)


class S3Store(Store):
    """S3 (and S3-compatible stores that enforce conditional PUTs, as AWS and moto do)."""

    supports_cas = True

    def check_fencing(self) -> str | None:
        return probe_fencing(self, '"00000000000000000000000000000000"')

    def _bucket_key(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def _write(self, path: str, pieces: Pieces) -> None:
        # botocore takes bytes or a file-like body: a reader over the pieces uploads them without joining.
        # One PUT per object; shard_size is capped at S3's single-PUT limit when the plugin is built.
        bucket, key = self._bucket_key(path)
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=GatherReader(pieces))
        finally:
            self.fs.invalidate_cache(path)

    def _range_pieces(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        if end <= start:
            return
        bucket, key = self._bucket_key(path)
        response = sync(self.fs.loop, self.fs._call_s3, "get_object", Bucket=bucket, Key=key,
                        Range=f"bytes={start}-{end - 1}")
        body = response["Body"]
        try:
            while True:
                # Each piece is pulled from the event loop into this worker thread, so checksums and copies
                # of concurrent reads run in parallel threads instead of on s3fs's single loop thread.
                piece = sync(self.fs.loop, body.read, READ_PIECE)
                if not piece:
                    return
                yield memoryview(piece)
        finally:
            body.close()

    def read(self, rel: str) -> bytes:
        # One GET (s3fs's cat_file adds a HEAD first): manifests and skeletons are read on every resume.
        path = self.path(rel)
        bucket, key = self._bucket_key(path)

        async def get() -> bytes:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with response["Body"] as body:
                return bytes(await body.read())

        data: bytes = self._call("read", rel, lambda: sync(self.fs.loop, get))
        return data

    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        path = self.path(rel)
        bucket, key = self._bucket_key(path)

        async def get() -> tuple[bytes, str] | None:
            # One GET returns the bytes and their ETag together: no window in which they can disagree, and
            # one request per pointer read instead of s3fs's HEAD + HEAD + GET.
            try:
                response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            async with response["Body"] as body:
                data = await body.read()
            return data, response["ETag"]

        versioned: tuple[bytes, str] | None = self._call("read", rel, lambda: sync(self.fs.loop, get))
        return versioned

    def write_if(self, rel: str, data: bytes, expected: str | None) -> bool:
        path = self.path(rel)
        bucket, key = self._bucket_key(path)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}

        def put() -> bool:
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
            except FileExistsError:
                return False
            except OSError as exc:
                if _precondition_failed(exc):
                    return False
                raise
            finally:
                self.fs.invalidate_cache(path)
            return True

        return self._call("conditional write", rel, put)

    def bucket_exists(self, bucket: str) -> bool:
        # s3fs's exists() answers False for any error, missing credentials included: ask HeadBucket directly.
        def head() -> bool:
            try:
                self.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                return False
            return True

        return bool(self._call("stat bucket", "", head))

    def abort_stale_uploads(self, older_than: float) -> list[str]:
        bucket, prefix = self._bucket_key(self.root_path)
        prefix = prefix.rstrip("/") + "/" if prefix else ""

        def abort() -> list[str]:
            aborted = []
            listing = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            for upload in listing.get("Uploads", []):
                initiated = upload.get("Initiated")
                started = initiated.timestamp() if initiated is not None else 0.0
                if started < older_than:
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                    UploadId=upload["UploadId"])
                    aborted.append(upload["Key"])
            return aborted

        return self._call("abort stale uploads", "", abort)


class GCSStore(Store):
    """Google Cloud Storage: generation preconditions (``ifGenerationMatch``)."""

    supports_cas = True

    def check_fencing(self) -> str | None:
        return probe_fencing(self, "1")

    def remove(self, rel: str) -> None:
        # gcsfs deletes many objects through the JSON batch endpoint, which emulators (fake-gcs-server)
        # answer in a way gcsfs keeps retrying for minutes; one DELETE per object works everywhere.
        def rm() -> None:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            for obj in self.fs.find(path):
                with suppress(FileNotFoundError):
                    self.fs.rm_file(obj)
            self.fs.invalidate_cache(path)

        self._call("delete", rel, rm)

    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        path = self.path(rel)

        def read() -> tuple[bytes, str] | None:
            for _ in range(5):
                self.fs.invalidate_cache(path)
                try:
                    info = self.fs.info(path)
                    data = self.fs.cat_file(path)
                except FileNotFoundError:
                    return None
                generation = str(info["generation"])
                md5 = info.get("md5Hash")
                if md5 is None or base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode() == md5:
                    return data, generation
            return data, generation

        return self._call("read", rel, read)

    def write_if(self, rel: str, data: bytes, expected: str | None) -> bool:
        path = self.path(rel)
        bucket, key, _ = self.fs.split_path(path)
        from urllib.parse import quote

        # gcsfs exposes only create-only writes, so the replace-if-generation upload is made here, in the
        # same single-request multipart form that the server checks preconditions on.
        metadata = json.dumps({"name": key})
        body = (
            b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n" + metadata.encode()
            + b"\n--==0==\nContent-Type: application/json\n\n" + data + b"\n--==0==--"
        )

        def put() -> bool:
            try:
                self.fs.call(
                    "POST",
                    f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                    uploadType="multipart",
                    headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                    data=body,
                    json_out=True,
                    ifGenerationMatch=expected if expected is not None else "0",
                )
            except FileExistsError:  # gcsfs maps 412 Precondition Failed to FileExistsError
                return False
            finally:
                self.fs.invalidate_cache(path)
            return True

        return self._call("conditional write", rel, put)


def _joined(pieces: Pieces) -> bytes | memoryview:
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class GatherReader(io.RawIOBase):
    """A read-only, seekable file over a list of memoryviews: uploads them without joining them."""

    def __init__(self, pieces: Pieces) -> None:
        super().__init__()
        self._pieces = [memoryview(p).cast("B") for p in pieces if len(p)]
        self._starts: list[int] = []
        total = 0
        for p in self._pieces:
            self._starts.append(total)
            total += len(p)
        self._size = total
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def __len__(self) -> int:
        return self._size

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written = 0
        i = max(0, bisect.bisect_right(self._starts, self._pos) - 1)
        while written < len(out) and i < len(self._pieces) and self._pos < self._size:
            piece, start = self._pieces[i], self._starts[i]
            inner = self._pos - start
            n = min(len(piece) - inner, len(out) - written)
            if n > 0:
                out[written : written + n] = piece[inner : inner + n]
                written += n
                self._pos += n
            i += 1
        return written


# What to set when a store sees no (or not enough) credentials, per protocol: (environment, Python option, CLI
# option). The environment comes first: it also reaches ModelCheckpoint's own client, and keeps secrets out of
# configs and command lines.
_CREDENTIALS = {
    "s3": ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
           "storage_options={'profile': ...} (or {'key': ..., 'secret': ...})",
           """--storage-options '{"profile": "NAME"}'"""),
    "gs": (("GOOGLE_APPLICATION_CREDENTIALS (a service-account key file; or run `gcloud auth application-default"
            " login`)"), "storage_options={'token': '/path/to/key.json'}",
           """--storage-options '{"token": "/path/to/key.json"}'"""),
}
_CLOUD = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs"}


def credentials_error(url: str, what: str, *, detail: str | None = None,
                      client: str | None = None) -> StoreCredentialsError:
    """The error for a store that sees no credentials (``detail`` None) or refuses these ones (``detail``: the
    store's words). ``client``: whose client it was, when not ours (``ModelCheckpoint``), which storage options
    never reach, so only the environment helps."""
    cloud = _CLOUD.get(split_protocol(url)[0] or "", "s3")
    env, option, cli_option = _CREDENTIALS[cloud]
    if client is not None:
        head = (f"{client} lists {url} with its own client, which gets no storage_options and"
                f" {'finds no credentials' if detail is None else f'was refused ({detail})'}")
        endpoint = " (and AWS_ENDPOINT_URL for an S3-compatible store)" if cloud == "s3" else ""
        message = f"{head}: set {env} in the environment{endpoint}; storage_options reach only AtomicCheckpointIO"
        return StoreCredentialsError(message)
    if detail is None:
        head = f"no credentials to {what} {url}: set {env} in the environment"
    else:
        head = f"access denied to {what} {url} ({detail}): check the credentials ({env}) and their rights on it"
    return StoreCredentialsError(f"{head}, or pass {option}", cli_message=f"{head}, or pass {cli_option}")


def _no_credentials(exc: BaseException) -> bool:
    text = str(exc)
    return (type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError")
            or "Unable to locate credentials" in text)


def _refused(exc: BaseException, protocol: str) -> bool:
    """An authorization refusal: a PermissionError (s3fs maps 403 to it), or GCS's 401/403 (gcsfs raises its
    HttpError for 401 and a plain OSError "Forbidden: ..." for 403)."""
    if isinstance(exc, PermissionError):
        return True
    if _CLOUD.get(protocol) != "gs":
        return False
    return getattr(exc, "code", None) in (401, 403) or str(exc).startswith("Forbidden")


def _translate(exc: Exception, url: str, what: str) -> Exception:
    """Map backend errors to built-ins whose message says what to fix; keep the original as the cause."""
    text = str(exc)
    protocol = split_protocol(url)[0] or "file"
    if isinstance(exc, StoreSetupError):
        return exc
    if _no_credentials(exc):
        return credentials_error(url, what)
    if _refused(exc, protocol):
        return credentials_error(url, what, detail=" ".join(text.split()) or type(exc).__name__)
    names_bucket = "bucket" in text.lower() or "NoSuchBucket" in text
    if isinstance(exc, FileNotFoundError) and protocol in _CLOUD and names_bucket:
        bucket = split_protocol(url)[1].split("/", 1)[0]
        return BucketNotFoundError(f"bucket {bucket!r} does not exist ({what} {url}): create it or fix the"
                                   " checkpoint dirpath")
    return exc


def check_default_client(url: str, client: str = "ModelCheckpoint") -> None:
    """Raise :class:`StoreCredentialsError` now when an ``s3://`` URL's default client (built without storage
    options, as Lightning's ``ModelCheckpoint`` builds the one it lists its dirpath with) finds no credentials.

    Credentials given only as ``storage_options`` reach this package's clients, not that one, which then fails at
    its first listing with botocore's bare ``NoCredentialsError``; this says to set them in the environment. It
    sends no request: botocore's own lookup (environment, AWS_PROFILE and the shared files, then the instance
    metadata unless AWS_EC2_METADATA_DISABLED) decides, as it will for that client."""
    if _CLOUD.get(split_protocol(url)[0] or "") != "s3":
        return  # gcsfs falls back to anonymous access rather than failing for want of credentials
    import botocore.session

    if botocore.session.Session().get_credentials() is None:
        raise credentials_error(url, "list", client=client)


def open_error(url: str, exc: BaseException) -> StoreURLError:
    """The error for a URL whose filesystem fsspec does not know (``ValueError``) or cannot import
    (``ImportError``): what was wrong and what would work."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return StoreURLError(f"cannot open {url!r}: {reason}. Use a local path, s3://bucket/prefix, gs://bucket/prefix"
                         " or another fsspec URL whose filesystem is installed.")


def open_store(url: str, storage_options: dict[str, Any] | None, retry: RetryPolicy) -> Store:
    """Build the :class:`Store` for the checkpoint root ``url``; :class:`StoreURLError` for a URL no installed
    filesystem can open."""
    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
    except (ValueError, ImportError) as exc:
        if not _unknown_protocol(exc):
            raise  # a bad storage option, say: fsspec's own words name it
        raise open_error(url, exc) from None
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        cls: type[Store] = LocalStore
        path = os.path.abspath(path)
    elif "memory" in protocols:
        cls = MemoryStore
    elif "s3" in protocols:
        cls = S3Store
    elif "gs" in protocols or "gcs" in protocols:
        cls = GCSStore
    else:
        cls = Store
    return cls(fs, url.rstrip("/") or url, path.rstrip("/") or path, retry)


def _unknown_protocol(exc: BaseException) -> bool:
    """fsspec's errors for a protocol it does not know, or whose filesystem package is not installed."""
    return isinstance(exc, ImportError) or str(exc).startswith("Protocol not known")
