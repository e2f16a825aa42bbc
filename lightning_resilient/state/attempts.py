"""The per-attempt record: what one rank of one attempt of a training run consumed, step by step, kept beside the
checkpoints (``.lightning_resilient/attempts/`` in the checkpoint root), one object per attempt and rank.

An *attempt* is one run of the training command against a root: the first, and each restart after a kill. Its id,
``a<sequence>-<random>``, orders attempts (the sequence is one more than the highest found when it starts; the
random part keeps two jobs started at once apart). Rank ``r``'s record is ``<attempt>.r<r>.jsonl``, JSON lines:

- a header object first: ``format``, ``attempt``, ``rank``, ``world_size``, ``started`` (this host's clock, for
  display), ``resumed_step`` and ``resumed_from`` (None for a fresh start), ``facts`` (batch size, dataset, seed, ...);
- one list per training step (:class:`StepDigest`): ``[epoch, batch_idx, global_step, sample indices digest, input
  digest, loss]``, and, where the sampler says the indices, a seventh item ``[samples, sample set digest]`` (added to
  format 1 later; a reader of the first version reads the first six);
- later objects update header fields (the resume audit's ``audit`` result, how the attempt ``ended``).

Versioning: a reader refuses a header of a newer ``format`` (:class:`~lightning_resilient.UnsupportedFormatError`)
and a damaged record (:class:`~lightning_resilient.CheckpointCorruptedError`); callers report it and skip the
record, never fail training. Header fields this version does not know are kept (``extra``), so later versions can
add fields (a goodput ledger: restore time, save stalls) without a new format.

Writing (:class:`AttemptLog`): on local disk (or a shared POSIX filesystem) every step is appended and flushed, so a
SIGKILL loses nothing the step recorded; on an object store, which cannot append, a background thread rewrites the
whole object at most every ``flush_seconds`` (or ``flush_steps`` steps), never from the training thread, so a kill
loses at most that interval. The record keeps only the steps after the second-to-last save it saw (:meth:`AttemptLog.
prune`): what a resume from the latest (or the one before it) replays. A failed write is logged and retried at the
next flush; it never reaches training.

Retention: when an attempt starts, records of attempts older than the :data:`KEEP_ATTEMPTS` newest are deleted
(:func:`drop_old_attempts`). A resume only ever compares against the newest attempt that trained past its
checkpoint, so nothing a resume can use is deleted; the protocol's own retention and ``gc`` never list this folder.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import uuid
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import IO, Any

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.io.folders import ATTEMPTS_DIR
from lightning_resilient.io.store import LocalStore, Store

__all__ = ["AttemptLog", "AttemptRecord", "AuditResult", "FORMAT", "KEEP_ATTEMPTS", "StepDigest", "drop_old_attempts",
           "list_attempts", "new_attempt_id", "parse_record", "read_attempts", "read_record", "record_name"]

log = logging.getLogger(__name__)

FORMAT = 1
KEEP_ATTEMPTS = 32  # newest attempts whose records are kept (each a few bytes per step, after pruning)
_ATTEMPT_RE = re.compile(r"^a(\d{6,})-([0-9a-f]{6})$")
_RECORD_RE = re.compile(r"^(a\d{6,}-[0-9a-f]{6})\.r(\d+)\.jsonl$")
_KIND = "lightning_resilient.attempt"


def new_attempt_id(store: Store) -> str:
    """A new attempt's id: one more than the highest sequence under the root's attempts folder."""
    known = [int(m.group(1)) for a in list_attempts(store) if (m := _ATTEMPT_RE.match(a))]
    return f"a{max(known, default=0) + 1:06d}-{uuid.uuid4().hex[:6]}"


def list_attempts(store: Store) -> list[str]:
    """The attempt ids with a record under the root, oldest first."""
    ids = {m.group(1) for name in store.list_dir(ATTEMPTS_DIR) if (m := _RECORD_RE.match(name))}
    return sorted(ids, key=_order)


def _order(attempt: str) -> tuple[int, str]:
    match = _ATTEMPT_RE.match(attempt)
    return (int(match.group(1)), match.group(2)) if match else (-1, attempt)


def record_name(attempt: str, rank: int) -> str:
    """The root-relative name of rank ``rank``'s record of ``attempt``."""
    return f"{ATTEMPTS_DIR}/{attempt}.r{rank}.jsonl"


