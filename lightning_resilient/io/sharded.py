"""Sharded checkpoints (``torch.distributed.checkpoint``) in the atomic layout.

With FSDP2 / tensor parallelism every rank holds only its shards of the model and optimizer, and writes them
itself. :class:`AtomicStorageWriter` and :class:`AtomicStorageReader` are DCP storage plugins that put those
shards into one commit folder of a checkpoint root, as the rest of this package does:

- every rank uploads its own tensor stream (raw bytes, cut into objects, chunk digests) into the same commit
  folder, named by the coordinator;
- only after DCP has collected every rank's results does the coordinator write DCP's metadata, the non-sharded
  rest of the checkpoint (loops, callbacks, ...), the manifest (last) and move the pointer: a rank that crashes
  mid-save leaves a folder without a manifest, and the previous checkpoint stays latest;
- loading verifies every chunk it reads, and reads only the chunks its rank needs; DCP reshards, so a
  checkpoint written by N processes loads into M.

DCP's metadata (shapes, chunk layout) is pickled, as DCP itself stores it; tensor bytes never are. Reading never
unpickles more than a full load would: the metadata goes through an unpickler that knows only DCP's metadata types
(a payload naming anything else is refused, whatever its checksums say), and DCP's non-tensor items (which DCP's
planner loads with ``weights_only=False``) are first checked with torch's ``weights_only`` unpickler unless the
caller passed ``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from lightning_resilient.errors import CheckpointCorruptedError, CheckpointError
from lightning_resilient.io import incremental, layout, paths
from lightning_resilient.io.folders import WHOLE, writer_epoch_of
from lightning_resilient.io.manifest import Manifest, ObjectEntry, ShardedRecord
from lightning_resilient.io.reader import Job
from lightning_resilient.io.root import CheckpointRoot
from lightning_resilient.io.writer import HostSources

__all__ = ["AtomicStorageReader", "AtomicStorageWriter", "load_full", "load_metadata", "load_sharded", "own_error",
           "own_errors", "root_and_name", "save_sharded"]

log = logging.getLogger(__name__)

METADATA_NAME = "dcp.metadata"

# What DCP's metadata is made of (torch 2.3-2.13): its own dataclasses and enum, torch.Size, dtypes and layouts.
_METADATA_TYPES = {"Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                   "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global (a function that would run) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and name in _METADATA_TYPES)
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: it is not one of DCP's metadata types"
                                         " (a payload that names it could run code)")
        return super().find_class(module, name)


def load_metadata(data: bytes, where: str) -> Metadata:
    """DCP metadata from its pickled bytes, with the restricted unpickler."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(f"{where}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptedError(f"{where} is not DCP metadata", object=where)
    return metadata


