"""One checkpoint root: the commit protocol, writer fencing, lineage, retention and garbage collection.

Save: shard objects -> skeleton -> check they are all stored -> manifest (last) -> conditional swap of the pointer.
A crash before the swap leaves the previous pointer valid and the new folder uncommitted; a crash after it leaves
at worst undeleted garbage.

What may be deleted, and when (nothing else ever is):

- a folder the pointer no longer references (retention: ``keep_last``, Lightning's removals, a name saved again)
  is *retired*: recorded in the pointer, its manifest deleted at once (it is no checkpoint any more, even for a
  pointer rebuilt after a loss), and its data once a later commit has happened: a reader already reading it has a
  save interval to finish;
- a folder the pointer does not reference, written by a writer epoch older than the pointer's (a fenced writer,
  which can never commit it): without a manifest (a crashed upload), or with one outside the current lineage (the
  writer died between its manifest and the pointer update: never visible, never resumable). A save in progress
  of the current writer is never touched, whatever its age or the clocks;
- with ``gc --abandoned`` only: checkpoints the pointer catalogs outside the current lineage (a branch a rollback
  left behind).

A folder with a manifest is a committed checkpoint whatever the pointer says: a missing pointer makes nothing
deletable (it is rebuilt from the manifests), a damaged one stops collection until it is repaired, and a commit
the pointer does not reference is kept while it belongs to the current lineage.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import re
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_resilient.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    ShardedCheckpointError,
    StaleWriterError,
    UnsupportedFormatError,
)
from lightning_resilient.io import layout
from lightning_resilient.io.lineage import ORIGINS_DIR, Lineage, Origin, origin_record_name
from lightning_resilient.io.manifest import (
    MANIFEST_NAME,
    Manifest,
    ObjectEntry,
    TensorEntry,
    chunk_digests,
    hasher,
    object_digest,
)
from lightning_resilient.io.pointer import LEGACY_NAMES, LEGACY_POINTER_NAME, POINTER_NAME, Entry, Pointer
from lightning_resilient.io.store import LocalStore, Store

__all__ = ["CheckpointRoot", "LoadStats", "Prepared", "RootSettings", "Scan"]

log = logging.getLogger(__name__)

_COMMIT_RE = re.compile(r"^c(\d{13})-e(\d+)-[0-9a-f]{8}$")
SKELETON_NAME = "skeleton.pt"
_CAS_ATTEMPTS = 50
RESUMED = "resumed from"
# Stock checkpoint files a save of the same name replaces wait here until that save has committed.
REPLACED_DIR = ".lightning_resilient/replaced"
# Consecutive checksummed chunks are read with one request of at least this many bytes: the number of requests
# depends on the bytes read, never on a manifest's chunk size (a chunk size of 1 must not mean a request per byte).
READ_SPAN = 4 * 2**20


def writer_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def commit_time(commit: str) -> float | None:
    """When a commit folder was started, by its writer's clock (for display only: no decision depends on it)."""
    match = _COMMIT_RE.match(commit.rsplit("/", 1)[-1])
    return int(match.group(1)) / 1000 if match else None


def commit_epoch(commit: str) -> int | None:
    """The writer epoch a commit folder was written under (its name carries it), or None if it is not one."""
    match = _COMMIT_RE.match(commit.rsplit("/", 1)[-1])
    return int(match.group(2)) if match else None


@dataclass(frozen=True)
class RootSettings:
    keep_last: int | None
    shard_size: int
    orphan_grace_seconds: float
    fallback_on_corruption: bool
    chunk_size: int = 16 * 2**20
    parallelism: int = 8  # upload threads: a stream is cut into at least this many objects (see object_size)


@dataclass
class Prepared:
    """A checkpoint captured for saving: its skeleton, its tensors' layout, and how to read their bytes."""

    name: str
    step: int
    epoch: int
    created: float
    skeleton: bytes
    tensors: list[TensorEntry]
    total: int  # bytes in the tensor stream
    pieces: Callable[[int, int], list[memoryview]]  # the stream's bytes [start, end) as memoryviews
    ready: Callable[[], None]  # waits until those bytes are on the host (device-to-host copies done)


@dataclass(frozen=True)
class LoadStats:
    """What one load did: for benchmarks, and tests of the memory bound."""

    commit: str
    bytes: int  # bytes read and verified
    objects: int
    requests: int  # ranged reads issued
    host_buffer_bytes: int  # host memory allocated for tensors
    host_buffers: int
    seconds: float
    tier: str = ""  # with a local tier: "local" or "durable", the tier the checkpoint was read from


@dataclass
class Loaded:
    checkpoint: dict[str, Any]
    entry_commit: str
    manifest: Manifest
    stats: LoadStats | None = None


@dataclass
class Scan:
    """What a listing of every commit folder of a root found (used when the pointer cannot be)."""

    manifests: list[Manifest] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # commit -> why its manifest does not load
    uncommitted: list[str] = field(default_factory=list)  # commit folders without a manifest
    max_epoch: int = 0  # the highest writer epoch any commit folder's name (or origin record) carries
    origins: dict[int, Origin] = field(default_factory=dict)  # from the origin records of the writer epochs

    def pointer(self) -> Pointer:
        return Pointer.rebuilt(self.manifests, self.max_epoch, self.origins)


Job = Callable[[], int]


def _nothing() -> None:
    pass


def _shifted(write: Callable[[int, memoryview], None], start: int, offset: int, piece: memoryview) -> None:
    write(start + offset, piece)


def _views(scatter: layout.Scatter, start: int, a: int, b: int) -> list[memoryview]:
    return scatter.views(start + a, b - a)


def _discard_piece(offset: int, piece: memoryview) -> None:
    pass


_warned_fencing: set[str] = set()


