"""Elastic resume, in-process (state/elastic.py and what ResumeStateCallback records for it): an epoch's global
order drawn again from its description equals what the samplers read, what was consumed is a prefix of it, and the
rest is split so that every position is read once, in the same number of batches on every rank. The DDP resumes
themselves (2 -> 1, 1 -> 2, 2 -> 4 processes, 2 nodes) run in ``test_elastic_resume.py``.
"""

from __future__ import annotations

import glob
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    WeightedRandomSampler,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from lightning_resilient import ResumeStateCallback, SettingTypeError, load_checkpoint
from lightning_resilient.state._record import RankRecord
from lightning_resilient.state.elastic import (
    consumed_positions,
    describe_order,
    distributed_batch_sampler,
    global_order,
    kept_accumulation,
    plan_rest,
    split_rest,
)


def interleaved(samplers: list[Any]) -> list[int]:
    """What the ranks of a DistributedSampler read, as one sequence: position p is rank p % W's (p // W)-th index."""
    streams = [list(s) for s in samplers]
    return [streams[p % len(streams)][p // len(streams)] for p in range(sum(map(len, streams)))]


@pytest.mark.parametrize("n", [12, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize(("shuffle", "drop_last"), [(True, False), (False, False), (True, True)])
def test_the_global_order_is_what_the_distributed_samplers_read_together(n, world, shuffle, drop_last):
    data = list(range(n))
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=shuffle, seed=5, drop_last=drop_last)
                for r in range(world)]
    for s in samplers:
        s.set_epoch(3)
    spec = describe_order(DataLoader(data, sampler=samplers[0], batch_size=2), rng=None, states=None)
    assert isinstance(spec, dict) and spec["layout"] == "sampler" and spec["start"] == 0
    together = interleaved(samplers)
    order = global_order(spec).tolist()
    assert order == together[:len(order)]
    # DistributedSampler pads with repeats of the order's head (not positions of their own), or drops the tail
    assert len(order) == (n // world * world if drop_last else n)


def test_lightning_s_wrapper_order_is_drawn_again_from_its_inner_sampler_s_generator():
    data = list(range(14))
    generator = torch.Generator().manual_seed(3)
    inner = StatefulRandomSampler(data, generator=generator)
    before = generator.get_state()
    wrappers = [DistributedSamplerWrapper(inner, num_replicas=2, rank=r, seed=9) for r in range(2)]
    generator.set_state(before)
    first = list(wrappers[0])
    generator.set_state(before)
    together = interleaved([first, list(wrappers[1])])  # (both ranks draw the inner order from the same state)
    loader = DataLoader(data, sampler=wrappers[0], batch_size=2)
    spec = describe_order(loader, rng=None, states=[before])
    assert isinstance(spec, dict) and spec["kind"] == "wrapper"
    assert global_order(spec).tolist() == together


@pytest.mark.parametrize("own_generator", [False, True])
def test_a_random_sampler_s_order_is_drawn_again_from_the_state_it_was_drawn_from(own_generator):
    generator = torch.Generator().manual_seed(11) if own_generator else None
    loader = DataLoader(list(range(30)), batch_size=4, shuffle=True, generator=generator)
    rng = {"torch": torch.get_rng_state()}
    states = [generator.get_state()] if generator is not None else []
    drawn = list(loader.sampler)
    torch.manual_seed(123)  # whatever the global RNG does since
    spec = describe_order(loader, rng=rng, states=states)
    assert isinstance(spec, dict) and spec["kind"] == "random"
    assert global_order(spec).tolist() == drawn
    assert torch.initial_seed() == 123  # drawing it again left the caller's RNG as it was


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_s_order_is_the_one_its_live_stream_drew(workers):
    """torchdata builds (and draws) its index stream twice while it creates an iterator with workers: the order is
    the one of the stream being read, whose generator state its iterator keeps."""
    loader = StatefulDataLoader(list(range(24)), batch_size=4, shuffle=True, num_workers=workers)
    states = [loader.sampler.generator.get_state()]
    it = iter(loader)
    read = [int(i) for _ in range(6) for i in next(it)]
    spec = describe_order(loader, rng=None, states=states, iterator=it)
    assert isinstance(spec, dict) and spec["kind"] == "random" and spec["source"] == "torchdata"
    assert global_order(spec).tolist() == read
    del it


class Indexed(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x + 0.01 * torch.randn(4), x.sum(0, keepdim=True), i


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from range(8)


class IndexedStream(IterableDataset):
    """Indexed's samples as a stream: it has no global order to split."""

    def __iter__(self) -> Any:
        yield from (Indexed()[i] for i in range(40))


class StatefulStream(IndexedStream):
    """A stream with a position of its own (state_dict/load_state_dict): still no global order to split."""

    def __init__(self) -> None:
        self.at = 0

    def __iter__(self) -> Any:
        while self.at < 40:
            self.at += 1
            yield Indexed()[self.at - 1]

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


class Buckets(BatchSampler):
    """A custom batch sampler (its batches are its own)."""


def test_what_has_no_global_order_is_named():
    weighted = DataLoader(Indexed(), batch_size=4, sampler=WeightedRandomSampler([1.0] * 40, 40))
    assert "the sampler WeightedRandomSampler is not one whose order can be drawn again" in describe_order(
        weighted, rng=None, states=None)
    assert "Stream has no length (an IterableDataset has no global order)" in describe_order(
        DataLoader(Stream(), batch_size=2), rng=None, states=None)
    custom = DataLoader(Indexed(), batch_sampler=Buckets(RandomSampler(Indexed()), 4, False))
    assert "the batch sampler Buckets is not torch's BatchSampler" in describe_order(custom, rng=None, states=None)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 4])
def test_the_rest_is_split_once_in_the_same_number_of_non_empty_batches_on_every_rank(world, batch_size):
    order = torch.randperm(50, generator=torch.Generator().manual_seed(world * 10 + batch_size))
    for start in range(51):
        for drop_last in (False, True):
            splits = [split_rest(order, start, world=world, rank=r, batch_size=batch_size, drop_last=drop_last)
                      for r in range(world)]
            first = splits[0]
            assert all(len(s.batches) == first.per_rank for s in splits)
            assert all(0 < len(b) <= batch_size for s in splits for b in s.batches)
            read = Counter(i for s in splits for b in s.batches for i in b)
            rest = order[start:].tolist()
            if first.repeated:  # fewer samples left than ranks (batch_size 1, or a rest shorter than the ranks)
                assert not drop_last and set(read) == set(rest) and sum(read.values()) == len(rest) + first.repeated
            else:
                kept = rest[:len(rest) - first.dropped]
                assert read == Counter(kept), (start, drop_last)
                assert first.dropped < world * batch_size and (drop_last or first.dropped == 0)
            # stretch by stretch: the j-th batches of all ranks together are the next stretch of the order
            at = start
            for j in range(first.per_rank):
                stretch = sorted(i for s in splits for i in s.batches[j])
                assert sorted(set(stretch)) == sorted(order[at:at + len(set(stretch))].tolist())
                at += len(set(stretch))


def test_what_the_ranks_consumed_is_a_prefix_that_a_later_resume_continues():
    """2 ranks read a DistributedSampler's epoch for 3 batches; 3 ranks then read 2 batches of the rest; 1 rank reads
    what is left: every position of the order once."""
    data, batch = list(range(37)), 2
    samplers = [DistributedSampler(data, num_replicas=2, rank=r, seed=1) for r in range(2)]
    spec = describe_order(DataLoader(data, sampler=samplers[0], batch_size=batch), rng=None, states=None)
    assert isinstance(spec, dict)
    order = global_order(spec)
    first = [list(s)[:3 * batch] for s in samplers]
    consumed = consumed_positions(spec, [len(f) for f in first])
    assert sorted(i for f in first for i in f) == sorted(order[:consumed].tolist())
    rest = {**spec, "layout": "rest", "start": consumed}
    second = [split_rest(order, consumed, world=3, rank=r, batch_size=batch, drop_last=False).batches[:2]
              for r in range(3)]
    samples = [sum(len(b) for b in s) for s in second]
    later = consumed_positions(rest, samples)
    assert sorted(i for s in second for b in s for i in b) == sorted(order[consumed:later].tolist())
    last = split_rest(order, later, world=1, rank=0, batch_size=batch, drop_last=False).batches
    every = [i for f in first for i in f] + [i for s in second for b in s for i in b] + [i for b in last for i in b]
    assert sorted(every) == data


def test_one_process_reads_the_order_ddp_reads_with_keep_global_batch():
    data = list(range(21))
    one = distributed_batch_sampler(BatchSampler(RandomSampler(data), 3, False), seed=4)
    assert one is not None
    two = [DistributedSampler(data, num_replicas=2, rank=r, seed=4) for r in range(2)]
    for epoch in (0, 1):
        one.sampler.set_epoch(epoch)
        for s in two:
            s.set_epoch(epoch)
        assert [i for b in one for i in b] == interleaved(two)[:21]
    assert distributed_batch_sampler(BatchSampler(WeightedRandomSampler([1.0] * 5, 5), 2, False), seed=0) is None


def test_keep_global_batch_computes_the_accumulation_or_names_the_sizes():
    assert kept_accumulation(world_then=4, accumulate_then=1, batch_then=8, world=2, batch=8) == 2
    assert kept_accumulation(world_then=2, accumulate_then=3, batch_then=4, world=6, batch=4) == 1
    assert kept_accumulation(world_then=2, accumulate_then=1, batch_then=8, world=1, batch=4) == 4
    with pytest.raises(ValueError, match=(
            r"the checkpoint's job trained 8 samples per optimizer step \(2 process\(es\) x accumulate_grad_batches 1"
            r" x batch_size 4\), and this run's 3 process\(es\) x batch_size 4 read 12 per micro-batch, which does"
            r" not divide 8\. Fix: resume on a number of processes that divides it with batch_size 4 \(1, 2\)")):
        kept_accumulation(world_then=2, accumulate_then=1, batch_then=4, world=3, batch=4)
    with pytest.raises(SettingTypeError, match="keep_global_batch must be True or False"):
        ResumeStateCallback(keep_global_batch="yes")  # type: ignore[arg-type]


# -- from a real checkpoint --------------------------------------------------------------------------------------
class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Seen(Callback):
    def __init__(self) -> None:
        self.ids: list[tuple[int, list[int]]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ids.append((trainer.global_step, batch[2].tolist()))


def fit(root: Path, loader: Any, *, steps: int, accumulate: int = 1, callbacks: list[Callback] | None = None,
        every: int = 3, **callback_args: Any) -> Seen:
    seen = Seen()
    Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            accumulate_grad_batches=accumulate, default_root_dir=root,
            callbacks=[ResumeStateCallback(**callback_args), seen, *(callbacks or []),
                       ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1)]).fit(Net(), loader)
    return seen


def saved_records(root: Path, step: int) -> tuple[dict[str, Any], list[RankRecord]]:
    (path,) = glob.glob(str(root / f"*step={step}.ckpt"))
    state = load_checkpoint(path)["callbacks"]["ResumeStateCallback"]
    return state, [RankRecord.from_dict(r) for r in state["ranks"]]


@pytest.mark.parametrize("loader_kind", ["plain, workers 2", "stateful"])
def test_a_single_process_checkpoint_splits_its_rest_among_two(tmp_path, loader_kind):
    """One process trains 5 steps with accumulation 2 (the save at step 3 holds 6 batches); its checkpoint's rest,
    planned for 2 ranks, is every sample it had not trained, once. The order is the one the process drew: a
    RandomSampler's from the global RNG (2 workers: torch asks for the index stream twice), or torchdata's from its
    generator."""
    torch.manual_seed(0)
    loader = (DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2) if loader_kind.startswith("plain")
              else StatefulDataLoader(Indexed(), batch_size=4, shuffle=True))
    seen = fit(tmp_path, loader, steps=5, accumulate=2)
    state, records = saved_records(tmp_path, 3)
    assert state["accumulate_grad_batches"] == 2 and state["batch_size"] == 4
    (record,) = records
    assert record.step_samples == record.samples == 24 and isinstance(record.order, dict)
    trained = [i for step, ids in seen.ids[:6] for i in ids]
    plans = [plan_rest(records, dataset_size=40, world=2, rank=r, batch_size=4, drop_last=False) for r in range(2)]
    assert all(not isinstance(p, str) for p in plans)
    rest = [i for p in plans for b in p.split.batches for i in b]  # type: ignore[union-attr]
    assert sorted(trained + rest) == list(range(40))
    assert global_order(record.order)[:24].tolist() == trained  # the order the process read, drawn again