class AtomicStorageWriter(StorageWriter):
    """A DCP storage writer that commits into the checkpoint root of ``path`` (``<root>/<name>``).

    Args:
        root: the checkpoint root, as :meth:`AtomicCheckpointIO.root` returns it (one per process).
        name: the checkpoint's name in the root (``epoch=1-step=500.ckpt``).
        rest: on the coordinator, the part of the checkpoint that is not sharded (saved like a normal
            checkpoint alongside the shards); ignored on other ranks.
        nodes: the global ranks of each node (recorded in the manifest: a local tier holds one part per node).
        stage: the coordinator stages the commit (objects and manifest, in :attr:`manifest`) without publishing
            it: with a local tier on several nodes every node publishes the manifest with its own part.

    Each rank's stream puts its shards first and its whole items (tensors no rank shares with another, DCP's
    deduplicated replicated tensors, bytes) in objects of their own (``r<rank>-whole-...``): every rank may need
    those on load, so a local tier keeps them on every node (see ``io/parts.py``).
    """

    def __init__(self, root: CheckpointRoot, name: str, rest: dict[str, Any] | None = None, *,
                 nodes: list[list[int]] | None = None, stage: bool = False, within: set[str] | None = None) -> None:
        super().__init__()
        self.root = root
        self.name = name
        self.rest = rest if rest is not None else {}
        self.nodes = nodes or []
        self.stage = stage
        self.within = within  # with dedup: the only folders a rank may reference (those every node's tier keeps)
        self.is_coordinator = False
        self.commit: str | None = None
        self.entry: Any = None
        self.manifest: Manifest | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.commit = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.root.store.url(self.name))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator names the commit folder (claiming the root if it has not) and tells every rank.
        commit = self.root.writer.new_commit_folder(self.name, time.time())
        return [replace(plan, storage_data={"commit": commit, "rank": i}) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.commit, rank = plan.storage_data["commit"], plan.storage_data["rank"]
        slots: list[layout.TensorSlot] = []
        kinds: list[str] = []
        # Shards first, then the whole items, each group in plan order: the whole items start an object of their own.
        items = sorted(plan.items, key=_is_whole)
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = bytes(data.getbuffer()) if isinstance(data, io.BytesIO) else bytes(data)
                tensor = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                          else torch.empty(0, dtype=torch.uint8))
                kinds.append("bytes")
            else:
                assert isinstance(data, torch.Tensor)  # every item that is not BYTE_IO resolves to a tensor
                tensor = data.detach()
                kinds.append("tensor")
            slots.append(layout.TensorSlot([["s", str(item.index.fqn)]], tensor, str(tensor.device)))
        first_whole = next((i for i, item in enumerate(items) if _is_whole(item)), len(items))
        prefix = f"{self.commit}/r{rank:05d}-"
        if self.root.settings.dedup:
            objects, offsets = self._write_incremental(slots[:first_whole], slots[first_whole:], prefix)
        else:
            total = layout.plan(slots)
            split = slots[first_whole].offset if first_whole < len(slots) else total
            sources = layout.host_sources(slots)
            objects = self.root.writer.upload_stream(prefix, split, lambda a, b: layout.gather(slots, sources, a, b))
            objects += self.root.writer.upload_stream(f"{prefix}{WHOLE}", total - split, lambda a, b: layout.gather(
                slots, sources, split + a, split + b))
            offsets = [slot.offset for slot in slots]
        results = [WriteResult(index=item.index, size_in_bytes=slot.nbytes,
                               storage_data={"rank": rank, "offset": offset, "nbytes": slot.nbytes,
                                             "kind": kind, "dtype": layout.dtype_name(slot.tensor.dtype),
                                             "shape": list(slot.tensor.shape)})
                   for item, slot, kind, offset in zip(items, slots, kinds, offsets, strict=True)]
        if results:  # the coordinator needs every rank's objects for the manifest: they ride on the results
            results[0].storage_data["objects"] = [asdict(o) for o in objects]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_incremental(self, shards: list[layout.TensorSlot], whole: list[layout.TensorSlot],
                           prefix: str) -> tuple[list[ObjectEntry], list[int]]:
        """``dedup``: this rank's shards and whole items as two incremental streams (``io/incremental.py``): the
        units its last committed save stored unchanged (a frozen base's shards) are referenced, not read or written.
        Only folders the pointer keeps live, of this save's writer epoch, are referenced; the coordinator's pointer
        update checks them again. Returns the objects (shards', then whole items') and each slot's offset in the
        rank's stream (the two streams end to end)."""
        assert self.commit is not None
        live = self.root.writer.keep_live(self.within)  # (the coordinator's rest references by digest only those)
        streams, epoch = self.root.rank_streams, writer_epoch_of(self.commit)
        own = prefix.rsplit("/", 1)[1]  # "r<rank>-"
        streams.begin()
        shard = self.root.writer.shard_size
        objects: list[ObjectEntry] = []
        offsets: list[int] = []
        for stream, slots, name in (("shards", shards, prefix), ("whole", whole, f"{prefix}{WHOLE}")):
            plan = streams.plan(stream, slots, live=live, epoch=epoch, own=min(shard, incremental.OWN),
                                pack=min(shard, incremental.PACK), shard=shard)
            # By digest, only this rank's own objects of the same stream: a whole item stored under a shard's name
            # would not count as common to every node (io/parts.py).
            kind = f"{own}{WHOLE}"

            def ours(path: str, whole: bool = stream == "whole", kind: str = kind) -> bool:
                base = path.rsplit("/", 1)[1]
                return base.startswith(kind) if whole else base.startswith(own) and not base.startswith(kind)

            written = self.root.writer.upload_stream(name, plan.total, _pieces(slots), plan=plan, only=ours)
            streams.wrote(stream, plan, slots, written)
            base = sum(o.size for o in objects)
            offsets += [base + slot.offset for slot in slots]
            objects += written
        return objects, offsets

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        commit = self.commit  # the coordinator wrote its own shards too, into the folder it named
        assert commit is not None, "finish() before write_data()"
        world_size = len(results)
        rank_objects: list[list[ObjectEntry]] = [[] for _ in range(world_size)]
        storage: dict[MetadataIndex, Any] = {}
        for wr_list in results:
            for wr in wr_list:
                data = dict(wr.storage_data)
                found = data.pop("objects", None)
                if found is not None:
                    rank_objects[data["rank"]] = [ObjectEntry(**o) for o in found]
                storage[wr.index] = data
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        meta = self.root.writer.put(f"{commit}/{METADATA_NAME}", [memoryview(pickle.dumps(metadata))], {})
        extra = [o for objs in rank_objects for o in objs] + [meta]

        def record(objects: list[ObjectEntry]) -> ShardedRecord:
            first = len(objects) - len(extra)
            ranks, i = [], first
            for objs in rank_objects:
                ranks.append(list(range(i, i + len(objs))))
                i += len(objs)
            return ShardedRecord(world_size, i, ranks, self.nodes)

        prepared = self.root.prepare(self.rest, self.name, reuse=False)  # (the rest: small, written whole)
        if self.stage:
            self.manifest = self.root.writer.stage(prepared, folder=commit, extra=extra, sharded=record)
        else:
            self.entry = self.root.commit(prepared, folder=commit, extra=extra, sharded=record)


