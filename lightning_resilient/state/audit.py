"""The resume audit: what each training step consumed (:func:`digest_batch`, :func:`digest_indices`), how a resumed
attempt compares the steps it replays with the interrupted attempt's record (:class:`Replay`), and the one
``resume audit:`` line that says what it found (:func:`audit_line`).

A step's record is a digest of its sample indices (where the sampler says them: a map-style DataLoader), a digest
of its inputs (for each tensor its dtype, shape and a strided slice of at most :data:`SLICE` elements' bytes, taken
on the host before the batch moves to the device; strings and numbers as they are) and its loss. A resume from the
checkpoint of step S replays the steps the interrupted attempt ran after S; each replayed step is compared, on every
rank, with the interrupted attempt's step at the same (epoch, batch_idx). The first difference is named by its
step, rank and what differed: the data (sample indices or input bytes) or, with the same data, the loss. Nothing to
compare (no record, or none past S) is said as such, never as "identical".

After a resume on another number of processes (``state/elastic.py``) no step matches one of the interrupted attempt:
the batches are cut differently. What is compared then is which samples were trained (:class:`SampleReplay`): each
step also records an order-free digest of its sample indices that adds up over batches (:func:`digest_sample_set`),
so the samples the interrupted attempt's ranks trained after the checkpoint, stretch by stretch of the epoch's order,
can be compared with those this attempt's ranks train, wherever both have trained the same number of samples. Input
bytes and losses are not compared across such a change.

Where it runs and when it writes is the callback's business (``callback.py``); the records are ``attempts.py``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_resilient.io.store import Store
from lightning_resilient.state.attempts import (
    AttemptLog,
    AttemptRecord,
    AuditResult,
    StepDigest,
    drop_old_attempts,
    list_attempts,
    new_attempt_id,
    read_record,
)

__all__ = ["RankOutcome", "Replay", "ResumeAudit", "SLICE", "STATE_ELEMENTS", "STATE_TENSORS", "SampleReplay",
           "StateSampler", "add_sample_sets", "audit_line", "changed_facts", "digest_batch", "digest_indices",
           "digest_sample_set", "digest_state", "nothing_line", "sample_line", "sample_state"]

_log = logging.getLogger(__name__)

SLICE = 1024  # elements of each tensor whose bytes are hashed: every sample of a batch of up to 1024 is touched
_LEAVES = 256  # leaves of a nested batch looked at (a batch of many small tensors costs no more than that)
_DIGEST = 8  # bytes of each digest (16 hex digits)


def digest_indices(indices: Sequence[Any]) -> str:
    """A digest of a batch's sample indices, in order."""
    try:
        data = array("q", (int(i) for i in indices)).tobytes()
    except (TypeError, ValueError, OverflowError):  # keys of a dataset indexed by something else
        data = repr(list(indices)).encode()
    return hashlib.blake2b(data, digest_size=_DIGEST).hexdigest()


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def digest_sample_set(indices: Sequence[Any]) -> str:
    """An order-free digest of a batch's sample indices that adds up over batches (:func:`add_sample_sets`): the sum,
    modulo 2**64, of a 64-bit mix (splitmix64) of each index, as 16 hex digits."""
    try:
        values = np.array([int(i) for i in indices], dtype=np.int64).view(np.uint64)
    except (TypeError, ValueError, OverflowError):  # keys of a dataset indexed by something else
        values = np.array([int.from_bytes(hashlib.blake2b(repr(i).encode(), digest_size=8).digest(), "little")
                           for i in indices], dtype=np.uint64)
    with np.errstate(over="ignore"):  # the mix is arithmetic modulo 2**64
        z = values + _MIX[0]
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
        z = z ^ (z >> np.uint64(31))
        return f"{int(z.sum(dtype=np.uint64)):016x}"


def add_sample_sets(a: str, b: str) -> str:
    """The :func:`digest_sample_set` of two batches together."""
    return f"{(int(a, 16) + int(b, 16)) % (1 << 64):016x}"


STATE_TENSORS = 8  # parameter tensors sampled after each step (the first, the last and evenly between)
STATE_ELEMENTS = 64  # elements of each, strided over the tensor


def sample_state(module: torch.nn.Module) -> str | list[torch.Tensor] | None:
    """A small sample of ``module``'s trainable parameters as they are now (see :class:`StateSampler`, which keeps
    the choice of tensors between steps: this is one step's worth, for a one-off)."""
    return StateSampler(module)()


