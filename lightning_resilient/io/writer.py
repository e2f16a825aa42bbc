"""Saving into a checkpoint root: capture, upload, commit; and the stock Lightning files a save replaces.

Save: shard objects -> skeleton -> check they are all stored -> manifest (last) -> conditional swap of the pointer
(:class:`~lightning_resilient.io.fencing.WriterFence`). A crash before the swap leaves the previous pointer valid and
the new folder uncommitted; a crash after it leaves at worst undeleted garbage (see ``retention``).

A save of the same step whose objects are byte-identical to the previous commit's (``save_last`` right after a
top-k save) references them instead of uploading them again: the writer remembers the last commit's objects. With
``dedup`` (``io/incremental.py``), saves of any step do: the stream is laid out so that tensors unchanged since this
writer's last commit keep their objects, which are referenced without reading their bytes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from lightning_resilient.errors import CheckpointError, StaleWriterError
from lightning_resilient.io import incremental, layout
from lightning_resilient.io._lanes import map_in_lanes
from lightning_resilient.io.fencing import WriterFence, is_resumed
from lightning_resilient.io.folders import SKELETON_NAME, new_commit_folder
from lightning_resilient.io.known_objects import KnownObjects
from lightning_resilient.io.manifest import (
    MANIFEST_NAME,
    Manifest,
    ObjectEntry,
    ShardedRecord,
    TensorEntry,
    chunk_digests,
    object_digest,
)
from lightning_resilient.io.pointer import Entry, Pointer
from lightning_resilient.io.reader import RootReader
from lightning_resilient.io.reported import reported_in
from lightning_resilient.io.retention import Retention
from lightning_resilient.io.stock_files import StockFiles
from lightning_resilient.io.store import Store

__all__ = ["HostSources", "Prepared", "RootWriter", "step_of"]

log = logging.getLogger(__name__)


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
    # The names in the root its ModelCheckpoints reported (io/reported.py); None: the save carried none of their state.
    reported: list[str] | None = None
    # An incremental save's layout (``dedup``): which objects are referenced as stored; and its tensors, to record
    # after the commit what was stored. None: the stream is cut into windows, every object written.
    plan: incremental.Plan | None = None
    slots: list[layout.TensorSlot] | None = None


class HostSources:
    """Each slot's bytes on the host, copied (from an accelerator) only when an object that holds them is written:
    the tensors of referenced objects are never read."""

    def __init__(self, slots: list[layout.TensorSlot]) -> None:
        self._slots = slots
        self._views: dict[int, memoryview] = {}

    def __getitem__(self, index: int) -> memoryview:
        view = self._views.get(index)
        if view is None:  # two threads may copy the same slot at once: the same bytes, one kept
            view = self._views.setdefault(index, layout.host_sources([self._slots[index]])[0])
        return view


def _nothing() -> None:
    pass


def step_of(value: Any) -> int:
    """A checkpoint's ``global_step`` (or ``epoch``) as an int: 0 when it has none (Fabric's, a plain save)."""
    if isinstance(value, torch.Tensor):
        return int(value.item())
    return int(value) if isinstance(value, (int, float)) else 0


class RootWriter:
    """Uploads and commits the checkpoints of one writer into one root."""

    def __init__(self, store: Store, *, chunk_size: int, shard_size: int, max_concurrency: int,
                 executor: Callable[[], Executor], fence: WriterFence, reader: RootReader, retention: Retention,
                 claim: Callable[[], int], dedup: bool = False,
                 behind: Callable[[Callable[[], None], str], None] | None = None) -> None:
        """``dedup``: incremental saves (``io/incremental.py``). ``claim`` returns this process's writer epoch, making
        it the root's writer first if it is not yet (a save or a removal claims the root unless a resume already did;
        once, whichever thread asks first). ``behind(work, what)`` runs what a commit leaves to do once it is
        committed (deleting what it retired) behind the caller, before the root's next change
        (``CheckpointRoot.finish_later``); default: at once."""
        self.store = store
        self.chunk_size = chunk_size
        self.shard_size = shard_size
        self.max_concurrency = max_concurrency  # a stream is cut into at least this many objects (object_size)
        self._executor = executor
        self.fence = fence
        self.reader = reader
        self.retention = retention
        self._claim = claim
        self._behind = behind or (lambda work, what: work())
        # What a save may reference by digest instead of uploading (known_objects.py): the same step's objects, or
        # with dedup any step's and the resumed checkpoint's; ``_stored`` lets unchanged tensors be referenced
        # without reading them (only this writer's own commits, of its epoch).
        self._known = KnownObjects(dedup=dedup)
        self.dedup = dedup
        self._stored = incremental.StoredUnits()
        #: Stock Lightning files directly in the root, which a save of the same name replaces (stock_files.py).
        self.stock = StockFiles(store, fence, retention)
        #: The folder Lightning's paths name this root's checkpoints by (a ModelCheckpoint's dirpath), to tell which
        #: names a save's ModelCheckpoints report here: the root's own URL; a node-local tier's is its durable root's
        #: (set by ``TieredRoot``), whose names its commits carry there when persisted.
        self.folder_url = store.root_url

    @property
    def url(self) -> str:
        return self.store.root_url

    def prepare(self, checkpoint: dict[str, Any], name: str, snapshot: layout.Snapshot | None = None,
                before_fill: Callable[[], None] | None = None, *, reported: list[str] | None = None,
                reuse: bool = True) -> Prepared:
        """Everything a save needs from the live checkpoint: after this returns, training may change it.

        Without a snapshot the upload reads the tensors in place (a synchronous save). With one (an async save),
        the tensors are copied into the snapshot's reusable buffer, after ``before_fill`` (which waits for the
        uploads still reading it) returns. A second save of the same state, as ``save_last`` makes right after a
        top-k save, reuses what the buffer already holds: no wait, and only tensors that changed (a few small
        ones, such as RNG states) are copied, into memory of their own.

        The names the ModelCheckpoints report in this root are read from the checkpoint's callback states (see
        ``reported.py``), unless ``reported`` gives them (a weights-only save carries no callback state: the plugin
        reads the Trainer's callbacks).

        With ``dedup`` (not for ``reuse=False``: a sharded save's rest), the stream is laid out by
        ``io/incremental.py`` and objects of unchanged tensors are referenced; an async save copies into its snapshot
        only the tensors of the objects it writes.
        """
        skeleton, slots = layout.flatten(checkpoint)
        plan: incremental.Plan | None = None
        if self.dedup and reuse and snapshot is not None and before_fill is not None:
            # An incremental async save plans from what the previous save committed and the pointer after it: wait
            # for that commit first (the fill below would wait for it anyway). Planned from the record before it,
            # this save could reference a folder that commit's retention retires, and its pointer update would
            # refuse it; and that commit's thread updates the record this plan reads.
            before_fill()
            before_fill = None
        if self.dedup and reuse:  # (a sharded save's rest: each rank's stream read the pointer for this save already)
            self.keep_live()
            plan = self._stored.plan(slots, own=min(self.shard_size, incremental.OWN),
                                     pack=min(self.shard_size, incremental.PACK), shard=self.shard_size)
            total = plan.total
        else:
            total = layout.plan(slots)
        step = step_of(checkpoint.get("global_step"))
        tensors = [TensorEntry(slot.key, layout.dtype_name(slot.tensor.dtype), list(slot.tensor.shape),
                               slot.offset, slot.nbytes, slot.device) for slot in slots]
        skeleton_bytes = layout.save_skeleton(skeleton)
        ready: Callable[[], None] = _nothing
        if snapshot is None:
            sources: Any = layout.host_sources(slots) if plan is None else HostSources(slots)
            pieces: Callable[[int, int], list[memoryview]] = lambda a, b: layout.gather(slots, sources, a, b)  # noqa: E731
        elif plan is not None:
            # An incremental async save: only the tensors of the units it writes are copied (the referenced ones
            # are never read), into the buffer at their stream offsets, each written unit's padding zeroed.
            regions = [(u.spans[0][0], u.spans[-1][1]) for u in plan.units if u.reuse is None and u.spans]
            inside = {i for u in plan.units if u.reuse is None for i in u.members}
            if before_fill is not None:
                before_fill()
            snapshot.fill([s for i, s in enumerate(slots) if i in inside], total, step, regions=regions)
            view = snapshot.sources(total)
            pieces = lambda a, b: [view[a:b]]  # noqa: E731
            ready = snapshot.wait
        else:
            held = snapshot.match(slots, step)
            changed = sum(s.nbytes for s, ok in zip(slots, held or [], strict=False) if not ok)  # none held: 0
            if held is not None and changed <= max(2**20, total // 50):
                own = layout.host_sources([s for s, ok in zip(slots, held, strict=True) if not ok])
                own_views = iter([bytes(v) for v in own])  # copies: the live tensors may change once we return
                sources = [snapshot.slot_view(s.offset, s.nbytes) if ok else memoryview(next(own_views))
                           for s, ok in zip(slots, held, strict=True)]
                pieces = lambda a, b: layout.gather(slots, sources, a, b)  # noqa: E731
            else:
                if before_fill is not None:
                    before_fill()
                snapshot.fill(slots, total, step)
                view = snapshot.sources(total)
                pieces = lambda a, b: [view[a:b]]  # noqa: E731
            ready = snapshot.wait
        return Prepared(name=name, step=step, epoch=step_of(checkpoint.get("epoch")),
                        created=time.time(), skeleton=skeleton_bytes, tensors=tensors, total=total,
                        pieces=pieces, ready=ready,
                        reported=reported if reported is not None else reported_in(checkpoint, self.folder_url),
                        plan=plan, slots=slots if plan is not None else None)

    def keep_live(self, within: set[str] | None = None) -> set[str]:
        """Before an incremental save: forget the units stored by identity (this writer's own commits, of its
        epoch) and the objects known by digest (``known_objects.py``: also the resumed checkpoint's, of an earlier
        epoch) outside the folders the pointer keeps live now (a removal since the last commit may have retired one),
        and outside ``within`` when given (a sharded save across nodes: what every node's tier keeps). Returns the
        folders kept (none without a readable pointer)."""
        try:
            pointer, _ = self.fence.read_pointer()
        except Exception:
            pointer = None
        if pointer is None:
            self._stored.clear()
            self._known.clear()
            return set()
        live = pointer.live_folders() if within is None else pointer.live_folders() & within
        epoch = self.fence.writer_epoch
        if epoch is not None and pointer.writer_epoch == epoch:
            self._stored.keep(live, epoch)
        else:
            self._stored.clear()
        self._known.keep_live(live)
        return live

    def new_commit_folder(self, name: str, created: float) -> str:
        """The folder of a new commit of ``name`` (claiming the root first if this process has not yet)."""
        epoch = self._claim()
        self.stock.make_room(name)
        return new_commit_folder(name, created, epoch)

    def put(self, rel: str, pieces: list[memoryview], known: dict[tuple[str, int], str]) -> ObjectEntry:
        """Write one object (or reference a byte-identical one of a save of the same step); returns its entry."""
        chunks = chunk_digests(pieces, self.chunk_size)
        digest, size = object_digest(chunks), sum(len(p) for p in pieces)
        existing = known.get((digest, size))
        if existing is not None:
            return ObjectEntry(existing, size, digest, chunks)
        self.store.write_pieces(rel, pieces)
        return ObjectEntry(rel, size, digest, chunks)

    def upload_stream(self, prefix: str, total: int, pieces: Callable[[int, int], list[memoryview]],
                      step: int | None = None, plan: incremental.Plan | None = None, *,
                      also: tuple[str, bytes] | None = None,
                      only: Callable[[str], bool] | None = None) -> list[ObjectEntry]:
        """Upload a tensor stream of ``total`` bytes as objects ``{prefix}shard-NNNNN.bin``, in parallel (with an
        incremental ``plan``: its objects, those it references as stored left unread); ``also``: one more object (a
        path and its bytes, the skeleton), uploaded beside them and entered last; ``only``: the known objects it may
        reference by digest (by path)."""
        known = self._known.for_save(step, incremental=plan is not None)
        if only is not None:
            known = {key: path for key, path in known.items() if only(path)}
        reused: list[ObjectEntry | None]
        if plan is not None:
            laid = plan.objects()
            spans = [span for span, _ in laid]
            reused = [obj for _, obj in laid]
        else:
            # The objects (their size: from max_concurrency alone, the same layout on every machine).
            spans = layout.windows(total, layout.object_size(total, self.shard_size, self.max_concurrency))
            reused = [None] * len(spans)

        def put_span(rel: str, start: int, end: int) -> ObjectEntry:
            return self.put(rel, pieces(start, end), known)

        # Written by as many threads at once as the store gains from (a local disk: fewer, see Store.write_threads).
        # The extra object goes first, so that no upload waits for it at the end; a referenced object costs nothing.
        jobs: list[Callable[[], ObjectEntry]] = []
        if also is not None:
            rel, data = also
            jobs.append(functools.partial(self.put, rel, [memoryview(data)], known))
        for i, (span, obj) in enumerate(zip(spans, reused, strict=True)):
            jobs.append(functools.partial(_given, obj) if obj is not None
                        else functools.partial(put_span, f"{prefix}shard-{i:05d}.bin", *span))
        lanes = self.store.write_threads(self.max_concurrency)
        with self._executor() as pool:
            done = map_in_lanes(pool, lambda job: job(), jobs, lanes)
        return done[1:] + done[:1] if also is not None else done

    def commit(self, prepared: Prepared, *, folder: str | None = None, extra: list[ObjectEntry] | None = None,
               sharded: Callable[[list[ObjectEntry]], ShardedRecord] | None = None) -> Entry:
        """Upload a prepared checkpoint, write its manifest, then move the pointer to it.

        A sharded save (``sharded.py``) passes the commit folder its ranks already wrote into, their objects
        (``extra``), and a function giving the manifest's ``sharded`` record from the final object list.
        """
        folder = folder or self.new_commit_folder(prepared.name, prepared.created)
        try:
            manifest = self._stage(prepared, folder, extra, sharded)
            entry = self.publish(manifest)
        except BaseException as exc:
            self._stored.clear()  # what it stored is unknown now: the next save reads everything again
            if self.dedup:
                self._known.clear()
            self._failed(prepared.name, folder, exc)
            raise
        if prepared.plan is not None and prepared.slots is not None:
            self._stored.record(prepared.plan, prepared.slots, [manifest.objects[i] for i in manifest.stream])
        return entry

    def stage(self, prepared: Prepared, *, folder: str, extra: list[ObjectEntry] | None = None,
              sharded: Callable[[list[ObjectEntry]], ShardedRecord] | None = None) -> Manifest:
        """Upload a prepared checkpoint into ``folder`` and return its manifest, unpublished: what :meth:`commit`
        does before :meth:`publish`. A sharded save with a local tier on several nodes stages on the coordinator's
        node, and every node then publishes the manifest with the part it holds (``tiered.commit_node_part``)."""
        try:
            return self._stage(prepared, folder, extra, sharded)
        except BaseException as exc:
            self._failed(prepared.name, folder, exc)
            raise

    def _failed(self, name: str, folder: str, error: BaseException) -> None:
        # Not committed, so nothing refers to it: delete it now (a crash instead leaves it to gc). If the
        # pointer may have moved to it after all (a lost response), it is left alone.
        if self._unreferenced(folder, error):
            self.retention.discard(folder)
            self.stock.put_back(name)

    def make_room(self, name: str) -> None:
        """Before a commit of ``name`` that did not come through :meth:`new_commit_folder` (a persist from a local
        tier): what stock Lightning left under that name goes aside until the commit is published (:meth:`put_back`
        on failure; ``stock_files.py``)."""
        self.stock.make_room(name)

    def put_back(self, name: str) -> None:
        self.stock.put_back(name)

    def forget_stock(self, name: str) -> bool:
        """Delete ``name`` when it is a stock Lightning file or link (:meth:`StockFiles.forget`)."""
        return self.stock.forget(name)

    def abandon(self, folder: str, error: BaseException | None = None) -> None:
        """Delete the folder of a commit that failed (with ``error``) before its pointer move, unless the pointer may
        name it after all (a lost response): what a failed save does, and a failed persist into this root."""
        if self._unreferenced(folder, error):
            self.retention.discard(folder)

    def _unreferenced(self, folder: str, error: BaseException | None) -> bool:
        """Whether nothing can reference ``folder``, whose commit failed with ``error``."""
        if isinstance(error, StaleWriterError) and error.recreated:
            # The root was deleted and written again since this writer claimed it: nothing of the new incarnation
            # refers to this folder, even while its pointer is missing (which otherwise keeps it: a job may have
            # resumed it), and a rebuild must not take its writer epoch for the new run's.
            return True
        return not self._maybe_referenced(folder)

    def _maybe_referenced(self, folder: str) -> bool:
        try:
            pointer, _ = self.fence.read_pointer()
        except Exception:
            return True
        return pointer is None or folder in pointer.live_folders()

    def _stage(self, prepared: Prepared, folder: str, extra: list[ObjectEntry] | None,
               sharded: Callable[[list[ObjectEntry]], ShardedRecord] | None) -> Manifest:
        prepared.ready()
        assert self.fence.writer_epoch is not None and self.fence.origin is not None
        epoch, origin, name, step = self.fence.writer_epoch, self.fence.origin, prepared.name, prepared.step
        objects = self.upload_stream(f"{folder}/", prepared.total, prepared.pieces, step, prepared.plan,
                                     also=(f"{folder}/{SKELETON_NAME}", prepared.skeleton))
        stream = list(range(len(objects) - 1))
        skeleton = len(objects) - 1
        objects += extra or []
        return Manifest(name=name, commit=folder, step=step, epoch=prepared.epoch, created=prepared.created,
                        writer_epoch=epoch, chunk_size=self.chunk_size, skeleton=skeleton,
                        stream=stream, objects=objects, tensors=prepared.tensors,
                        sharded=sharded(objects) if sharded is not None else None, origin=origin,
                        root_id=self.fence.lineage_id or "", reported=prepared.reported)

    def publish(self, manifest: Manifest, *, held: list[ObjectEntry] | None = None,
                brought: frozenset[str] = frozenset()) -> Entry:
        """Commit ``manifest``, whose objects are stored: check them, write the manifest, move the pointer. A save's
        last step, and the whole of persisting a node-local checkpoint to its durable tier (the objects copied there
        first, the manifest the one the local tier committed: same commit, writer epoch and origin).
        ``held``: the objects this root holds of a sharded checkpoint written across nodes (one node's part of a
        local tier, see ``io/parts.py``): only they are checked; the manifest still names every object.
        ``brought``: folders of other commits into which the copy publishing this one (a peer's replica, a restore)
        wrote the objects it references there: they need not be live yet; every other referenced folder must be.
        """
        assert self.fence.writer_epoch is not None and manifest.writer_epoch == self.fence.writer_epoch
        folder, name, step, origin = manifest.commit, manifest.name, manifest.step, manifest.origin
        epoch = self.fence.writer_epoch
        for path in (folder, *sorted(brought)):  # the data is durable before the manifest names it
            self.store.sync_folder(path)
        self._check_stored(manifest.objects if held is None else held, folder)
        # The manifest goes last: until it exists, this folder is not a checkpoint.
        self.fence.deletions.manifest_written(folder)  # (a retired folder published again: its manifest is back)
        self.store.write(f"{folder}/{MANIFEST_NAME}", manifest.to_bytes())
        for path in (folder, name, ""):  # and it, and the folders holding it, before the pointer names it
            self.store.sync_folder(path)
        entry = Entry.from_manifest(manifest)
        reused = set(entry.folders) - {folder} - set(brought)

        def add(p: Pointer) -> Pointer:
            if not reused <= p.live_folders():  # shared bytes of an earlier commit must still be kept alive
                gone = sorted(reused - p.live_folders())
                raise CheckpointError(f"{self.store.url(folder)} shares objects with {gone},"
                                      " which were retired while it uploaded: the save was not committed")
            # An older state published after a newer one (a tier's persist, at the end of a fit, of a checkpoint a
            # ModelCheckpoint reports) is catalogued, and changes nothing that follows the newest save.
            newest = p.latest is None or entry.order >= p.latest.order
            if newest and p.last_saved != [epoch, step]:  # save_last at the step of a top-k save is the same save
                p.saves += 1
                p.last_saved = [epoch, step]
            p.writer_epoch = max(p.writer_epoch, epoch)  # a rebuilt pointer may not have seen this writer yet
            if origin is not None:  # this writer knows its origin (a rebuilt pointer may only have guessed it)
                p.origins[epoch] = origin
            p.writer = p.writer or self.fence.writer
            p.checkpoints[name] = entry
            if newest and manifest.reported is not None:  # what the ModelCheckpoints report now (none: as before)
                p.reported = list(manifest.reported)
            # Within one writer the pointer never moves to a lower step.
            if newest:
                p.latest = entry
            self.retention.apply_keep_last(p)
            return p

        try:
            new, old = self.fence.update(add, fenced=True, defer_manifests=True)
        except BaseException:
            self._unwrite_if_incomplete(manifest, manifest.objects if held is None else held)
            raise
        self._known.remember(manifest, new, held)
        written = sum(o.size for o in manifest.objects if _folder_of(o.path) == folder)
        log.info("committed %s (step %d, %d objects, %d bytes, %d of them new)", self.store.url(folder), entry.step,
                 len(manifest.objects), entry.size, written)
        retired = set(new.retired) - set(old.retired)
        if retired or new.retired_due():
            # Committed: what it retired (the manifests of the checkpoints it replaced, the folders due since the
            # last commit) is deleted behind the caller where the root says so (``CheckpointRoot.deletes_behind``).
            # A kill before they are done leaves them to the next commit or gc (the pointer records them).
            self._behind(lambda: self._delete_retired(new, retired), "deletion of what a commit retired")
        self.stock.replaced(name)
        return entry

    def _delete_retired(self, pointer: Pointer, retired: set[str]) -> None:
        self.fence.deletions.remove_manifests(retired)  # (never raises: a manifest left is deleted with its folder)
        self.retention.delete_retired(pointer)

    def _check_stored(self, objects: list[ObjectEntry], folder: str) -> None:
        """Every object the manifest will name is stored with its size: a commit never references what is gone."""
        found = self.reader.stored_sizes({o.path for o in objects})
        for obj in objects:
            size = found.get(obj.path)
            if size == obj.size or (size is None and obj.path in found):  # stored, of a size the store cannot tell
                continue
            pointer, _ = self.fence.read_pointer()
            if pointer is not None:  # gone because a newer job (or a new incarnation of the root) collected it
                self.fence.check_current(pointer)
            what = "is missing" if size is None else f"has {size} bytes, not {obj.size}"
            raise CheckpointError(f"{self.store.url(obj.path)} {what} just before {self.store.url(folder)} was to be"
                                  " committed (something deleted or replaced it): the save was not committed")

    def _unwrite_if_incomplete(self, manifest: Manifest, objects: list[ObjectEntry]) -> None:
        """After a failed pointer move: delete ``manifest`` again if one of its ``objects`` (those this root holds)
        is gone. A newer job's ``gc`` may delete a fenced writer's objects between its stored-objects check and its
        manifest write (the folder had no manifest then); the folder may be kept (while the pointer is missing), but
        never as a checkpoint that names what is gone. Such a manifest was never loadable, so nothing is lost."""
        with contextlib.suppress(Exception):  # best effort: a manifest naming what is gone never verifies anyway
            found = self.reader.stored_sizes({o.path for o in objects})
            if any(o.path not in found or found[o.path] not in (o.size, None) for o in objects):
                self.store.remove_object(f"{manifest.commit}/{MANIFEST_NAME}")
                log.warning("%s names objects that were deleted while this fenced writer committed it: its manifest"
                            " was deleted again", self.store.url(manifest.commit))

    # -- remove ------------------------------------------------------------------------------------------------
    def remove(self, name: str) -> None:
        def drop(p: Pointer) -> Pointer | None:
            entry = p.checkpoints.get(name)
            if entry is None:
                return None
            if is_resumed(p, entry):
                log.info("not removing %s: this job resumed from it", self.store.url(name))
                return None
            del p.checkpoints[name]
            if name in p.reported:  # Lightning removes only what its ModelCheckpoints no longer report
                p.reported.remove(name)
            return p

        pointer, _ = self.fence.read_pointer()
        if pointer is not None and name not in pointer.checkpoints:
            return  # not a name of ours (nothing to remove, and no reason to claim the root or write its pointer)
        self._claim()
        self.fence.update(drop, fenced=True)

    def stored_like(self, obj: ObjectEntry, live: set[str]) -> str | None:
        """The path of an object this writer stored or loaded with ``obj``'s bytes, in one of the ``live`` folders;
        None when it knows none (a tier's persist references it instead of copying)."""
        return self._known.like(obj, live)

    def remember_loaded(self, manifest: Manifest, held: list[ObjectEntry] | None = None) -> None:
        """A loaded checkpoint's objects (``held``: those this root stores): a save of the same step (with
        ``dedup``: any) that holds identical bytes references them."""
        self._known.remember(manifest, held=held)


def _folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _given(obj: ObjectEntry) -> ObjectEntry:
    """An object an incremental plan references as stored: nothing to upload."""
    return obj