def _pieces(slots: list[layout.TensorSlot]) -> Callable[[int, int], list[memoryview]]:
    """The bytes [start, end) of a stream laid out from ``slots``, each tensor copied to the host only when read."""
    sources: Any = HostSources(slots)  # (gather indexes it like the list of host views it stands for)
    return lambda start, end: layout.gather(slots, sources, start, end)


def _is_whole(item: WriteItem) -> bool:
    """Whether a DCP write item is a whole value (bytes, a plain tensor, a tensor no other rank holds part of) rather
    than one rank's shard of a tensor sharded across ranks."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return True
    return list(item.tensor_data.chunk.sizes) == list(item.tensor_data.size)


class AtomicStorageReader(StorageReader):
    """A DCP storage reader over one committed sharded checkpoint (``commit`` in ``root``).

    It keeps the manifest and the metadata once read, so one reader serves every ``dcp.load`` of a resume (the
    model, then each optimizer) with one read of each; pass ``manifest`` when the caller has already read it.

    ``sources``: roots holding copies of the commit, in the order to read them (a node's local tier, which may hold
    only some of the shards, then the durable root): each object is read from the first that stores it, and read
    again from the next when a copy fails verification. Those that failed are in :attr:`failed`.
    """

    def __init__(self, root: CheckpointRoot, commit: str, manifest: Manifest | None = None,
                 weights_only: bool | None = None, sources: list[CheckpointRoot] | None = None) -> None:
        super().__init__()
        self.root = root
        self.commit = commit
        self.manifest = manifest
        self.weights_only = weights_only
        self.sources = sources if sources else [root]
        self.failed: set[CheckpointRoot] = set()
        self._holders: dict[int, list[CheckpointRoot]] | None = None
        self.metadata: Metadata | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}

    def holders(self, manifest: Manifest, index: int) -> list[CheckpointRoot]:
        """The sources that store object ``index`` with the size the manifest gives (one listing per folder and
        source, made once): a declared size is never trusted to allocate before it was compared with a store."""
        if self._holders is None:
            holders: dict[int, list[CheckpointRoot]] = {i: [] for i in range(len(manifest.objects))}
            for source in self.sources:
                stored = source.reader.stored_sizes(o.path for o in manifest.objects)
                for i, obj in enumerate(manifest.objects):
                    if obj.path in stored and stored[obj.path] in (obj.size, None):
                        holders[i].append(source)
            self._holders = holders
        found = self._holders[index]
        if not found:
            url = self.root.store.url(manifest.objects[index].path)
            raise CheckpointCorruptedError(f"{url} is missing" + (" from every copy" if len(self.sources) > 1 else ""),
                                           object=url)
        return found

    def read_object(self, manifest: Manifest, index: int, sink: Callable[[int, memoryview], None],
                    only: Callable[[int, int], bool] | None = None) -> list[Job]:
        """Jobs reading (verified) object ``index`` from its first holder, then from the next when that fails."""
        sources = self.holders(manifest, index)
        if len(sources) == 1:
            return self._tracked(sources[0], sources[0].reader.read_chunks(manifest, index, sink, only=only))

        def job() -> int:
            for i, source in enumerate(sources):
                try:
                    return sum(read() for read in source.reader.read_chunks(manifest, index, sink, only=only))
                except CheckpointCorruptedError as exc:
                    self.failed.add(source)
                    if i == len(sources) - 1:
                        raise
                    log.warning("%s; reading it from %s instead", exc, sources[i + 1].store.url(""))
            raise AssertionError("unreachable")

        return [job]

    def _tracked(self, source: CheckpointRoot, jobs: list[Job]) -> list[Job]:
        def tracked(job: Job) -> Job:
            def run() -> int:
                try:
                    return job()
                except CheckpointCorruptedError:
                    self.failed.add(source)
                    raise
            return run
        return [tracked(job) for job in jobs]

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is not None:
            return self.metadata
        manifest = self.manifest if self.manifest is not None else self.root.read_manifest(self.commit)
        if manifest.sharded is None:
            raise CheckpointCorruptedError(f"{self.root.store.url(self.commit)} is not a sharded checkpoint",
                                           object=self.root.store.url(self.commit))
        self.manifest = manifest
        index = manifest.sharded.metadata
        self.holders(manifest, index)  # declared sizes against the store before allocating
        buf = bytearray(manifest.objects[index].size)

        def sink(offset: int, piece: memoryview) -> None:
            buf[offset : offset + len(piece)] = piece

        self.root.reader.run(self.read_object(manifest, index, sink))
        metadata = load_metadata(bytes(buf), self.root.store.url(manifest.objects[index].path))
        self.metadata = metadata
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if self.manifest is None:  # DCP reads the metadata on the coordinator only, then broadcasts it
            self.manifest = self.root.read_manifest(self.commit)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        manifest = self.manifest
        assert manifest is not None and manifest.sharded is not None
        unique: dict[tuple[int, int], dict[str, Any]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            unique.setdefault((info["rank"], info["offset"]), info)
        keys = sorted(unique)
        buffers: dict[tuple[int, int], torch.Tensor] = {}
        jobs = []
        for rank in sorted({r for r, _ in keys}):
            mine = [k for k in keys if k[0] == rank]
            extents = [(offset, unique[(rank, offset)]["nbytes"]) for _, offset in mine]
            needed = []
            for index, start in zip(manifest.sharded.ranks[rank], manifest.rank_offsets(rank), strict=True):
                def wanted(a: int, b: int, start: int = start, extents: list[tuple[int, int]] = extents) -> bool:
                    # Only the chunks holding bytes this rank asked for: a resharded load reads its part only.
                    return any(o < start + b and start + a < o + n for o, n in extents if n)

                if wanted(0, max(1, manifest.objects[index].size)):
                    self.holders(manifest, index)  # its stored size checked before the buffers are allocated
                    needed.append((index, start, wanted))
            scatter = layout.Scatter(extents, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
            buffers.update(zip(mine, scatter.buffers, strict=True))
            for index, start, wanted in needed:
                jobs += self.read_object(manifest, index, _shifted(scatter.write, start), only=wanted)
        self.root.reader.run(jobs)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            buffer = buffers[(info["rank"], info["offset"])]
            if req.type == LoadItemType.BYTE_IO:
                raw = buffer.numpy().tobytes()
                if self.weights_only is not False:
                    # DCP's planner loads these with weights_only=False: only what a full load would accept gets there.
                    torch.load(io.BytesIO(raw), weights_only=True)
                planner.load_bytes(req, io.BytesIO(raw))
                continue
            tensor = layout.tensor_view(buffer, layout.parse_dtype(info["dtype"]), info["shape"])
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointCorruptedError(f"{req.storage_index.fqn}: stored chunk {tuple(tensor.size())} does not"
                                               f" fit the requested {tuple(target.size())}",
                                               object=self.root.store.url(self.commit))
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future


def _shifted(write: Callable[[int, memoryview], None], start: int) -> Callable[[int, memoryview], None]:
    return lambda offset, piece: write(start + offset, piece)


# Errors raised by our storage plugins that a caller must see as they are: ours, and a refusal to unpickle.
_OWN = (CheckpointError, pickle.UnpicklingError)


def own_error(exc: BaseException) -> BaseException | None:
    """Our own error inside DCP's ``CheckpointException`` (which wraps every rank's failure), if there is one: a
    ``CheckpointError`` or a refusal to unpickle.

    DCP shares each rank's failure with all ranks, so every rank finds the same error here.
    """
    if isinstance(exc, _OWN):
        return exc
    for wrapped in getattr(exc, "failures", {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, _OWN):
            return inner
    return None


@contextlib.contextmanager
def own_errors() -> Iterator[None]:
    """Around a DCP call: re-raise our own error (a ``StaleWriterError``, a ``CheckpointCorruptedError``, ...) as
    it is, on every rank, instead of DCP's ``CheckpointException`` wrapper."""
    try:
        yield
    except BaseException as exc:
        own = own_error(exc)
        if own is None or own is exc:
            raise
        raise own from exc


