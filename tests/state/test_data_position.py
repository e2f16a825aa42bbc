"""The data position across a resume, in-process: iterable datasets, StatefulDataLoader, sampler epochs, ranks.

Each case trains uninterrupted, then stops at a checkpointed step (the state a SIGKILL after that save leaves)
and resumes from it with a new Trainer in the same process. The resumed steps must train on the same samples
(by id, with the same batch_idx) and end with ``torch.equal`` weights; every step draws from the global RNG
(dropout, noise), so the RNG must be restored too. Real kills and DDP run in ``test_exact_resume.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

import lightning_resilient.state._stream as stream_module
import lightning_resilient.state.callback as callback_module
from lightning_resilient import PerSampleSeeded, ResumeStateCallback
from lightning_resilient.errors import UnsupportedFormatError
from lightning_resilient.state._stream import DataStream

N = 40  # samples; batches of 4: 10 per epoch


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(4, generator=torch.Generator().manual_seed(i))
    return torch.tensor(i), x, x.sum(0, keepdim=True)


class Indexed(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sample(i)


class Stream(IterableDataset):
    """Samples 0..N-1 in order, then the next epoch starts over; no state."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Any:
        while self.pos < N:
            self.pos += 1
            yield sample(self.pos - 1)
        self.pos = 0


class StatefulStream(Stream):
    """The same stream, resumable the way torchdata expects: load_state_dict(), then iter() continues."""

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class Recorder(LightningModule):
    """Records (global_step, batch_idx, sample ids) per step; dropout and noise make each step RNG-dependent."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x, y = batch
        self.seen.append((self.global_step, batch_idx, ids.tolist()))
        return torch.nn.functional.mse_loss(self.net(x), y + 0.01 * torch.randn_like(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SteppingRecorder(Recorder):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Sizing a schedule: Lightning builds the train loader here, before the loops' state is restored (#20550).
        assert self.trainer.estimated_stepping_batches > 0
        return super().configure_optimizers()


def fit(root: Path, make_loader: Any, *, steps: int = -1, ckpt: str | None = None, callback: bool = True,
        every: int = 3, epochs: int = 2, model_cls: type[Recorder] = Recorder) -> Recorder:
    torch.manual_seed(0)  # the same model, and the same loader generators (StatefulDataLoader seeds its own)
    model = model_cls()
    callbacks: list[Any] = [ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1)]
    if callback:
        callbacks.insert(0, ResumeStateCallback())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|exists and is not empty|set_vital"
                                                  "|resuming from a checkpoint that ended before|LeafSpec"
                                                  "|callbacks used to create|dirpath has changed).*")
        Trainer(max_epochs=epochs, max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=callbacks).fit(model, make_loader(), ckpt_path=ckpt)
    return model


def checkpoint(root: Path, step: int) -> str:
    (path,) = root.glob(f"*-step={step}.ckpt")
    return str(path)


def interrupted(tmp_path: Path, make_loader: Any, stop: int, **kwargs: Any) -> tuple[Recorder, Recorder, str]:
    """An uninterrupted run, and a run stopped after its save at step ``stop`` then resumed from that save."""
    full = fit(tmp_path / "full", make_loader, **kwargs)
    fit(tmp_path / "part", make_loader, steps=stop, **kwargs)
    ckpt = checkpoint(tmp_path / "part", stop)
    return full, fit(tmp_path / "part", make_loader, ckpt=ckpt, **kwargs), ckpt


def after(model: Recorder, step: int) -> list[tuple[int, int, list[int]]]:
    return [s for s in model.seen if s[0] >= step]


def assert_resumed_exactly(full: Recorder, resumed: Recorder, stop: int) -> None:
    assert resumed.seen == after(full, stop)
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"


def record(ckpt: str) -> dict[str, Any]:
    """This callback's saved record for rank 0; loading with weights_only=True proves it holds no custom objects."""
    return torch.load(ckpt, weights_only=True)["callbacks"]["ResumeStateCallback"]["ranks"][0]


# -- IterableDataset with state_dict, plain DataLoader ------------------------------------------------------------
@pytest.mark.parametrize("stop", [3, 12], ids=["epoch0", "epoch1"])
def test_iterable_dataset_with_state_resumes_at_the_next_unconsumed_batch(tmp_path, stop):
    full, resumed, ckpt = interrupted(tmp_path, lambda: DataLoader(StatefulStream(), batch_size=4), stop)
    assert_resumed_exactly(full, resumed, stop)
    saved = record(ckpt)
    # Lightning had already fetched the next batch when it saved: the saved position is before that batch.
    assert saved["kind"] == "dataset" and saved["loader_state"] == {"pos": (stop % 10) * 4}
    assert saved["consumed"] == stop % 10 and saved["samples"] == (stop % 10) * 4 and saved["mid_epoch"]


