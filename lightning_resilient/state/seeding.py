"""Per-sample seeding: random augmentation that depends only on (seed, epoch, sample index).

Without it, a sample's augmentation depends on which worker loaded it and on how many samples that worker loaded
before, so skipping batches on resume (or changing ``num_workers``) changes the augmentation of every later
sample. Each ``dataset[i]`` runs instead with the global RNGs (Python ``random``, NumPy, torch CPU) seeded from
``(seed, epoch, i)``.

Two ways in, one mechanism (:func:`seed_global_rngs` from :func:`sample_seed`):

- :class:`SampleSeeding`, which ``ResumeStateCallback`` installs as the training dataset's ``__getitems__`` (the
  hook torch's DataLoader calls to fetch a batch, in the main process or in a worker): the user changes nothing.
  Its epoch lives in shared memory, so workers that persist across epochs (``persistent_workers=True``) see each
  new epoch. The loader's ``collate_fn`` is wrapped too (:class:`SeededCollate`): it runs seeded from the batch
  (its epoch and indices), so a ``collate_fn`` that draws random numbers (masking, mixing) draws the same for the
  same batch. In the main process (``num_workers=0``) the caller's RNG states are put back after each, as the
  training step's random numbers come from them.
- :class:`PerSampleSeeded`, a dataset wrapper for use without the callback (call its ``set_epoch`` yourself); it
  puts the caller's RNG states back after each sample.

Limits: only randomness drawn from those global RNGs is covered (a generator the dataset creates itself is its own
business, and GPU RNGs are neither seeded nor touched); a dataset's own batched ``__getitems__`` is bypassed while
:class:`SampleSeeding` is installed (each sample is read with ``dataset[i]``, under its own seed).
"""

from __future__ import annotations

import hashlib
import operator
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from lightning_resilient._checks import check_int

__all__ = ["PerSampleSeeded", "SampleSeeding", "SeededCollate", "sample_seed", "seed_global_rngs"]

_GlobalStates = tuple[Any, Any, torch.Tensor]


def _plain(index: Any) -> Any:
    """An integer index as a plain ``int`` (a NumPy or 0-d tensor index formats differently); anything else as is."""
    try:
        return operator.index(index)
    except TypeError:
        return index


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def sample_seed(index: Any, *, epoch: int = 0, seed: int = 0) -> int:
    """A 63-bit seed that depends only on ``(seed, epoch, index)``."""
    return _seed_of(f"{seed}:{epoch}:{_plain(index)}")


def seed_global_rngs(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's CPU generator from ``seed``.

    The CPU generator only: ``torch.manual_seed`` would also reseed every CUDA generator, and nothing here puts those
    back (a main-process loader would change the training step's GPU randomness)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


def _global_states() -> _GlobalStates:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _put_back(saved: _GlobalStates) -> None:
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


class PerSampleSeeded(Dataset[Any]):
    """Wrap a map-style dataset so each sample's randomness is a function of (seed, epoch, index) only.

    ``ResumeStateCallback`` seeds every sample of a map-style training dataset by itself (with the run's seed), so
    this wrapper is for data read without the callback; the callback honours it (its ``seed`` is used). Call
    :meth:`set_epoch` when each epoch starts (the callback does). Example::

        train = PerSampleSeeded(MyAugmentedDataset(...), seed=17)
        DataLoader(train, batch_size=64, shuffle=True, num_workers=8)
    """

    def __init__(self, dataset: Any, *, seed: int = 0) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(f"dataset must be a map-style dataset with __getitem__, got {type(dataset).__name__}")
        self.dataset = dataset
        self.seed = check_int("seed", seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        saved = _global_states()
        seed_global_rngs(sample_seed(index, epoch=self.epoch, seed=self.seed))
        try:
            return self.dataset[index]
        finally:
            _put_back(saved)


class SampleSeeding:
    """A map-style dataset's ``__getitems__`` that reads each sample with the global RNGs seeded from
    ``(seed, epoch, index)``: what :class:`PerSampleSeeded` does, without wrapping the dataset.

    ``ResumeStateCallback`` sets an instance as the training dataset's ``__getitems__`` attribute (torch's fetcher
    calls it for every batch, then the loader's ``collate_fn``) and removes it after the fit. For a
    :class:`PerSampleSeeded` dataset it reads the wrapped dataset under the wrapper's own seed: the same numbers, with
    the epoch kept up to date in persistent workers too. :meth:`collate` wraps the loader's ``collate_fn`` so that
    what it draws depends on the batch only (seeded from the epoch and the batch's indices). It is picklable (workers
    started with ``spawn`` get it with the dataset), and its epoch is one integer in shared memory, written by
    :meth:`set_epoch` in the main process and read by every worker.
    """

    def __init__(self, dataset: Any, *, seed: int) -> None:
        if isinstance(dataset, PerSampleSeeded):
            self.dataset, self.seed = dataset.dataset, dataset.seed
        else:
            self.dataset, self.seed = dataset, check_int("seed", seed)
        # In shared memory: persistent workers keep their copy of the dataset, but see this one value change.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._batch = threading.local()  # the seed of the batch just read, for the collate_fn that follows

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_batch"]  # a thread-local does not pickle; each process starts without a batch
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._batch = threading.local()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))

    def __call__(self, indices: Sequence[Any]) -> list[Any]:
        epoch = self.epoch
        in_worker = get_worker_info() is not None
        # Capturing the states costs more than seeding a whole small batch: only where someone reads them later (the
        # main process's training step; a worker draws nothing else).
        saved = None if in_worker else _global_states()
        batch_seed = _seed_of(f"{self.seed}:{epoch}:batch:{','.join(str(_plain(i)) for i in indices)}")
        self._batch.seed = batch_seed
        try:
            out = []
            for index in indices:
                seed_global_rngs(sample_seed(index, epoch=epoch, seed=self.seed))
                out.append(self.dataset[index])
            return out
        finally:
            if saved is not None:
                _put_back(saved)
            else:  # a worker: what a collate_fn (even one not wrapped by collate()) draws next depends on the batch
                seed_global_rngs(batch_seed)

    def collate(self, collate_fn: Callable[[Any], Any]) -> SeededCollate:
        """``collate_fn`` run with the global RNGs seeded from the batch just read (and, in the main process, the
        caller's RNG states put back afterwards)."""
        return SeededCollate(self, collate_fn)

    def take_batch_seed(self) -> int | None:
        """The seed of the batch this thread read last, once."""
        seed = getattr(self._batch, "seed", None)
        self._batch.seed = None
        return seed


class SeededCollate:
    """A loader's ``collate_fn`` run under the seed of the batch :class:`SampleSeeding` just read (see there)."""

    def __init__(self, seeding: SampleSeeding, collate_fn: Callable[[Any], Any]) -> None:
        self.seeding = seeding
        self.collate_fn = collate_fn

    def __call__(self, data: Any) -> Any:
        seed = self.seeding.take_batch_seed()
        if seed is None:
            # A batch read without the seeding (another loader over the same dataset), or a worker started with spawn,
            # whose copy of this object is not its dataset's: there the global RNGs are left seeded from the batch.
            return self.collate_fn(data)
        saved = None if get_worker_info() is not None else _global_states()
        seed_global_rngs(seed)
        try:
            return self.collate_fn(data)
        finally:
            if saved is not None:
                _put_back(saved)