def save_sharded(state: dict[str, Any], root: CheckpointRoot, name: str, rest: dict[str, Any] | None = None,
                 **dcp_kwargs: Any) -> Any:
    """Save ``state`` (DTensors / sharded tensors per rank) as checkpoint ``name`` of ``root``; every rank calls.

    Returns the committed :class:`~lightning_resilient.io.pointer.Entry` on the coordinator, None elsewhere.
    Raises our own errors (a ``StaleWriterError``, ...) as they are, on every rank, rather than DCP's wrapper.
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    writer = AtomicStorageWriter(root, name, rest)
    with own_errors(), root.rank_streams.outcome():
        dcp_save(state, storage_writer=writer, **dcp_kwargs)
    return writer.entry


def load_sharded(state: dict[str, Any], root: CheckpointRoot, commit: str, *,
                 reader: AtomicStorageReader | None = None, **dcp_kwargs: Any) -> None:
    """Load ``commit`` into ``state`` in place (DCP: any number of processes, resharded as needed).

    ``reader``: an :class:`AtomicStorageReader` of this commit to reuse (its manifest and metadata are read once).
    A damaged chunk raises :class:`~lightning_resilient.CheckpointCorruptedError` naming the object.
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if reader is None:
        reader = AtomicStorageReader(root, commit)
    elif reader.root is not root or reader.commit != commit:
        raise ValueError(f"reader is for {reader.root.store.url(reader.commit)}, not {root.store.url(commit)}")
    reader.read_metadata()  # here, not inside DCP, which reports a failed metadata read only as text
    with own_errors():
        dcp_load(state, storage_reader=reader, **dcp_kwargs)


