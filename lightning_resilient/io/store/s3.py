"""S3 (and S3-compatible stores that enforce conditional PUTs, as AWS and moto do): ``If-None-Match: *`` to create,
``If-Match: <etag>`` to replace (a single-part PUT: the pointer is small). Uploads go straight from the caller's
buffers (:class:`GatherReader`), and ranged reads hand their bytes on piece by piece.

A cloud store serves one connection far slower than its aggregate, so a save's speed is the number of connections
busy at once. An object up to :data:`MULTIPART_THRESHOLD` is one PUT (the writer uploads many such objects at once);
a larger one (a ``shard_size`` set above it) is a multipart upload whose parts go up in parallel, up to
:data:`PARTS_IN_FLIGHT` per object (s3fs's own ``pipe_file`` sends the parts of one object one after another). A
multipart upload that fails is aborted at once; one whose process was killed is aborted by garbage collection
(:meth:`S3Store.abort_stale_uploads`). Either way no object appears, and without its object no manifest names it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

from fsspec.asyn import sync

from lightning_resilient.io.retry import is_transient
from lightning_resilient.io.store.base import READ_PIECE, Conditions, Pieces, Store, probe_fencing

__all__ = ["GatherReader", "MULTIPART_THRESHOLD", "PARTS_IN_FLIGHT", "PART_SIZE", "POOL_CONNECTIONS", "S3Store",
           "UNSIGNED_BODIES", "slice_pieces"]

#: Objects above this size are multipart uploads with parts in parallel; smaller ones are one PUT.
MULTIPART_THRESHOLD = 16 * 2**20
#: The size of a multipart upload's parts (S3's minimum is 5 MiB, its most parts 10,000: larger objects get larger
#: parts). 8 MiB is what AWS's own clients (the CRT) use.
PART_SIZE = 8 * 2**20
#: Parts of one object in flight at once.
PARTS_IN_FLIGHT = 8
#: The connections one S3 client keeps (botocore's default is 10, fewer than a save's uploads at once): what
#: ``open_store`` gives the client unless the storage options name a ``max_pool_connections`` of their own.
POOL_CONNECTIONS = 64
#: The botocore ``s3`` config ``open_store`` merges in on a plain-HTTP endpoint (``with_client_defaults`` says when):
#: bodies are not hashed into the signature (there botocore would SHA-256 every uploaded byte; over HTTPS it already
#: does not). Measured on 2 cores, 512 MB as 8 MiB PUTs to moto behind the latency proxy: 1.40 -> 0.68 s of client
#: CPU, 2.60 -> 2.01 s.
UNSIGNED_BODIES: dict[str, Any] = {"payload_signing_enabled": False}
_MAX_PARTS = 10_000


_S3 = Conditions(create="If-None-Match: *", replace="If-Match", version="ETag")


def precondition_failed(exc: BaseException) -> bool:
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


class S3Store(Store):
    """S3 (and S3-compatible stores that enforce conditional PUTs, as AWS and moto do)."""

    supports_cas = True
    conditions = _S3

    def endpoint(self) -> str | None:
        # Where botocore sends the requests: the filesystem's endpoint, else the environment's (AWS's default: None).
        client_kwargs = getattr(self.fs, "client_kwargs", None) or {}
        found = (getattr(self.fs, "endpoint_url", None) or client_kwargs.get("endpoint_url")
                 or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        return str(found) if found else None

    def check_fencing(self) -> str | None:
        return probe_fencing(self, '"00000000000000000000000000000000"', _S3)

    def _entries(self, path: str) -> list[dict[str, Any]]:
        # s3fs's ``ls`` of a prefix with nothing under it lists the parent too (to tell a file of that name): one
        # more round trip for every folder not there yet (a new root has several, and a root's parent can be a
        # bucket's whole top level). A folder here is a prefix, never a file: one listing answers.
        lsdir = getattr(self.fs, "_lsdir", None)
        folder = self.fs._strip_protocol(path).strip("/")
        if lsdir is None or not folder:
            return super()._entries(path)  # the list of buckets (or an s3fs without it): fsspec's own listing
        self.fs.invalidate_cache(path)
        try:
            return list(sync(self.fs.loop, lsdir, folder, refresh=True))
        except FileNotFoundError:  # no such bucket
            return []

    def _bucket_key(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def _write(self, path: str, pieces: Pieces) -> None:
        # botocore takes bytes or a file-like body: a reader over the pieces uploads them without joining.
        bucket, key = self._bucket_key(path)
        size = sum(len(p) for p in pieces)
        try:
            if size > MULTIPART_THRESHOLD:
                sync(self.fs.loop, self._multipart, bucket, key, pieces, size)
            else:
                sync(self.fs.loop, self._send, "put_object", Bucket=bucket, Key=key, Body=GatherReader(pieces))
        finally:
            self.fs.invalidate_cache(path)

    async def _send(self, method: str, **kwargs: Any) -> Any:
        """One request whose body is a reader, tried once: a retry (ours, :class:`RetryPolicy`) must start from a fresh
        reader. s3fs's own retries send the same reader again from where the failed try left it, and botocore, which
        takes the length from ``len(body)``, then announces every byte and sends none: the request hangs until its
        read timeout."""
        from s3fs.core import _error_wrapper  # (here: this module is imported without the [s3] extra installed)

        await self.fs.set_session()
        client = await self.fs.get_s3(kwargs.get("Bucket"))
        call = getattr(client, method)
        return await _error_wrapper(call, kwargs=self.fs._get_s3_method_kwargs(call, **kwargs), retries=1)

    async def _multipart(self, bucket: str, key: str, pieces: Pieces, size: int) -> None:
        """One object as a multipart upload, its parts in parallel (on s3fs's event loop: no thread per part)."""
        part = max(PART_SIZE, -(-size // _MAX_PARTS))
        spans = [(start, min(start + part, size)) for start in range(0, size, part)]
        upload = await self.fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = upload["UploadId"]
        gate = asyncio.Semaphore(PARTS_IN_FLIGHT)

        async def send(number: int, start: int, end: int) -> dict[str, Any]:
            async with gate:
                for attempt in range(1, self.retry.attempts + 1):  # a failed part is sent again, not the object
                    try:
                        sent = await self._send("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                                PartNumber=number, Body=GatherReader(slice_pieces(pieces, start, end)))
                        return {"PartNumber": number, "ETag": sent["ETag"]}
                    except Exception as exc:
                        if attempt == self.retry.attempts or not is_transient(exc):
                            raise
                        await asyncio.sleep(self.retry.backoff(attempt))
            raise AssertionError("unreachable")  # pragma: no cover

        try:
            # Every part ends (sent or failed) before the upload is completed or aborted: an abort while a part is
            # still in flight could leave that part stored behind it.
            results = await asyncio.gather(*(send(n, a, b) for n, (a, b) in enumerate(spans, 1)),
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            parts = [r for r in results if isinstance(r, dict)]
            await self.fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                                   MultipartUpload={"Parts": parts})
        except BaseException:
            # Not completed, so no object: the parts go too (a failed abort leaves them to gc, which aborts
            # uploads older than its grace).
            with contextlib.suppress(Exception):
                await self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise

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

    def write_versioned(self, rel: str, data: bytes, expected: str | None) -> str | None:
        path = self.path(rel)
        bucket, key = self._bucket_key(path)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}

        def put() -> str | None:
            try:
                response = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
            except FileExistsError:
                return None
            except FileNotFoundError:
                if expected is None:
                    raise  # a create answered 404: the bucket is gone
                # S3 answers an If-Match write of a key deleted since it was read 404 NoSuchKey: the version it was
                # to replace is gone, so the condition failed (the caller reads again and finds no object).
                return None
            except OSError as exc:
                if precondition_failed(exc):
                    return None
                raise
            finally:
                self.fs.invalidate_cache(path)
            return str(response.get("ETag") or "")  # (the ETag a GET of it returns, which If-Match compares)

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


def slice_pieces(pieces: Pieces, start: int, end: int) -> Pieces:
    """The bytes ``[start, end)`` of the concatenation of ``pieces``, as views into them (nothing is copied)."""
    out: Pieces = []
    offset = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        lo, hi = max(start, offset), min(end, offset + len(view))
        if lo < hi:
            out.append(view[lo - offset : hi - offset])
        offset += len(view)
        if offset >= end:
            break
    return out


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