def test_a_save_between_optimizer_steps_reads_its_micro_batches_again(tmp_path):
    """A save after the first micro-batch of an accumulation (a user's save from on_train_batch_end): that batch's
    gradient was not saved, so an elastic resume splits the rest from the last optimizer step, that batch included,
    and says so."""

    class SaveMidStep(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if trainer.fit_loop.epoch_loop.batch_progress.current.ready == 5:  # 2 steps and one micro-batch
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    fit(tmp_path / "root", DataLoader(Indexed(), batch_size=4, shuffle=True), steps=3, accumulate=2,
        callbacks=[SaveMidStep()])
    (record,) = [RankRecord.from_dict(r) for r in torch.load(tmp_path / "mid.ckpt", weights_only=True)[
        "callbacks"]["ResumeStateCallback"]["ranks"]]
    assert (record.samples, record.step_samples) == (20, 16)
    plans = [plan_rest([record], dataset_size=40, world=2, rank=r, batch_size=4, drop_last=False) for r in range(2)]
    assert not isinstance(plans[0], str) and (plans[0].consumed, plans[0].again) == (16, 4)


def test_orders_that_are_not_one_global_order_are_refused_with_the_reason(tmp_path):
    torch.manual_seed(0)
    fit(tmp_path, DataLoader(Indexed(), batch_size=4, shuffle=True), steps=3)
    _, (record,) = saved_records(tmp_path, 3)
    # two processes that each read a RandomSampler of their own (no distributed sampler) read no shares of one order
    assert "each of the checkpoint's 2 processes read a random order of its own" in plan_rest(
        [record, record], dataset_size=40, world=1, rank=0, batch_size=4, drop_last=False)
    assert "the training dataset has 41 samples now and had 40 then" in plan_rest(
        [record], dataset_size=41, world=2, rank=0, batch_size=4, drop_last=False)


def test_keep_global_batch_sets_accumulate_grad_batches_when_the_checkpoint_is_loaded(tmp_path):
    """A checkpoint of 2 processes x accumulation 1 x batch 4 (its two records stand in for two ranks), loaded by one
    process with keep_global_batch: accumulate_grad_batches becomes 2 before configure_optimizers could read it; with
    a GradientAccumulationScheduler the two would fight: refused, naming both."""
    torch.manual_seed(0)
    fit(tmp_path, DataLoader(Indexed(), batch_size=4, shuffle=True), steps=3)
    state, (record,) = saved_records(tmp_path, 3)
    two = {**state, "world_size": 2, "ranks": [record.to_dict(), record.to_dict()]}
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    callback = ResumeStateCallback(keep_global_batch=True)
    callback._trainer = trainer
    callback.load_state_dict(two)
    assert trainer.accumulate_grad_batches == 2 and callback._elastic is not None
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                      callbacks=[GradientAccumulationScheduler({0: 1})])
    callback = ResumeStateCallback(keep_global_batch=True)
    callback._trainer = trainer
    with pytest.raises(ValueError, match="has a GradientAccumulationScheduler that sets it too"):
        callback.load_state_dict(two)
    callback = ResumeStateCallback()  # without the option: left as it is
    callback._trainer = trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                                          default_root_dir=tmp_path)
    callback.load_state_dict(two)
    assert trainer.accumulate_grad_batches == 1


