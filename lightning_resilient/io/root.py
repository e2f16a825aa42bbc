"""One checkpoint root, as one process sees it: the four parts of the protocol, and the operations that span them.

A root is a folder (local, or a prefix in a bucket) holding checkpoints as immutable commit folders, each with a
manifest written last, and one small mutable pointer that catalogs them. :class:`CheckpointRoot` is what the rest of
the package holds; its work is done by four parts, each in its own module:

- :class:`~lightning_resilient.io.reader.RootReader` (``reader.py``): read, verify and rebuild a commit; scan;
- :class:`~lightning_resilient.io.fencing.WriterFence` (``fencing.py``): the pointer's conditional updates, claims
  (writer epochs), lineage origins, holds;
- :class:`~lightning_resilient.io.retention.Retention` (``retention.py``): what may be deleted, and when;
- :class:`~lightning_resilient.io.writer.RootWriter` (``writer.py``): capture, upload and commit a save.

The methods here are the operations callers use; those that span parts (a claim then collects garbage; a release
then deletes what became due) are composed here, the rest hand over to one part. Which root is which (a URL, the
latest of a lineage, fallbacks) is the catalog's job (``catalog.py``), not this module's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar

from lightning_resilient._checks import check_bool, check_int, check_number, check_optional_int
from lightning_resilient.io import incremental, layout
from lightning_resilient.io.fencing import WriterFence
from lightning_resilient.io.lineage import Origin
from lightning_resilient.io.manifest import Manifest, ObjectEntry, ShardedRecord
from lightning_resilient.io.pointer import Entry, Pointer
from lightning_resilient.io.reader import Loaded, LoadStats, RootReader, Scan
from lightning_resilient.io.retention import Retention
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import Store, open_store
from lightning_resilient.io.writer import Prepared, RootWriter

__all__ = ["CheckpointRoot", "INSPECTING", "LoadStats", "Loaded", "MAX_OBJECT_BYTES", "Prepared", "RootSettings",
           "Scan", "SerialExecutor", "open_root"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# The largest object one request may write: S3's single-PUT limit.
MAX_OBJECT_BYTES = 5 * 2**30


@dataclass(frozen=True)
class RootSettings:
    """How a root is written and collected; checked when made (each field named as ``AtomicCheckpointIO``'s)."""

    keep_last: int | None
    shard_size: int
    orphan_grace_seconds: float
    fallback_on_corruption: bool
    chunk_size: int = 16 * 2**20
    max_concurrency: int = 16  # upload threads: a stream is cut into at least this many objects (see object_size)
    # Write (with a warning) a store that accepts conditional writes without enforcing them (see WriterFence).
    allow_unfenced_store: bool = False
    # Incremental saves: objects of tensors unchanged since the writer's last commit are referenced (io/incremental.py).
    dedup: bool = False

    def __post_init__(self) -> None:
        # Each field keeps its checked value (a numpy int becomes an int: a manifest must serialize it).
        checked = {
            "keep_last": check_optional_int("keep_last", self.keep_last, minimum=1, typed=False),
            "shard_size": check_int("shard_size", self.shard_size, minimum=1, maximum=MAX_OBJECT_BYTES, typed=False,
                                    rule="a number of bytes from 1 to 5 GiB (S3's single-PUT limit)"),
            "chunk_size": check_int("chunk_size", self.chunk_size, minimum=1, rule="a positive number of bytes",
                                    typed=False),
            "max_concurrency": check_int("max_concurrency", self.max_concurrency, minimum=1, typed=False),
            # Infinity is "never collect a crashed save of a fenced writer".
            "orphan_grace_seconds": check_number("orphan_grace_seconds", self.orphan_grace_seconds, minimum=0,
                                                 rule="a number >= 0", finite=False),
            "fallback_on_corruption": check_bool("fallback_on_corruption", self.fallback_on_corruption),
            "allow_unfenced_store": check_bool("allow_unfenced_store", self.allow_unfenced_store),
            "dedup": check_bool("dedup", self.dedup),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: set once, here


class CheckpointRoot:
    """The protocol for the checkpoints under one root URL, as one writer sees it."""

    def __init__(self, store: Store, settings: RootSettings, executor: Callable[[], Executor]) -> None:
        """``executor`` makes a fresh pool per save or load (threads never outlive the operation)."""
        self.store = store
        self.settings = settings
        self.reader = RootReader(store, executor)
        self.fence = WriterFence(store, self.reader, allow_unfenced_store=settings.allow_unfenced_store)
        self.retention = Retention(store, self.fence, self.reader, keep_last=settings.keep_last,
                                   orphan_grace_seconds=settings.orphan_grace_seconds)
        self.writer = RootWriter(store, chunk_size=settings.chunk_size, shard_size=settings.shard_size,
                                 max_concurrency=settings.max_concurrency, executor=executor, fence=self.fence,
                                 reader=self.reader, retention=self.retention, claim=self.claim_once,
                                 dedup=settings.dedup, behind=self._behind)
        #: With ``dedup``: what this process's rank stored in its streams of a sharded save (``io/sharded.py``).
        self.rank_streams = incremental.RankStreams()
        self._later: list[threading.Thread] = []  # (two threads' commits may each leave work behind)
        #: Whether what a commit retired is deleted behind it (``RootWriter.publish``): on an object store, where
        #: each deletion is a round trip, a sync save returns that much sooner (on a cloud store a tenth of a 512 MB
        #: save). Not on local disk, whose deletion also removes a name's folder once empty, which would race the
        #: next save creating its commit folder inside it; nor where the commits run behind training already, with
        #: a bound on how long they may take (a tier's persists: ``TieredRoot`` turns it off).
        self.deletes_behind = not store.supports_read_into
        self._later_lock = threading.Lock()  # (the training, async-save, persist and replication threads settle)
        # Claims of this root, one at a time: a save and a removal in two threads that both find the root unclaimed
        # (Lightning's AsyncCheckpointIO saves on its worker thread, the Trainer's thread removes) make one claim.
        self._claim_lock = threading.Lock()

    # -- work finished behind training (a restore's copies: io/replicas.py) ---------------------------------------
    def finish_later(self, work: Callable[[], None], what: str, *, undone: str = "a restart does it again") -> None:
        """Run ``work`` (which writes into this root) in a thread of its own. Every later change to the root (a
        claim, a commit, a removal, a collection: the methods below) and :meth:`settle` wait for it first, so
        nothing this process does to the root overlaps it. Its error is logged (with ``undone``: who does it
        instead), not raised: ``work`` may only make durable what the process no longer needs (a restore's copy: left
        undone, the part has no record and the next restart restores it again), or delete what nothing needs."""
        self.settle()

        def run() -> None:
            try:
                work()
            except Exception as exc:
                log.warning("%s in %s did not finish (%s): %s", what, self.url, exc, undone)

        # Not a daemon: an interpreter that exits normally finishes it first.
        thread = threading.Thread(target=run, name=f"lightning_resilient-{what.replace(' ', '-')[:60]}")
        thread.start()  # (started before it is published: a settle in another thread joins a started thread)
        with self._later_lock:
            self._later = [t for t in self._later if t.is_alive()] + [thread]

    def settle(self) -> None:
        """Wait for the work :meth:`finish_later` started (at once when there is none; in that work's own thread
        too, where it changes the root itself)."""
        current = threading.current_thread()
        while True:
            with self._later_lock:
                self._later = [t for t in self._later if t.is_alive()]
                pending = [t for t in self._later if t is not current]
            if not pending:
                return
            for thread in pending:
                thread.join()

    def _behind(self, work: Callable[[], None], what: str) -> None:
        """What a commit leaves to do (``RootWriter``'s ``behind``): :meth:`finish_later`, or at once in work that
        runs behind already (a restore's copy that commits: the root's next change waits for that thread only) and
        where :attr:`deletes_behind` is off."""
        with self._later_lock:
            inside = threading.current_thread() in self._later
        if inside or not self.deletes_behind:
            work()
        else:
            self.finish_later(work, what, undone="the next commit or gc does it")

    @property
    def url(self) -> str:
        return self.store.root_url

    @property
    def writer_epoch(self) -> int | None:
        """The writer epoch this process claimed the root with (None until it claims)."""
        return self.fence.writer_epoch

    @property
    def origin(self) -> Origin | None:
        """Where this writer's training came from (None until it claims)."""
        return self.fence.origin

    # -- pointer and writer epochs (fencing.py) ------------------------------------------------------------------
    def read_pointer(self) -> tuple[Pointer | None, str | None]:
        """The pointer and its version (None when there is none, or only a legacy one: the next update creates it)."""
        return self.fence.read_pointer()

    def claim(self, *, resumed_from: Entry | None = None) -> int:
        """Become the writer of this root (:meth:`WriterFence.claim`), then collect the garbage of fenced writers."""
        self.settle()
        with self._claim_lock:
            epoch = self.fence.claim(resumed_from=resumed_from)
        self._collect_quietly()
        return epoch

    def claim_once(self) -> int:
        """This process's writer epoch, claiming the root (:meth:`claim`) if it has not yet: what a save or a removal
        does before it writes. Whichever thread asks first claims; one that asks meanwhile waits for that claim and
        gets its epoch. Two claims would each bump the epoch, fencing this process's own save in flight (its commit
        folder carries the first epoch, the fence the second)."""
        self.settle()
        with self._claim_lock:
            epoch = self.fence.writer_epoch
            if epoch is not None:
                return epoch
            epoch = self.fence.claim()
        self._collect_quietly()
        return epoch

    def adopt(self, epoch: int, origin: Origin, origins: dict[int, Origin], lineage_id: str = "") -> None:
        """Write this root as writer epoch ``epoch`` of another root (:meth:`WriterFence.adopt`: a local tier)."""
        self.settle()
        self.retention.delete_retired(self.fence.adopt(epoch, origin, origins, lineage_id))
        self._collect_quietly()

    def check_fencing(self) -> None:
        """Refuse (``UnfencedStoreError``) a store that accepts conditional writes without enforcing them, unless
        the settings allow it (then warn once): :meth:`WriterFence.check_fencing`."""
        self.fence.check_fencing()

    def hold(self, folders: Iterable[str], why: str) -> None:
        """Keep ``folders`` from retention until :meth:`release` (they are to be copied)."""
        self.settle()
        self.fence.hold(folders, why)

    def release(self, folders: Iterable[str]) -> None:
        self.settle()
        self.retention.delete_retired(self.fence.release(folders))

    def resumed(self, entry: Entry, *, elsewhere: bool = False) -> None:
        """Record that this process loaded ``entry`` from the root (a fit's resume claims with it as origin);
        ``elsewhere``: only the root's node-local tier holds it."""
        self.fence.resumed(entry, elsewhere=elsewhere)

    def forked(self, entry: Entry, root: str) -> None:
        """Record that this process's fit writes this root from ``entry`` of another root ``root`` (a fork)."""
        self.fence.forked(entry, root)

    def _collect_quietly(self) -> None:
        try:
            self.retention.collect_garbage()
        except Exception as exc:  # garbage collection must never stop training
            log.warning("garbage collection under %s failed: %s", self.url, exc)

    # -- save (writer.py) ----------------------------------------------------------------------------------------
    def prepare(self, checkpoint: dict[str, Any], name: str, snapshot: layout.Snapshot | None = None,
                before_fill: Callable[[], None] | None = None, *, reported: list[str] | None = None,
                reuse: bool = True) -> Prepared:
        """Capture ``checkpoint`` for saving (:meth:`RootWriter.prepare`): once this returns, training may change
        it."""
        return self.writer.prepare(checkpoint, name, snapshot, before_fill, reported=reported, reuse=reuse)

    def save(self, checkpoint: dict[str, Any], name: str, *, reported: list[str] | None = None) -> Entry:
        """Capture and commit ``checkpoint`` as ``name`` (a synchronous save), through :meth:`commit`."""
        return self.commit(self.prepare(checkpoint, name, reported=reported))

    def commit(self, prepared: Prepared, *, folder: str | None = None, extra: list[ObjectEntry] | None = None,
               sharded: Callable[[list[ObjectEntry]], ShardedRecord] | None = None) -> Entry:
        """Upload a prepared checkpoint, write its manifest, then move the pointer to it (:meth:`RootWriter.commit`)."""
        self.settle()
        return self.writer.commit(prepared, folder=folder, extra=extra, sharded=sharded)

    def publish(self, manifest: Manifest, *, held: list[ObjectEntry] | None = None,
                brought: frozenset[str] = frozenset()) -> Entry:
        """Commit ``manifest``, whose objects are stored (:meth:`RootWriter.publish`; ``held``: those of them this
        root holds, when it holds one node's part of a sharded commit; ``brought``: folders of other commits into
        which the copy that publishes it wrote objects)."""
        self.settle()
        return self.writer.publish(manifest, held=held, brought=brought)

    def remove(self, name: str) -> None:
        """Drop checkpoint ``name`` from the catalog (Lightning's ``remove_checkpoint``); retention deletes it."""
        self.settle()
        self.writer.remove(name)

    def forget_stock(self, name: str) -> bool:
        """Delete ``name`` when it is a stock Lightning file or link, not a checkpoint of ours
        (:meth:`RootWriter.forget_stock`)."""
        self.settle()
        return self.writer.forget_stock(name)

    # -- load (reader.py) ----------------------------------------------------------------------------------------
    def read_manifest(self, folder: str) -> Manifest:
        return self.reader.read_manifest(folder)

    def load(self, folder: str, *, map_location: Any, weights_only: bool | None, pin_memory: bool = False,
             sharded_rest: bool = False, tee: Callable[[str, int, memoryview], None] | None = None,
             manifest: Manifest | None = None) -> Loaded:
        """Read, verify and rebuild one commit (:meth:`RootReader.load`)."""
        return self.reader.load(folder, map_location=map_location, weights_only=weights_only, pin_memory=pin_memory,
                                sharded_rest=sharded_rest, tee=tee, manifest=manifest)

    def verify(self, folder: str, progress: Callable[[int], None] | None = None) -> Manifest:
        return self.reader.verify(folder, progress)

    def scan(self) -> Scan:
        return self.reader.scan()

    def remember_loaded(self, loaded: Loaded, held: list[ObjectEntry] | None = None) -> None:
        """A save of the same step as ``loaded`` (with ``dedup``: any) references its identical objects instead of
        uploading them (``held``: only those this root stores, when it holds part of a sharded commit)."""
        self.writer.remember_loaded(loaded.manifest, held)

    # -- retention and garbage (retention.py) --------------------------------------------------------------------
    def collect_garbage(self, *, dry_run: bool = False, abandoned: bool = False) -> list[tuple[str, str]]:
        """Delete what no committed checkpoint needs (:meth:`Retention.collect_garbage`); ``(url, why)`` each."""
        self.settle()
        return self.retention.collect_garbage(dry_run=dry_run, abandoned=abandoned)

    def end_of_writer(self) -> list[str]:
        """This process's fit of the root ended: delete what it retired since its last commit
        (:meth:`Retention.end_of_writer`)."""
        self.settle()
        return self.retention.end_of_writer()

    def retain(self, keep_last: int, *, dry_run: bool = False) -> list[Entry]:
        self.settle()
        return self.retention.retain(keep_last, dry_run=dry_run)

    def drop(self, commits: set[str], *, dry_run: bool = False) -> list[Entry]:
        self.settle()
        return self.retention.drop(commits, dry_run=dry_run)


#: Settings of a root opened to read, verify or collect (find_latest_checkpoint, the CLI), never to save into: a
#: checkpoint that fails verification is reported, not replaced by an older one, unless the caller asks.
INSPECTING = RootSettings(keep_last=None, shard_size=1, orphan_grace_seconds=3600.0, fallback_on_corruption=False)


def open_root(url: str, storage_options: dict[str, Any] | None = None, *, settings: RootSettings = INSPECTING,
              retry: RetryPolicy | None = None, executor: Callable[[], Executor] | None = None) -> CheckpointRoot:
    """The root at ``url`` (a normalized URL), through a fresh store client: the one way a root is opened.

    ``executor`` makes the thread pool of each load or save (default: none, every job in the calling thread)."""
    store = open_store(url, dict(storage_options or {}), retry or RetryPolicy())
    return CheckpointRoot(store, settings, executor or SerialExecutor)


class SerialExecutor(Executor):
    """Runs every job in the calling thread: one-off reads by tools, where threads would cost more than they save."""

    def map(self, fn: Callable[..., _T], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[_T]:
        return map(fn, *iterables)

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future
