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
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from lightning_resilient.errors import CheckpointCorruptedError, CheckpointError
from lightning_resilient.io import _paths, layout
from lightning_resilient.io.manifest import Manifest, ObjectEntry, ShardedRecord
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["AtomicStorageReader", "AtomicStorageWriter", "load_full", "load_metadata", "load_sharded", "own_error",
           "own_errors", "root_and_name", "save_sharded"]

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
    """

    def __init__(self, root: CheckpointRoot, name: str, rest: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.root = root
        self.name = name
        self.rest = rest if rest is not None else {}
        self.is_coordinator = False
        self.commit: str | None = None
        self.entry: Any = None

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
        for item in plan.items:
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
        total = layout.plan(slots)
        sources = layout.host_sources(slots)
        objects = self.root.writer.upload_stream(f"{self.commit}/r{rank:05d}-", total,
                                          lambda a, b: layout.gather(slots, sources, a, b))
        results = [WriteResult(index=item.index, size_in_bytes=slot.nbytes,
                               storage_data={"rank": rank, "offset": slot.offset, "nbytes": slot.nbytes,
                                             "kind": kind, "dtype": layout.dtype_name(slot.tensor.dtype),
                                             "shape": list(slot.tensor.shape)})
                   for item, slot, kind in zip(plan.items, slots, kinds, strict=True)]
        if results:  # the coordinator needs every rank's objects for the manifest: they ride on the results
            results[0].storage_data["objects"] = [asdict(o) for o in objects]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

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
            return ShardedRecord(world_size, i, ranks)

        prepared = self.root.prepare(self.rest, self.name)
        self.entry = self.root.commit(prepared, folder=commit, extra=extra, sharded=record)


class AtomicStorageReader(StorageReader):
    """A DCP storage reader over one committed sharded checkpoint (``commit`` in ``root``).

    It keeps the manifest and the metadata once read, so one reader serves every ``dcp.load`` of a resume (the
    model, then each optimizer) with one read of each; pass ``manifest`` when the caller has already read it.
    """

    def __init__(self, root: CheckpointRoot, commit: str, manifest: Manifest | None = None,
                 weights_only: bool | None = None) -> None:
        super().__init__()
        self.root = root
        self.commit = commit
        self.manifest = manifest
        self.weights_only = weights_only
        self.metadata: Metadata | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}

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
        self.root.reader.check_sizes(self.commit, manifest)  # declared sizes against the store before allocating
        self.manifest = manifest
        index = manifest.sharded.metadata
        buf = bytearray(manifest.objects[index].size)

        def sink(offset: int, piece: memoryview) -> None:
            buf[offset : offset + len(piece)] = piece

        self.root.reader.run(self.root.reader.read_chunks(manifest, index, sink))
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
            scatter = layout.Scatter(extents, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
            buffers.update(zip(mine, scatter.buffers, strict=True))
            for index, start in zip(manifest.sharded.ranks[rank], manifest.rank_offsets(rank), strict=True):
                def wanted(a: int, b: int, start: int = start, extents: list[tuple[int, int]] = extents) -> bool:
                    # Only the chunks holding bytes this rank asked for: a resharded load reads its part only.
                    return any(o < start + b and start + a < o + n for o, n in extents if n)

                sink = _shifted(scatter.write, start)
                jobs += self.root.reader.read_chunks(manifest, index, sink, only=wanted)
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
    with own_errors():
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

    from lightning_resilient.io.catalog import normalize, resolve
    from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO

    io_ = AtomicCheckpointIO(storage_options=storage_options)
    found = resolve(normalize(url), io_.root)
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
    name = _paths.basename(url)
    if not name:
        raise ValueError(f"checkpoint path {url!r} names no checkpoint (it ends at a folder or bucket)")
    return io_.root(_paths.dirname(url)), name

