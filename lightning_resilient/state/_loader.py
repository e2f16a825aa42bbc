"""How ``ResumeStateCallback`` sees a training loader: its kind (:class:`LoaderKind`), where its epochs start
(:class:`TrackedBatchSampler`, :func:`hook_iterators`), what it fetched, the generators and sampler facts that
decide its order, and the per-sample seeding of its dataset (:func:`apply_sample_seeding`). It owns every patch made
to the user's loader and dataset, and :func:`untrack` undoes them.

For the ``LOADER``, ``DATASET`` and ``ITERABLE`` kinds the iterator the loader creates is hooked
(:func:`hook_iterators`): an epoch starts when the loader creates or resets its iterator, and a state can be
snapshotted right before each underlying fetch. For ``MAP`` the batch sampler is wrapped instead, so a resumed epoch
skips consumed batches at the index level (and its iterators are hooked only to see each fetched batch). Every
batch the main process receives from the loader's iterator is handed to an ``on_batch`` callback, on the host,
before Lightning moves it to the device.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _DatasetSamplerWrapper
from torch.utils.data import DataLoader, IterableDataset

from lightning_resilient.state.seeding import PerSampleSeeded, SampleSeeding, SeededCollate

__all__ = ["LoaderKind", "OneEpochBatches", "Start", "TrackedBatchSampler", "apply_sample_seeding", "batch_len",
           "classify", "custom_samplers", "draw_once_per_epoch", "generators", "give_batches", "has_state",
           "hook_iterators", "own_batch_sampler", "restore_batch_sampler", "sample_seeding", "sampler_facts",
           "set_data_epoch", "sized", "untrack"]


class LoaderKind(str, Enum):
    """Kinds of training data, by how their position can be saved. The values are what checkpoints store (a ``str``
    Enum: each member equals its value, so a stored ``"map"`` compares equal to ``LoaderKind.MAP``)."""

    # A plain sized DataLoader over a map-style dataset: the position is a number of batches, skipped at the index
    # level on resume.
    MAP = "map"
    # A DataLoader subclass with state_dict/load_state_dict (torchdata's StatefulDataLoader): its state is the
    # position.
    LOADER = "loader"
    # A plain DataLoader with num_workers=0 over an IterableDataset with state_dict/load_state_dict: the dataset's
    # state is the position.
    DATASET = "dataset"
    # Any other DataLoader over an IterableDataset: the position cannot be saved.
    ITERABLE = "iterable"
    # Anything that is not a DataLoader (Lightning also accepts plain iterables), and a DataLoader without automatic
    # batching (batch_size=None) over a map-style dataset.
    OTHER = "other"

    def __str__(self) -> str:
        # Python 3.11 formats a str-mixin Enum member as "LoaderKind.MAP"; messages and logs show the stored value.
        return str(self.value)


def has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def sized(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def classify(loader: Any) -> LoaderKind:
    if not isinstance(loader, DataLoader):
        return LoaderKind.OTHER
    if has_state(loader):
        return LoaderKind.LOADER
    if isinstance(loader.dataset, IterableDataset):
        stateful = has_state(loader.dataset) and loader.num_workers == 0
        return LoaderKind.DATASET if stateful else LoaderKind.ITERABLE
    if loader.batch_sampler is not None and sized(loader):
        return LoaderKind.MAP
    return LoaderKind.OTHER


def samplers(loader: Any) -> list[Any]:
    """The loader's sampler and its batch sampler's sampler (as Lightning's ``_set_sampler_epoch`` finds them)."""
    found: dict[int, Any] = {}
    for obj in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None:
            found[id(obj)] = obj
    return list(found.values())


def set_data_epoch(loader: Any, epoch: int) -> None:
    """Give the samplers (``DistributedSampler``), a ``PerSampleSeeded`` dataset and the dataset's per-sample
    seeding the epoch before it starts.

    Lightning sets the sampler epoch in ``on_train_epoch_start``, but on a resume it creates the iterator before
    that, and a worker-backed iterator (or torchdata's batch sampler) draws its first indices at creation
    (Lightning #21938).
    """
    dataset = getattr(loader, "dataset", None)
    seeding = sample_seeding(loader)
    for obj in [*samplers(loader), *([dataset] if isinstance(dataset, PerSampleSeeded) else []),
                *([seeding] if seeding is not None else [])]:
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


# -- per-sample seeding ------------------------------------------------------------------------------------------
def sample_seeding(loader: Any) -> SampleSeeding | None:
    """The :class:`SampleSeeding` :func:`apply_sample_seeding` installed on the loader's dataset, if any."""
    found = getattr(getattr(loader, "dataset", None), "__dict__", {}).get("__getitems__")
    return found if isinstance(found, SampleSeeding) else None


def apply_sample_seeding(loader: Any, seed: int) -> SampleSeeding | str:
    """Seed every sample the loader reads from ``(seed, epoch, index)``: install a :class:`SampleSeeding` as its
    dataset's ``__getitems__`` (torch's fetcher calls it in the main process and in every worker) and seed its
    ``collate_fn`` per batch. Returns it, or, where it cannot apply, why (a phrase naming the case)."""
    if not isinstance(loader, DataLoader):
        return f"the training data is a {type(loader).__name__}, not a DataLoader"
    dataset = loader.dataset
    name = type(dataset).__name__
    if isinstance(dataset, IterableDataset):
        return f"the training dataset {name} is an IterableDataset (it has no per-sample __getitem__ to seed)"
    if loader.batch_sampler is None:
        return ("the training DataLoader has batch_size=None (no automatic batching), so it reads samples without"
                " the __getitems__ hook")
    installed = sample_seeding(loader)
    if installed is not None:
        if not isinstance(loader.collate_fn, SeededCollate):  # another loader over the same dataset
            loader.collate_fn = installed.collate(loader.collate_fn)
        return installed
    if "__getitems__" in getattr(dataset, "__dict__", {}):
        return (f"the training dataset {name} already has its own __getitems__ set on the instance (it is wrapped"
                " already), which per-sample seeding would replace")
    seeding = SampleSeeding(dataset, seed=seed)
    try:
        dataset.__getitems__ = seeding  # type: ignore[attr-defined]  # torch's fetcher looks it up on the instance
    except (AttributeError, TypeError):
        return f"the training dataset {name} takes no new attribute (__slots__ without __dict__)"
    if not isinstance(loader.collate_fn, SeededCollate):  # (an iterator reads it when it is created)
        loader.collate_fn = seeding.collate(loader.collate_fn)
    return seeding


_KNOWN_SAMPLER_MODULES = ("torch.utils.data.", "lightning.", "pytorch_lightning.", "torchdata.",
                          "lightning_resilient.")


def custom_samplers(loader: Any) -> list[Any]:
    """The loader's samplers and batch samplers that are not torch's, Lightning's or torchdata's (their randomness
    may live outside what a resume restores), innermost ones of Lightning's wrappers included."""
    found: dict[int, Any] = {}

    def visit(obj: Any, depth: int) -> None:
        if obj is None or depth > 4:
            return
        if isinstance(obj, TrackedBatchSampler):
            visit(obj.inner, depth + 1)
            return
        if not type(obj).__module__.startswith(_KNOWN_SAMPLER_MODULES):
            found.setdefault(id(obj), obj)
        for attr in ("sampler", "batch_sampler", "_sampler"):
            visit(getattr(obj, attr, None), depth + 1)
        wrapped = getattr(obj, "dataset", None)
        if isinstance(wrapped, _DatasetSamplerWrapper):  # DistributedSamplerWrapper: the sampler it distributes
            visit(getattr(wrapped, "_sampler", None), depth + 1)

    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        visit(obj, 0)
    return list(found.values())


def sampler_facts(loader: Any) -> dict[str, int]:
    """``epoch``, ``seed``, ``num_replicas`` and ``rank`` of the loader's sampler where it has them."""
    facts: dict[str, int] = {}
    for obj in samplers(loader):
        for name in ("epoch", "seed", "num_replicas", "rank"):
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                facts.setdefault(name, value)
    return facts


def _walk(loader: Any) -> tuple[list[torch.Generator], list[_DatasetSamplerWrapper]]:
    found: dict[int, torch.Generator] = {}
    wrappers: dict[int, _DatasetSamplerWrapper] = {}

    def visit(obj: Any, depth: int) -> None:
        if obj is None or depth > 5:
            return
        if isinstance(obj, torch.Generator):
            found.setdefault(id(obj), obj)
            return
        for name in ("generator", "sampler", "batch_sampler", "inner", "_sampler"):
            visit(getattr(obj, name, None), depth + 1)
        if isinstance(dataset := getattr(obj, "dataset", None), _DatasetSamplerWrapper):  # DistributedSamplerWrapper
            wrappers.setdefault(id(dataset), dataset)
            visit(dataset, depth + 1)

    visit(getattr(loader, "generator", None), 0)
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        visit(obj, 0)
    return list(found.values()), list(wrappers.values())


def generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that decide the loader's order: ``DataLoader(generator=...)`` (it also
    draws the worker base seed) and those of its samplers, nested ones included (a ``RandomSampler(generator=...)``,
    torchdata's ``RandomSampler``, which always owns one, and the sampler inside Lightning's
    ``DistributedSamplerWrapper``). They advance once per epoch and no loader state holds all of them."""
    return _walk(loader)[0]


def draw_once_per_epoch(loader: Any, drawing: Callable[[], set[int] | None],
                        before_draw: Callable[[], None] | None = None) -> None:
    """Make each ``DistributedSamplerWrapper`` in the loader draw its inner sampler's order once per epoch.

    Lightning wraps a sampler it does not know (torchdata's ``RandomSampler`` among them) in a
    ``DistributedSamplerWrapper``, whose every ``iter()`` re-draws the inner sampler and so advances its
    generator. torchdata iterates the index sampler once to build an iterator, twice with workers, and four times
    to build one from a saved state, so a resumed epoch would draw a different order. While ``drawing()`` returns
    a set (an epoch's iterator is being built), a wrapper already in it keeps its order. ``before_draw()`` is called
    right before a wrapper draws (the generators are then as the epoch's order is drawn from them).
    """
    for wrapper in _walk(loader)[1]:
        ref = weakref.ref(wrapper)
        reset = type(wrapper).reset

        def reset_once(ref: Any = ref, reset: Any = reset) -> None:
            target, drawn = ref(), drawing()
            if drawn is not None and id(target) in drawn:
                return
            if before_draw is not None:
                before_draw()
            reset(target)
            if drawn is not None:
                drawn.add(id(target))

        reset_once._hooked = True  # type: ignore[attr-defined]  # our mark, found by untrack()
        wrapper.reset = reset_once  # type: ignore[method-assign]  # on the instance: its type stays Lightning's


def untrack(loader: Any) -> None:
    """Undo what :class:`TrackedBatchSampler`, :func:`hook_iterators`, :func:`draw_once_per_epoch` and
    :func:`apply_sample_seeding` did to ``loader``: the user's loader goes back to its own batch sampler and its
    class's methods, its dataset to its own ``__getitems__``."""
    if not isinstance(loader, DataLoader):
        return  # only DataLoaders are patched; a plain iterable (a list, a generator) may not even have a __dict__
    if sample_seeding(loader) is not None:
        del loader.dataset.__dict__["__getitems__"]
    collate = getattr(loader, "collate_fn", None)
    if isinstance(collate, SeededCollate):
        loader.collate_fn = collate.collate_fn
    restore_batch_sampler(loader)
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, TrackedBatchSampler):
        object.__setattr__(loader, "batch_sampler", sampler.original)  # as set: DataLoader refuses it after __init__
    if getattr(loader.__dict__.get("_get_iterator"), "_hooked", False):
        del loader.__dict__["_get_iterator"]
    for wrapper in _walk(loader)[1]:
        if getattr(wrapper.__dict__.get("reset"), "_hooked", False):
            del wrapper.__dict__["reset"]


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (or the length of a plain list)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, Mapping):
        return batch_len(next(iter(batch.values()))) if batch else 0
    if isinstance(batch, (list, tuple)):
        if batch and isinstance(batch[0], (torch.Tensor, Mapping, list, tuple)):
            return batch_len(batch[0])
        return len(batch)
    return 1


# -- map-style: the index stream ----------------------------------------------------------------------------------
# What an epoch's start tells the index stream: batches of the sampler's order to skip, or the batches to read
# instead of the sampler's (the rest of an epoch resumed on another number of processes).
Start = int | list[list[int]]


class _Stream:
    """One epoch's index stream, started lazily so an iterator torch discards unread costs nothing."""

    def __init__(self, inner: Any, start: Start, handed: deque[Any], on_order: Callable[[], None] | None) -> None:
        self.inner = inner
        self.start = start
        self.handed = handed
        self.on_order = on_order
        self.started = False
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self.started = True
            if isinstance(self.start, list):  # given batches: the sampler draws no order for them
                self._it = iter(self.start)
            else:
                if self.on_order is not None:
                    self.on_order()  # right before the sampler draws the epoch's order
                self._it = itertools.islice(iter(self.inner), self.start, None)
        batch = next(self._it)
        self.handed.append(batch)  # with workers the stream runs ahead: consumed in order, later
        return batch


class TrackedBatchSampler:
    """Wraps a loader's batch sampler: each new index stream is the start of an epoch.

    ``on_epoch_start()`` is called when a stream is created and returns how many batches to skip, or the batches
    to yield instead of the sampler's; ``on_order()`` right before the stream's first index is drawn (when a sampler
    draws the epoch's order); every batch of indices the stream yields is appended to ``handed`` (so the samples of
    each consumed batch are known).
    """

    inner: Any  # the batch sampler read: the loader's own, or ``replacement``
    original: Any  # the loader's own batch sampler, put back by untrack()

    def __init__(self, inner: Any, on_epoch_start: Callable[[], Start], handed: deque[Any],
                 on_order: Callable[[], None] | None = None, replacement: Any = None) -> None:
        while isinstance(inner, TrackedBatchSampler):  # a second fit with the same loader: track it once
            inner = inner.original
        self.original = inner
        self.inner = inner if replacement is None else replacement
        self.on_epoch_start = on_epoch_start
        self.on_order = on_order
        self.handed = handed
        self._last: _Stream | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._last is not None and not self._last.started:
            # torch's multiprocessing iterator asks for the index stream twice while it is created (once in
            # the base class, once in its first reset) and throws the first away, and a resume may create an
            # iterator it never reads: same epoch, same skip.
            stream = _Stream(self.inner, self._last.start, self.handed, self.on_order)
        else:
            stream = _Stream(self.inner, self.on_epoch_start(), self.handed, self.on_order)
        self._last = stream
        return stream

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class OneEpochBatches:
    """A stateful loader's batch sampler with given batches for one epoch: the rest of an epoch resumed on another
    number of processes (a stateful loader's own state cannot say it). Its first stream yields ``batches`` (each
    appended to ``handed``), every later one is the loader's own batch sampler's, unwrapped (so the loader's state
    holds that sampler's own iterator state). :func:`restore_batch_sampler` puts the loader's own back."""

    inner: Any

    def __init__(self, inner: Any, batches: list[list[int]], handed: deque[Any]) -> None:
        self.inner = inner
        self.batches = batches
        self.handed = handed
        self._last: _Stream | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._last is not None and self._last.started:
            return iter(self.inner)
        # (torch's multiprocessing iterator asks for the stream twice while it is created: same batches)
        self._last = _Stream(self.inner, self.batches, self.handed, None)
        return self._last

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def own_batch_sampler(loader: Any) -> Any:
    """The loader's batch sampler under :class:`TrackedBatchSampler` and :class:`OneEpochBatches`."""
    found = getattr(loader, "batch_sampler", None)
    while isinstance(found, (TrackedBatchSampler, OneEpochBatches)):
        found = found.inner
    return found


def give_batches(loader: DataLoader[Any], batches: list[list[int]], handed: deque[Any]) -> None:
    """Make the loader's next epoch read ``batches`` (see :class:`OneEpochBatches`)."""
    object.__setattr__(loader, "batch_sampler", OneEpochBatches(own_batch_sampler(loader), batches, handed))


def restore_batch_sampler(loader: Any, iterator: Any = None) -> None:
    """Put the loader's own batch sampler back after :func:`give_batches`, also into a live (persistent) iterator
    about to be reset for a new epoch (it keeps the index sampler it was created with)."""
    given = getattr(loader, "batch_sampler", None)
    if not isinstance(given, OneEpochBatches):
        return
    own = given.inner
    object.__setattr__(loader, "batch_sampler", own)  # as set: DataLoader refuses it after __init__
    if iterator is not None and getattr(iterator, "_index_sampler", None) is given:
        iterator._index_sampler = own


# -- other DataLoaders: the iterator ------------------------------------------------------------------------------
def hook_iterators(loader: DataLoader[Any], on_epoch_start: Callable[[], object] | None,
                   on_iterator: Callable[[Any], None], before_fetch: Callable[[Any], None],
                   after_fetch: Callable[[Any], None]) -> None:
    """Call ``on_epoch_start()`` before the loader creates an iterator or resets its persistent one for a new epoch,
    then ``on_iterator(iterator)``; call ``before_fetch(iterator)`` right before each underlying fetch and
    ``after_fetch(batch)`` when that fetch returned a batch. What ``on_epoch_start()`` returns (batches to skip, for
    the ``MAP`` kind) is ignored: these loaders resume from a loaded state, not by skipping. ``MAP`` loaders pass
    None: their epochs start in :class:`TrackedBatchSampler`.

    Only instance attributes are patched (``DataLoader.__iter__`` looks ``_get_iterator`` up on the instance,
    ``_BaseDataLoaderIter`` looks ``_next_data`` and ``_reset`` up on the iterator), so the types stay what they
    were and Lightning's ``isinstance`` checks (worker shutdown, ``_Stateful``) still hold. The closures hold weak
    references, so no reference cycle keeps an iterator (and its worker processes) alive.
    """
    loader_ref = weakref.ref(loader)
    get_iterator = type(loader)._get_iterator

    def hooked_get_iterator() -> Any:
        owner = loader_ref()
        assert owner is not None
        if on_epoch_start is not None:
            on_epoch_start()
        it = get_iterator(owner)
        _hook_iterator(it, on_epoch_start, on_iterator, before_fetch, after_fetch)
        on_iterator(it)
        return it

    hooked_get_iterator._hooked = True  # type: ignore[attr-defined]  # our mark, found by untrack()
    loader._get_iterator = hooked_get_iterator  # type: ignore[method-assign]  # on the instance, as said above


def _hook_iterator(it: Any, on_epoch_start: Callable[[], object] | None, on_iterator: Callable[[Any], None],
                   before_fetch: Callable[[Any], None], after_fetch: Callable[[Any], None]) -> None:
    ref = weakref.ref(it)
    next_data = type(it)._next_data
    reset = type(it)._reset

    def hooked_next_data() -> Any:
        target = ref()
        before_fetch(target)
        data = next_data(target)
        after_fetch(data)
        return data

    def hooked_reset(loader: Any, *args: Any, **kwargs: Any) -> Any:
        target = ref()
        if on_epoch_start is not None:
            on_epoch_start()
        out = reset(target, loader, *args, **kwargs)
        on_iterator(target)
        return out

    it._next_data = hooked_next_data
    it._reset = hooked_reset