def drop_old_attempts(store: Store, keep: int = KEEP_ATTEMPTS) -> list[str]:
    """Delete the records of every attempt but the ``keep`` newest; returns the attempts dropped."""
    attempts = list_attempts(store)
    dropped = attempts[:max(0, len(attempts) - keep)]
    if dropped:
        gone = set(dropped)
        for name in store.list_dir(ATTEMPTS_DIR):
            match = _RECORD_RE.match(name)
            if match and match.group(1) in gone:
                store.remove_object(f"{ATTEMPTS_DIR}/{name}")
    return dropped


@dataclass(frozen=True)
class StepDigest:
    """What one training step (one batch, one ``training_step`` call) consumed on one rank."""

    epoch: int  # the training epoch
    batch: int  # batch_idx within the epoch
    step: int  # the global step (optimizer steps done) when the batch was trained
    indices: str | None  # digest of the batch's sample indices; None where the sampler does not say
    data: str | None  # digest of the batch's inputs (a strided slice of each tensor's bytes, shapes, dtypes)
    loss: float | None  # the loss training_step returned; None when it returned none
    # (samples in the batch, an order-free digest of their indices that adds up over batches: audit.py's
    # digest_sample_set); None where the sampler does not say the indices. Compared across a change of world size.
    samples: tuple[int, str] | None = None

    @property
    def key(self) -> tuple[int, int]:
        """Where in training the step is: (epoch, batch_idx), the same in every attempt of an unchanged run."""
        return self.epoch, self.batch

    def to_json(self) -> list[Any]:
        out: list[Any] = [self.epoch, self.batch, self.step, self.indices, self.data, self.loss]
        if self.samples is not None:
            out.append([self.samples[0], self.samples[1]])
        return out

    @classmethod
    def from_json(cls, raw: Any) -> StepDigest:
        if not isinstance(raw, list) or len(raw) < 6:
            raise ValueError(f"a step is a list of 6 values, got {raw!r:.80}")
        epoch, batch, step, indices, data, loss = raw[:6]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, batch, step)):
            raise ValueError(f"a step's epoch, batch and step are ints, got {raw!r:.80}")
        if not all(v is None or isinstance(v, str) for v in (indices, data)):
            raise ValueError(f"a step's digests are strings or null, got {raw!r:.80}")
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise ValueError(f"a step's loss is a number or null, got {raw!r:.80}")
        samples = raw[6] if len(raw) > 6 else None
        if samples is not None and not (isinstance(samples, list) and len(samples) == 2 and isinstance(samples[0], int)
                                        and not isinstance(samples[0], bool) and isinstance(samples[1], str)):
            raise ValueError(f"a step's samples are [count, digest], got {raw!r:.80}")
        return cls(epoch, batch, step, indices, data, None if loss is None else float(loss),
                   None if samples is None else (samples[0], samples[1]))


@dataclass(frozen=True)
class AuditResult:
    """What the resume audit of an attempt concluded, as its ``resume audit:`` line says it."""

    outcome: str  # "identical", "differs" or "nothing" (nothing to compare)
    line: str  # the line that was logged
    compared: int  # training steps compared

    def to_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "line": self.line, "compared": self.compared}

    @classmethod
    def from_json(cls, raw: Any) -> AuditResult:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("line"), str):
            raise ValueError(f"an audit result is an object with a line, got {raw!r:.80}")
        return cls(str(raw.get("outcome", "")), raw["line"], int(raw.get("compared", 0)))