def test_without_the_snapshot_before_each_fetch_an_iterable_resumes_one_batch_late(tmp_path, monkeypatch):
    # The mechanism off: the dataset's live state is saved, and it already counts the prefetched batch.
    monkeypatch.setattr(DataStream, "_before_fetch", lambda self, it: None)
    full, resumed, _ = interrupted(tmp_path, lambda: DataLoader(StatefulStream(), batch_size=4), 3)
    assert [ids for _, _, ids in resumed.seen[:2]] == [ids for _, _, ids in after(full, 4)[:2]]


# -- StatefulDataLoader over a stateful IterableDataset -----------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_over_an_iterable_resumes_at_the_next_unconsumed_batch(tmp_path, workers):
    # With 2 workers each reads its own copy of the stream (every sample twice), batches alternating between them.
    make = lambda: StatefulDataLoader(StatefulStream(), batch_size=4, num_workers=workers)  # noqa: E731
    full, resumed, ckpt = interrupted(tmp_path, make, 3)
    assert_resumed_exactly(full, resumed, 3)
    if workers == 0:
        assert record(ckpt)["loader_state"]["dataset_state"] == {"pos": 12}


@pytest.mark.parametrize("workers", [0, 2])
def test_stock_lightning_resumes_a_stateful_dataloader_over_an_iterable_one_batch_late(tmp_path, workers):
    """Without the callback Lightning restores the StatefulDataLoader's own state, saved after its fetcher had
    already read the next batch (it prefetches one when the loader has no length): that batch is skipped."""
    make = lambda: StatefulDataLoader(StatefulStream(), batch_size=4, num_workers=workers)  # noqa: E731
    full, resumed, _ = interrupted(tmp_path, make, 3, callback=False)
    assert [ids for _, _, ids in resumed.seen[:2]] == [ids for _, _, ids in after(full, 4)[:2]]


def stateful() -> StatefulDataLoader:
    return StatefulDataLoader(Indexed(), batch_size=4, shuffle=True)


# -- StatefulDataLoader and estimated_stepping_batches (Lightning #20550) -------------------------------------------
def test_a_stateful_dataloader_keeps_its_position_when_configure_optimizers_reads_stepping_batches(tmp_path):
    full, resumed, _ = interrupted(tmp_path, stateful, 3, model_cls=SteppingRecorder)
    assert_resumed_exactly(full, resumed, 3)


def test_stock_lightning_drops_the_position_when_configure_optimizers_reads_stepping_batches(tmp_path):
    """Lightning builds the loader while configure_optimizers runs, before the loops' state (with the loader's
    saved position) is restored, and never loads that position afterwards: the resumed epoch starts over."""
    full, resumed, _ = interrupted(tmp_path, stateful, 3, model_cls=SteppingRecorder, callback=False)
    assert resumed.seen[0][2] == full.seen[0][2]  # epoch 0's first batch again


# -- what cannot be resumed ----------------------------------------------------------------------------------------
def test_a_stateless_iterable_warns_what_was_resumed_and_restarts_its_data(tmp_path):
    make = lambda: DataLoader(Stream(), batch_size=4)  # noqa: E731
    fit(tmp_path, make, steps=3)
    with pytest.warns(RuntimeWarning) as caught:
        resumed = fit(tmp_path, make, ckpt=checkpoint(tmp_path, 3))
    (message,) = [str(w.message) for w in caught if "ResumeStateCallback cannot restore" in str(w.message)]
    assert "Stream, an IterableDataset without state_dict()/load_state_dict()" in message
    assert "Resumed: the RNG states and the training loop's epoch and step (epoch 0, 3 batch(es) into it)" in message
    assert "Not resumed: the data, which restarts from the beginning of the iterable" in message
    assert "state_dict()/load_state_dict()" in message and "StatefulDataLoader" in message
    assert resumed.seen[0][2] == [0, 1, 2, 3]  # as the warning says


class Reversed(torch.utils.data.Sampler):
    """A custom sampler (not torch's, Lightning's or torchdata's), without state."""

    def __init__(self) -> None:
        self.order = list(range(N))[::-1]

    def __iter__(self) -> Any:
        return iter(self.order)

    def __len__(self) -> int:
        return N


