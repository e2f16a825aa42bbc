"""S3 (and S3-compatible stores that enforce conditional PUTs, as AWS and moto do): ``If-None-Match: *`` to create,
``If-Match: <etag>`` to replace (a single-part PUT: the pointer is small). Uploads go straight from the caller's
buffers (:class:`GatherReader`), and ranged reads hand their bytes on piece by piece.
"""

from __future__ import annotations

import bisect
import io
import os
from collections.abc import Iterator
from typing import Any

from fsspec.asyn import sync

from lightning_resilient.io.store.base import READ_PIECE, Conditions, Pieces, Store, probe_fencing

__all__ = ["GatherReader", "S3Store"]


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
            except FileNotFoundError:
                if expected is None:
                    raise  # a create answered 404: the bucket is gone
                # S3 answers an If-Match write of a key deleted since it was read 404 NoSuchKey: the version it was
                # to replace is gone, so the condition failed (the caller reads again and finds no object).
                return False
            except OSError as exc:
                if precondition_failed(exc):
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