@dataclass
class AttemptRecord:
    """One rank's record of one attempt (see the module docstring for its stored form)."""

    attempt: str
    rank: int
    world_size: int
    started: float  # this host's clock, for display only
    resumed_step: int | None = None  # the global step of the checkpoint it resumed from; None: a fresh start
    resumed_from: str | None = None  # that checkpoint's path, as the Trainer was given it
    facts: dict[str, Any] = field(default_factory=dict)  # batch size, dataset, seed, ...: named in a DIFFERS line
    audit: AuditResult | None = None  # the resume audit's result (rank 0's record holds it)
    ended: str | None = None  # "finished", or what stopped it; None: killed, or still running
    steps: list[StepDigest] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # header fields of a later version, kept as they were

    def header(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.extra, "record": _KIND, "format": FORMAT, "attempt": self.attempt, "rank": self.rank,
            "world_size": self.world_size, "started": self.started, "resumed_step": self.resumed_step,
            "resumed_from": self.resumed_from, "facts": self.facts}
        if self.audit is not None:
            out["audit"] = self.audit.to_json()
        if self.ended is not None:
            out["ended"] = self.ended
        return out

    def to_bytes(self) -> bytes:
        lines = [_line(self.header()), *(_line(s.to_json()) for s in self.steps)]
        return "".join(lines).encode()

    @property
    def last_step(self) -> StepDigest | None:
        return self.steps[-1] if self.steps else None


_HEADER_FIELDS = {"record", "format", "attempt", "rank", "world_size", "started", "resumed_step", "resumed_from",
                  "facts", "audit", "ended"}


def _line(value: Any) -> str:
    # NaN and infinite losses are written as JSON's non-standard literals, which json reads back exactly.
    return json.dumps(value, separators=(",", ":")) + "\n"


def parse_record(data: bytes, where: str) -> AttemptRecord:
    """Read a stored record. A last line cut short (a write the process did not finish) is ignored; anything else
    that does not parse, or a newer format, raises (the caller reports the record and skips it)."""
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    complete = text.endswith("\n")
    header: dict[str, Any] | None = None
    steps: list[StepDigest] = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            value = json.loads(line)
            if header is None:
                if not isinstance(value, dict) or value.get("record") != _KIND:
                    raise ValueError("the first line is not an attempt record's header")
                _check_format(value.get("format"), where)
                header = dict(value)
            elif isinstance(value, dict):
                header.update(value)
            else:
                steps.append(StepDigest.from_json(value))
        except UnsupportedFormatError:
            raise
        except ValueError as exc:
            if number == len(lines) and not complete:
                break  # the last write was cut short
            raise CheckpointCorruptedError(f"attempt record {where} is damaged at line {number}: {exc}") from None
    if header is None:
        raise CheckpointCorruptedError(f"attempt record {where} is empty")
    try:
        audit = header.get("audit")
        return AttemptRecord(
            attempt=str(header["attempt"]), rank=int(header["rank"]), world_size=int(header["world_size"]),
            started=float(header.get("started", math.nan)), resumed_step=_optional_int(header.get("resumed_step")),
            resumed_from=header.get("resumed_from"), facts=dict(header.get("facts") or {}),
            audit=None if audit is None else AuditResult.from_json(audit), ended=header.get("ended"), steps=steps,
            extra={k: v for k, v in header.items() if k not in _HEADER_FIELDS})
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptedError(f"attempt record {where} has a damaged header ({exc!r})") from None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _check_format(found: Any, where: str) -> None:
    if found == FORMAT:
        return
    if isinstance(found, int) and not isinstance(found, bool) and found > FORMAT:
        raise UnsupportedFormatError(f"attempt record {where} has format {found}, but this lightning_resilient reads"
                                     f" format {FORMAT}: it was written by a newer version (skipped)")
    raise CheckpointCorruptedError(f"attempt record {where} has format {found!r}, which no version wrote")


def read_record(store: Store, attempt: str, rank: int) -> AttemptRecord:
    """Rank ``rank``'s record of ``attempt``; ``FileNotFoundError`` when there is none."""
    rel = record_name(attempt, rank)
    return parse_record(store.read(rel), store.url(rel))


