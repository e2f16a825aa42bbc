"""Google Cloud Storage: generation preconditions (``ifGenerationMatch``, 0 to create), sent in the single-request
multipart upload form that servers check them on."""

from __future__ import annotations

import base64
import hashlib
import json
from contextlib import suppress

from lightning_resilient.io.store.base import Conditions, Store, probe_fencing

__all__ = ["GCSStore"]


_GCS = Conditions(create="ifGenerationMatch=0", replace="ifGenerationMatch", version="generation")


class GCSStore(Store):
    """Google Cloud Storage: generation preconditions (``ifGenerationMatch``)."""

    supports_cas = True
    conditions = _GCS

    def endpoint(self) -> str | None:
        # gcsfs's endpoint: an emulator's (STORAGE_EMULATOR_HOST, endpoint_url), or Google's own (None).
        found = getattr(self.fs, "_endpoint", None)
        return None if not found or "storage.googleapis.com" in str(found) else str(found)

    def check_fencing(self) -> str | None:
        return probe_fencing(self, "1", _GCS)

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

    def write_versioned(self, rel: str, data: bytes, expected: str | None) -> str | None:
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

        def put() -> str | None:
            try:
                written = self.fs.call(
                    "POST",
                    f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                    uploadType="multipart",
                    headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                    data=body,
                    json_out=True,
                    ifGenerationMatch=expected if expected is not None else "0",
                )
            except FileExistsError:  # gcsfs maps 412 Precondition Failed to FileExistsError
                return None
            finally:
                self.fs.invalidate_cache(path)
            # The object's generation (what ifGenerationMatch compares): "" when the answer did not say.
            return str(written.get("generation") or "") if isinstance(written, dict) else ""

        return self._call("conditional write", rel, put)