def load_full(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Consolidate a sharded checkpoint into one process: full tensors, no process group needed.

    ``url`` is a checkpoint root (its latest), a name in it, or a commit folder. Returns the checkpoint's rest
    (loops, callbacks, ...) with every sharded key (``state_dict``, ``optimizer_0``, ...) as full, unsharded
    tensors in DCP's fully-qualified-name layout.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lightning_resilient.io import catalog

    found = catalog.resolve(catalog.normalize(url), lambda root: catalog.reader(root, storage_options))
    if found is None:
        raise ValueError(f"{url} is a plain file, not a lightning_resilient checkpoint")
    root, entry = found.root, found.entry
    rest = root.load(entry.commit, map_location=None, weights_only=None, sharded_rest=True).checkpoint
    state: dict[str, Any] = {}
    reader = AtomicStorageReader(root, entry.commit)
    reader.read_metadata()  # here, not inside DCP, which reports a failed metadata read only as text
    with own_errors():
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]  # torch leaves it unannotated
                     no_dist=True)
    if "model" in state and "state_dict" not in state:
        # FSDP1 (AtomicFSDPStrategy, like Lightning's FSDPStrategy) shards the weights under "model"; a consolidated
        # checkpoint names them "state_dict", as every full Lightning checkpoint does.
        state["state_dict"] = state.pop("model")
    return {**rest, **state}


def root_and_name(io_: Any, path: str) -> tuple[CheckpointRoot, str]:
    """The root and checkpoint name of a save path ``<root>/<name>``."""
    from lightning_resilient.io.catalog import normalize

    url = normalize(path)
    name = paths.basename(url)
    if not name:
        raise ValueError(f"checkpoint path {url!r} names no checkpoint (it ends at a folder or bucket)")
    return io_.root(paths.dirname(url)), name

