"""Elastic resume: an epoch's global sample order, how much of it was consumed, and how the rest is split when a job
resumes on another number of processes.

**The global order of an epoch** is the sequence of dataset indices the epoch reads, whatever the number of
processes reading it: under DDP, ``DistributedSampler``'s permutation (seeded by ``seed + epoch``; rank ``r`` of ``W``
reads positions ``r, r + W, r + 2W, ...``), and in one process the sampler's own order. :func:`describe_order`
writes down what that order is (an :data:`OrderSpec`: plain values and tensors, stored in the checkpoint) and
:func:`global_order` draws it again, with torch's own samplers, in another job.

**What was consumed is a prefix of it.** Every rank trains the same number of batches (DDP steps together), and a
rank's ``j``-th batch holds positions of the ``j``-th stretch of ``W x batch_size`` positions, so after each rank
consumed ``s_r`` samples the ranks together consumed positions ``[0, sum(s_r))``. A checkpoint stores each rank's
count; the prefix is their sum (plus the ``start`` of the stream, below), capped at the order's length
(``DistributedSampler`` pads the last stretch with repeats of its first samples, which are not positions of their
own).

**The rest is split among the new ranks** (:func:`split_rest`) the way ``DistributedSampler`` would split it: in
stretches of ``world x batch_size`` positions, rank ``r`` taking positions ``r, r + world, ...`` of each stretch. A
stream that reads such a rest starts at ``start`` (the prefix consumed before it), so its own saves record the same
kind of prefix, and a later resume (on any number of processes) splits what is left after it. DDP needs every rank to
run the same number of batches, so the last stretches are balanced:

- a last stretch of at least ``world`` samples is split as it is (batch sizes differ by at most one);
- a shorter last stretch takes samples from the stretch before it (only with ``batch_size >= 2``), so each rank has
  one sample in it;
- otherwise (fewer samples left than ranks, with ``batch_size`` 1 or nothing before it) the last stretch is padded
  with repeats of its own samples, as ``DistributedSampler`` pads, and the count is reported (``repeated``);
- with the loader's ``drop_last=True`` an incomplete last stretch is dropped, as ``drop_last`` drops an incomplete
  batch, and the count is reported (``dropped``).

**Same global batch** (:func:`kept_accumulation`): with ``world x accumulate_grad_batches x batch_size`` the same,
the optimizer steps of the rest cover the same stretches of the global order as the original job's would.

It imports torch and the samplers it replays (torch's, Lightning's wrapper; torchdata's only where a checkpoint names
it: torchdata is optional), not Lightning's Trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from lightning_resilient.state._loader import generators, own_batch_sampler
from lightning_resilient.state._record import RankRecord
from lightning_resilient.state.rng import RngState

__all__ = ["OrderSpec", "Rest", "RestSplit", "consumed_positions", "describe_order", "distributed_batch_sampler",
           "global_order", "kept_accumulation", "order_length", "plan_rest", "split_rest", "stretch_sizes"]

# What describe_order writes: {"kind": "distributed" | "wrapper" | "random" | "sequential", ...}, plus, at the top
# level, "dataset" (the dataset's length), "layout" ("sampler": each rank read the sampler's own stream; "rest": the
# ranks read a rest split by split_rest) and "start" (positions consumed before that stream).
OrderSpec = dict[str, Any]


def describe_order(loader: Any, *, rng: RngState | None, states: Sequence[torch.Tensor] | None,
                   iterator: Any = None) -> OrderSpec | str:
    """What the loader's epoch order is, so :func:`global_order` can draw it again elsewhere; or, where it cannot
    be described, why (a phrase naming the sampler or dataset).

    ``rng`` and ``states`` are the global RNG and the loader's generators (:func:`~lightning_resilient.state._loader.
    generators`, in that order) as they were right before the epoch's order was drawn: a ``RandomSampler`` draws it
    from its own generator, or, without one, from a seed it draws from torch's global generator. A stateful loader's
    live ``iterator`` says better for torchdata's ``RandomSampler``: torchdata builds (and draws) its index stream
    more than once while it creates an iterator with workers, and the stream it reads keeps the generator state its
    permutation was drawn from."""
    dataset = getattr(loader, "dataset", None)
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return f"the training dataset {type(dataset).__name__} has no length (an IterableDataset has no global order)"
    batch_sampler = own_batch_sampler(loader)
    if batch_sampler is None:
        return "the training DataLoader has batch_size=None (no batches to split)"
    # (torchdata's BatchSampler subclasses torch's and batches alike)
    if not isinstance(batch_sampler, BatchSampler) or type(batch_sampler).__module__.split(".")[0] not in (
            "torch", "torchdata"):
        return f"the batch sampler {type(batch_sampler).__name__} is not torch's BatchSampler (its batches are its own)"
    found = _sampler_spec(batch_sampler.sampler, generators(loader), rng, states, iterator)
    if isinstance(found, str):
        return found
    return {**found, "layout": "sampler", "start": 0, "dataset": size}


def _sampler_spec(sampler: Any, gens: list[torch.Generator], rng: RngState | None,
                  states: Sequence[torch.Tensor] | None, iterator: Any = None) -> OrderSpec | str:
    name = type(sampler).__name__
    if isinstance(sampler, DistributedSamplerWrapper):
        inner = _sampler_spec(getattr(sampler.dataset, "_sampler", None), gens, rng, states)
        if isinstance(inner, str):
            return inner
        return {**_distributed(sampler), "kind": "wrapper", "inner": inner}
    if isinstance(sampler, DistributedSampler) and type(sampler).__module__.split(".")[0] in ("torch", "torchdata"):
        return _distributed(sampler)
    if type(sampler) is SequentialSampler:
        return {"kind": "sequential", "n": len(sampler.data_source)}
    stateful = _is_torchdata_random(sampler)
    if type(sampler) is RandomSampler or stateful:
        state = _drawn_from(iterator, sampler) if stateful else None
        if state is None and sampler.generator is not None:
            index = next((i for i, g in enumerate(gens) if g is sampler.generator), None)
            if index is None or states is None or index >= len(states):
                return f"the state of the {name}'s generator at the epoch's start was not recorded"
            state = states[index]
        if state is None and rng is None:
            return f"the RNG state the {name} drew the epoch's order from was not recorded"
        return {"kind": "random", "source": "torchdata" if stateful else "torch",
                "n": len(sampler.data_source), "replacement": bool(sampler.replacement),
                "num_samples": int(sampler.num_samples), "generator": state,
                "rng": None if state is not None or rng is None else rng["torch"]}
    return (f"the sampler {name} is not one whose order can be drawn again (torch's RandomSampler or"
            " SequentialSampler, DistributedSampler, torchdata's RandomSampler, Lightning's DistributedSamplerWrapper)")


def _drawn_from(iterator: Any, sampler: Any) -> torch.Tensor | None:
    """The generator state the permutation of torchdata's ``RandomSampler`` being read was drawn from: its iterator
    keeps it (``generator_state``, what its ``state_dict()`` saves), under the batch sampler's iterator."""
    sampler_iter = getattr(getattr(iterator, "_sampler_iter", None), "sampler_iter", None)
    if sampler_iter is None or getattr(sampler_iter, "sampler", None) is not sampler:
        return None
    state = getattr(sampler_iter, "generator_state", None)
    return state.clone() if isinstance(state, torch.Tensor) else None


def _is_torchdata_random(sampler: Any) -> bool:
    kind = type(sampler)
    return kind.__name__ == "RandomSampler" and kind.__module__.startswith("torchdata.")


def _distributed(sampler: DistributedSampler[Any]) -> OrderSpec:
    return {"kind": "distributed", "n": len(sampler.dataset), "seed": int(sampler.seed),  # type: ignore[arg-type]
            "epoch": int(sampler.epoch), "shuffle": bool(sampler.shuffle), "drop_last": bool(sampler.drop_last),
            "replicas": int(sampler.num_replicas)}


def order_length(spec: OrderSpec) -> int:
    """Positions in the order: ``DistributedSampler``'s padding repeats are not positions of their own; with its
    ``drop_last`` the tail it drops is not part of the epoch."""
    kind = spec["kind"]
    if kind in ("distributed", "wrapper"):
        n, replicas = int(spec["n"]), int(spec["replicas"])
        return (n // replicas) * replicas if spec["drop_last"] else n
    if kind == "random":
        return int(spec["num_samples"])
    return int(spec["n"])


def global_order(spec: OrderSpec) -> torch.Tensor:
    """The epoch's order (dataset indices, int64) as the sampler described by ``spec`` drew it."""
    kind = spec["kind"]
    if kind == "sequential":
        return torch.arange(int(spec["n"]), dtype=torch.int64)
    if kind == "random":
        return _random_order(spec)
    # DistributedSampler.__iter__: a permutation from a generator seeded with seed + epoch (or 0..n-1 unshuffled).
    n = int(spec["n"])
    if spec["shuffle"]:
        generator = torch.Generator()
        generator.manual_seed(int(spec["seed"]) + int(spec["epoch"]))
        positions = torch.randperm(n, generator=generator)
    else:
        positions = torch.arange(n, dtype=torch.int64)
    positions = positions[:order_length(spec)]
    if kind == "wrapper":  # the wrapper permutes the positions of its inner sampler's order
        return global_order(spec["inner"])[positions]
    return positions


def _random_order(spec: OrderSpec) -> torch.Tensor:
    n, replacement, num_samples = int(spec["n"]), bool(spec["replacement"]), int(spec["num_samples"])
    source = range(n)
    if spec.get("generator") is not None:
        generator = torch.Generator()
        generator.set_state(spec["generator"])
        cls: Any = RandomSampler
        if spec.get("source") == "torchdata":  # the checkpoint's job read a StatefulDataLoader: torchdata is there
            from torchdata.stateful_dataloader.sampler import RandomSampler as cls  # type: ignore[import-untyped,no-redef]
        return torch.tensor(list(cls(source, replacement=replacement, num_samples=num_samples, generator=generator)),
                            dtype=torch.int64)
    # torch's RandomSampler without a generator draws a seed from torch's global generator: draw it from the state
    # it had then, and put the caller's back.
    saved = torch.get_rng_state()
    try:
        torch.set_rng_state(spec["rng"])
        return torch.tensor(list(RandomSampler(source, replacement=replacement, num_samples=num_samples)),
                            dtype=torch.int64)
    finally:
        torch.set_rng_state(saved)


@dataclass(frozen=True)
class RestSplit:
    """One rank's share of the rest of an epoch's order (see the module docstring)."""

    batches: list[list[int]]  # this rank's batches of dataset indices, in order
    per_rank: int  # batches every rank runs (the same on all)
    remaining: int  # positions of the order left to train (all ranks together)
    repeated: int  # samples given twice so that every rank has a sample in the last stretch
    dropped: int  # samples of an incomplete last stretch left out (the loader's drop_last)


def stretch_sizes(remaining: int, *, world: int, batch_size: int, drop_last: bool) -> tuple[list[int], int, int]:
    """The sizes of the stretches the rest is read in (one batch per rank each), and how many samples are repeated
    and dropped to give every rank a non-empty batch in each."""
    full = world * batch_size
    if drop_last:
        count = remaining // full
        return [full] * count, 0, remaining - count * full
    count = math.ceil(remaining / full)
    if count == 0:
        return [], 0, 0
    sizes = [full] * (count - 1) + [remaining - (count - 1) * full]
    short = world - sizes[-1]
    if short <= 0:
        return sizes, 0, 0
    if count >= 2 and batch_size >= 2:  # the stretch before gives the last one sample per rank
        sizes[-2] -= short
        sizes[-1] += short
        return sizes, 0, 0
    return sizes, short, 0


def split_rest(order: torch.Tensor, start: int, *, world: int, rank: int, batch_size: int,
               drop_last: bool) -> RestSplit:
    """Rank ``rank``'s batches of ``order[start:]`` when ``world`` ranks read it, ``batch_size`` per batch."""
    rest = order[start:]
    sizes, repeated, dropped = stretch_sizes(len(rest), world=world, batch_size=batch_size, drop_last=drop_last)
    batches: list[list[int]] = []
    at = 0
    for size in sizes:
        stretch = rest[at:at + size]
        at += size
        if size < world:  # padded with its own samples, as DistributedSampler pads
            stretch = stretch.repeat(math.ceil(world / size))[:world]
        batches.append(stretch[rank::world].tolist())
    return RestSplit(batches, len(sizes), len(rest), repeated, dropped)


def consumed_positions(spec: OrderSpec, samples: Sequence[int]) -> int:
    """Positions of the order the ranks consumed, from each rank's samples in the stream ``spec`` describes."""
    return min(int(spec.get("start", 0)) + sum(samples), order_length(spec))


def kept_accumulation(*, world_then: int, accumulate_then: int, batch_then: int, world: int, batch: int) -> int:
    """The ``accumulate_grad_batches`` that keeps the global batch (``world x accumulate x batch_size``) of the
    checkpoint's job on ``world`` processes with ``batch`` samples per batch; ValueError naming the sizes when none
    does."""
    global_batch = world_then * accumulate_then * batch_then
    per_micro_step = world * batch
    if global_batch % per_micro_step:
        fits = [w for w in range(1, global_batch // batch + 1) if global_batch % (w * batch) == 0]
        raise ValueError(
            f"ResumeStateCallback(keep_global_batch=True) cannot keep the global batch: the checkpoint's job trained"
            f" {global_batch} samples per optimizer step ({world_then} process(es) x accumulate_grad_batches"
            f" {accumulate_then} x batch_size {batch_then}), and this run's {world} process(es) x batch_size {batch}"
            f" read {per_micro_step} per micro-batch, which does not divide {global_batch}. Fix: resume on a number"
            f" of processes that divides it with batch_size {batch} ({', '.join(map(str, fits[:8]))}), change the"
            " batch size, or pass keep_global_batch=False (the global batch then becomes"
            f" {per_micro_step} x accumulate_grad_batches).")
    return global_batch // per_micro_step


@dataclass(frozen=True)
class Rest:
    """How a resume continues an epoch saved by another number of processes (or saved while reading such a rest)."""

    epoch: int
    order: OrderSpec  # the epoch's order as the resumed stream records it: layout "rest", start = consumed
    consumed: int  # positions of the order consumed before the save (its last optimizer step)
    length: int  # positions in the order
    split: RestSplit  # this rank's share of the rest
    again: int  # samples consumed after the save's last optimizer step (their gradients were not applied): read again


def plan_rest(records: Sequence[RankRecord], *, dataset_size: int, world: int, rank: int, batch_size: int,
              drop_last: bool) -> Rest | str:
    """This rank's share of what the ranks of ``records`` (one per rank of the saving job) left of their epoch; or
    why it cannot be known (a phrase naming the cause)."""
    spec = records[0].order
    if isinstance(spec, str):
        return spec
    if spec is None:
        return ("the checkpoint does not describe the epoch's order (it was written by an earlier version of"
                " lightning_resilient, or before the training loader was built)")
    if any(not isinstance(r.order, dict) or r.order.get("start") != spec.get("start") for r in records):
        return "the checkpoint's ranks describe different orders of the epoch"
    if spec["layout"] == "sampler":
        readers = int(spec["replicas"]) if spec["kind"] in ("distributed", "wrapper") else 1
        if readers != len(records):
            return (f"each of the checkpoint's {len(records)} processes read a {spec['kind']} order of its own"
                    f" ({readers} reader(s) each), not shares of one order (a sampler that is not distributed)")
    if int(spec["dataset"]) != dataset_size:
        return f"the training dataset has {dataset_size} samples now and had {spec['dataset']} then"
    samples = [r.samples for r in records]
    stepped = [r.samples if r.step_samples is None else r.step_samples for r in records]
    consumed = consumed_positions(spec, stepped)
    order = global_order(spec)
    split = split_rest(order, consumed, world=world, rank=rank, batch_size=batch_size, drop_last=drop_last)
    return Rest(records[0].epoch, {**spec, "layout": "rest", "start": consumed}, consumed, len(order), split,
                sum(samples) - sum(stepped))


def distributed_batch_sampler(batch_sampler: Any, *, seed: int) -> BatchSampler | None:
    """In one process, the batch sampler that reads the order DDP's ``DistributedSampler`` gives (Lightning puts one
    in place of a ``RandomSampler`` or ``SequentialSampler`` under DDP, seeded from ``PL_GLOBAL_SEED`` or 0), so the
    epochs' orders do not depend on the number of processes; None for any other batch sampler (left as it is)."""
    if type(batch_sampler) is not BatchSampler:
        return None
    sampler = batch_sampler.sampler
    if type(sampler) is SequentialSampler:
        shuffle = False
    elif type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        shuffle = True
    else:
        return None
    distributed: DistributedSampler[Any] = DistributedSampler(
        sampler.data_source, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
    return BatchSampler(distributed, batch_sampler.batch_size, batch_sampler.drop_last)
