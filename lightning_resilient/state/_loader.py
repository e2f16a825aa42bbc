"""How ``ResumeStateCallback`` sees a training loader: its kind (:class:`LoaderKind`), where its epochs start
(:class:`TrackedBatchSampler`, :func:`hook_iterators`), what it fetched, and the generators and sampler facts that
decide its order. It owns every patch made to the user's loader, and :func:`untrack` undoes them.

For the ``LOADER``, ``DATASET`` and ``ITERABLE`` kinds the iterator the loader creates is hooked
(:func:`hook_iterators`): an epoch starts when the loader creates or resets its iterator, and a state can be
snapshotted right before each underlying fetch. For ``MAP`` the batch sampler is wrapped instead, so a resumed epoch
skips consumed batches at the index level.
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

from lightning_resilient.state.seeding import PerSampleSeeded

__all__ = ["LoaderKind", "TrackedBatchSampler", "batch_len", "classify", "draw_once_per_epoch", "generators",
           "has_state", "hook_iterators", "sampler_facts", "set_data_epoch", "sized", "untrack"]


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
    """Give the samplers (``DistributedSampler``) and a ``PerSampleSeeded`` dataset the epoch before it starts.

    Lightning sets the sampler epoch in ``on_train_epoch_start``, but on a resume it creates the iterator before
    that, and a worker-backed iterator (or torchdata's batch sampler) draws its first indices at creation
    (Lightning #21938).
    """
    dataset = getattr(loader, "dataset", None)
    for obj in [*samplers(loader), *([dataset] if isinstance(dataset, PerSampleSeeded) else [])]:
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


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


def draw_once_per_epoch(loader: Any, drawing: Callable[[], set[int] | None]) -> None:
    """Make each ``DistributedSamplerWrapper`` in the loader draw its inner sampler's order once per epoch.

    Lightning wraps a sampler it does not know (torchdata's ``RandomSampler`` among them) in a
    ``DistributedSamplerWrapper``, whose every ``iter()`` re-draws the inner sampler and so advances its
    generator. torchdata iterates the index sampler once to build an iterator, twice with workers, and four times
    to build one from a saved state, so a resumed epoch would draw a different order. While ``drawing()`` returns
    a set (an epoch's iterator is being built), a wrapper already in it keeps its order.
    """
    for wrapper in _walk(loader)[1]:
        ref = weakref.ref(wrapper)
        reset = type(wrapper).reset

        def reset_once(ref: Any = ref, reset: Any = reset) -> None:
            target, drawn = ref(), drawing()
            if drawn is not None and id(target) in drawn:
                return
            reset(target)
            if drawn is not None:
                drawn.add(id(target))

        reset_once._hooked = True  # type: ignore[attr-defined]  # our mark, found by untrack()
        wrapper.reset = reset_once  # type: ignore[method-assign]  # on the instance: its type stays Lightning's


def untrack(loader: Any) -> None:
    """Undo what :class:`TrackedBatchSampler`, :func:`hook_iterators` and :func:`draw_once_per_epoch` did to
    ``loader``: the user's loader goes back to its own batch sampler and its class's methods."""
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, TrackedBatchSampler):
        object.__setattr__(loader, "batch_sampler", sampler.inner)  # as set: DataLoader refuses it after __init__
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
class _Stream:
    """One epoch's index stream, started lazily so an iterator torch discards unread costs nothing."""

    def __init__(self, inner: Any, skip: int, lengths: deque[int], on_order: Callable[[], None] | None) -> None:
        self.inner = inner
        self.skip = skip
        self.lengths = lengths
        self.on_order = on_order
        self.started = False
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self.started = True
            if self.on_order is not None:
                self.on_order()  # right before the sampler draws the epoch's order
            self._it = itertools.islice(iter(self.inner), self.skip, None)
        batch = next(self._it)
        self.lengths.append(len(batch))  # with workers the stream runs ahead: consumed in order, later
        return batch


class TrackedBatchSampler:
    """Wraps a loader's batch sampler: each new index stream is the start of an epoch.

    ``on_epoch_start()`` is called when a stream is created and returns how many batches to skip; ``on_order()``
    right before the stream's first index is drawn (when a sampler draws the epoch's order); the length of every
    batch the stream yields is appended to ``lengths`` (so samples consumed can be counted).
    """

    inner: Any  # the loader's own batch sampler

    def __init__(self, inner: Any, on_epoch_start: Callable[[], int], lengths: deque[int],
                 on_order: Callable[[], None] | None = None) -> None:
        while isinstance(inner, TrackedBatchSampler):  # a second fit with the same loader: track it once
            inner = inner.inner
        self.inner = inner
        self.on_epoch_start = on_epoch_start
        self.on_order = on_order
        self.lengths = lengths
        self._last: _Stream | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._last is not None and not self._last.started:
            # torch's multiprocessing iterator asks for the index stream twice while it is created (once in
            # the base class, once in its first reset) and throws the first away, and a resume may create an
            # iterator it never reads: same epoch, same skip.
            stream = _Stream(self.inner, self._last.skip, self.lengths, self.on_order)
        else:
            stream = _Stream(self.inner, self.on_epoch_start(), self.lengths, self.on_order)
        self._last = stream
        return stream

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# -- other DataLoaders: the iterator ------------------------------------------------------------------------------
def hook_iterators(loader: DataLoader[Any], on_epoch_start: Callable[[], object], on_iterator: Callable[[Any], None],
                   before_fetch: Callable[[Any], None], after_fetch: Callable[[], None]) -> None:
    """Call ``on_epoch_start()`` before the loader creates an iterator or resets its persistent one for a new epoch,
    then ``on_iterator(iterator)``; call ``before_fetch(iterator)`` right before each underlying fetch and
    ``after_fetch()`` when that fetch returned a batch. What ``on_epoch_start()`` returns (batches to skip, for the
    ``MAP`` kind) is ignored: these loaders resume from a loaded state, not by skipping.

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
        on_epoch_start()
        it = get_iterator(owner)
        _hook_iterator(it, on_epoch_start, on_iterator, before_fetch, after_fetch)
        on_iterator(it)
        return it

    hooked_get_iterator._hooked = True  # type: ignore[attr-defined]  # our mark, found by untrack()
    loader._get_iterator = hooked_get_iterator  # type: ignore[method-assign]  # on the instance, as said above


def _hook_iterator(it: Any, on_epoch_start: Callable[[], object], on_iterator: Callable[[Any], None],
                   before_fetch: Callable[[Any], None], after_fetch: Callable[[], None]) -> None:
    ref = weakref.ref(it)
    next_data = type(it)._next_data
    reset = type(it)._reset

    def hooked_next_data() -> Any:
        target = ref()
        before_fetch(target)
        data = next_data(target)
        after_fetch()
        return data

    def hooked_reset(loader: Any, *args: Any, **kwargs: Any) -> Any:
        target = ref()
        on_epoch_start()
        out = reset(target, loader, *args, **kwargs)
        on_iterator(target)
        return out

    it._next_data = hooked_next_data
    it._reset = hooked_reset