# -- a resume on another number of processes, in-process ---------------------------------------------------------
def two_ranks_checkpoint(tmp_path: Path, make_loader: Any, step: int = 3) -> tuple[Path, list[int]]:
    """The checkpoint a 2-process job writes at ``step``, made in this process: each "rank" trains its share of a
    DistributedSampler(num_replicas=2) alone, and their callback records are put together as rank 0 gathers them.
    Returns it and the samples both trained before it."""
    states, trained = [], []
    for rank in range(2):
        torch.manual_seed(0)
        sampler = DistributedSampler(Indexed(), num_replicas=2, rank=rank, seed=3)
        seen = fit(tmp_path / f"rank{rank}", make_loader(sampler), steps=step, every=step)
        trained += [i for _, ids in seen.ids[:step] for i in ids]
        (path,) = glob.glob(str(tmp_path / f"rank{rank}" / f"*step={step}.ckpt"))
        states.append(torch.load(path, weights_only=True))
    joined = states[0]
    mine = joined["callbacks"]["ResumeStateCallback"]
    mine["ranks"] = [s["callbacks"]["ResumeStateCallback"]["ranks"][0] for s in states]
    mine["world_size"] = 2
    torch.save(joined, tmp_path / "two.ckpt")
    return tmp_path / "two.ckpt", trained


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["plain", "stateful"])
def test_a_two_process_checkpoint_resumed_by_one_trains_each_sample_of_the_epoch_once(tmp_path, kind, workers, caplog):
    """2 -> 1 with keep_global_batch (accumulate_grad_batches 1 -> 2), the resumed loader a shuffling DataLoader or
    StatefulDataLoader with 0 or 2 workers: the rest of the saved DistributedSampler order, each sample once, and
    the line that says so. (With real processes: test_elastic_resume.py.)"""
    cls: Any = StatefulDataLoader if kind == "stateful" else DataLoader

    def make_loader(sampler: Any = None) -> Any:
        return cls(Indexed(), batch_size=4, sampler=sampler, shuffle=None if sampler is not None else True,
                   num_workers=workers)

    checkpoint, trained = two_ranks_checkpoint(tmp_path, make_loader)
    seen = Seen()
    caplog.set_level("INFO")
    trainer = Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                      callbacks=[ResumeStateCallback(keep_global_batch=True), seen])
    trainer.fit(Net(), make_loader(), ckpt_path=checkpoint)
    assert trainer.accumulate_grad_batches == 2
    epoch0 = [i for _, ids in seen.ids[:4] for i in ids]  # 40 samples: 24 trained, 16 left: 4 batches
    assert Counter(trained + epoch0) == Counter(range(40))
    assert [step for step, _ in seen.ids[:4]] == [3, 4, 4, 5]  # steps of 2 micro-batches, as 2 processes took 1
    assert sorted(i for _, ids in seen.ids[4:] for i in ids) == list(range(40))  # epoch 1: its own order, once
    assert trainer.global_step == 3 + 2 + 5  # 8 samples per step in both epochs
    line = next(r.getMessage() for r in caplog.records if "ResumeStateCallback: resumed" in r.getMessage())
    assert ("resumed on 1 process(es) a checkpoint written by 2 in epoch 0: 24 of its 40 samples were trained before"
            " the checkpoint (the epoch's global order: DistributedSampler's permutation, seed 3), and the other 16"
            " are split among this run's 1 process(es), 4 batch(es) each, so every sample of the epoch is trained"
            " once") in line
    assert "(keep_global_batch: accumulate_grad_batches 1 -> 2)" in line and "those of its rank 1 end" in line