def test_a_custom_sampler_warns_at_fit_start_and_the_resume_claims_no_exactness(tmp_path, caplog):
    import logging

    make = lambda: DataLoader(Indexed(), batch_size=4, sampler=Reversed())  # noqa: E731
    with pytest.warns(RuntimeWarning, match=r"sampler Reversed is not torch's, Lightning's or torchdata's: a resume"
                                            r" redraws its order.*not claimed exact.*Fix: give it state_dict"):
        fit(tmp_path, make, steps=3)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, make, ckpt=checkpoint(tmp_path, 3))
    (line,) = [r.getMessage() for r in caplog.records if "restored the data position" in r.getMessage()]
    assert "Not restored: the order of the custom sampler Reversed" in line and "continues exactly" not in line


def test_a_stateful_iterable_read_by_workers_warns_that_its_position_is_not_saved(tmp_path):
    make = lambda: DataLoader(StatefulStream(), batch_size=4, num_workers=2)  # noqa: E731
    with pytest.warns(RuntimeWarning, match=r"2 worker processes, each with its own copy.*StatefulDataLoader"):
        fit(tmp_path, make, steps=1)


def test_a_changed_num_workers_for_a_stateful_dataloader_warns_and_restarts_the_epoch(tmp_path):
    # torchdata would fail an assertion loading 0 workers' state into 2 workers.
    fit(tmp_path, lambda: StatefulDataLoader(Indexed(), batch_size=4, shuffle=True), steps=3)
    make = lambda: StatefulDataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2)  # noqa: E731
    with pytest.warns(RuntimeWarning, match=r"num_workers changed since the checkpoint \(0 then, 2 now\)"):
        resumed = fit(tmp_path, make, ckpt=checkpoint(tmp_path, 3), epochs=1)
    # The data restarts the epoch, but Lightning still counts the 3 batches trained before the save: 7 remain.
    assert len(resumed.seen) == 7 and resumed.seen[0][:2] == (3, 3)


# -- sampler epoch (Lightning #21938) ------------------------------------------------------------------------------
def distributed(kind: str) -> Any:
    # Rank 0 of 2 without a process group: 5 batches of 4 per epoch, order decided by (seed, epoch).
    sampler = DistributedSampler(Indexed(), num_replicas=2, rank=0, shuffle=True, seed=7)
    if kind == "workers2":  # the worker iterator draws its first indices when Lightning creates it
        return DataLoader(Indexed(), batch_size=4, sampler=sampler, num_workers=2)
    return StatefulDataLoader(Indexed(), batch_size=4, sampler=sampler)  # torchdata's batch sampler draws eagerly


@pytest.mark.parametrize("kind", ["workers2", "stateful"])
def test_a_distributed_sampler_resumed_in_a_later_epoch_gets_that_epoch_first(tmp_path, kind):
    full, resumed, ckpt = interrupted(tmp_path, lambda: distributed(kind), 7, every=7)  # epoch 1, batch 2
    assert_resumed_exactly(full, resumed, 7)
    saved = record(ckpt)
    assert (saved["epoch"], saved["consumed"], saved["samples"], saved["mid_epoch"]) == (1, 2, 8, True)
    assert saved["sampler"] == {"epoch": 1, "seed": 7, "num_replicas": 2, "rank": 0}