class _ChunkCheck:
    """Checks consecutive chunks of one object against their digests while their bytes stream past."""

    def __init__(self, manifest: Manifest, obj: ObjectEntry, chunks: list[tuple[int, int, int]], url: str) -> None:
        self.algorithm, self.obj, self.chunks, self.url = manifest.hash, obj, chunks, url
        self.restart()

    def restart(self) -> None:
        self.i, self.pos, self.digest = 0, self.chunks[0][1], hasher(self.algorithm)

    def feed(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        while len(view) and self.i < len(self.chunks):
            end = self.chunks[self.i][2]
            take = min(len(view), end - self.pos)
            self.digest.update(view[:take])
            self.pos += take
            view = view[take:]
            if self.pos == end:
                self._close()

    def _close(self) -> None:
        j, a, b = self.chunks[self.i]
        if self.digest.hexdigest() != self.obj.chunks[j]:
            raise CheckpointCorruptedError(f"{self.url} fails its {self.algorithm} checksum at bytes {a}-{b}: its bytes"
                                           " were corrupted", object=self.url)
        self.i, self.digest = self.i + 1, hasher(self.algorithm)

    def finish(self) -> None:
        while self.i < len(self.chunks) and self.chunks[self.i][1] == self.chunks[self.i][2]:  # an empty object
            self._close()
        if self.i != len(self.chunks):
            raise CheckpointCorruptedError(f"{self.url} ends at byte {self.pos}, the manifest says it has"
                                           f" {self.obj.size} (truncated or replaced)", object=self.url)


class CheckpointRoot:
    """The protocol for the checkpoints under one root URL, as one writer sees it."""

    def __init__(self, store: Store, settings: RootSettings, executor: Callable[[], Executor]) -> None:
        """``executor`` makes a fresh pool per save or load (threads never outlive the operation)."""
        self.store = store
        self.settings = settings
        self._executor = executor
        self.writer = writer_identity()
        self.epoch: int | None = None  # writer epoch this process claimed, once it did
        self.origin: Origin | None = None  # where this writer's training came from, once it claimed
        self.resumed_from: str | None = None
        #: What this process last loaded from the root: a fit that resumed from it claims the root with it as
        #: origin at its first save. A process that only reads never writes, so never claims (never fences).
        self.pending_resume: Entry | None = None
        self.pending_resume_elsewhere = False  # ``pending_resume`` is held by another tier (io/tiered.py), not here
        self._resumed_entry: Entry | None = None  # what this writer claimed with as its origin
        # Retired folders this process deleted: their records leave the pointer at its next update.
        self._deleted: set[str] = set()
        # (digest, size) -> root-relative path of the objects of the last commit, and its step. A save of the
        # same step whose shard is byte-identical (ModelCheckpoint's save_last right after a top-k save)
        # references the object instead of uploading it again. Only at the same step: checkpoints of
        # different steps never share bytes, so one corrupted object can never take several of them down.
        self._known: dict[tuple[str, int], str] = {}
        self._known_step: int | None = None
        # Files directly in the root (stock Lightning checkpoints), listed at this process's first save, and those
        # a save moved aside until it commits.
        self._stock: set[str] | None = None
        self._aside: dict[str, str] = {}
        self._leftover: dict[str, str] = {}  # name -> stock file a save that never committed moved aside

    @property
    def url(self) -> str:
        return self.store.root_url

    # -- pointer -----------------------------------------------------------------------------------------------
    def read_pointer(self) -> tuple[Pointer | None, str | None]:
        """The pointer and its version (None when there is none, or only a legacy one: the next update creates it)."""
        pointer, version, _ = self._read_pointer()
        return pointer, version

    def _read_pointer(self) -> tuple[Pointer | None, str | None, bool]:
        got = self.store.read_versioned(POINTER_NAME)
        if got is not None:
            data, version = got
            return Pointer.from_bytes(data, where=self.store.url(POINTER_NAME)), version, False
        legacy = self.store.read_versioned(LEGACY_POINTER_NAME)  # a root written by release 0.1
        if legacy is None:
            return None, None, False
        pointer = Pointer.from_bytes(legacy[0], where=self.store.url(LEGACY_POINTER_NAME))
        if self._newest_recorded_epoch() > pointer.writer_epoch:
            # A leftover of a migration whose new pointer was lost since: older than what has been claimed, so
            # the root is read by scanning (never a licence to delete) instead of resuming an old state.
            return None, None, False
        return pointer, None, True

    def _newest_recorded_epoch(self) -> int:
        epochs = [int(m.group(1)) for m in (re.fullmatch(r"e(\d+)\.json", r) for r in self.store.list_dir(ORIGINS_DIR))
                  if m]
        return max(epochs, default=0)

    def _drop_legacy_pointer(self) -> None:
        # The pointer now lives in the dot-folder and is read first: the old one is a stale copy. A reader that
        # found no new pointer a moment ago and then no old one either reads the root by scanning (never deletes).
        for name in sorted(LEGACY_NAMES):
            try:
                self.store.remove(name)
            except OSError as exc:  # cosmetic: it is never read again once the new pointer exists
                log.warning("could not remove the legacy %s: %s", self.store.url(name), exc)

    def _update(self, mutate: Callable[[Pointer], Pointer | None], *, fenced: bool,
                retire_now: bool = False) -> tuple[Pointer, Pointer]:
        """Apply ``mutate`` to the current pointer with a compare-and-swap loop; returns (new, old).

        Folders the old pointer kept alive and the new one does not are retired in the same write (deletable
        after the next commit, or at once with ``retire_now``: an operator's explicit retention). A missing
        pointer is rebuilt from the manifests first, so an update never forgets what is committed.
        """
        for attempt in range(_CAS_ATTEMPTS):
            current, version, legacy = self._read_pointer()
            if current is None:
                scan = self.scan()
                base = scan.pointer()
                if scan.manifests or scan.max_epoch:
                    log.warning("%s is missing: rebuilt it from the %d manifest(s) under %s",
                                self.store.url(POINTER_NAME), len(scan.manifests), self.url)
                if self._resumed_entry is not None and self.epoch == base.writer_epoch:
                    _protect(base, self._resumed_entry, self.writer)  # this writer's own protection, lost with it
            else:
                base = current
            if fenced and self.epoch is not None and base.writer_epoch > self.epoch:
                raise StaleWriterError(self.url, self.epoch, base.writer_epoch, base.writer)
            new = base.copy()
            for folder in self._deleted & set(new.retired):
                del new.retired[folder]
            if mutate(new) is None:
                return base, base
            live = new.live_folders()
            for folder in base.live_folders() - live:
                new.retired.setdefault(folder, -1 if retire_now else new.saves)
            for folder in [f for f in new.retired if f in live]:  # referenced again (a rebuilt catalog): keep it
                del new.retired[folder]
            new.txn = uuid.uuid4().hex
            new.root_id = new.root_id or uuid.uuid4().hex
            if self.store.write_if(POINTER_NAME, new.to_bytes(), version) or self._landed(new):
                if legacy:
                    self._drop_legacy_pointer()
                self._deleted -= set(base.retired) - set(new.retired)
                for folder in sorted(set(new.retired) - set(base.retired)):
                    # A retired folder stops being a checkpoint at once (its manifest goes now; a reader already
                    # reading it keeps its data until the next commit), so that a pointer rebuilt after a loss
                    # never takes it for a live checkpoint again.
                    self._discard(f"{folder}/{MANIFEST_NAME}")
                return new, base
            time.sleep(random.uniform(0, min(0.5, 0.01 * 2**attempt)))
        raise TimeoutError(f"could not update {self.store.url(POINTER_NAME)}: {_CAS_ATTEMPTS} conditional writes"
                           " in a row lost to other writers")

    def _landed(self, new: Pointer) -> bool:
        # The swap failed: someone else wrote, or our own write landed and only its response was lost (the retried
        # request then fails its precondition). The txn tells which.
        try:
            again, _ = self.read_pointer()
        except CheckpointError:
            return False
        return again is not None and again.txn == new.txn

    def claim(self, *, resumed_from: Entry | None = None) -> int:
        """Become the writer of this root: a newer epoch than any before, so older jobs are fenced off.

        ``resumed_from`` (default: what this process loaded from the root) is the origin of this writer's lineage:
        it becomes the latest, and checkpoints of older epochs after it are an abandoned branch from now on. None
        is a fresh start: every older checkpoint is then an abandoned branch (kept until ``gc --abandoned``).

        An origin that only the node-local tier holds (see :mod:`~lightning_resilient.io.tiered`, where
        ``pending_resume_elsewhere`` is set) is recorded as the lineage's origin all the same; this root cannot
        protect or name it as latest, and its own checkpoints up to the origin's step stay the lineage's fallbacks.
        """
        elsewhere = resumed_from is None and self.pending_resume_elsewhere
        if resumed_from is None:
            resumed_from = self.pending_resume
        self._check_fencing()
        origin = Origin(None) if resumed_from is None else Origin(resumed_from.commit, resumed_from.writer_epoch,
                                                                  resumed_from.step)
        if resumed_from is not None and not elsewhere \
                and not self.store.exists(f"{resumed_from.commit}/{MANIFEST_NAME}"):
            raise self._origin_gone(resumed_from)

        fresh_over: list[Entry] = []

        def bump(p: Pointer) -> Pointer:
            if resumed_from is not None and not elsewhere and resumed_from.commit in p.retired:
                raise self._origin_gone(resumed_from)
            fresh_over[:] = p.candidates()[:1] if resumed_from is None else []
            p.writer_epoch += 1
            p.writer = self.writer
            p.origins[p.writer_epoch] = origin
            # Protections belong to the job that set them; this job protects what it resumed from.
            p.protected = {}
            if resumed_from is not None and not elsewhere:
                _protect(p, resumed_from, self.writer)
            # The newest checkpoint of the new lineage: what a restart of this job resumes until it saves (with an
            # origin held elsewhere, this root's newest checkpoint of the lineage it continues).
            p.latest = resumed_from if not elsewhere else next(iter(p.lineage().members(p.entries())), None)
            _prune_origins(p)
            return p

        new, _ = self._update(bump, fenced=False)
        if self.store.exists(LEGACY_POINTER_NAME):  # a migration that died before deleting it
            self._drop_legacy_pointer()
        self.epoch = new.writer_epoch
        self.origin = origin
        self._resumed_entry = resumed_from if not elsewhere else None
        # After the swap (a record is only ever written for an epoch that was claimed): a crash between the two loses
        # nothing while the pointer lives (it holds the origin too); only a pointer lost as well makes a rebuild guess.
        self._record_origin(self.epoch, origin)

        self.resumed_from = resumed_from.commit if resumed_from else None
        self.pending_resume = None
        self.pending_resume_elsewhere = False
        if fresh_over:
            # Legitimate (a new experiment in the same folder), but more often a resume that found nothing:
            # ckpt_path="last" on S3/GCS (Lightning lists last*.ckpt without the protocol and finds none) or a
            # forgotten ckpt_path. Nothing is lost: the old run stays, an abandoned branch, until gc --abandoned.
            warnings.warn(
                f"this job started from scratch (no checkpoint loaded) in {self.url}, which holds a run up to step"
                f" {fresh_over[0].step}; that run is kept as an abandoned branch. To resume it instead, pass"
                f" ckpt_path=find_latest_checkpoint({self.url!r}) (ckpt_path=\"last\" finds nothing on S3/GCS: Lightning"
                " lists last.ckpt without its protocol).", RuntimeWarning, stacklevel=2)
        log.info("claimed %s as writer epoch %d (%s), %s", self.url, self.epoch, self.writer,
                 f"resuming {resumed_from.commit}" if resumed_from else "starting fresh")
        try:
            self.collect_garbage()
        except Exception as exc:  # garbage collection must never stop training
            log.warning("garbage collection under %s failed: %s", self.url, exc)
        return self.epoch

    def _origin_gone(self, resumed: Entry) -> CheckpointError:
        return CheckpointError(
            f"{self.store.url(resumed.commit)}, the checkpoint this job resumed from, was deleted by the retention of the"
            f" job still writing {self.url} before this job claimed the root, so this job's lineage cannot be"
            " recorded: nothing of it was committed. Stop the old job, then run this one again: it resumes the newest"
            " checkpoint. (A fit that resumes claims the root as soon as it loads, unless claim_on_load=False.)")

    def _record_origin(self, epoch: int, origin: Origin) -> None:
        """Store writer epoch ``epoch``'s origin beside the pointer, so that the lineage survives a lost pointer
        even for a job that dies before its first commit (best effort: the manifests carry it too)."""
        try:
            self.store.write(origin_record_name(epoch), origin.record(epoch, self.writer))
        except Exception as exc:
            log.warning("could not record the origin of writer epoch %d under %s: %s", epoch, self.url, exc)

    def _check_fencing(self) -> None:
        """Once per root and process, before the first write: warn when the store ignores conditional writes."""
        if self.url in _warned_fencing or not self.store.supports_cas:  # a store without any says so itself
            return
        _warned_fencing.add(self.url)
        reason = self.store.check_fencing()
        if reason is not None:
            warnings.warn(
                f"writer fencing is OFF for {self.url}: {reason}, so two jobs writing this root at once can overwrite"
                " each other's pointer (last writer wins). Checkpoints stay atomic and verified; make sure only one"
                " job writes the root (stop the old one before starting its replacement), or use a store that"
                " enforces conditional writes (AWS S3, GCS, local disk).", RuntimeWarning, stacklevel=4)

    def adopt(self, epoch: int, origin: Origin, origins: dict[int, Origin]) -> None:
        """Write this root as writer epoch ``epoch`` of another root: the node-local tier of a durable root whose
        claim gave ``epoch`` and ``origin`` (``origins``: that root's lineage). Commits here then carry the durable
        writer epoch and lineage, so the two tiers order and compare their checkpoints alike.

        A newer epoch already adopted here (a newer job on this node) makes this writer stale. Local checkpoints
        outside the adopted lineage can never be resumed again (a lineage only grows): they are dropped.
        """
        def bump(p: Pointer) -> Pointer:
            if p.writer_epoch > epoch:
                raise StaleWriterError(self.url, epoch, p.writer_epoch, p.writer)
            p.writer_epoch = epoch
            p.writer = self.writer
            p.origins.update(origins)
            p.origins[epoch] = origin
            p.protected = {}
            for entry in p.lineage().outside(p.entries()):
                p.checkpoints.pop(entry.name, None)
            p.latest = next(iter(p.lineage().members(p.entries())), None)
            _prune_origins(p)
            return p

        new, _ = self._update(bump, fenced=False)
        self.epoch, self.origin = epoch, origin
        self._delete_retired(new)
        try:
            self.collect_garbage()
        except Exception as exc:  # garbage collection must never stop training
            log.warning("garbage collection under %s failed: %s", self.url, exc)

    def hold(self, folders: Iterable[str], why: str) -> None:
        """Keep ``folders`` (of committed checkpoints) from retention until :meth:`release`: they are to be copied.
        Recorded in the pointer, so a ``gc`` run by another process keeps them too; a writer's next claim or adopt
        drops what a dead one held."""
        folders = list(folders)

        def add(p: Pointer) -> Pointer:
            for folder in folders:
                p.protected[folder] = why
            return p

        self._update(add, fenced=False)

    def release(self, folders: Iterable[str]) -> None:
        folders = list(folders)

        def drop(p: Pointer) -> Pointer | None:
            dropped = [f for f in folders if p.protected.pop(f, None) is not None]
            return p if dropped else None

        new, _ = self._update(drop, fenced=False)
        self._delete_retired(new)

    # -- save --------------------------------------------------------------------------------------------------
    def prepare(self, checkpoint: dict[str, Any], name: str, snapshot: layout.Snapshot | None = None,
                before_fill: Callable[[], None] = _nothing) -> Prepared:
        """Everything a save needs from the live checkpoint: after this returns, training may change it.

        Without a snapshot the upload reads the tensors in place (a synchronous save). With one (an async save),
        the tensors are copied into the snapshot's reusable buffer, after ``before_fill`` (which waits for the
        uploads still reading it) returns. A second save of the same state, as ``save_last`` makes right after a
        top-k save, reuses what the buffer already holds: no wait, and only tensors that changed (a few small
        ones, such as RNG states) are copied, into memory of their own.
        """
        skeleton, slots = layout.flatten(checkpoint)
        total = layout.plan(slots)
        step = _int(checkpoint.get("global_step"))
        tensors = [TensorEntry(slot.key, layout.dtype_name(slot.tensor.dtype), list(slot.tensor.shape),
                               slot.offset, slot.nbytes, slot.device) for slot in slots]
        skeleton_bytes = layout.save_skeleton(skeleton)
        ready: Callable[[], None] = _nothing
        if snapshot is None:
            sources = layout.host_sources(slots)
            pieces: Callable[[int, int], list[memoryview]] = lambda a, b: layout.gather(slots, sources, a, b)  # noqa: E731
        else:
            held = snapshot.match(slots, step)
            changed = sum(s.nbytes for s, ok in zip(slots, held or []) if not ok)
            if held is not None and changed <= max(2**20, total // 50):
                own = layout.host_sources([s for s, ok in zip(slots, held) if not ok])
                own_views = iter([bytes(v) for v in own])  # copies: the live tensors may change once we return
                sources = [snapshot.slot_view(s.offset, s.nbytes) if ok else memoryview(next(own_views))
                           for s, ok in zip(slots, held)]
                pieces = lambda a, b: layout.gather(slots, sources, a, b)  # noqa: E731
            else:
                before_fill()
                snapshot.fill(slots, total, step)
                view = snapshot.sources(total)
                pieces = lambda a, b: [view[a:b]]  # noqa: E731
            ready = snapshot.wait
        return Prepared(name=name, step=step, epoch=_int(checkpoint.get("epoch")),
                        created=time.time(), skeleton=skeleton_bytes, tensors=tensors, total=total,
                        pieces=pieces, ready=ready)

    def save(self, checkpoint: dict[str, Any], name: str) -> Entry:
        return self.commit(self.prepare(checkpoint, name))

    def new_commit(self, name: str, created: float) -> str:
        """The folder of a new commit of ``name`` (claiming the root first if this process has not yet)."""
        if self.epoch is None:
            self.claim()
        self._make_room(name)
        return f"{name}/c{int(created * 1000):013d}-e{self.epoch}-{uuid.uuid4().hex[:8]}"

    def _put(self, rel: str, pieces: list[memoryview], known: dict[tuple[str, int], str]) -> ObjectEntry:
        """Write one object (or reference a byte-identical one of a save of the same step); returns its entry."""
        chunks = chunk_digests(pieces, self.settings.chunk_size)
        digest, size = object_digest(chunks), sum(len(p) for p in pieces)
        existing = known.get((digest, size))
        if existing is not None:
            return ObjectEntry(existing, size, digest, chunks)
        self.store.write_pieces(rel, pieces)
        return ObjectEntry(rel, size, digest, chunks)

    def upload_stream(self, prefix: str, total: int, pieces: Callable[[int, int], list[memoryview]],
                      step: int | None = None) -> list[ObjectEntry]:
        """Upload a tensor stream of ``total`` bytes as objects ``{prefix}shard-NNNNN.bin``, in parallel."""
        known = self._known if step is not None and step == self._known_step else {}
        spans = layout.windows(total, layout.object_size(total, self.settings.shard_size, self.settings.parallelism))
        with self._executor() as pool:
            return list(pool.map(lambda i: self._put(f"{prefix}shard-{i:05d}.bin", pieces(*spans[i]), known),
                                 range(len(spans))))

    def commit(self, prepared: Prepared, *, commit: str | None = None, extra: list[ObjectEntry] | None = None,
               sharded: Callable[[list[ObjectEntry]], dict[str, Any]] | None = None) -> Entry:
        """Upload a prepared checkpoint, write its manifest, then move the pointer to it.

        A sharded save (``sharded.py``) passes the commit folder its ranks already wrote into, their objects
        (``extra``), and a function giving the manifest's ``sharded`` record from the final object list.
        """
        commit = commit or self.new_commit(prepared.name, prepared.created)
        try:
            prepared.ready()
            return self._commit(prepared, commit, extra, sharded)
        except BaseException:
            # Not committed, so nothing refers to it: delete it now (a crash instead leaves it to gc). If the
            # pointer may have moved to it after all (a lost response), it is left alone.
            if not self._maybe_referenced(commit):
                self._discard(commit)
                self._put_back(prepared.name)
            raise

    def make_room(self, name: str) -> None:
        """Before a commit of ``name`` that did not come through :meth:`new_commit` (a persist from a local tier):
        what stock Lightning left under that name goes aside until the commit is published (:meth:`put_back` on
        failure)."""
        self._make_room(name)

    def put_back(self, name: str) -> None:
        self._put_back(name)

    def _make_room(self, name: str) -> None:
        """Clear ``name`` of what stock Lightning left there, as stock Lightning would overwrite it.

        A ``save_last="link"`` symlink holds no data: it goes. A stock checkpoint file of that name (a run from before
        this plugin was added, whose ``last.ckpt`` is saved again now) stays a resumable checkpoint until the save that
        replaces it has committed: on local disk, where a file and a folder cannot share a name, it waits in the
        dot-folder (where ``find_latest_checkpoint`` still finds it, and from where a failed save puts it back); on an
        object store the key and our prefix coexist, and the key is deleted after the commit. Stock files are found by
        one listing of the root per process."""
        if self.store.is_link(name):
            self.store.remove_object(name)  # the link, never what it points to
            return
        if self._stock is None:
            self._stock = self._list_stock()
        if name in self._leftover:  # moved aside by a save that never committed: this one replaces it
            self._aside[name] = self._leftover.pop(name)
        if name not in self._stock:
            return
        self._stock.discard(name)
        if isinstance(self.store, LocalStore):
            aside = f"{REPLACED_DIR}/{name}"
            self.store.move(name, aside)
            log.info("moved the stock checkpoint %s aside until a committed save of the same name replaces it",
                     self.store.url(name))
            self._aside[name] = aside
        else:
            self._aside[name] = name

    def _list_stock(self) -> set[str]:
        names = {n for n in self.store.list_detail("") if not n.startswith(".") and n not in LEGACY_NAMES}
        pointer, _ = self.read_pointer()
        committed = set(pointer.checkpoints) if pointer is not None else set()
        for name in self.store.list_detail(REPLACED_DIR):
            if name in committed:  # its replacement committed; the process died before deleting it
                self.store.remove_object(f"{REPLACED_DIR}/{name}")
            else:
                self._leftover[name] = f"{REPLACED_DIR}/{name}"
        return names

    def _replaced(self, name: str) -> None:
        aside = self._aside.pop(name, None)
        if aside is not None:
            self.store.remove_object(aside)

    def _put_back(self, name: str) -> None:
        """The save of ``name`` failed: a stock file moved aside for it goes back where it was."""
        aside = self._aside.pop(name, None)
        if aside is None or aside == name:
            return
        try:
            self._tidy_names({name})  # the failed save's now empty name folder, where the file goes back
            self.store.move(aside, name)
        except OSError as exc:  # still in the dot-folder, where find_latest_checkpoint finds it
            log.warning("could not put the stock checkpoint %s back: %s", self.store.url(aside), exc)

    def forget_stock(self, name: str) -> bool:
        """Delete ``name`` when it is a stock Lightning file or link (``remove_checkpoint`` of a path this plugin did not
        write, as stock Lightning deletes it): that one object only, never a checkpoint of ours of the same name."""
        if self.store.is_link(name) or self.store.is_file(name):
            self.store.remove_object(name)
            if self._stock is not None:
                self._stock.discard(name)
            return True
        return False

    def abandon(self, commit: str) -> None:
        """Delete the folder of a commit that failed before its pointer move, unless the pointer may name it after
        all (a lost response): what a failed save does, and a failed persist into this root."""
        if not self._maybe_referenced(commit):
            self._discard(commit)

    def _maybe_referenced(self, commit: str) -> bool:
        try:
            pointer, _ = self.read_pointer()
        except Exception:
            return True
        return pointer is None or commit in pointer.live_folders()

    def _commit(self, prepared: Prepared, commit: str, extra: list[ObjectEntry] | None,
                sharded: Callable[[list[ObjectEntry]], dict[str, Any]] | None) -> Entry:
        assert self.epoch is not None and self.origin is not None
        epoch, origin, name, step = self.epoch, self.origin, prepared.name, prepared.step
        objects = self.upload_stream(f"{commit}/", prepared.total, prepared.pieces, step)
        stream = list(range(len(objects)))
        objects.append(self._put(f"{commit}/{SKELETON_NAME}", [memoryview(prepared.skeleton)],
                                 self._known if step == self._known_step else {}))
        skeleton = len(objects) - 1
        objects += extra or []
        manifest = Manifest(name=name, commit=commit, step=step, epoch=prepared.epoch, created=prepared.created,
                            writer_epoch=epoch, chunk_size=self.settings.chunk_size, skeleton=skeleton,
                            stream=stream, objects=objects, tensors=prepared.tensors,
                            sharded=sharded(objects) if sharded is not None else None, origin=origin)
        return self.publish(manifest)

    def publish(self, manifest: Manifest) -> Entry:
        """Commit ``manifest``, whose objects are stored: check them, write the manifest, move the pointer.

        A save's last step, and the whole of persisting a node-local checkpoint to its durable tier (the objects
        copied there first, the manifest the one the local tier committed: same commit, writer epoch and origin).
        """
        assert self.epoch is not None and manifest.writer_epoch == self.epoch
        commit, name, step, epoch, origin = manifest.commit, manifest.name, manifest.step, self.epoch, manifest.origin
        self.store.sync_folder(commit)  # the data is durable before the manifest names it
        self._check_stored(manifest.objects, commit)
        # The manifest goes last: until it exists, this folder is not a checkpoint.
        self.store.write(f"{commit}/{MANIFEST_NAME}", manifest.to_bytes())
        for folder in (commit, name, ""):  # and it, and the folders holding it, before the pointer names it
            self.store.sync_folder(folder)
        entry = Entry.from_manifest(manifest)
        reused = set(entry.folders) - {commit}

        def add(p: Pointer) -> Pointer:
            if not reused <= p.live_folders():  # shared bytes of an earlier commit must still be kept alive
                raise CheckpointError(f"{self.store.url(commit)} shares objects with {sorted(reused - p.live_folders())},"
                                      " which were retired while it uploaded: the save was not committed")
            if p.last_saved != [epoch, step]:  # save_last at the step of a top-k save is the same save
                p.saves += 1
                p.last_saved = [epoch, step]
            p.writer_epoch = max(p.writer_epoch, epoch)  # a rebuilt pointer may not have seen this writer yet
            if origin is not None:  # this writer knows its origin (a rebuilt pointer may only have guessed it)
                p.origins[epoch] = origin
            p.writer = p.writer or self.writer
            p.checkpoints[name] = entry
            # Within one writer the pointer never moves to a lower step.
            if p.latest is None or entry.order >= p.latest.order:
                p.latest = entry
            self._apply_keep_last(p)
            return p

        new, _ = self._update(add, fenced=True)
        self._remember(manifest, new)
        log.info("committed %s (step %d, %d objects, %d bytes)", self.store.url(commit), entry.step,
                 len(manifest.objects), entry.size)
        self._delete_retired(new)
        self._replaced(name)
        return entry

    def _check_stored(self, objects: list[ObjectEntry], commit: str) -> None:
        """Every object the manifest will name is stored with its size: a commit never references what is gone."""
        found = self._stored_sizes({o.path for o in objects})
        for obj in objects:
            size = found.get(obj.path)
            if size == obj.size:
                continue
            pointer, _ = self.read_pointer()
            if pointer is not None and self.epoch is not None and pointer.writer_epoch > self.epoch:
                raise StaleWriterError(self.url, self.epoch, pointer.writer_epoch, pointer.writer)
            what = "is missing" if size is None else f"has {size} bytes, not {obj.size}"
            raise CheckpointError(f"{self.store.url(obj.path)} {what} just before {self.store.url(commit)} was to be"
                                  " committed (something deleted or replaced it): the save was not committed")

    def _stored_sizes(self, paths: Iterable[str]) -> dict[str, int]:
        """The stored size of each object under the folders holding ``paths``: one listing per folder."""
        out: dict[str, int] = {}
        for folder in sorted({p.rsplit("/", 1)[0] for p in paths}):
            for obj, info in self.store.list_detail(folder).items():
                out[f"{folder}/{obj}"] = info.size
        return out

    def _apply_keep_last(self, p: Pointer) -> None:
        if self.settings.keep_last is not None:
            for entry in _beyond(p, self.settings.keep_last):
                del p.checkpoints[entry.name]

    def retain(self, keep_last: int, *, dry_run: bool = False) -> list[Entry]:
        """Drop all but the ``keep_last`` newest checkpoints of the current lineage now (an operator's retention).

        The latest and what a job resumed from are kept; abandoned branches are not counted (``gc --abandoned``).
        Does not claim the root: a job writing it is not fenced, and the conditional pointer update makes this
        safe to run beside it. Returns what was (would be) dropped.
        """
        pointer, _ = self.read_pointer()
        if pointer is None or dry_run:
            return _beyond(pointer, keep_last) if pointer is not None else []
        dropped: list[Entry] = []

        def drop(p: Pointer) -> Pointer | None:
            dropped[:] = _beyond(p, keep_last)
            for entry in dropped:
                del p.checkpoints[entry.name]
            return p if dropped else None

        new, _ = self._update(drop, fenced=False, retire_now=True)
        self._delete_retired(new)
        return dropped

    def drop_abandoned(self, *, dry_run: bool = False) -> list[Entry]:
        """Drop from the catalog every checkpoint outside the current lineage (an operator's ``gc --abandoned``)."""
        pointer, _ = self.read_pointer()
        if pointer is None or dry_run:
            return _abandoned(pointer) if pointer is not None else []
        dropped: list[Entry] = []

        def drop(p: Pointer) -> Pointer | None:
            dropped[:] = _abandoned(p)
            for entry in dropped:
                del p.checkpoints[entry.name]
            return p if dropped else None

        new, _ = self._update(drop, fenced=False, retire_now=True)
        self._delete_retired(new)
        return dropped

    def drop(self, commits: set[str], *, dry_run: bool = False) -> list[Entry]:
        """Drop the checkpoints ``commits`` from the catalog now and delete them (an operator's ``gc`` of a local
        tier, for its checkpoints outside the durable lineage). Returns what was (would be) dropped."""
        pointer, _ = self.read_pointer()
        if pointer is None:
            return []
        if dry_run:
            return [e for e in pointer.entries() if e.commit in commits]
        dropped: list[Entry] = []

        def mutate(p: Pointer) -> Pointer | None:
            dropped[:] = [e for e in p.entries() if e.commit in commits]
            for entry in dropped:
                p.checkpoints.pop(entry.name, None)
                if p.latest is not None and p.latest.commit == entry.commit:
                    p.latest = None
            return p if dropped else None

        new, _ = self._update(mutate, fenced=False, retire_now=True)
        self._delete_retired(new)
        return dropped

    def _discard(self, commit: str) -> None:
        """Delete an uncommitted folder (best effort)."""
        try:
            self.store.remove(commit)
        except Exception as exc:
            log.warning("could not delete uncommitted %s: %s", self.store.url(commit), exc)

    def _delete_committed(self, folder: str) -> bool:
        """Delete a retired (or abandoned) committed folder: its manifest first, so that a deletion interrupted
        half-way leaves a folder without a manifest (never a checkpoint with missing objects)."""
        try:
            self.store.remove(f"{folder}/{MANIFEST_NAME}")
            self.store.remove(folder)
        except Exception as exc:
            log.warning("could not delete %s: %s", self.store.url(folder), exc)
            return False
        return True

    def _delete_retired(self, pointer: Pointer) -> list[str]:
        """Delete the retired folders whose time has come (a commit happened since they were retired)."""
        deleted = [f for f in sorted(pointer.retired_due()) if self._delete_committed(f)]
        self._deleted.update(deleted)
        self._tidy_names({f.split("/", 1)[0] for f in deleted})
        return deleted

    def _tidy_names(self, names: set[str]) -> None:
        # Local disk keeps empty name folders after their last commit is deleted; object stores have none.
        if not self.store.supports_read_into:  # i.e. not local disk
            return
        for name in names:
            try:
                os.rmdir(self.store.path(name))
            except OSError:
                pass

    def _remember(self, manifest: Manifest, pointer: Pointer | None = None) -> None:
        if manifest.step != self._known_step:
            self._known = {}
        self._known_step = manifest.step
        live = pointer.live_folders() if pointer is not None else None
        self._known = {k: v for k, v in self._known.items() if live is None or v.rsplit("/", 1)[0] in live}
        for obj in manifest.objects:
            self._known[(obj.digest, obj.size)] = obj.path

    # -- remove ------------------------------------------------------------------------------------------------
    def remove(self, name: str) -> None:
        def drop(p: Pointer) -> Pointer | None:
            entry = p.checkpoints.get(name)
            if entry is None:
                return None
            if _is_resumed(p, entry):
                log.info("not removing %s: this job resumed from it", self.store.url(name))
                return None
            del p.checkpoints[name]
            return p

        pointer, _ = self.read_pointer()
        if pointer is not None and name not in pointer.checkpoints:
            return  # not a name of ours (nothing to remove, and no reason to claim the root or write its pointer)
        if self.epoch is None:
            self.claim()
        self._update(drop, fenced=True)

    def resumed(self, entry: Entry, *, elsewhere: bool = False) -> None:
        """Record that this process loaded ``entry`` from the root (a fit's resume claims with it as origin);
        ``elsewhere``: only the root's node-local tier holds it (see :meth:`claim`)."""
        if self.epoch is None:
            self.pending_resume = entry
            self.pending_resume_elsewhere = elsewhere

    # -- load --------------------------------------------------------------------------------------------------
    def read_manifest(self, commit: str) -> Manifest:
        where = self.store.url(f"{commit}/{MANIFEST_NAME}")
        try:
            data = self.store.read(f"{commit}/{MANIFEST_NAME}")
        except FileNotFoundError as exc:
            raise CheckpointCorruptedError(f"{where} is missing: {self.store.url(commit)} was never committed or"
                                           " was deleted", object=where) from exc
        manifest = Manifest.from_bytes(data, where=where)
        if manifest.commit != commit:
            raise CheckpointCorruptedError(f"{where} describes {manifest.commit!r}, not {commit!r}", object=where)
        return manifest

    def check_sizes(self, commit: str, manifest: Manifest | None = None) -> Manifest:
        """Cheap structural check, before anything is allocated or read: every object the manifest names is stored
        with the size it declares (one listing per folder), and every tensor's byte count matches its dtype and
        shape. A manifest can therefore never make a load allocate more than the stored bytes."""
        manifest = manifest if manifest is not None else self.read_manifest(commit)
        stored = self._stored_sizes(o.path for o in manifest.objects)
        for obj in manifest.objects:
            url = self.store.url(obj.path)
            size = stored.get(obj.path)
            if size is None:
                raise CheckpointCorruptedError(f"{url} is missing", object=url)
            if size != obj.size:
                raise CheckpointCorruptedError(f"{url} has {size} bytes, the manifest says {obj.size}", object=url)
        where = self.store.url(f"{commit}/{MANIFEST_NAME}")
        for t in manifest.tensors:
            try:
                itemsize = layout.parse_dtype(t.dtype).itemsize
            except ValueError as exc:
                raise CheckpointCorruptedError(f"tensor {layout.key_id(t.key)!r} in {where}: {exc}",
                                               object=where) from exc
            if any(d < 0 for d in t.shape) or math.prod(t.shape) * itemsize != t.nbytes:
                raise CheckpointCorruptedError(f"tensor {layout.key_id(t.key)!r} in {where} declares shape {t.shape}"
                                               f" of {t.dtype} in {t.nbytes} bytes", object=where)
        return manifest

    def read_chunks(self, manifest: Manifest, index: int, sink: Callable[[int, memoryview], None],
                    only: Callable[[int, int], bool] | None = None,
                    into: Callable[[int, int], list[memoryview]] | None = None) -> list[Job]:
        """Jobs that read object ``index``, verify every chunk and hand the verified bytes to ``sink`` (with their
        offset in the object); ``only(start, end)`` selects the chunks to read (default: all).

        Consecutive chunks are read with one request of at least :data:`READ_SPAN` bytes, each chunk checked
        against its own digest; a request's bytes reach ``sink`` only as they pass through the digest (the caller
        keeps nothing until the whole load has verified). ``into(start, end)`` may give the final destination
        of a span's bytes (the tensors' buffers): a store that can read into memory (local disk) then fills them
        directly, with no copy in between.
        """
        obj = manifest.objects[index]
        url = self.store.url(obj.path)
        direct = into is not None and self.store.supports_read_into
        wanted = [(j, a, b) for j, (a, b) in enumerate(manifest.chunk_ranges(index)) if only is None or only(a, b)]
        spans: list[list[tuple[int, int, int]]] = []
        for chunk in wanted:
            last = spans[-1] if spans else None
            if last is not None and last[-1][2] == chunk[1] and last[-1][2] - last[0][1] < READ_SPAN:
                last.append(chunk)
            else:
                spans.append([chunk])

        def job(chunks: list[tuple[int, int, int]]) -> int:
            a, b = chunks[0][1], chunks[-1][2]
            check = _ChunkCheck(manifest, obj, chunks, url)
            try:
                if direct:
                    assert into is not None
                    views = into(a, b)
                    got = self.store.read_into(obj.path, a, views)
                    remaining = got
                    for view in views:
                        check.feed(view[:remaining])
                        remaining -= min(remaining, len(view))
                else:
                    def consume(pieces: Any) -> int:
                        check.restart()
                        n = 0
                        for piece in pieces:
                            check.feed(piece)
                            sink(a + n, piece)
                            n += len(piece)
                        return n

                    got = self.store.read_range(obj.path, a, b, consume)
            except FileNotFoundError as exc:
                raise CheckpointCorruptedError(f"{url} is missing", object=url) from exc
            if got != b - a:
                raise CheckpointCorruptedError(f"{url} ends at byte {a + got}, the manifest says it has {obj.size}"
                                               " (truncated or replaced)", object=url)
            check.finish()
            return got

        return [functools.partial(job, chunks) for chunks in spans]

    def run(self, jobs: list[Job], on_done: Callable[[int], None] | None = None) -> None:
        """Run read jobs in parallel; the first failure cancels what has not started and is raised."""
        with self._executor() as pool:
            futures = [pool.submit(job) for job in jobs]
            try:
                for future in as_completed(futures):
                    n = future.result()
                    if on_done is not None:
                        on_done(n)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def load(self, commit: str, *, map_location: Any, weights_only: bool | None,
             pin_memory: bool = False, sharded_rest: bool = False,
             tee: Callable[[str, int, memoryview], None] | None = None, manifest: Manifest | None = None) -> Loaded:
        """Read, verify and rebuild one commit: one manifest read, then every chunk of every object in parallel,
        scattered straight into one buffer per tensor (pinned when ``pin_memory``).

        A sharded commit holds its model and optimizer states in per-rank streams that only
        ``torch.distributed.checkpoint`` can place: loading it here is an error unless ``sharded_rest`` asks for
        just the rest (loops, callbacks, ...), as the sharded strategy does. ``tee(path, offset, piece)`` also
        receives every byte read (the node cache keeps a copy with it). ``manifest``: this commit's manifest, when
        the caller has already read it.
        """
        started = time.perf_counter()
        if manifest is None:
            manifest = self.read_manifest(commit)
        elif manifest.commit != commit:
            raise ValueError(f"the manifest given is {manifest.commit!r}'s, not {commit!r}'s")
        self.check_sizes(commit, manifest)  # before anything is allocated from the manifest's declared sizes
        if manifest.sharded is not None and not sharded_rest:
            raise ShardedCheckpointError(
                f"{self.store.url(commit)} is a sharded checkpoint written by {manifest.sharded['world_size']}"
                " processes (torch.distributed.checkpoint): resume it with the strategy that wrote it,"
                " lightning_resilient.AtomicModelParallelStrategy (FSDP2) or AtomicFSDPStrategy (FSDP1), on any"
                " number of processes (it reshards), or"
                " consolidate it into one full state dict with lightning_resilient.io.sharded.load_full(url)")
        allocated: list[int] = []

        def allocate(n: int) -> torch.Tensor:
            allocated.append(n)
            return torch.empty(n, dtype=torch.uint8, pin_memory=pin_memory)

        scatter = layout.Scatter([(t.offset, t.nbytes) for t in manifest.tensors], allocate=allocate)
        skeleton_obj = manifest.objects[manifest.skeleton]
        skeleton_buf = bytearray(skeleton_obj.size)

        def to_skeleton(offset: int, piece: memoryview) -> None:
            skeleton_buf[offset : offset + len(piece)] = piece

        def teed(index: int, sink: Callable[[int, memoryview], None]) -> Callable[[int, memoryview], None]:
            if tee is None:
                return sink
            path = manifest.objects[index].path

            def both(offset: int, piece: memoryview) -> None:
                sink(offset, piece)
                tee(path, offset, piece)

            return both

        jobs = self.read_chunks(manifest, manifest.skeleton, teed(manifest.skeleton, to_skeleton))
        for index, start in zip(manifest.stream, manifest.stream_offsets()):
            into = None if tee is not None else functools.partial(_views, scatter, start)
            jobs += self.read_chunks(manifest, index, teed(index, functools.partial(_shifted, scatter.write, start)),
                                     into=into)
        self.run(jobs)
        skeleton_url = self.store.url(skeleton_obj.path)
        try:
            skeleton = layout.load_skeleton(bytes(skeleton_buf), weights_only=weights_only,
                                            map_location=map_location if map_location is not None else "cpu")
        except Exception as exc:
            # The bytes passed their checksums, so this is not corruption (no fallback): under weights_only, torch
            # refused an object the checkpoint holds, or a class it names cannot be imported here.
            _add_note(exc, f"{skeleton_url} (the non-tensor part of {self.store.url(commit)}) verified against its"
                           " checksums but does not load here. If torch refused an object under weights_only and you"
                           " trust this checkpoint, allow it with torch.serialization.add_safe_globals([...]) or load"
                           " with weights_only=False; otherwise make the classes it names importable.")
            raise
        tensors = {}
        moved = False
        for t, buffer in zip(manifest.tensors, scatter.buffers):
            try:
                tensor = layout.tensor_view(buffer, layout.parse_dtype(t.dtype), t.shape)
            except (ValueError, RuntimeError) as exc:
                where = self.store.url(f"{commit}/{MANIFEST_NAME}")
                raise CheckpointCorruptedError(f"tensor {layout.key_id(t.key)!r} in {where}: {exc}",
                                               object=where) from exc
            mapped = _map(tensor, t.device, map_location, non_blocking=pin_memory)
            moved = moved or mapped is not tensor
            tensors[layout.key_id(t.key)] = mapped
        if moved and pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned host buffers may be freed once this returns
        try:
            checkpoint = layout.unflatten(skeleton, tensors)
        except ValueError as exc:
            where = self.store.url(f"{commit}/{MANIFEST_NAME}")
            raise CheckpointCorruptedError(f"{where} does not match its skeleton: {exc}", object=where) from exc
        stats = LoadStats(commit=commit, bytes=manifest.total_bytes, objects=len(manifest.objects),
                          requests=len(jobs), host_buffer_bytes=sum(allocated), host_buffers=len(allocated),
                          seconds=time.perf_counter() - started)
        return Loaded(checkpoint, commit, manifest, stats)

    def verify(self, commit: str, progress: Callable[[int], None] | None = None) -> Manifest:
        """Read every byte of a commit and check every checksum, keeping nothing; raises on the first failure.

        ``progress`` is called with the number of bytes of each chunk verified.
        """
        manifest = self.check_sizes(commit)
        jobs: list[Job] = []
        for index in range(len(manifest.objects)):
            jobs += self.read_chunks(manifest, index, _discard_piece)
        self.run(jobs, progress)
        return manifest

    def remember_loaded(self, loaded: Loaded) -> None:
        self._remember(loaded.manifest)

    # -- garbage -----------------------------------------------------------------------------------------------
    def scan(self) -> Scan:
        """List every commit folder and read every manifest (for a root whose pointer is missing or damaged)."""
        scan = Scan()
        for record in self.store.list_dir(ORIGINS_DIR):
            rel = f"{ORIGINS_DIR}/{record}"
            try:
                epoch, origin = Origin.from_record(self.store.read(rel), where=self.store.url(rel))
            except (CheckpointCorruptedError, FileNotFoundError):
                continue  # a damaged record only costs the lineage of one epoch: the manifests also carry it
            scan.origins[epoch] = origin
            scan.max_epoch = max(scan.max_epoch, epoch)
        for name in self.store.list_dir(""):
            if name in LEGACY_NAMES or name.startswith("."):
                continue
            for child in self.store.list_dir(name):
                epoch = commit_epoch(child)
                if epoch is None:
                    continue
                scan.max_epoch = max(scan.max_epoch, epoch)
                commit = f"{name}/{child}"
                try:
                    scan.manifests.append(self.read_manifest(commit))
                except (CheckpointCorruptedError, UnsupportedFormatError) as exc:
                    if self.store.exists(f"{commit}/{MANIFEST_NAME}"):
                        scan.unreadable[commit] = str(exc)
                    else:
                        scan.uncommitted.append(commit)
        return scan

    def collect_garbage(self, *, dry_run: bool = False, abandoned: bool = False) -> list[tuple[str, str]]:
        """Delete what no committed checkpoint of the root needs; returns ``(url, why)`` of each folder deleted
        (or, with ``dry_run``, that would be).

        - retired folders whose time has come (a commit has happened since retention dropped them);
        - folders the pointer does not reference, of a writer epoch older than the pointer's (their writer is
          fenced, so it can never commit them): those without a manifest, and those whose manifest lies outside the
          current lineage (the writer died between its manifest and the pointer update, so no resume can ever pick
          them). A save in progress of the current writer is never touched, whatever its age or the clocks, nor is
          an unreferenced commit inside the lineage. ``orphan_grace_seconds`` leaves such a folder a while longer,
          measured with the store's own timestamps (its newest object against the pointer's last write), never
          against this host's clock;
        - with ``abandoned`` only: checkpoints the pointer catalogs outside the current lineage (a branch a
          rollback left behind).

        Also aborts incomplete multipart uploads and removes temp files of interrupted pointer writes. Without a
        pointer nothing is deleted (a missing pointer is never a licence to delete); a damaged one raises.
        """
        pointer, _ = self.read_pointer()
        if pointer is None:
            if self.scan().manifests:
                log.warning("%s is missing: nothing collected under %s (its checkpoints are found by scanning; the"
                            " next save, or repair_pointer, rebuilds it)", self.store.url(POINTER_NAME), self.url)
            return []
        doomed: list[tuple[str, str]] = []
        if abandoned:
            for entry in self.drop_abandoned(dry_run=dry_run):
                doomed += [(self.store.url(f), f"checkpoint {entry.name} (step {entry.step}) of an abandoned branch")
                           for f in entry.folders]
            pointer, _ = self.read_pointer()
            if pointer is None:
                return doomed
        head, live, due, lineage = pointer.writer_epoch, pointer.live_folders(), pointer.retired_due(), pointer.lineage()
        reference = self.store.modified(POINTER_NAME) or self.store.modified(LEGACY_POINTER_NAME) or time.time()
        grace = self.settings.orphan_grace_seconds
        partial: list[str] = []
        committed: list[str] = []
        for name in self.store.list_dir(""):
            if name in LEGACY_NAMES or name.startswith("."):
                continue
            for child in self.store.list_dir(name):
                epoch, folder = commit_epoch(child), f"{name}/{child}"
                if epoch is None or folder in live:
                    continue
                if folder in pointer.retired:
                    if folder in due:
                        committed.append(folder)
                        doomed.append((self.store.url(folder), "retired by retention"))
                    continue
                if epoch >= head:
                    continue  # the current writer may still commit it: never collected, whatever its age
                objects = self.store.list_detail(folder)
                newest = max((o.modified for o in objects.values() if o.modified is not None), default=None)
                if newest is not None and reference - newest < grace:
                    continue
                if MANIFEST_NAME not in objects:
                    partial.append(folder)
                    doomed.append((self.store.url(folder), f"no manifest, written by fenced writer epoch {epoch}"))
                elif self._outside(lineage, folder):
                    # Its writer died (or was fenced) between the manifest and the pointer update: never visible,
                    # and outside the lineage, so no resume can ever pick it. One inside the lineage is kept.
                    committed.append(folder)
                    doomed.append((self.store.url(folder), f"manifest never referenced by the pointer, writer epoch"
                                                           f" {epoch} fenced, outside the current lineage"))
        if not dry_run:
            for folder in partial:
                self._discard(folder)
            deleted = [f for f in committed if self._delete_committed(f)]
            self._tidy_names({f.split("/", 1)[0] for f in partial + deleted})
            self._deleted |= {f for f in deleted if f in pointer.retired}
            if self._deleted and self.epoch is None:  # a writer prunes the records at its next commit; an operator
                self._update(lambda p: p, fenced=False)  # now
            self._prune_origin_records(pointer)
            for key in self.store.abort_stale_uploads(reference - grace):
                log.info("aborted incomplete multipart upload %s", key)
            for name in self.store.remove_stale_temp_files(POINTER_NAME):
                log.info("removed %s, left by an interrupted pointer write", name)
        if doomed:
            log.info("%s %d folder(s) under %s", "would delete" if dry_run else "deleted", len(doomed), self.url)
        return doomed

    def _prune_origin_records(self, pointer: Pointer) -> None:
        """Delete origin records of epochs older than every checkpoint the pointer names: no lineage reaches them."""
        oldest = min([e.writer_epoch for e in pointer.entries()] + [pointer.writer_epoch])
        for record in self.store.list_dir(ORIGINS_DIR):
            match = re.fullmatch(r"e(\d+)\.json", record)
            if match and int(match.group(1)) < oldest:
                self._discard(f"{ORIGINS_DIR}/{record}")

    def _outside(self, lineage: Lineage, folder: str) -> bool:
        try:
            return not lineage.contains(self.read_manifest(folder))
        except CheckpointCorruptedError:
            return True  # a manifest that does not load makes nothing loadable
        except UnsupportedFormatError:
            return False  # a newer version wrote it: not ours to judge


def _beyond(p: Pointer, keep: int) -> list[Entry]:
    """Catalog entries of the current lineage past the ``keep`` newest checkpoints, except the latest and what a job
    resumed from (what its restart would need). Abandoned branches are neither counted nor dropped here.

    A checkpoint is a training state (writer epoch, step), not a name: ``last.ckpt`` saved at the step of a top-k
    save is the same state under a second name, so it does not take one of the ``keep`` places."""
    ordered = p.lineage().members(p.checkpoints.values())
    kept: set[tuple[int, int] | str] = set()
    beyond = []
    for e in ordered:
        # Saves that record no step (Fabric's, a plain save_checkpoint) are each a state of their own.
        state: tuple[int, int] | str = (e.writer_epoch, e.step) if e.step > 0 else e.commit
        if state in kept or len(kept) < keep:
            kept.add(state)
        else:
            beyond.append(e)
    return [e for e in beyond if not (p.latest is not None and e.commit == p.latest.commit) and not _is_resumed(p, e)]


def _abandoned(p: Pointer) -> list[Entry]:
    """Catalog entries outside the current lineage (never the latest or a resumed-from checkpoint)."""
    return [e for e in p.lineage().outside(p.checkpoints.values())
            if not (p.latest is not None and e.commit == p.latest.commit) and not _is_resumed(p, e)]


def _prune_origins(p: Pointer) -> None:
    """Forget the origins of epochs older than every checkpoint the pointer still names: no lineage reaches them."""
    epochs = [e.writer_epoch for e in p.entries()] + [p.writer_epoch]
    oldest = min(epochs)
    p.origins = {k: v for k, v in p.origins.items() if k >= oldest}


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", []):
        exc.add_note(note)


def _protect(p: Pointer, resumed: Entry, writer: str) -> None:
    p.protected.update({f: f"data of the checkpoint {writer} resumed from" for f in resumed.folders})
    p.protected[resumed.commit] = f"{RESUMED} by {writer}"


def _is_resumed(p: Pointer, entry: Entry) -> bool:
    return p.protected.get(entry.commit, "").startswith(RESUMED)


def _int(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.item())
    return int(value) if isinstance(value, (int, float)) else 0


def _map(tensor: torch.Tensor, saved_device: str, map_location: Any, *, non_blocking: bool = False) -> torch.Tensor:
    """Where ``map_location`` puts a tensor saved on ``saved_device`` (loads keep tensors on the CPU without one)."""
    if map_location is None:
        return tensor
    if isinstance(map_location, dict):
        target = map_location.get(saved_device, saved_device)
        device = torch.device(target)
    elif callable(map_location):
        storage = map_location(tensor.untyped_storage(), saved_device)
        device = getattr(storage, "device", torch.device("cpu"))
    else:
        device = torch.device(map_location)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=non_blocking)
