"""One checkpoint root: the commit protocol, writer fencing, retention and garbage collection.

Save: shard objects -> skeleton -> manifest (last) -> conditional swap of the pointer -> delete what no live
checkpoint needs any more. A crash before the swap leaves the previous pointer valid and the new folder an
orphan (collected after a grace period); a crash after it leaves at worst undeleted garbage.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass
from typing import Any

import torch

from lightning_resilient.errors import CheckpointCorruptedError, ShardedCheckpointError, StaleWriterError
from lightning_resilient.io import layout
from lightning_resilient.io.manifest import (
    MANIFEST_NAME,
    Manifest,
    ObjectEntry,
    TensorEntry,
    chunk_digests,
    hasher,
    object_digest,
)
from lightning_resilient.io.pointer import POINTER_NAME, Entry, Pointer
from lightning_resilient.io.store import LocalStore, Store

__all__ = ["CheckpointRoot", "LoadStats", "Prepared", "RootSettings"]

log = logging.getLogger(__name__)

_COMMIT_RE = re.compile(r"^c(\d{13})-e(\d+)-[0-9a-f]{8}$")
SKELETON_NAME = "skeleton.pt"
_CAS_ATTEMPTS = 50
RESUMED = "resumed from"


def writer_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def commit_time(commit: str) -> float | None:
    """When a commit folder was started (its name carries the time; object stores have no folder mtime)."""
    match = _COMMIT_RE.match(commit.rsplit("/", 1)[-1])
    return int(match.group(1)) / 1000 if match else None


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


@dataclass
class Loaded:
    checkpoint: dict[str, Any]
    entry_commit: str
    manifest: Manifest
    stats: LoadStats | None = None


Job = Callable[[], int]


def _nothing() -> None:
    pass


def _shifted(write: Callable[[int, memoryview], None], start: int, offset: int, piece: memoryview) -> None:
    write(start + offset, piece)


def _views(scatter: layout.Scatter, start: int, a: int, b: int) -> list[memoryview]:
    return scatter.views(start + a, b - a)


def _discard_piece(offset: int, piece: memoryview) -> None:
    pass


class CheckpointRoot:
    """The protocol for the checkpoints under one root URL, as one writer sees it."""

    def __init__(self, store: Store, settings: RootSettings, executor: Callable[[], Executor]) -> None:
        """``executor`` makes a fresh pool per save or load (threads never outlive the operation)."""
        self.store = store
        self.settings = settings
        self._executor = executor
        self.writer = writer_identity()
        self.epoch: int | None = None  # writer epoch this process claimed, once it did
        self.resumed_from: str | None = None
        # (digest, size) -> root-relative path of the objects of the last commit, and its step. A save of the
        # same step whose shard is byte-identical (ModelCheckpoint's save_last right after a top-k save)
        # references the object instead of uploading it again. Only at the same step: checkpoints of
        # different steps never share bytes, so one corrupted object can never take several of them down.
        self._known: dict[tuple[str, int], str] = {}
        self._known_step: int | None = None

    @property
    def url(self) -> str:
        return self.store.root_url

    # -- pointer -----------------------------------------------------------------------------------------------
    def read_pointer(self) -> tuple[Pointer | None, str | None]:
        got = self.store.read_versioned(POINTER_NAME)
        if got is None:
            return None, None
        data, version = got
        return Pointer.from_bytes(data, where=self.store.url(POINTER_NAME)), version

    def _update(self, mutate: Callable[[Pointer], Pointer | None], *, fenced: bool) -> tuple[Pointer, Pointer]:
        """Apply ``mutate`` to the current pointer with a compare-and-swap loop; returns (new, old)."""
        for attempt in range(_CAS_ATTEMPTS):
            current, version = self.read_pointer()
            base = current if current is not None else Pointer()
            if fenced and current is not None and self.epoch is not None and current.writer_epoch != self.epoch:
                raise StaleWriterError(self.url, self.epoch, current.writer_epoch, current.writer)
            new = mutate(base.copy())
            if new is None:
                return base, base
            new.txn = uuid.uuid4().hex
            if self.store.write_if(POINTER_NAME, new.to_bytes(), version):
                return new, base
            # The swap failed: someone else wrote, or our own write landed and only its response was lost
            # (the retried request then fails its precondition). The txn tells which.
            again, _ = self.read_pointer()
            if again is not None and again.txn == new.txn:
                return new, base
            time.sleep(random.uniform(0, min(0.5, 0.01 * 2**attempt)))
        raise TimeoutError(f"could not update {self.store.url(POINTER_NAME)}: {_CAS_ATTEMPTS} conditional writes"
                           " in a row lost to other writers")

    def claim(self, *, resumed_from: Entry | None = None) -> int:
        """Become the writer of this root: a newer epoch than any before, so older jobs are fenced off."""

        def bump(p: Pointer) -> Pointer:
            p.writer_epoch += 1
            p.writer = self.writer
            # Protections belong to the job that set them; this job protects what it resumed from.
            p.protected = {}
            if resumed_from is not None:
                p.protected = {f: f"data of the checkpoint {self.writer} resumed from" for f in resumed_from.folders}
                p.protected[resumed_from.commit] = f"{RESUMED} by {self.writer}"
            return p

        new, _ = self._update(bump, fenced=False)
        self.epoch = new.writer_epoch
        self.resumed_from = resumed_from.commit if resumed_from else None
        log.info("claimed %s as writer epoch %d (%s)", self.url, self.epoch, self.writer)
        try:
            self.collect_garbage()
        except Exception as exc:  # garbage collection must never stop training
            log.warning("garbage collection under %s failed: %s", self.url, exc)
        return self.epoch

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
        assert self.epoch is not None
        epoch, name, step = self.epoch, prepared.name, prepared.step
        try:
            prepared.ready()
            objects = self.upload_stream(f"{commit}/", prepared.total, prepared.pieces, step)
            stream = list(range(len(objects)))
            objects.append(self._put(f"{commit}/{SKELETON_NAME}", [memoryview(prepared.skeleton)],
                                     self._known if step == self._known_step else {}))
            skeleton = len(objects) - 1
            objects += extra or []
            self.store.sync_folder(commit)  # the data is durable before the manifest names it
            manifest = Manifest(name=name, commit=commit, step=step, epoch=prepared.epoch, created=prepared.created,
                                writer_epoch=epoch, chunk_size=self.settings.chunk_size, skeleton=skeleton,
                                stream=stream, objects=objects, tensors=prepared.tensors,
                                sharded=sharded(objects) if sharded is not None else None)
            # The manifest goes last: until it exists, this folder is not a checkpoint.
            self.store.write(f"{commit}/{MANIFEST_NAME}", manifest.to_bytes())
            for folder in (commit, name, ""):  # and it, and the folders holding it, before the pointer names it
                self.store.sync_folder(folder)
            entry = Entry(name=name, commit=commit, step=manifest.step, epoch=manifest.epoch,
                          created=prepared.created, writer_epoch=epoch, folders=tuple(manifest.folders),
                          size=manifest.total_bytes)

            def add(p: Pointer) -> Pointer:
                p.writer_epoch = max(p.writer_epoch, epoch)
                p.writer = p.writer or self.writer
                p.checkpoints[name] = entry
                # Within one writer the pointer never moves to a lower step; an older writer's latest (a job
                # this one superseded) is replaced whatever its step.
                if p.latest is None or p.latest.writer_epoch < epoch or entry.order >= p.latest.order:
                    p.latest = entry
                self._apply_keep_last(p)
                return p

            new, old = self._update(add, fenced=True)
        except StaleWriterError:
            self._discard(commit)
            raise
        self._release(old, new)
        self._remember(manifest, new)
        log.info("committed %s (step %d, %d objects, %d bytes)", self.store.url(commit), entry.step,
                 len(objects), entry.size)
        return entry

    def _apply_keep_last(self, p: Pointer) -> None:
        if self.settings.keep_last is not None:
            for entry in _beyond(p, self.settings.keep_last):
                del p.checkpoints[entry.name]

    def retain(self, keep_last: int, *, dry_run: bool = False) -> list[Entry]:
        """Drop all but the ``keep_last`` newest committed checkpoints now (an operator's retention pass).

        The latest and what a job resumed from are kept. Does not claim the root: a job writing it is not fenced,
        and the conditional pointer update makes this safe to run beside it. Returns what was (would be) dropped.
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

        new, old = self._update(drop, fenced=False)
        self._release(old, new)
        return dropped

    def _discard(self, commit: str) -> None:
        try:
            self.store.remove(commit)
        except Exception as exc:
            log.warning("could not delete uncommitted %s: %s", self.store.url(commit), exc)

    def _release(self, old: Pointer, new: Pointer) -> None:
        """Delete folders that the old pointer kept alive and the new one does not."""
        released = old.live_folders() - new.live_folders()
        for folder in sorted(released):
            self._discard(folder)
        self._tidy_names({f.split("/", 1)[0] for f in released})

    def _tidy_names(self, names: set[str]) -> None:
        # Local disk keeps empty name folders after their last commit is deleted; object stores have none.
        if not isinstance(self.store, LocalStore):
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

        if self.epoch is None:
            self.claim()
        new, old = self._update(drop, fenced=True)
        self._release(old, new)

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

    def check_sizes(self, commit: str) -> Manifest:
        """Cheap structural check: the manifest parses and every object exists with its recorded size."""
        manifest = self.read_manifest(commit)
        for obj in manifest.objects:
            url = self.store.url(obj.path)
            try:
                size = self.store.size(obj.path)
            except FileNotFoundError as exc:
                raise CheckpointCorruptedError(f"{url} is missing", object=url) from exc
            if size != obj.size:
                raise CheckpointCorruptedError(f"{url} has {size} bytes, the manifest says {obj.size}", object=url)
        return manifest

    def read_chunks(self, manifest: Manifest, index: int, sink: Callable[[int, memoryview], None],
                    only: Callable[[int, int], bool] | None = None,
                    into: Callable[[int, int], list[memoryview]] | None = None) -> list[Job]:
        """Jobs that read object ``index`` chunk by chunk, verify each chunk and hand its pieces to ``sink``
        (with their offset in the object); ``only(start, end)`` selects the chunks to read (default: all).

        ``into(start, end)`` may give the final destination of a chunk's bytes (the tensors' buffers): a store
        that can read into memory (local disk) then fills them directly, with no copy in between.
        """
        obj = manifest.objects[index]
        url = self.store.url(obj.path)
        direct = into is not None and self.store.supports_read_into

        def job(j: int, a: int, b: int) -> int:
            if direct:
                assert into is not None
                views = into(a, b)
                try:
                    got = self.store.read_into(obj.path, a, views)
                except FileNotFoundError as exc:
                    raise CheckpointCorruptedError(f"{url} is missing", object=url) from exc
                if got != b - a:
                    raise CheckpointCorruptedError(f"{url} ends at byte {a + got}, the manifest says it has"
                                                   f" {obj.size} (truncated or replaced)", object=url)
                check = hasher(manifest.hash)
                for view in views:
                    check.update(view)
                if check.hexdigest() != obj.chunks[j]:
                    raise CheckpointCorruptedError(f"{url} fails its {manifest.hash} checksum at bytes {a}-{b}: its"
                                                   " bytes were corrupted", object=url)
                return got

            def consume(pieces: Any) -> tuple[int, str]:
                digest, got = hasher(manifest.hash), 0
                for piece in pieces:
                    digest.update(piece)
                    sink(a + got, piece)
                    got += len(piece)
                return got, digest.hexdigest()

            try:
                got, digest = self.store.read_range(obj.path, a, b, consume)
            except FileNotFoundError as exc:
                raise CheckpointCorruptedError(f"{url} is missing", object=url) from exc
            if got != b - a:
                raise CheckpointCorruptedError(f"{url} ends at byte {a + got}, the manifest says it has {obj.size}"
                                               " (truncated or replaced)", object=url)
            if digest != obj.chunks[j]:
                raise CheckpointCorruptedError(f"{url} fails its {manifest.hash} checksum at bytes {a}-{b}: its bytes"
                                               " were corrupted", object=url)
            return got

        return [functools.partial(job, j, a, b) for j, (a, b) in enumerate(manifest.chunk_ranges(index))
                if only is None or only(a, b)]

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
            if type(exc).__name__ == "UnpicklingError" and weights_only:
                raise  # a weights_only refusal is the user's decision to make, not corruption
            raise CheckpointCorruptedError(f"{skeleton_url} does not unpickle: {exc}", object=skeleton_url) from exc
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
        manifest = self.read_manifest(commit)
        jobs: list[Job] = []
        for index in range(len(manifest.objects)):
            jobs += self.read_chunks(manifest, index, _discard_piece)
        self.run(jobs, progress)
        return manifest

    def remember_loaded(self, loaded: Loaded) -> None:
        self._remember(loaded.manifest)

    # -- garbage -----------------------------------------------------------------------------------------------
    def collect_garbage(self, *, dry_run: bool = False, now: float | None = None) -> list[str]:
        """Delete commit folders no live checkpoint needs and that are older than the grace period.

        Younger unreferenced folders may be saves in progress (this job's or another's), so they stay.
        Also aborts incomplete multipart uploads under the root, and temp files of interrupted local writes.
        """
        pointer, _ = self.read_pointer()
        live = pointer.live_folders() if pointer else set()
        cutoff = (now if now is not None else time.time()) - self.settings.orphan_grace_seconds
        doomed: list[str] = []
        for name in self.store.list_dir(""):
            if name == POINTER_NAME or name.startswith("."):
                continue
            for child in self.store.list_dir(name):
                folder = f"{name}/{child}"
                started = commit_time(child)
                if started is not None and folder not in live and started < cutoff:
                    doomed.append(folder)
        if not dry_run:
            for folder in doomed:
                self._discard(folder)
            self._tidy_names({f.split("/", 1)[0] for f in doomed})
            for key in self.store.abort_stale_uploads(cutoff):
                log.info("aborted incomplete multipart upload %s", key)
            if isinstance(self.store, LocalStore):
                _remove_stale_temp_files(self.store.root_path, cutoff)
        if doomed:
            log.info("%s %d orphaned folder(s) under %s", "would delete" if dry_run else "deleted", len(doomed),
                     self.url)
        return [self.store.url(f) for f in doomed]


def _beyond(p: Pointer, keep: int) -> list[Entry]:
    """Catalog entries past the ``keep`` newest, except the latest and what a job resumed from."""
    ordered = sorted(p.checkpoints.values(), key=lambda e: e.order, reverse=True)
    return [e for e in ordered[keep:] if not (p.latest is not None and e.commit == p.latest.commit)
            and not _is_resumed(p, e)]  # what a job resumed from is what its restart would need


def _is_resumed(p: Pointer, entry: Entry) -> bool:
    return p.protected.get(entry.commit, "").startswith(RESUMED)


def _remove_stale_temp_files(root: str, cutoff: float) -> None:
    for directory, _, files in os.walk(root):
        for f in files:
            if f.startswith(".tmp-"):
                path = os.path.join(directory, f)
                try:
                    if os.path.getmtime(path) < cutoff:
                        os.unlink(path)
                except OSError:
                    pass


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