@pytest.mark.parametrize("kind", ["workers2", "stateful"])
def test_without_setting_the_sampler_epoch_first_the_resumed_epoch_differs(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(stream_module, "set_data_epoch", lambda loader, epoch: None)
    full, resumed, _ = interrupted(tmp_path, lambda: distributed(kind), 7, every=7)
    assert [ids for _, _, ids in resumed.seen] != [ids for _, _, ids in after(full, 7)]


# -- per rank ------------------------------------------------------------------------------------------------------
def test_each_rank_loads_its_own_stateful_loader_position_and_only_that(tmp_path, monkeypatch):
    """Plays rank 1 of 2: the checkpoint's rank-0 record and Lightning's own copy of the loader state (saved from
    rank 0) say step 2; rank 1's record says step 5. Resuming must continue from step 5, so neither rank 0's
    state nor Lightning's copy may be applied, before or on top of rank 1's."""
    make = lambda: StatefulDataLoader(Indexed(), batch_size=4, shuffle=True)  # noqa: E731
    full = fit(tmp_path / "full", make)
    fit(tmp_path / "part", make, steps=5, every=1)
    early = torch.load(checkpoint(tmp_path / "part", 2), weights_only=True)
    late = torch.load(checkpoint(tmp_path / "part", 5), weights_only=True)
    late["callbacks"]["ResumeStateCallback"]["ranks"] = [record(checkpoint(tmp_path / "part", 2)),
                                                        late["callbacks"]["ResumeStateCallback"]["ranks"][0]]
    late["callbacks"]["ResumeStateCallback"]["world_size"] = 2
    fit_state = late["loops"]["fit_loop"]["state_dict"]
    fit_state["combined_loader"] = early["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert fit_state["combined_loader"][0]["_num_yielded"] == 2
    mixed = tmp_path / "mixed.ckpt"
    torch.save(late, mixed)
    monkeypatch.setattr(callback_module, "_rank_and_world", lambda: (1, 2))
    resumed = fit(tmp_path / "resumed", make, ckpt=str(mixed))
    assert_resumed_exactly(full, resumed, 5)


def test_a_stateful_dataloader_with_workers_saves_a_weights_only_record(tmp_path):
    make = lambda: StatefulDataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2)  # noqa: E731
    fit(tmp_path, make, steps=2, every=2)
    saved = record(checkpoint(tmp_path, 2))
    assert saved["kind"] == "loader" and saved["num_workers"] == 2
    assert saved["loader_state"]["_snapshot"]["_snapshot_step"] == 2


# -- Lightning's counters after a checkpoint on an epoch's last batch ---------------------------------------------
def test_a_save_on_the_last_batch_then_a_mid_epoch_save_resume_with_the_right_batch_idx(tmp_path, monkeypatch):
    """Lightning 2.6 resuming a save made on an epoch's last batch does not count the next epoch as started, so
    a mid-epoch save in that epoch looks finished and the next resume restarts batch_idx at 0; the callback
    resets that restart stage (shown to matter: with the fix off, batch_idx restarts)."""
    make = lambda: DataLoader(Indexed(), batch_size=4, shuffle=True)  # noqa: E731
    full = fit(tmp_path / "full", make, every=5)
    fit(tmp_path / "part", make, steps=10, every=5)  # saved on epoch 0's last batch
    fit(tmp_path / "part", make, steps=15, every=5, ckpt=checkpoint(tmp_path / "part", 10))
    resumed = fit(tmp_path / "part", make, every=5, ckpt=checkpoint(tmp_path / "part", 15))
    assert_resumed_exactly(full, resumed, 15)
    assert resumed.seen[0][:2] == (15, 5)

    monkeypatch.setattr(ResumeStateCallback, "_count_the_epoch_after_a_last_batch_save", lambda self, trainer: None)
    fit(tmp_path / "off", make, steps=10, every=5)
    fit(tmp_path / "off", make, steps=15, every=5, ckpt=checkpoint(tmp_path / "off", 10))
    off = fit(tmp_path / "off", make, every=5, ckpt=checkpoint(tmp_path / "off", 15))
    assert off.seen[0][:2] == (15, 0)


# -- the loader's own random generators ----------------------------------------------------------------------------
def own_generator() -> DataLoader:
    # The order comes from this generator, not the global RNG; it advances once per epoch.
    sampler = RandomSampler(Indexed(), generator=torch.Generator().manual_seed(5))
    return DataLoader(Indexed(), batch_size=4, sampler=sampler)


def test_a_sampler_with_its_own_generator_resumes_in_a_later_epoch(tmp_path):
    assert_resumed_exactly(*interrupted(tmp_path, own_generator, 12)[:2], 12)


def test_without_restoring_the_samplers_generator_a_later_epoch_differs(tmp_path, monkeypatch):
    monkeypatch.setattr(DataStream, "_set_generators", lambda self, states: None)
    full, resumed, _ = interrupted(tmp_path, own_generator, 12)
    assert [ids for _, _, ids in resumed.seen] != [ids for _, _, ids in after(full, 12)]


def wrapped() -> StatefulDataLoader:
    # What Lightning builds under DDP for StatefulDataLoader(shuffle=True): torchdata's RandomSampler is not
    # torch's, so Lightning wraps it in a DistributedSamplerWrapper, which re-draws it on every iter().
    sampler = DistributedSamplerWrapper(StatefulRandomSampler(Indexed()), num_replicas=2, rank=0, shuffle=True)
    return StatefulDataLoader(Indexed(), batch_size=4, sampler=sampler)


def test_a_wrapped_sampler_is_drawn_once_per_epoch_so_a_later_epoch_resumes(tmp_path):
    assert_resumed_exactly(*interrupted(tmp_path, wrapped, 7, every=7)[:2], 7)


def test_without_drawing_once_per_epoch_a_wrapped_sampler_resumes_another_order(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_module, "draw_once_per_epoch", lambda loader, drawing, before_draw=None: None)
    full, resumed, _ = interrupted(tmp_path, wrapped, 7, every=7)
    assert [ids for _, _, ids in resumed.seen] != [ids for _, _, ids in after(full, 7)]


# -- StatefulDataLoader saved on an epoch's last batch --------------------------------------------------------------
def test_a_stateful_dataloader_saved_on_an_epochs_last_batch_resumes_into_the_next_epoch(tmp_path):
    full, resumed, ckpt = interrupted(tmp_path, stateful, 10, every=5)
    assert_resumed_exactly(full, resumed, 10)
    assert (record(ckpt)["epoch_done"], record(ckpt)["mid_epoch"]) == (True, False)


def test_without_replaying_the_saved_state_to_its_end_the_next_epoch_is_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(DataStream, "_replay_to_epoch_end", lambda self, loader, epoch: None)
    full, resumed, _ = interrupted(tmp_path, stateful, 10, every=5)
    assert len(resumed.seen) < len(after(full, 10))


def test_a_record_of_another_format_fails_the_resume_saying_what_to_do(tmp_path):
    # No release wrote format 1 (the record before the data position): it is refused like any other format.
    make = lambda: DataLoader(Indexed(), batch_size=4, shuffle=True)  # noqa: E731
    fit(tmp_path / "part", make, steps=3)
    ckpt = torch.load(checkpoint(tmp_path / "part", 3), weights_only=True)
    state = ckpt["callbacks"]["ResumeStateCallback"]
    old = ("epoch_rng", "now_rng", "consumed", "mid_epoch", "batches", "batch_size")  # format 1's fields
    state["format"], state["ranks"] = 1, [{k: v for k, v in state["ranks"][0].items() if k in old}]
    torch.save(ckpt, tmp_path / "old.ckpt")
    with pytest.raises(UnsupportedFormatError, match=r"has format 1, but this lightning_resilient reads format 2"
                                                     r" only.*resume without ResumeStateCallback"):
        fit(tmp_path / "resumed", make, ckpt=str(tmp_path / "old.ckpt"))


# -- PerSampleSeeded gets the resumed epoch ---------------------------------------------------------------------------
class Jittered(Indexed):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, x, y = sample(i)
        return ids, x + 0.1 * torch.randn(4), y  # augmentation: PerSampleSeeded makes it f(seed, epoch, i)


def test_per_sample_seeding_uses_the_resumed_epoch_after_a_save_on_the_last_batch(tmp_path):
    # Resumed from step 10 (epoch 0's last batch), Lightning still reports epoch 0 when it builds the iterator.
    make = lambda: DataLoader(PerSampleSeeded(Jittered(), seed=3), batch_size=4, shuffle=True)  # noqa: E731
    full, resumed, _ = interrupted(tmp_path, make, 10, every=5)
    assert_resumed_exactly(full, resumed, 10)


# -- plain iterables: nothing to track, nothing to undo ------------------------------------------------------------
class FromModel(Recorder):
    """Its training data comes from ``train_dataloader()``, as a user's module gives it."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> Any:
        return self.data()


def batches() -> Any:
    """Three batches as a plain iterator: it has no ``__dict__`` for a patch to live in."""
    return iter([tuple(torch.stack(t) for t in zip(*(sample(i) for i in range(b, b + 4)), strict=True))
                 for b in (0, 4, 8)])


@pytest.mark.parametrize("data", [list, batches], ids=["empty-list", "iterator"])
def test_a_plain_iterable_trains_as_it_does_without_the_callback(tmp_path, data):
    models = []
    for callback in (False, True):
        torch.manual_seed(0)
        model = FromModel(data)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(LeafSpec|across ranks is zero).*")
            trainer = Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                              enable_model_summary=False, enable_checkpointing=False,
                              default_root_dir=tmp_path, callbacks=[ResumeStateCallback()] if callback else [])
            trainer.fit(model)  # teardown once failed on the list: it has no __dict__ to undo patches in
        models.append((trainer.global_step, model))
    (steps, plain), (steps_cb, tracked) = models
    assert steps == steps_cb == (0 if data is list else 3)
    assert plain.seen == tracked.seen
    for a, b in zip(plain.state_dict().values(), tracked.state_dict().values(), strict=True):
        assert torch.equal(a, b)
