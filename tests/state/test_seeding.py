"""Per-sample seeding: a sample's randomness depends on (seed, epoch, index) only."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_resilient import PerSampleSeeded
from lightning_resilient.state import sample_seed


class Augmenting(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random()])


def test_items_do_not_depend_on_order_workers_or_global_state():
    data = PerSampleSeeded(Augmenting(), seed=5)
    forward = [data[i] for i in range(12)]
    torch.manual_seed(999)
    backward = [data[i] for i in reversed(range(12))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward, strict=True))
    by_workers = torch.cat(list(DataLoader(data, batch_size=3, num_workers=2)))
    assert torch.equal(by_workers, torch.stack(forward))


def test_without_the_wrapper_order_changes_the_augmentation():
    plain = Augmenting()
    torch.manual_seed(0)
    forward = [plain[i] for i in range(12)]
    torch.manual_seed(0)
    backward = [plain[i] for i in reversed(range(12))][::-1]
    assert not all(torch.equal(a, b) for a, b in zip(forward, backward, strict=True))


def test_caller_rng_is_untouched_and_epochs_differ():
    data = PerSampleSeeded(Augmenting(), seed=5)
    torch.manual_seed(1)
    expected = torch.rand(2)
    torch.manual_seed(1)
    _ = data[3]
    assert torch.equal(torch.rand(2), expected)
    first = data[3]
    data.set_epoch(1)
    assert not torch.equal(data[3], first)
    assert sample_seed(3, epoch=1, seed=5) != sample_seed(3, epoch=0, seed=5)


def test_bad_arguments():
    with pytest.raises(TypeError, match="map-style dataset"):
        PerSampleSeeded(object())
    with pytest.raises(TypeError, match="seed must be an int"):
        PerSampleSeeded(Augmenting(), seed="x")


def test_per_sample_seeding_never_touches_the_cuda_generators(monkeypatch):
    """torch.manual_seed would reseed every CUDA generator (and nothing would put them back): the wrapper seeds the
    CPU generator only. The CUDA calls are recorded here, on a machine without CUDA."""
    calls: list[str] = []
    for name in ("manual_seed", "manual_seed_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: calls.append(name))
    data = PerSampleSeeded(Augmenting(), seed=5)
    first = data[3]
    assert calls == []
    assert torch.equal(first, data[3])  # still seeded per sample