class AttemptLog:
    """Writes one rank's :class:`AttemptRecord` as the attempt goes (see the module docstring for when).

    Every method may be called from the training thread: none raises (a failed write is logged, and the next flush
    writes everything again), and on an object store none waits for a request except :meth:`close`.
    """

    def __init__(self, store: Store, record: AttemptRecord, *, flush_seconds: float,
                 flush_steps: int | None) -> None:
        self.store = store
        self.record = record
        self.rel = record_name(record.attempt, record.rank)
        self.flush_seconds = flush_seconds
        self.flush_steps = flush_steps
        self.local = isinstance(store, LocalStore)
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._unflushed = 0  # steps not yet on the store
        self._dirty = False  # the header changed since the last write
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.writes = 0  # objects (or, on local disk, lines) written: for the tests and the benchmark

    # -- training thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.local:
            self._rewrite_local()
            return
        self._dirty = True  # the header: written with the first steps (or at close)
        self._thread = threading.Thread(target=self._run, name="lightning_resilient-audit", daemon=True)
        self._thread.start()

    def add(self, step: StepDigest) -> None:
        with self._lock:
            self.record.steps.append(step)
            self._unflushed += 1
            due = self.flush_steps is not None and self._unflushed >= self.flush_steps
        if self.local:
            self._append(step.to_json())
        elif due:
            self._wake.set()

    def update(self, **fields: Any) -> None:
        """Set header fields (``audit``, ``ended``): appended on local disk, in the next flush elsewhere."""
        with self._lock:
            self.record = replace(self.record, **fields)
            self._dirty = True
        if self.local:
            changes = {k: (v.to_json() if isinstance(v, AuditResult) else v) for k, v in fields.items()}
            self._append(changes)
        else:
            self._wake.set()

    def prune(self, after: tuple[int, int]) -> None:
        """Forget the steps at or before ``after`` (an (epoch, batch_idx) key): no resume replays them any more."""
        with self._lock:
            kept = [s for s in self.record.steps if s.key > after]
            if len(kept) == len(self.record.steps):
                return
            self.record.steps[:] = kept
        if self.local:
            self._rewrite_local()

    def close(self) -> None:
        """Write what is left and stop the background thread (waits for the last write)."""
        if self._thread is not None:
            self._stopping.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
            self._flush()
        if self._file is not None:
            with suppress(OSError):
                self._file.close()
            self._file = None

    # -- local disk ------------------------------------------------------------------------------------------------
    def _append(self, value: Any) -> None:
        try:
            if self._file is None:
                self._file = open(self.store.path(self.rel), "a", encoding="utf-8")  # noqa: SIM115 (kept open)
            self._file.write(_line(value))
            self._file.flush()  # in the kernel: a SIGKILL of this process loses nothing written
            self.writes += 1
            self._ok()
        except OSError as exc:
            self._failed(exc)

    def _rewrite_local(self) -> None:
        """The whole record, replacing the file atomically (a kill leaves the old one or the new one)."""
        path = self.store.path(self.rel)
        try:
            if self._file is not None:
                self._file.close()
                self._file = None
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with self._lock:
                data = self.record.to_bytes()
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            finally:
                with suppress(FileNotFoundError):
                    os.unlink(tmp)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
            self.writes += 1
            self._ok()
        except OSError as exc:
            self._failed(exc)

    # -- object stores: the background thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.flush_seconds if math.isfinite(self.flush_seconds) else None)
            self._wake.clear()
            if self._stopping.is_set():
                return  # close() writes the rest, from its own thread
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            if not self._unflushed and not self._dirty:
                return
            count, self._unflushed, self._dirty = self._unflushed, 0, False
            data = self.record.to_bytes()
        try:
            self.store.write(self.rel, data)
            self.writes += 1
            self._ok()
        except Exception as exc:  # the audit never stops training: logged, written again next time
            with self._lock:
                self._unflushed += count
                self._dirty = True
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if not self._failing:
            log.warning("the resume audit could not write the attempt record %s (%s); training goes on, and the record"
                        " is written again at the next %s", self.store.url(self.rel), exc,
                        "step" if self.local else "flush")
        self._failing = True

    def _ok(self) -> None:
        if self._failing:
            log.warning("the resume audit writes the attempt record %s again", self.store.url(self.rel))
        self._failing = False


def read_attempts(store: Store, rank: int = 0) -> Iterable[tuple[str, AttemptRecord | Exception]]:
    """Each attempt's record of ``rank``, oldest first, or the error that kept it from being read."""
    for attempt in list_attempts(store):
        try:
            yield attempt, read_record(store, attempt, rank)
        except (CheckpointCorruptedError, UnsupportedFormatError, FileNotFoundError, OSError) as exc:
            yield attempt, exc