class MySampler(RandomSampler):
    """A sampler of one's own: its order cannot be drawn again elsewhere."""


@pytest.mark.parametrize("case", ["custom sampler", "two whole orders", "iterable dataset", "stateful stream",
                                  "stateful loader over a stream"])
def test_what_cannot_be_split_is_named_at_resume_and_training_goes_on(tmp_path, case):
    """A checkpoint of 2 processes whose data has no global order, resumed on 1: a warning names what cannot be split
    and says the epoch's data restarts (some samples twice, some never), and training goes on."""
    make: Any
    if case == "custom sampler":
        make = lambda: DataLoader(Indexed(), batch_size=4, sampler=MySampler(Indexed()))  # noqa: E731
        says = "the sampler MySampler is not one whose order can be drawn again"
    elif case == "two whole orders":
        make = lambda: DataLoader(Indexed(), batch_size=4, shuffle=True)  # noqa: E731
        says = "each of the checkpoint's 2 processes read a random order of its own"
    elif case == "iterable dataset":
        make = lambda: DataLoader(IndexedStream(), batch_size=4)  # noqa: E731
        says = ("the training data is a DataLoader over an IterableDataset without a usable state, which has no global"
                " order of samples")
    elif case == "stateful stream":
        make = lambda: DataLoader(StatefulStream(), batch_size=4)  # noqa: E731
        says = "the training data is a .*, which has no global order of samples"
    else:
        make = lambda: StatefulDataLoader(IndexedStream(), batch_size=4)  # noqa: E731
        says = r"the training dataset IndexedStream has no length \(an IterableDataset has no global order\)"
    torch.manual_seed(0)
    fit(tmp_path, make(), steps=3)
    (path,) = glob.glob(str(tmp_path / "*step=3.ckpt"))
    state = torch.load(path, weights_only=True)
    mine = state["callbacks"]["ResumeStateCallback"]
    mine["ranks"], mine["world_size"] = mine["ranks"] * 2, 2  # as if 2 processes had each read such a loader
    torch.save(state, tmp_path / "two.ckpt")
    seen = Seen()
    with pytest.warns(RuntimeWarning, match=(
            r"resumed on 1 process\(es\) a checkpoint written by 2, and the rest of epoch 0 cannot be split among"
            rf" this run's processes: {says}.*Not resumed: the data, which restarts from the beginning of the"
            r" epoch's order at this number of processes, so in this epoch some samples are trained twice and some"
            r" not at all. To continue the epoch exactly, "
            + ("read" if case == "iterable dataset" else r"resume on 2 process\(es\), or read"))):
        Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, default_root_dir=tmp_path,
                callbacks=[ResumeStateCallback(), seen]).fit(Net(), make(), ckpt_path=tmp_path / "two.ckpt")
    if case in ("custom sampler", "two whole orders"):
        assert len(seen.ids) == 10 - 3  # the loop's count of the epoch went on; the data restarted
    else:  # a stream has no count to end at: it is read again from its beginning, as the warning says
        assert [i for _, ids in seen.ids for i in ids] == list(range(40))


def test_a_two_process_checkpoint_of_an_epoch_s_end_resumed_by_one_starts_the_next_epoch(tmp_path, caplog):
    """Saved on the last batch of epoch 0 (5 batches per rank): the one process counts that epoch finished although
    its own epoch is 10 batches long, and reads epoch 1 whole, once."""
    checkpoint, trained = two_ranks_checkpoint(tmp_path, lambda sampler: DataLoader(Indexed(), batch_size=4,
                                                                                     sampler=sampler), step=5)
    assert sorted(trained) == list(range(40))
    seen = Seen()
    caplog.set_level("INFO")
    trainer = Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                      callbacks=[ResumeStateCallback(), seen])
    trainer.fit(Net(), DataLoader(Indexed(), batch_size=4, shuffle=True), ckpt_path=checkpoint)
    assert sorted(i for _, ids in seen.ids for i in ids) == list(range(40)) and len(seen.ids) == 10
    assert trainer.current_epoch == 2 and trainer.global_step == 5 + 10
    assert any("resumed on 1 process(es) a checkpoint written by 2 at the end of epoch 0: epoch 1 starts from its"
               " beginning" in r.getMessage() for r in caplog.records)
