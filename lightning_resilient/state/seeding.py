"""Per-sample seeding: random augmentation that depends only on (seed, epoch, sample index).

Without it, a sample's augmentation depends on which worker loaded it and on how many samples that worker loaded
before, so skipping batches on resume (or changing ``num_workers``) changes the augmentation of every later
sample. Wrapping the dataset makes each ``__getitem__`` run with the global RNGs (Python ``random``, NumPy,
torch CPU) seeded from ``(seed, epoch, index)``, and puts the caller's RNG states back afterwards.

Limits: only randomness drawn from those global RNGs inside ``__getitem__`` is covered (a generator the dataset
creates itself is its own business, and GPU RNGs are neither seeded nor touched); the epoch reaches worker
processes when they start, so with ``persistent_workers=True`` workers keep the epoch of their first start (the
index still varies the seed, but repeated epochs repeat the augmentation).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_resilient._checks import check_int

__all__ = ["PerSampleSeeded", "sample_seed"]


def sample_seed(index: int, *, epoch: int = 0, seed: int = 0) -> int:
    """A 63-bit seed that depends only on ``(seed, epoch, index)``."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PerSampleSeeded(Dataset[Any]):
    """Wrap a map-style dataset so each sample's randomness is a function of (seed, epoch, index) only.

    ``ResumeStateCallback`` calls :meth:`set_epoch` when each epoch's data stream starts. Example::

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
        s = sample_seed(index, epoch=self.epoch, seed=self.seed)
        saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
        random.seed(s)
        np.random.seed(s % 2**32)
        # The CPU generator only: torch.manual_seed would also reseed every CUDA generator, and nothing here puts
        # those back (a main-process loader would change the training step's GPU randomness).
        torch.default_generator.manual_seed(s)
        try:
            return self.dataset[index]
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.set_rng_state(saved[2])