class StateSampler:
    """A small sample of a module's trainable parameters after each step: up to :data:`STATE_TENSORS` tensors (the
    first, the last, evenly between), of each up to :data:`STATE_ELEMENTS` elements strided over it. What changes any
    update of those tensors (a different gradient, learning rate or optimizer state) changes its digest.

    The tensors are chosen once (walking a module's parameters costs more than the sample). Parameters on the CPU are
    read through NumPy views of their storage, made once: the optimizer updates them in place, so each call digests
    the current values (:func:`digest_state`'s digest, a few microseconds); a parameter whose storage moved (replaced,
    not updated) makes the choice anew. On an accelerator the sampled elements are copied there and read by
    :meth:`ResumeAudit._settle` steps later (reading them now would wait for the device). A sharded parameter (a
    DTensor) is sampled from this rank's shard."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._chosen: list[torch.Tensor] = []
        self._places: list[int] = []
        self._views: list[tuple[bytes, np.ndarray]] | None = None  # CPU: (dtype and shape, strided view) per tensor

    def _choose(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        if len(params) > STATE_TENSORS:
            step = (len(params) - 1) / (STATE_TENSORS - 1)
            params = [params[round(i * step)] for i in range(STATE_TENSORS)]
        chosen = []
        for p in params:
            t = p.detach()
            to_local = getattr(t, "to_local", None)
            if callable(to_local):  # a DTensor: this rank's shard (reading the whole would be a collective)
                t = to_local()
            if t.numel():
                chosen.append(t)
        self._chosen = chosen
        self._places = [t.data_ptr() for t in chosen]
        self._views = None
        if chosen and all(t.device.type == "cpu" and t.is_contiguous() for t in chosen):
            try:
                strided = [(t.dtype, _strided(_bits(t).reshape(-1))) for t in chosen]
                # (the head digest_state gives the same elements copied to the host: their dtype, the sample's shape)
                self._views = [(f"{dtype}{tuple(view.shape)}".encode(), view) for dtype, view in strided]
            except (TypeError, KeyError, RuntimeError):  # a dtype without NumPy bits: the tensor path below
                self._views = None

    def __call__(self) -> str | list[torch.Tensor] | None:
        if not self._chosen or [t.data_ptr() for t in self._chosen] != self._places:
            self._choose()
        if not self._chosen:
            return None
        if self._views is not None:
            h = hashlib.blake2b(digest_size=_DIGEST)
            for head, view in self._views:
                h.update(head)
                h.update(view.tobytes())
            return h.hexdigest()
        with torch.no_grad():
            return [_strided(t.reshape(-1)).clone() for t in self._chosen]


def _bits(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's storage: its values, or for a dtype NumPy does not have (bfloat16, float8) its
    bits as ints of the same size."""
    try:
        return t.numpy()
    except TypeError:
        return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def _strided(flat: Any) -> Any:
    """At most :data:`STATE_ELEMENTS` elements strided over a flat tensor or array (a view)."""
    stride = max(1, len(flat) // STATE_ELEMENTS)
    return flat[::stride][:STATE_ELEMENTS]


def digest_state(sample: list[torch.Tensor]) -> str:
    """The digest of a sample of parameters (:func:`sample_state`): of each tensor its dtype, shape and the bits of at
    most :data:`STATE_ELEMENTS` elements strided over it (read to the host)."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    for t in sample:
        t = t.detach().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(_strided(np.ascontiguousarray(_bits(t)).reshape(-1)).tobytes())
    return h.hexdigest()


def digest_batch(batch: Any) -> str:
    """A digest of a batch as the loader produced it: per tensor (or NumPy array) its dtype, shape and the bytes of
    a strided slice of at most :data:`SLICE` elements; strings, numbers and None as they are. A tensor that is not
    on the CPU contributes its dtype, shape and device only (reading it would wait for the device)."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    leaves = 0
    stack: list[Any] = [batch]
    while stack and leaves < _LEAVES:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            leaves += 1
            _tensor_into(h, item)
        elif isinstance(item, np.ndarray):
            leaves += 1
            _tensor_into(h, torch.from_numpy(item) if item.dtype.kind in "biufc" else torch.empty(0))
            h.update(repr((item.dtype.str, item.shape)).encode())
        elif isinstance(item, Mapping):
            h.update(b"{")
            for key in reversed(list(item)):
                stack.append(item[key])
                stack.append(str(key))
        elif isinstance(item, (list, tuple)):
            h.update(b"[")
            stack.extend(reversed(item))
        else:
            leaves += 1
            h.update(repr(item)[:200].encode())
            h.update(b"|")
    return h.hexdigest()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_into(h: Any, t: torch.Tensor) -> None:
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or not t.numel():
        h.update(str(t.device).encode())
        return
    t = t.detach()
    try:
        array = t.numpy()
    except TypeError:  # a dtype NumPy does not have (bfloat16, float8): its bits, as ints of the same size
        array = t.view(_SAME_SIZE_INT[t.element_size()]).numpy()
    stride = max(1, array.size // SLICE)
    if array.flags.c_contiguous:  # NumPy's strided view: no copy until tobytes() takes the slice's elements
        picked = array.reshape(-1)[::stride][:SLICE]
    else:  # take() reads the elements in row-major order whatever the strides: no copy of the whole tensor
        picked = torch.take(t, torch.arange(0, array.size, stride)[:SLICE]).numpy()
    h.update(picked.tobytes())


@dataclass(frozen=True)
class RankOutcome:
    """What one rank's comparison found (gathered to rank 0, which writes the line)."""

    rank: int
    had_record: bool  # the interrupted attempt left a record for this rank
    expected: int  # steps of that record from this attempt's first step on (what this attempt replays)
    compared: int  # replayed steps compared so far
    first_step: int | None  # global step of the first compared step
    last_step: int | None  # global step of the last compared step
    difference: tuple[int, int, int, str] | None  # (global step, epoch, batch_idx, what) of the first difference
    identical_before: int  # compared steps before that difference (all of them when there is none)
    # whether sample indices, input bytes, loss and the parameters after the step were compared (on every step)
    fields: tuple[bool, bool, bool, bool]


class Replay:
    """One rank's comparison of the steps it replays with the interrupted attempt's record of the same rank."""

    def __init__(self, rank: int, previous: AttemptRecord | None, resumed_step: int) -> None:
        self.rank = rank
        self.had_record = previous is not None
        past = [s for s in previous.steps if s.step >= resumed_step] if previous is not None else []
        self.expected = {s.key: s for s in past}
        self.last_key: tuple[int, int] | None = max(self.expected) if self.expected else None
        self._first_key: tuple[int, int] | None = None
        self.compared = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.difference: tuple[int, int, int, str] | None = None
        self._identical_before = 0
        self._fields = [True, True, True, True]

    def check(self, step: StepDigest) -> None:
        if self._first_key is None:
            self._first_key = step.key
        then = self.expected.get(step.key)
        if then is None:
            return
        self.compared += 1
        self.first_step = step.step if self.first_step is None else self.first_step
        self.last_step = step.step
        pairs = ((then.indices, step.indices), (then.data, step.data), (then.loss, step.loss),
                 (then.state, step.state))
        for i, (a, b) in enumerate(pairs):
            self._fields[i] = self._fields[i] and a is not None and b is not None
        if self.difference is not None:
            return
        what = None
        if then.indices is not None and step.indices is not None and then.indices != step.indices:
            what = "data (sample indices)"
        elif then.data is not None and step.data is not None and then.data != step.data:
            what = "data (input bytes)"
        elif then.loss is not None and step.loss is not None and not _same_float(then.loss, step.loss):
            what = f"loss ({then.loss!r} then, {step.loss!r} now)"
        elif then.state is not None and step.state is not None and then.state != step.state:
            # Same data and loss, another update: what changed came after the loss (the gradients, the optimizer).
            what = "parameters after the step (same data and loss: the gradients or the optimizer's update)"
        if what is not None:
            self.difference = (step.step, step.epoch, step.batch, what)
            self._identical_before = self.compared - 1

    def outcome(self) -> RankOutcome:
        first = self._first_key
        expected = sum(1 for k in self.expected if first is None or k >= first)
        before = self.compared if self.difference is None else self._identical_before
        return RankOutcome(self.rank, self.had_record, expected, self.compared, self.first_step, self.last_step,
                           self.difference, before,
                           (self._fields[0], self._fields[1], self._fields[2], self._fields[3]))


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


_FACTS = {"world_size": "world size", "batch_size": "batch size", "dataset": "dataset",
          "sample_seed": "per-sample seed", "per_sample_seeding": "per-sample seeding", "num_workers": "num_workers",
          "accumulate_grad_batches": "accumulate_grad_batches", "loader": "training loader"}


def changed_facts(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The run's facts that differ between two attempts, as phrases ("batch size 4 then, 8 now")."""
    return [f"{label} {then[key]!r} then, {now[key]!r} now" for key, label in _FACTS.items()
            if key in then and key in now and then[key] != now[key]]


class SampleReplay:
    """One rank's samples, batch by batch, in the epoch a resume on another number of processes continued: what it
    trained there until its share covers what the interrupted attempt trained after the checkpoint (``needed``
    samples, all ranks together, ``per_batch`` per batch of all ranks), or the epoch ends."""

    def __init__(self, *, epoch: int, needed: int, per_batch: int) -> None:
        self.epoch = epoch
        self.batches_needed = max(1, math.ceil(needed / max(1, per_batch)))
        self.samples: list[tuple[int, str] | None] = []
        self.first_step: int | None = None
        self.last_step: int | None = None

    def check(self, step: StepDigest) -> bool:
        """Take a step's samples; True when this rank's share is complete (the same step on every rank)."""
        if step.epoch != self.epoch:
            return step.epoch > self.epoch
        self.samples.append(step.samples)
        self.first_step = step.step if self.first_step is None else self.first_step
        self.last_step = step.step
        return len(self.samples) >= self.batches_needed


def _stretches(per_rank: Sequence[Sequence[tuple[int, str] | None]]) -> list[tuple[int, str]] | None:
    """Batch by batch, the samples of every rank's batch together (a stretch of the epoch's order); None when a
    batch's samples are not known. Only the batches every rank has count."""
    count = min((len(batches) for batches in per_rank), default=0)
    out = []
    for j in range(count):
        parts = [batches[j] for batches in per_rank]
        if any(p is None for p in parts):
            return None
        total, digest = 0, f"{0:016x}"
        for size, part in parts:  # type: ignore[misc]  # (None excluded above)
            total, digest = total + size, add_sample_sets(digest, part)
        out.append((total, digest))
    return out


def sample_line(then: list[tuple[int, str]], now: Sequence[Sequence[tuple[int, str] | None]], *, interrupted: str,
                world_then: int, world_now: int, steps: tuple[int | None, int | None], resumed_step: int,
                changed: list[str]) -> AuditResult:
    """The line comparing which samples the interrupted attempt's ranks trained after the checkpoint (``then``:
    its stretches) with those this attempt's ranks trained (``now``: each rank's batches), across a change of world
    size: at every count of samples both have trained, the same samples or not. The line says how many samples were
    compared, of how many each side trained, and why the rest was not (never that this run stopped where it did
    not)."""
    hint = f" Changed since then: {'; '.join(changed)}." if changed else ""
    stretches = _stretches(now)
    if stretches is None:
        return nothing_line(f"this run's loader does not say its sample indices (world size {world_then} then,"
                            f" {world_now} now){hint}")
    seen: dict[int, str] = {}
    total, digest = 0, f"{0:016x}"
    for size, part in then:
        total, digest = total + size, add_sample_sets(digest, part)
        seen[total] = digest
    compared, total, digest = 0, 0, f"{0:016x}"
    for size, part in stretches:
        total, digest = total + size, add_sample_sets(digest, part)
        if total in seen:
            if seen[total] != digest:
                line = (f"resume audit: the samples this run trained after the checkpoint of step {resumed_step} DIFFER"
                        f" from those the interrupted attempt {interrupted} trained after it ({world_then} rank(s)"
                        f" then, {world_now} now): the first {total} samples are not the same set ({compared} samples"
                        f" before them were the same), so the rest of the epoch was not split as it was left.{hint}")
                return AuditResult("differs", line, compared)
            compared = total
    if not compared:
        return nothing_line(f"the interrupted attempt {interrupted} and this run never trained the same number of"
                            f" samples after the checkpoint of step {resumed_step} ({world_then} rank(s) then,"
                            f" {world_now} now: their batches do not line up){hint}")
    first, last = steps
    span = (f"global step {first}" if first == last else f"global steps {first} to {last}") if first is not None else ""
    # Say only what was compared. Sample sets add up, so they compare only at a count where a stretch ends in both
    # attempts: where this run's stretches are wider or cut elsewhere (2 ranks now where 1 was), the interrupted
    # attempt's last samples may fall between two such counts although this run trained past them. This run's own
    # count is what its ranks trained while the comparison ran (it stops once its share covers theirs, or at the
    # end of its fit or of the epoch), over the steps ``steps`` spans.
    trained, then_total = total, max(seen)
    ours = f"the {compared}" if trained == compared else f"the first {compared} of the {trained}"
    theirs = "those" if then_total == compared else f"the first {compared} of the {then_total}"
    rest = ""
    if then_total > compared:
        why = (f"this run's batches and its never end at the same count of samples past the first {compared}, and"
               " sample sets are compared only where both end" if trained >= then_total else
               f"this run's comparison ended after {trained} samples of the epoch, fewer than its {then_total}")
        rest = f" (its other {then_total - compared} samples were not compared: {why})"
    line = (f"resume audit: {ours} samples this run trained after the checkpoint of step {resumed_step}"
            f" ({span} on {world_now} rank(s)) are the same samples, stretch by stretch of the epoch's order, as"
            f" {theirs} the interrupted attempt {interrupted} trained after it on {world_then} rank(s){rest}: sample"
            " ids compared across the change of world size (input bytes and losses are not comparable across it).")
    return AuditResult("identical", line, compared)


def nothing_line(reason: str) -> AuditResult:
    return AuditResult("nothing", f"resume audit: nothing to compare: {reason}", 0)


def audit_line(outcomes: list[RankOutcome], *, interrupted: str, changed: list[str], world_then: int | None,
               resumed_step: int) -> AuditResult:
    """The one line for every rank's outcome: identical, DIFFER (first step, rank, what), or nothing to compare."""
    world_now = len(outcomes)
    compared = max((o.compared for o in outcomes), default=0)
    differing = [o for o in outcomes if o.difference is not None]
    hint = f" Changed since then: {'; '.join(changed)}." if changed else ""
    if differing:
        first = min(differing, key=lambda o: (o.difference[:3] if o.difference else (0, 0, 0), o.rank))
        assert first.difference is not None
        step, epoch, batch, what = first.difference
        before = first.identical_before
        line = (f"resume audit: the replayed training steps DIFFER from the interrupted attempt {interrupted}: first"
                f" at global step {step} (epoch {epoch}, batch {batch}) on rank {first.rank}: {what} differ;"
                f" {before} replayed step(s) before it were identical.{hint}")
        return AuditResult("differs", line, compared)
    if world_then is not None and world_then != world_now:
        rank = min((o.rank for o in outcomes if not o.had_record), default=0)
        at = next((o.first_step for o in outcomes if o.first_step is not None), None)
        where = f"global step {at}" if at is not None else f"the first step after step {resumed_step}"
        line = (f"resume audit: the replayed training steps DIFFER from the interrupted attempt {interrupted}: first"
                f" at {where} on rank {rank}: world size ({world_then} rank(s) then, {world_now} now), so each"
                f" rank reads other samples and the gradients are averaged over other ranks.{hint}")
        return AuditResult("differs", line, compared)
    if compared == 0:
        return nothing_line(f"the interrupted attempt {interrupted} recorded no training step at or after this"
                            f" run's first (it stopped at the checkpoint of step {resumed_step})")
    fields = [name for name, on in zip(("sample indices", "input bytes", "loss", "parameters after each step"),
                                       (all(o.fields[i] for o in outcomes if o.compared) for i in range(4)),
                                       strict=True) if on]
    what = ", ".join(fields[:-1]) + (" and " if len(fields) > 1 else "") + fields[-1] if fields else "steps"
    first_steps = [o.first_step for o in outcomes if o.first_step is not None]
    last_steps = [o.last_step for o in outcomes if o.last_step is not None]
    span = (f"global step {min(first_steps)}" if min(first_steps) == max(last_steps)
            else f"global steps {min(first_steps)} to {max(last_steps)}")
    expected = max(o.expected for o in outcomes)
    short = (f" (this run stopped before replaying the interrupted attempt's last {expected - compared})"
             if expected > compared else "")
    ranks = "the only rank" if world_now == 1 else f"every rank ({world_now} ranks)"
    line = (f"resume audit: the {compared} replayed training step(s) ({span}) were identical on {ranks} to what the"
            f" interrupted attempt {interrupted} recorded: same {what}{short}.")
    return AuditResult("identical", line, compared)


_LAG = 2  # steps a loss on an accelerator waits before it is read (reading it at once would wait for the device)
_SEARCH = 8  # earlier attempts looked at for the one the resume replays


@dataclass(frozen=True)
class _Decided:
    """What rank 0 decided when the attempt started, as every rank receives it."""

    attempt: str | None  # this attempt's id; None: no record can be written (the store failed)
    interrupted: str | None  # the attempt whose steps this one replays; None: none found
    reason: str | None  # why there is nothing to compare (with interrupted None)
    world_then: int | None
    facts_then: dict[str, Any]
    root_id: str | None = None  # the root's incarnation as rank 0 knows it (None: not known yet, a fresh root)


class ResumeAudit:
    """One rank's audit of one attempt: records each step (:class:`~lightning_resilient.state.attempts.AttemptLog`),
    compares the steps a resume replays (:class:`Replay`), and writes the ``resume audit:`` result into rank 0's
    record. Every rank calls :meth:`start`, :meth:`report` and :meth:`close` in the same order (``gather`` is the
    job's all-gather; :meth:`start` and :meth:`report` call it). Nothing here raises into training: a store that
    fails is logged and the audit goes on without it.
    """

    def __init__(self, *, rank: int, world: int, gather: Callable[[Any], list[Any]], flush_seconds: float,
                 flush_steps: int | None, compare: bool = True) -> None:
        self.rank, self.world, self.gather = rank, world, gather
        self.compare = compare  # False: only keep the record (for the goodput ledger), no step digests, no audit
        self.flush_seconds, self.flush_steps = flush_seconds, flush_steps
        self.log: AttemptLog | None = None
        self.replay: Replay | None = None
        self.end: tuple[int, int] | None = None  # the last (epoch, batch) any rank's interrupted attempt recorded
        # After a resume on another number of processes: this rank's samples (SampleReplay), and the stretches of
        # the epoch's order the interrupted attempt's ranks trained after the checkpoint (samples, set digest).
        self.samples: SampleReplay | None = None
        self._then: list[tuple[int, str]] = []
        self.decided: _Decided | None = None
        self.resumed_step = 0
        self.reported = False
        # Steps whose loss (or parameter sample) may still be on the device: read _LAG steps later.
        self._pending: list[tuple[StepDigest, torch.Tensor | None, list[torch.Tensor] | None]] = []
        self._saves: list[tuple[int, int] | None] = []  # the last recorded key at each save
        self._last_key: tuple[int, int] | None = None
        self.spool: str | None = None  # this node's spool of the records (object stores), see start()
        self.root_id: str | None = None

    # -- start -----------------------------------------------------------------------------------------------------
    def start(self, store: Store | None, *, facts: dict[str, Any], resumed_step: int | None,
              resumed_from: str | None, spool: str | None = None, root_id: str | None = None) -> AuditResult | None:
        """Open this attempt's record; on a resume, find the interrupted attempt's record and read this rank's part.
        ``spool``: this node's folder of the records on an object store (``attempts.spool_folder``), where each step
        is appended as it ends; ``root_id``: the root's incarnation, recorded, and a record of another one ignored.
        Returns, on rank 0, the line to log when there is nothing to compare (None otherwise, or elsewhere)."""
        self.spool, self.root_id = spool, root_id
        decided = self._decide(store, resumed_step if self.compare else None) if self.rank == 0 else None
        if decided is not None:
            decided = dataclasses.replace(decided, root_id=root_id)
        decided = self.gather(decided)[0]
        if not isinstance(decided, _Decided):  # no rank 0 among the ranks gathered: nothing is known
            decided = _Decided(None, None, "rank 0 of this run decided nothing", None, {})
        self.decided = decided
        self.root_id = decided.root_id
        if store is not None and decided.attempt is not None:
            record = AttemptRecord(decided.attempt, self.rank, self.world, time.time(), resumed_step,
                                   resumed_from, facts, root_id=root_id)
            self.log = AttemptLog(store, record, flush_seconds=self.flush_seconds, flush_steps=self.flush_steps,
                                  spool=spool)
            self.log.start()
        if resumed_step is None or not self.compare:
            self.reported = True  # a fresh start (or no audit): nothing to compare
            return None
        self.resumed_step = resumed_step
        if decided.interrupted is not None and decided.world_then is not None and decided.world_then != self.world:
            return self._start_samples(store, decided, facts)
        previous = self._read_previous(store, decided) if decided.interrupted is not None else None
        self.replay = Replay(self.rank, previous, resumed_step)
        ends = [e for e in self.gather(self.replay.last_key) if e is not None]
        self.end = max(ends) if ends else None
        if self.end is not None:
            return None
        self.reported = True
        result = nothing_line(decided.reason or (
            f"the interrupted attempt {decided.interrupted} recorded no training step after step {resumed_step}, the"
            f" checkpoint this run resumed from ({self._why_nothing_past(store)})"))
        if self.rank == 0:
            self._keep(result)
            return result
        return None

    def _start_samples(self, store: Store | None, decided: _Decided, facts: Mapping[str, Any]) -> AuditResult | None:
        """A resume on another number of processes: rank 0 reads every rank's record of the interrupted attempt and
        adds up, batch by batch, the samples its ranks trained after the checkpoint; every rank then records its
        own samples until its share covers as many (a collective: every rank runs it)."""
        found = self._stretches_then(store, decided) if self.rank == 0 else None
        found = self.gather(found)[0]
        if not isinstance(found, tuple):
            self.reported = True
            result = nothing_line(found if isinstance(found, str) else "rank 0 of this run decided nothing")
            if self.rank == 0:
                self._keep(result)
                return result
            return None
        epoch, self._then = found
        batch_size = facts.get("batch_size")
        per_batch = self.world * (batch_size if isinstance(batch_size, int) and batch_size > 0 else 1)
        self.samples = SampleReplay(epoch=epoch, needed=sum(size for size, _ in self._then), per_batch=per_batch)
        return None

    def _stretches_then(self, store: Store | None, decided: _Decided) -> tuple[int, list[tuple[int, str]]] | str:
        interrupted, world_then = decided.interrupted, decided.world_then
        assert store is not None and interrupted is not None and world_then is not None
        records = []
        for rank in range(world_then):
            try:
                records.append(read_record(store, interrupted, rank, self.spool))
            except Exception as exc:  # missing, damaged, newer: nothing to compare across ranks
                return (f"rank {rank}'s record of the interrupted attempt {interrupted} could not be read ({exc}), and"
                        f" after a change of world size ({world_then} rank(s) then, {self.world} now) the samples"
                        " of every rank are needed")
        past = [[s for s in record.steps if s.step >= self.resumed_step] for record in records]
        if not past[0]:
            return (f"the interrupted attempt {interrupted} recorded no training step after step"
                    f" {self.resumed_step}, the checkpoint this run resumed from")
        epoch = past[0][0].epoch
        stretches = _stretches([[s.samples for s in steps if s.epoch == epoch] for steps in past])
        if stretches is None:
            return (f"the interrupted attempt {interrupted}'s loader did not say its sample indices (a stateful"
                    f" loader), so the samples it trained cannot be compared across the change of world size"
                    f" ({world_then} rank(s) then, {self.world} now)")
        if not stretches:
            return f"not every rank of the interrupted attempt {interrupted} recorded a step after the checkpoint"
        return epoch, stretches

    def _decide(self, store: Store | None, resumed_step: int | None) -> _Decided:
        if store is None:
            return _Decided(None, None, "the checkpoint root could not be opened (see the warning above)", None, {})
        try:
            attempts = list_attempts(store, self.spool)
            attempt = new_attempt_id(store, self.spool)
        except Exception as exc:  # the audit never stops training
            _warn_store(store, exc)
            return _Decided(None, None, f"the attempts under {store.url()} could not be listed ({exc})", None, {})
        try:
            drop_old_attempts(store)
        except Exception as exc:
            _warn_store(store, exc)
        if resumed_step is None:
            return _Decided(attempt, None, None, None, {})
        skipped: list[str] = []
        foreign: list[str] = []
        past: list[AttemptRecord] = []  # the newest first, each with a step at or after the checkpoint
        for earlier in reversed(attempts[-_SEARCH:]):
            try:
                record = read_record(store, earlier, 0, self.spool)
            except Exception as exc:  # damaged, newer, unreadable: reported and skipped
                _log.warning("the resume audit skipped the record of attempt %s: %s", earlier, exc)
                skipped.append(earlier)
                continue
            if self.root_id and record.root_id and record.root_id != self.root_id:
                foreign.append(earlier)  # copied from another root, or from before this one was recreated
                continue
            if any(s.step >= resumed_step for s in record.steps):
                past.append(record)
        if foreign:
            _log.warning("the resume audit ignored the record(s) of attempt(s) %s: they belong to another root (or to"
                         " an earlier incarnation of %s, deleted and written again), not to the run resumed here",
                         ", ".join(foreign), store.url())
        # The attempt this one continues trained from the checkpoint on: its record holds the step that started at
        # it (a newer one that resumed a later checkpoint, after a rollback to this one, does not); else the newest.
        chosen = next((r for r in past if any(s.step == resumed_step for s in r.steps)), past[0] if past else None)
        if chosen is not None:
            return _Decided(attempt, chosen.attempt, None, chosen.world_size, chosen.facts)
        if attempts:
            newest = attempts[-1]
            reason = (f"no earlier attempt recorded a training step after step {resumed_step}, the checkpoint this run"
                      f" resumed from (the newest, {newest}, stopped at that save, or, on an object store, before its"
                      f" record was next written)" if newest not in skipped else
                      f"the record of the interrupted attempt {newest} could not be read (see the warning above)")
        else:
            reason = (f"no earlier attempt left a record under {store.url()} (the checkpoint was written by a run"
                      " without the audit, or its records were deleted); the next resume will be audited")
        if foreign:
            reason += f" (the records of {', '.join(foreign)} belong to another root and were ignored)"
        return _Decided(attempt, None, reason, None, {})

    def _read_previous(self, store: Store | None, decided: _Decided) -> AttemptRecord | None:
        if store is None or decided.interrupted is None:
            return None
        try:
            return read_record(store, decided.interrupted, self.rank, self.spool)
        except FileNotFoundError:
            return None  # this rank did not exist then (the world size changed), or its record was never written
        except Exception as exc:  # damaged, newer, unreadable: reported and skipped
            _log.warning("the resume audit skipped rank %d's record of attempt %s: %s", self.rank, decided.interrupted,
                         exc)
            return None

    def _why_nothing_past(self, store: Store | None) -> str:
        return "it stopped at that save" + ("" if store is None or getattr(self.log, "local", True) else
                                           f", or before its record was next written: every {self.flush_seconds:g} s")

    # -- each step -------------------------------------------------------------------------------------------------
    def step(self, digest: StepDigest, loss: torch.Tensor | None,
             state: str | list[torch.Tensor] | None = None) -> bool:
        """Record a step (and compare it, on a resume); ``state``: a sample of the parameters after it
        (:func:`sample_state`: its digest, or tensors on the device to digest later). True when the replay just
        ended: call :meth:`report`."""
        if loss is not None and loss.device.type == "cpu":
            digest = dataclasses.replace(digest, loss=float(loss))
            loss = None
        if isinstance(state, str):
            digest = dataclasses.replace(digest, state=state)
            state = None
        self._pending.append((digest, loss, state))
        done = not self.reported and self.end is not None and digest.key >= self.end
        if self.samples is not None and not self.reported:
            done = self.samples.check(digest)
        self._settle(0 if done else _LAG)
        self._last_key = digest.key
        return done

    def _settle(self, keep: int) -> None:
        """Record and compare the pending steps whose loss is read, and all but the last ``keep`` of the others
        (reading their losses: by then the device has long computed them)."""
        while self._pending and (len(self._pending) > keep or (self._pending[0][1] is None
                                                                and self._pending[0][2] is None)):
            digest, loss, state = self._pending.pop(0)
            if loss is not None:
                digest = dataclasses.replace(digest, loss=float(loss))
            if state is not None:
                digest = dataclasses.replace(digest, state=digest_state(state))
            if self.log is not None:
                self.log.add(digest)
            if self.replay is not None and not self.reported:
                self.replay.check(digest)

    def report(self) -> AuditResult | None:
        """Gather every rank's outcome (a collective); rank 0 gets the line to log, the others None."""
        self._settle(0)
        self.reported = True
        assert self.decided is not None
        if self.samples is not None:
            return self._report_samples(self.samples, self.decided)
        assert self.replay is not None
        outcomes = self.gather(self.replay.outcome())
        if self.rank != 0:
            return None
        facts_now = dict(self.log.record.facts) if self.log is not None else {}
        result = audit_line(outcomes, interrupted=self.decided.interrupted or "?",
                            changed=changed_facts(self.decided.facts_then, facts_now),
                            world_then=self.decided.world_then, resumed_step=self.resumed_step)
        self._keep(result)
        return result

    def _report_samples(self, samples: SampleReplay, decided: _Decided) -> AuditResult | None:
        gathered = self.gather((samples.samples, samples.first_step, samples.last_step))
        if self.rank != 0:
            return None
        firsts = [g[1] for g in gathered if g[1] is not None]
        lasts = [g[2] for g in gathered if g[2] is not None]
        facts_now = dict(self.log.record.facts) if self.log is not None else {}
        result = sample_line(self._then, [g[0] for g in gathered], interrupted=decided.interrupted or "?",
                             world_then=decided.world_then or 0, world_now=self.world,
                             steps=(min(firsts) if firsts else None, max(lasts) if lasts else None),
                             resumed_step=self.resumed_step, changed=changed_facts(decided.facts_then, facts_now))
        self._keep(result)
        return result

    def learned_root_id(self, root_id: str) -> None:
        """The root's incarnation, known once this job claimed a root that had none (a fresh one): recorded, so that
        a copy of this record in another root is never taken for that root's."""
        if self.root_id is None and root_id:
            self.root_id = root_id
            if self.log is not None:
                self.log.update(root_id=root_id)

    def _keep(self, result: AuditResult) -> None:
        if self.log is not None:
            self.log.update(audit=result)

    # -- saves and the end -----------------------------------------------------------------------------------------
    def saved(self) -> None:
        """A checkpoint is being saved: the record keeps only the steps after the save before this one."""
        self._settle(0)
        self._saves.append(self._last_key)
        if self.log is not None and len(self._saves) >= 2 and self._saves[-2] is not None:
            self.log.prune(self._saves[-2])

    def close(self, ended: str, **fields: Any) -> None:
        """Record how the attempt ended (and ``fields``: the ledger's last figures) and close the record."""
        self._settle(0)
        if self.log is not None:
            self.log.update(ended=ended, **fields)
            self.log.close()
            self.log = None


def _warn_store(store: Store, exc: BaseException) -> None:
    _log.warning("the resume audit could not use the attempts folder of %s (%s); training goes on", store.url(), exc)
