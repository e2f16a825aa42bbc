"""Reading a checkpoint root: manifests, every object verified chunk by chunk, tensors rebuilt; listings of commits.

A load reads one manifest, checks every object it names is stored with its declared size (before anything is
allocated from those sizes), then reads every chunk of every object in parallel, each checked against its own
digest while its bytes stream into the tensors' buffers. Nothing a load returns was unverified. Reading never
writes, and never needs the pointer: whoever calls it has chosen the commit folder (see ``catalog``).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_resilient.errors import CheckpointCorruptedError, ShardedCheckpointError, UnsupportedFormatError
from lightning_resilient.io import layout
from lightning_resilient.io.folders import writer_epoch_of
from lightning_resilient.io.lineage import ORIGINS_DIR, Origin
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest, ObjectEntry, hasher
from lightning_resilient.io.pointer import LEGACY_NAMES, Pointer
from lightning_resilient.io.store import Store

__all__ = ["Job", "LoadStats", "Loaded", "READ_SPAN", "RootReader", "Scan"]

# Consecutive checksummed chunks are read with one request of at least this many bytes: the number of requests
# depends on the bytes read, never on a manifest's chunk size (a chunk size of 1 must not mean a request per byte).
READ_SPAN = 4 * 2**20

#: A read job: reads and verifies some chunks, returns the number of bytes it read.
Job = Callable[[], int]


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
    #: The root's incarnation as the newest origin record that carries one has it ("" if none does)
    root_id: str = ""
    #: commit folders whose manifest names another incarnation than ``root_id`` (left out of everything above)
    foreign: list[str] = field(default_factory=list)

    def pointer(self) -> Pointer:
        return Pointer.rebuilt(self.manifests, self.max_epoch, self.origins, root_id=self.root_id)


def _shifted(write: Callable[[int, memoryview], None], start: int, offset: int, piece: memoryview) -> None:
    write(start + offset, piece)


def _views(scatter: layout.Scatter, start: int, a: int, b: int) -> list[memoryview]:
    return scatter.views(start + a, b - a)


def _discard_piece(offset: int, piece: memoryview) -> None:
    pass


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


class RootReader:
    """Reads and verifies the commits of one root; ``executor`` makes a fresh thread pool per load or verify."""

    def __init__(self, store: Store, executor: Callable[[], Executor]) -> None:
        self.store = store
        self._executor = executor
        self._held: dict[str, tuple[list[str], torch.Tensor]] = {}
        self._held_lock = threading.Lock()

    def hold_verified(self, obj: ObjectEntry, data: torch.Tensor) -> None:
        """Keep ``data``, the bytes of ``obj`` this process has just checked against every one of ``obj``'s chunk
        digests (a copy received from a peer, and written to this root), so that the next read of ``obj`` takes them
        from memory instead of reading back and hashing again what was checked moments ago (and, where the restore
        writes them to disk only after the load, before they are there). They serve every read of ``obj`` by a
        manifest that lists the same digests (a sharded load reads some objects twice) until :meth:`drop_held`."""
        with self._held_lock:
            self._held[obj.path] = (list(obj.chunks), data)

    def drop_held(self) -> None:
        with self._held_lock:
            self._held.clear()

    def _take_held(self, obj: ObjectEntry) -> torch.Tensor | None:
        with self._held_lock:
            held = self._held.get(obj.path)
        if held is None or held[0] != list(obj.chunks) or held[1].numel() != obj.size:
            return None
        return held[1]

    def read_manifest(self, folder: str) -> Manifest:
        where = self.store.url(f"{folder}/{MANIFEST_NAME}")
        try:
            data = self.store.read(f"{folder}/{MANIFEST_NAME}")
        except FileNotFoundError as exc:
            raise CheckpointCorruptedError(f"{where} is missing: {self.store.url(folder)} was never committed or"
                                           " was deleted", object=where) from exc
        manifest = Manifest.from_bytes(data, where=where)
        if manifest.commit != folder:
            raise CheckpointCorruptedError(f"{where} describes {manifest.commit!r}, not {folder!r}", object=where)
        return manifest

    def check_sizes(self, folder: str, manifest: Manifest | None = None, *,
                    only: list[int] | None = None) -> Manifest:
        """Cheap structural check, before anything is allocated or read: every object the manifest names is stored
        with the size it declares (one listing per folder), and every tensor's byte count matches its dtype and
        shape. A manifest can therefore never make a load allocate more than the stored bytes. ``only``: the
        indices of the objects to check (those a load reads), when not all."""
        manifest = manifest if manifest is not None else self.read_manifest(folder)
        objects = manifest.objects if only is None else [manifest.objects[i] for i in only]
        stored = self.stored_sizes(o.path for o in objects)
        for obj in objects:
            url = self.store.url(obj.path)
            if obj.path not in stored:
                raise CheckpointCorruptedError(f"{url} is missing", object=url)
            size = stored[obj.path]
            # A store that cannot tell a size at all: the ranged reads check every object's length as they verify it.
            if size is not None and size != obj.size:
                raise CheckpointCorruptedError(f"{url} has {size} bytes, the manifest says {obj.size}", object=url)
        where = self.store.url(f"{folder}/{MANIFEST_NAME}")
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
        held = self._take_held(obj)
        direct = into is not None and (self.store.supports_read_into or held is not None)
        wanted = [(j, a, b) for j, (a, b) in enumerate(manifest.chunk_ranges(index)) if only is None or only(a, b)]
        spans: list[list[tuple[int, int, int]]] = []
        for chunk in wanted:
            last = spans[-1] if spans else None
            if last is not None and last[-1][2] == chunk[1] and last[-1][2] - last[0][1] < READ_SPAN:
                last.append(chunk)
            else:
                spans.append([chunk])

        def from_held(chunks: list[tuple[int, int, int]]) -> int:
            assert held is not None
            a, b = chunks[0][1], chunks[-1][2]
            if not direct:
                sink(a, layout.raw_bytes(held)[a:b])
                return b - a
            assert into is not None
            pos = a
            for view in into(a, b):
                # torch's copy lets go of the GIL (a memoryview assignment holds it), so the load's threads copy
                # side by side, and beside the training thread
                if len(view):
                    torch.frombuffer(view, dtype=torch.uint8).copy_(held[pos : pos + len(view)])
                pos += len(view)
            return pos - a

        if held is not None:
            return [functools.partial(from_held, chunks) for chunks in spans]

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

    def load(self, folder: str, *, map_location: Any, weights_only: bool | None,
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
            manifest = self.read_manifest(folder)
        elif manifest.commit != folder:
            raise ValueError(f"the manifest given is {manifest.commit!r}'s, not {folder!r}'s")
        # Before anything is allocated from the manifest's declared sizes. The rest of a sharded checkpoint is its
        # skeleton and stream: a local tier on several nodes holds them beside only some of the shards.
        rest = [manifest.skeleton, *manifest.stream] if manifest.sharded is not None and sharded_rest else None
        self.check_sizes(folder, manifest, only=rest)
        if manifest.sharded is not None and not sharded_rest:
            raise ShardedCheckpointError(
                f"{self.store.url(folder)} is a sharded checkpoint written by {manifest.sharded.world_size}"
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
        for index, start in zip(manifest.stream, manifest.stream_offsets(), strict=True):
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
            _add_note(exc, f"{skeleton_url} (the non-tensor part of {self.store.url(folder)}) verified against its"
                           " checksums but does not load here. If torch refused an object under weights_only and you"
                           " trust this checkpoint, allow it with torch.serialization.add_safe_globals([...]) or load"
                           " with weights_only=False; otherwise make the classes it names importable.")
            raise
        tensors = {}
        moved = False
        for t, buffer in zip(manifest.tensors, scatter.buffers, strict=True):
            try:
                tensor = layout.tensor_view(buffer, layout.parse_dtype(t.dtype), t.shape)
            except (ValueError, RuntimeError) as exc:
                where = self.store.url(f"{folder}/{MANIFEST_NAME}")
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
            where = self.store.url(f"{folder}/{MANIFEST_NAME}")
            raise CheckpointCorruptedError(f"{where} does not match its skeleton: {exc}", object=where) from exc
        stats = LoadStats(commit=folder, bytes=manifest.total_bytes, objects=len(manifest.objects),
                          requests=len(jobs), host_buffer_bytes=sum(allocated), host_buffers=len(allocated),
                          seconds=time.perf_counter() - started)
        return Loaded(checkpoint, folder, manifest, stats)

    def verify(self, folder: str, progress: Callable[[int], None] | None = None, *,
               only: list[int] | None = None) -> Manifest:
        """Read every byte of a commit and check every checksum, keeping nothing; raises on the first failure.

        ``progress`` is called with the number of bytes of each chunk verified. ``only``: the indices of the objects
        to verify (those a node's local tier holds of a sharded commit written across nodes), when not all.
        """
        manifest = self.check_sizes(folder, only=only)
        jobs: list[Job] = []
        for index in range(len(manifest.objects)) if only is None else only:
            jobs += self.read_chunks(manifest, index, _discard_piece)
        self.run(jobs, progress)
        return manifest

    def scan(self) -> Scan:
        """List every commit folder and read every manifest (for a root whose pointer is missing or damaged)."""
        scan = Scan()
        newest = 0  # the epoch of the record scan.root_id comes from
        for record in self.store.list_dir(ORIGINS_DIR):
            rel = f"{ORIGINS_DIR}/{record}"
            try:
                epoch, origin, root_id = Origin.from_record(self.store.read(rel), where=self.store.url(rel))
            except (CheckpointCorruptedError, FileNotFoundError):
                continue  # a damaged record only costs the lineage of one epoch: the manifests also carry it
            scan.origins[epoch] = origin
            scan.max_epoch = max(scan.max_epoch, epoch)
            if root_id and epoch >= newest:
                scan.root_id, newest = root_id, epoch
        recorded = bool(scan.root_id)  # (an origin record's word on the incarnation: only then is a commit foreign)
        for name in self.store.list_dir(""):
            if name in LEGACY_NAMES or name.startswith("."):
                continue
            for child in self.store.list_dir(name):
                written_by = writer_epoch_of(child)
                if written_by is None:
                    continue
                folder = f"{name}/{child}"
                try:
                    manifest = self.read_manifest(folder)
                except (CheckpointCorruptedError, UnsupportedFormatError) as exc:
                    if self.store.exists(f"{folder}/{MANIFEST_NAME}"):
                        scan.unreadable[folder] = str(exc)
                    else:
                        scan.uncommitted.append(folder)
                    scan.max_epoch = max(scan.max_epoch, written_by)
                    continue
                if recorded and manifest.root_id and manifest.root_id != scan.root_id:
                    # A commit of a deleted incarnation of this root, written into the recreated one by a job of the
                    # old one (it was refused at its pointer move, or died before it): neither a checkpoint of this
                    # root nor a writer epoch of it, whose number it may share.
                    scan.foreign.append(folder)
                    continue
                scan.max_epoch = max(scan.max_epoch, written_by)
                scan.manifests.append(manifest)
        if not recorded:
            # No origin record names the incarnation (their writes are best effort; roots from before they did):
            # the newest commit that names one keeps it, rather than the rebuilt pointer getting a new one, which
            # would make this run's own commits look like another incarnation's after the next loss. Nothing is
            # left out as foreign on this guess.
            named = [m for m in scan.manifests if m.root_id]
            if named:
                scan.root_id = max(named, key=lambda m: (m.writer_epoch, m.step, m.created)).root_id
        return scan

    def stored_sizes(self, paths: Iterable[str]) -> dict[str, int | None]:
        """The stored size of each object under the folders holding ``paths``: one listing per folder. An object
        absent from the result is missing. A listing without sizes (a static HTTP server's) costs one request per
        object of ``paths`` for its size; None only where the store cannot tell it at all (unknown, never 0). An
        object held in memory (:meth:`hold_verified`) counts with the size of its held bytes: a restore may write it
        to the store only after the load."""
        wanted = set(paths)
        with self._held_lock:
            held: dict[str, int | None] = {p: h[1].numel() for p, h in self._held.items() if p in wanted}
        out: dict[str, int | None] = {}
        for folder in sorted({p.rsplit("/", 1)[0] for p in wanted - held.keys()}):
            for obj, info in self.store.list_detail(folder).items():
                path = f"{folder}/{obj}"
                out[path] = self.store.size(path) if info.size is None and path in wanted else info.size
        out.update(held)
        return out


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", []):
        exc.add_note(note)


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
