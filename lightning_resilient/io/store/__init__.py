"""The few storage operations the checkpoint protocol needs, one module per fsspec backend.

- ``base.py``: the :class:`Store` interface and the generic backend (no conditional write: last writer wins, with a
  one-time warning that writer fencing is off), :class:`ObjectInfo`, :data:`PROTOCOL_DIR`, :func:`probe_fencing`;
- ``local.py``: local disk, an ``flock`` held across read-compare-replace (:func:`file_lock`);
- ``memory.py``: ``memory://``, a process-wide lock;
- ``s3.py``: ``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace;
- ``gcs.py``: ``ifGenerationMatch`` (0 to create);
- ``http.py``: HTTP(S), read-only (URL-quoted listings without sizes, servers that ignore ``Range``);
- ``errors.py``: backend errors mapped to messages that name the URL and the fix.

:func:`open_store` picks the backend for a URL.
"""

from __future__ import annotations

import os
from typing import Any

from fsspec.core import split_protocol, url_to_fs

from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store.base import PROTOCOL_DIR, Conditions, ObjectInfo, Store, probe_fencing, probe_write
from lightning_resilient.io.store.errors import (
    check_default_client,
    check_store_extra,
    check_url,
    is_unknown_protocol,
    open_error,
)
from lightning_resilient.io.store.gcs import GCSStore
from lightning_resilient.io.store.http import HTTPStore
from lightning_resilient.io.store.local import LocalStore, file_lock
from lightning_resilient.io.store.memory import MemoryStore
from lightning_resilient.io.store.s3 import POOL_CONNECTIONS, UNSIGNED_BODIES, GatherReader, S3Store

__all__ = ["Conditions", "GCSStore", "GatherReader", "HTTPStore", "LocalStore", "MemoryStore", "ObjectInfo",
           "PROTOCOL_DIR", "S3Store", "Store", "check_default_client", "check_store_extra", "check_url", "file_lock",
           "open_store", "probe_fencing", "probe_write", "with_client_defaults"]


def open_store(url: str, storage_options: dict[str, Any] | None, retry: RetryPolicy) -> Store:
    """Build the :class:`Store` for the checkpoint root ``url``; :class:`StoreURLError` for a URL no installed
    filesystem can open (one that this package's ``[s3]`` or ``[gcs]`` extra would install says so)."""
    check_store_extra(url)
    options = dict(storage_options or {})
    if split_protocol(url)[0] in ("s3", "s3a"):
        options = with_client_defaults(options)
    try:
        fs, path = url_to_fs(url, **options)
    except (ValueError, ImportError) as exc:
        if not is_unknown_protocol(exc):
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
    elif "http" in protocols or "https" in protocols:
        cls = HTTPStore
    else:
        cls = Store
    return cls(fs, url.rstrip("/") or url, path.rstrip("/") or path, retry)


def with_client_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs ``options`` with this package's client defaults, each unless the options name it themselves:

    - :data:`~lightning_resilient.io.store.s3.POOL_CONNECTIONS` connections (botocore's default of 10 would queue a
      save's parallel uploads);
    - on a plain-HTTP endpoint only (an on-premises MinIO or Ceph, a loopback store), no SHA-256 of the body in the
      request's signature (:data:`~lightning_resilient.io.store.s3.UNSIGNED_BODIES`): there botocore hashed every
      uploaded byte a second time, about half a save's client CPU. Over HTTPS botocore already sends upload bodies
      unsigned (with a trailing checksum), so nothing changes there, not even the signing of other requests. Nor
      where the body would then go unchecked: with ``request_checksum_calculation`` ``when_required`` (in
      ``config_kwargs`` or ``AWS_REQUEST_CHECKSUM_CALCULATION``), no CRC32 goes with the body, and its signature is
      the store's only check of the bytes on the way.
    """
    config = options.get("config_kwargs")
    if config is not None and not isinstance(config, dict):
        return options  # not ours to fix: s3fs's own words will name it
    config = dict(config or {})
    config.setdefault("max_pool_connections", POOL_CONNECTIONS)
    s3 = config.get("s3")
    if (s3 is None or isinstance(s3, dict)) and _plain_http(options) and _bodies_checksummed(config):
        config["s3"] = {**UNSIGNED_BODIES, **(s3 or {})}
    return {**options, "config_kwargs": config}


def _plain_http(options: dict[str, Any]) -> bool:
    """Whether the S3 client these options build talks plain HTTP (the endpoint botocore will use, as s3fs and
    botocore pick it: the options' own, else the environment's; AWS's own endpoints are HTTPS)."""
    found = options.get("client_kwargs")
    client_kwargs: dict[str, Any] = found if isinstance(found, dict) else {}
    endpoint = (options.get("endpoint_url") or client_kwargs.get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        return str(endpoint).lower().startswith("http://")
    return options.get("use_ssl") is False


def _bodies_checksummed(config: dict[str, Any]) -> bool:
    """Whether botocore sends a checksum with every upload (its default since 1.36: ``when_supported``)."""
    setting = config.get("request_checksum_calculation") or os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION")
    return str(setting or "when_supported").lower() != "when_required"
