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


# -- SampleSeeding: what ResumeStateCallback installs on a map-style training dataset --------------------------------
def collate_with_noise(items: list[torch.Tensor]) -> torch.Tensor:
    """A collate_fn that draws random numbers (masking, mixing do)."""
    return torch.stack(items) + torch.rand(()) + float(np.random.rand()) + random.random()


def seeded_loader(dataset: Dataset, **kwargs) -> DataLoader:
    from lightning_resilient.state._loader import apply_sample_seeding

    loader = DataLoader(dataset, batch_size=3, collate_fn=collate_with_noise, **kwargs)
    assert not isinstance(apply_sample_seeding(loader, 5), str)
    return loader


def test_installed_seeding_makes_samples_and_collate_independent_of_workers_and_history():
    data = Augmenting()
    loader = seeded_loader(data)
    torch.manual_seed(0)
    alone = torch.cat(list(loader))
    torch.manual_seed(99)  # other caller RNGs: same batches
    assert torch.equal(torch.cat(list(loader)), alone)
    # Two workers, persistent, over three epochs: each batch as read in the main process at that epoch.
    workers = seeded_loader(data, num_workers=2, persistent_workers=True)
    from lightning_resilient.state._loader import set_data_epoch

    for epoch in (0, 1, 0):
        set_data_epoch(workers, epoch)
        set_data_epoch(loader, epoch)
        assert torch.equal(torch.cat(list(workers)), torch.cat(list(loader))), epoch
    set_data_epoch(loader, 1)
    assert not torch.equal(torch.cat(list(loader)), alone)  # another epoch, other augmentation
    # Items as PerSampleSeeded reads them (the same mechanism): the collate noise aside, the first items agree.
    set_data_epoch(loader, 0)
    per_sample = PerSampleSeeded(Augmenting(), seed=5)
    assert torch.equal(data.__getitems__([4])[0], per_sample[4])


def test_without_it_the_same_loader_depends_on_the_workers():
    plain = DataLoader(Augmenting(), batch_size=3, collate_fn=collate_with_noise)
    torch.manual_seed(0)
    alone = torch.cat(list(plain))
    torch.manual_seed(0)
    assert not torch.equal(torch.cat(list(DataLoader(Augmenting(), batch_size=3, collate_fn=collate_with_noise,
                                                   num_workers=2))), alone)


def test_in_the_main_process_the_callers_rngs_are_untouched():
    loader = seeded_loader(Augmenting())
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    expected = torch.rand(2), np.random.rand(), random.random()
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    for indices in loader.batch_sampler:  # what torch's fetcher does, without the iterator's own base-seed draw
        loader.collate_fn(loader.dataset.__getitems__(indices))
    assert torch.equal(torch.rand(2), expected[0]) and np.random.rand() == expected[1]
    assert random.random() == expected[2]


def test_a_per_sample_seeded_dataset_keeps_its_seed_and_untrack_restores_everything():
    import pickle

    from lightning_resilient.state._loader import sample_seeding, untrack

    wrapped = PerSampleSeeded(Augmenting(), seed=17)
    loader = seeded_loader(wrapped)
    seeding = sample_seeding(loader)
    assert seeding is not None and seeding.seed == 17 and seeding.dataset is wrapped.dataset
    copy = pickle.loads(pickle.dumps(seeding))  # workers started with spawn get it with the dataset
    assert copy.seed == 17 and copy.dataset is not None
    untrack(loader)
    assert "__getitems__" not in wrapped.__dict__ and loader.collate_fn is collate_with_noise


class Slotted:
    """A map-style dataset DataLoader accepts, without an instance __dict__ (not a torch Dataset subclass)."""

    __slots__ = ()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def test_where_it_cannot_apply_it_says_why():
    from torch.utils.data import IterableDataset

    from lightning_resilient.state._loader import apply_sample_seeding

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    odd = Augmenting()
    odd.__getitems__ = lambda indices: [odd[i] for i in indices]
    cases = {"IterableDataset": DataLoader(Stream(), batch_size=2), "batch_size=None": DataLoader(odd, batch_size=None),
             "already has its own __getitems__": DataLoader(odd, batch_size=2),
             "__slots__": DataLoader(Slotted(), batch_size=2)}
    for phrase, loader in cases.items():
        why = apply_sample_seeding(loader, 0)
        assert isinstance(why, str) and phrase in why, (phrase, why)
