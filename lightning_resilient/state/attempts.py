"""The per-attempt record: what one rank of one attempt of a training run consumed, step by step, kept beside the
checkpoints (``.lightning_resilient/attempts/`` in the checkpoint root), one object per attempt and rank.

An *attempt* is one run of the training command against a root: the first, and each restart after a kill. Its id,
``a<sequence>-<random>``, orders attempts (the sequence is one more than the highest found when it starts; the
random part keeps two jobs started at once apart). Rank ``r``'s record is ``<attempt>.r<r>.jsonl``, JSON lines:

- a header object first: ``format``, ``attempt``, ``rank``, ``world_size``, ``started`` (this host's clock, for
  display), ``resumed_step`` and ``resumed_from`` (None for a fresh start), ``facts`` (batch size, dataset, seed, ...);
- one list per training step (:class:`StepDigest`): ``[epoch, batch_idx, global_step, sample indices digest, input
  digest, loss]``, and, where the sampler says the indices, a seventh item ``[samples, sample set digest]``, and an
  eighth, the digest of a sample of the parameters after the step (both added to format 1 later, the seventh null when
  only the eighth is known; a reader of the first version reads the first six);
- later objects update header fields (the resume audit's ``audit`` result, how the attempt ``ended``, the goodput
  ledger's ``progress`` and ``timings``).

The goodput ledger (``state/ledger.py`` measures, ``state/goodput.py`` reads) keeps its figures in the same record,
as header fields: ``progress`` (:class:`Progress`: the global step reached and this host's clock then, updated at
every optimizer step), ``timings`` (:class:`Timings`: when the fit started, the time to its first training step, the
commit it resumed, step-time medians, the time saves blocked the loop; updated at the first step, at each save and at
the end), ``end`` (how the attempt ended, one of :data:`END_KINDS`, beside the ``ended`` text) and, in rank 0's
record, ``stragglers`` (:class:`StragglerReport`). They were added to format 1 as optional header fields: a reader
that predates them keeps them in ``extra``, and this reader reads a record written before them (all None).

Versioning: a reader refuses a header of a newer ``format`` (:class:`~lightning_resilient.UnsupportedFormatError`)
and a damaged record (:class:`~lightning_resilient.CheckpointCorruptedError`); callers report it and skip the
record, never fail training. Header fields this version does not know are kept (``extra``), so later versions can
add fields without a new format (as the ledger's were); a field of a known name whose value does not parse makes the
record damaged.

Writing (:class:`AttemptLog`): on local disk (or a shared POSIX filesystem) every step (and every progress update) is
appended and flushed, so a SIGKILL loses nothing the step recorded (header updates are folded into the header by a
rewrite once they pile up); on an object store, which cannot append, a background thread rewrites the whole object
at most every ``flush_seconds`` (or ``flush_steps`` steps), never from the training thread, and every step and
progress update is appended to a copy in a node-local spool first (:func:`spool_folder`): a SIGKILL loses none of
them on that node (a restart there reads the spool and ships it to the store, :func:`ship_spooled`), and what a
restart on another node reads loses at most the flush interval. The record keeps only the steps after the second-to-last
save it saw (:meth:`AttemptLog.prune`): what a resume from the latest (or the one before it) replays. A failed write
is logged and retried at the next flush; it never reaches training. :func:`open_logs` lists the records this process
is writing, so that what ends the process from another thread (the hang watchdog) can record why first.

Retention: when an attempt starts, records of attempts older than the :data:`KEEP_ATTEMPTS` newest are deleted
(:func:`drop_old_attempts`). A resume only ever compares against the newest attempt that trained past its
checkpoint, so nothing a resume can use is deleted; the protocol's own retention and ``gc`` never list this folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import IO, Any

from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.io.folders import ATTEMPTS_DIR
from lightning_resilient.io.store import LocalStore, Store

__all__ = ["AttemptLog", "AttemptRecord", "AuditResult", "END_KINDS", "FORMAT", "KEEP_ATTEMPTS", "KEEP_SPOOLED",
           "Progress", "StepDigest", "StragglerReport", "Timings", "drop_old_attempts", "end_kind", "list_attempts",
           "list_records", "new_attempt_id", "open_logs", "parse_record", "read_attempts", "read_record",
           "record_name", "ship_spooled", "spool_folder"]

log = logging.getLogger(__name__)

FORMAT = 1
KEEP_ATTEMPTS = 32  # newest attempts whose records are kept (each a few bytes per step, after pruning)
KEEP_SPOOLED = 4  # newest attempts whose records a node's spool keeps (once shipped, the store has them)
SPOOL_DAYS = 14  # a root's spool folder no attempt wrote for this long is deleted
_ATTEMPT_RE = re.compile(r"^a(\d{6,})-([0-9a-f]{6})$")
_RECORD_RE = re.compile(r"^(a\d{6,}-[0-9a-f]{6})\.r(\d+)\.jsonl$")
_KIND = "lightning_resilient.attempt"


def new_attempt_id(store: Store, spool: str | None = None) -> str:
    """A new attempt's id: one more than the highest sequence under the root's attempts folder (and this node's
    spool of it: an attempt killed before its record reached the store still took its number)."""
    known = [int(m.group(1)) for a in list_attempts(store, spool) if (m := _ATTEMPT_RE.match(a))]
    return f"a{max(known, default=0) + 1:06d}-{uuid.uuid4().hex[:6]}"


def list_attempts(store: Store, spool: str | None = None) -> list[str]:
    """The attempt ids with a record under the root (or in this node's ``spool`` of it), oldest first."""
    return list(list_records(store, spool))


def list_records(store: Store, spool: str | None = None) -> dict[str, list[int]]:
    """Each attempt with a record under the root or in this node's ``spool`` of it (oldest first) and the ranks that
    left one (lowest first)."""
    ranks: dict[str, set[int]] = {}
    for name in [*store.list_dir(ATTEMPTS_DIR), *_spooled(spool)]:
        if match := _RECORD_RE.match(name):
            ranks.setdefault(match.group(1), set()).add(int(match.group(2)))
    return {attempt: sorted(ranks[attempt]) for attempt in sorted(ranks, key=_order)}


# -- the spool: every step's record on node-local disk before the next step ends (object stores) ----------------------
def spool_folder(root_url: str, base: str | None = None, endpoint: str | None = None) -> str:
    """The node-local folder where this node's ranks append the attempt records of the root ``root_url`` when it is on
    an object store: ``<base>/lightning_resilient-<uid>/attempts/<hash of the root URL>`` (``base``: the plugin's
    local tier, else the system's temp folder), private to this user (mode 0700). ``endpoint``: the server the store
    is on, where the URL does not say it (``Store.endpoint``): one URL on two servers (an emulator started again, as
    the demo does, or a staging and a production server) is two roots, whose attempts must not share numbers or
    records.

    An object store cannot append, and a background thread rewrites the record only every ``flush_seconds``: the
    steps after the last save, exactly those a resume replays, would die with a killed process. Appended here as each
    step ends, they survive a SIGKILL; a restart on the same node reads them (:func:`read_record`) and ships them to
    the store (:func:`ship_spooled`), so the audit and the ledger see every finished step. A restart on another node
    reads what reached the store."""
    top = os.path.join(base or tempfile.gettempdir(), f"lightning_resilient-{os.getuid()}")
    # (one server however it was spelled: in the options or the environment, with a trailing slash or capitals)
    key = root_url if not endpoint else f"{root_url} on {endpoint.strip().rstrip('/').lower()}"
    folder = os.path.join(top, "attempts", hashlib.sha256(key.encode()).hexdigest()[:16])
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(top, 0o700)
    _drop_stale_spools(os.path.dirname(folder), keep=folder)
    return folder


def _drop_stale_spools(parent: str, *, keep: str) -> None:
    """Delete the spool folders of roots no attempt on this node wrote for :data:`SPOOL_DAYS` days (their records
    were shipped by the next attempt, or that run is long over)."""
    cutoff = time.time() - SPOOL_DAYS * 86400
    with suppress(OSError):
        for entry in os.scandir(parent):
            if entry.path != keep and entry.is_dir(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry.path, ignore_errors=True)


def _basename(rel: str) -> str:
    return rel.rsplit("/", 1)[-1]


def _spooled(spool: str | None) -> list[str]:
    if spool is None:
        return []
    try:
        return [name for name in os.listdir(spool) if _RECORD_RE.match(name)]
    except OSError:
        return []


def _read_spooled(spool: str | None, attempt: str, rank: int) -> AttemptRecord | None:
    """This node's spooled copy of a record, or None (none here, or it does not parse: the store's copy counts)."""
    if spool is None:
        return None
    path = os.path.join(spool, _basename(record_name(attempt, rank)))
    try:
        with open(path, "rb") as f:
            return parse_record(f.read(), path, attempt=attempt, rank=rank)
    except FileNotFoundError:
        return None
    except Exception as exc:  # damaged: the store's copy (if any) is read instead
        log.warning("the spooled attempt record %s is unreadable (%s); the store's copy is read instead", path, exc)
        return None


def _further(a: AttemptRecord, b: AttemptRecord) -> bool:
    """Whether record ``a`` went further than ``b`` (the same rank of the same attempt): more steps or progress, or an
    end recorded."""
    def reach(r: AttemptRecord) -> tuple[int, int, int]:
        return (r.progress.step if r.progress is not None else -1, len(r.steps), int(r.ended is not None))

    return reach(a) > reach(b)


def ship_spooled(store: Store, spool: str, rank: int, *, keep: str | None = None) -> list[str]:
    """Write to the store each record of ``rank`` in this node's ``spool`` that went further than the store's copy
    (an attempt killed between two flushes), then delete the spooled records of all but the :data:`KEEP_SPOOLED`
    newest attempts (``keep``: the running attempt's is never deleted). Returns the attempts shipped. Never raises:
    what fails is logged and tried again by the next attempt."""
    shipped = []
    names = sorted(_spooled(spool), key=lambda n: _order(_RECORD_RE.match(n).group(1)))  # type: ignore[union-attr]
    for name in names:
        match = _RECORD_RE.match(name)
        assert match is not None
        attempt, of = match.group(1), int(match.group(2))
        if of != rank or attempt == keep:
            continue
        try:
            spooled = _read_spooled(spool, attempt, rank)
            if spooled is None:
                continue
            try:
                stored: AttemptRecord | None = read_record(store, attempt, rank)
            except FileNotFoundError:
                stored = None
            except Exception:  # damaged there: the spooled copy replaces it
                stored = None
            if stored is None or _further(spooled, stored):
                store.write(record_name(attempt, rank), spooled.to_bytes())
                shipped.append(attempt)
        except Exception as exc:
            log.warning("could not ship the spooled attempt record %s to %s (%s); the next attempt tries again",
                        os.path.join(spool, name), store.url(ATTEMPTS_DIR), exc)
    if shipped:
        log.info("shipped the records of attempt(s) %s from this node's spool to %s", ", ".join(shipped),
                 store.url(ATTEMPTS_DIR))
    attempts = sorted({m.group(1) for n in names if (m := _RECORD_RE.match(n))}, key=_order)
    for name in names:
        match = _RECORD_RE.match(name)
        if match and match.group(1) != keep and match.group(1) in attempts[:max(0, len(attempts) - KEEP_SPOOLED)]:
            with suppress(OSError):
                os.unlink(os.path.join(spool, name))
    return shipped


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
    # A digest of a sample of the trainable parameters after the batch (after its optimizer step, if it ended one):
    # catches what changes the update but not the loss (a gradient changed after the backward). None: not taken.
    state: str | None = None

    @property
    def key(self) -> tuple[int, int]:
        """Where in training the step is: (epoch, batch_idx), the same in every attempt of an unchanged run."""
        return self.epoch, self.batch

    def to_json(self) -> list[Any]:
        out: list[Any] = [self.epoch, self.batch, self.step, self.indices, self.data, self.loss]
        if self.samples is not None or self.state is not None:
            out.append(None if self.samples is None else [self.samples[0], self.samples[1]])
        if self.state is not None:
            out.append(self.state)
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
        state = raw[7] if len(raw) > 7 else None  # (added to format 1 later, as samples was)
        if state is not None and not isinstance(state, str):
            raise ValueError(f"a step's state digest is a string or null, got {raw!r:.80}")
        return cls(epoch, batch, step, indices, data, None if loss is None else float(loss),
                   None if samples is None else (samples[0], samples[1]), state)


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


END_KINDS = ("finished", "preempted", "hang", "error", "interrupted")
"""How an attempt ended, where it could tell: ``finished`` (the fit returned), ``preempted`` (a preemption notice:
``PreemptionCheckpoint``'s exit, or Lightning's SIGTERM handling), ``hang`` (the hang watchdog ended the process),
``error`` (an exception ended the fit), ``interrupted`` (Ctrl-C). An attempt killed outright (SIGKILL, a lost node)
records no end."""


def _number(raw: Any, what: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"{what} is a number, got {raw!r:.80}")
    return float(raw)


def _optional_number(raw: Any, what: str) -> float | None:
    return None if raw is None else _number(raw, what)


def _whole(raw: Any, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"{what} is an int, got {raw!r:.80}")
    return raw


def _optional_whole(raw: Any, what: str) -> int | None:
    return None if raw is None else _whole(raw, what)


def _optional_text(raw: Any, what: str) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise ValueError(f"{what} is a string or null, got {raw!r:.80}")
    return raw


@dataclass(frozen=True)
class Progress:
    """How far an attempt got: the global step reached (optimizer steps done) and this host's clock then."""

    step: int
    at: float

    def to_json(self) -> list[Any]:
        return [self.step, self.at]

    @classmethod
    def from_json(cls, raw: Any) -> Progress:
        if not isinstance(raw, list) or len(raw) < 2:
            raise ValueError(f"progress is a list [step, time], got {raw!r:.80}")
        return cls(_whole(raw[0], "progress's step"), _number(raw[1], "progress's time"))


@dataclass(frozen=True)
class Timings:
    """One rank's timings of one attempt (the goodput ledger's figures; see ``state/ledger.py`` for how each is
    measured). Clock times are this host's (``time.time()``); durations are measured with a monotonic clock."""

    fit_started: float | None = None  # when the fit started (the callback's setup): the attempt's start
    first_step: int | None = None  # the global step its first training batch started from
    first_step_at: float | None = None  # when that batch started: the end of startup (and, resumed, of the restore)
    restore_seconds: float | None = None  # from the fit's start to its first training batch
    load_seconds: float | None = None  # of which: the checkpoint plugin's load (AtomicCheckpointIO), when it loaded
    resumed_commit: str | None = None  # the commit folder the plugin loaded (None: a fresh start, or another plugin)
    resumed_tier: str | None = None  # "local" or "durable" with a local tier
    steps: int = 0  # optimizer steps this attempt completed
    step_seconds: float | None = None  # median optimizer step, recent steps, saves and validation excluded
    own_seconds: float | None = None  # median time of a batch's own work: its fetch and forward (see ledger.py)
    save_seconds: float = 0.0  # time trainer.save_checkpoint blocked the training loop, in all
    saves: int = 0  # checkpoints taken (the saves of one global step together)
    checkpoints: tuple[tuple[int, float, float], ...] = ()  # the newest: (global step, clock at the end, blocked s)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "checkpoints"}
        out["checkpoints"] = [list(c) for c in self.checkpoints]
        return out

    @classmethod
    def from_json(cls, raw: Any) -> Timings:
        """The known fields (a later version's others are ignored); a known field of the wrong type raises."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"timings is an object, got {raw!r:.80}")
        checkpoints = raw.get("checkpoints") or []
        if not isinstance(checkpoints, list) or not all(isinstance(c, list) and len(c) >= 3 for c in checkpoints):
            raise ValueError(f"timings' checkpoints are [step, time, seconds] lists, got {checkpoints!r:.80}")
        return cls(
            fit_started=_optional_number(raw.get("fit_started"), "fit_started"),
            first_step=_optional_whole(raw.get("first_step"), "first_step"),
            first_step_at=_optional_number(raw.get("first_step_at"), "first_step_at"),
            restore_seconds=_optional_number(raw.get("restore_seconds"), "restore_seconds"),
            load_seconds=_optional_number(raw.get("load_seconds"), "load_seconds"),
            resumed_commit=_optional_text(raw.get("resumed_commit"), "resumed_commit"),
            resumed_tier=_optional_text(raw.get("resumed_tier"), "resumed_tier"),
            steps=_whole(raw.get("steps", 0), "steps"),
            step_seconds=_optional_number(raw.get("step_seconds"), "step_seconds"),
            own_seconds=_optional_number(raw.get("own_seconds"), "own_seconds"),
            save_seconds=_number(raw.get("save_seconds", 0.0), "save_seconds"),
            saves=_whole(raw.get("saves", 0), "saves"),
            checkpoints=tuple((_whole(c[0], "a checkpoint's step"), _number(c[1], "a checkpoint's time"),
                               _number(c[2], "a checkpoint's seconds")) for c in checkpoints))


@dataclass(frozen=True)
class StragglerReport:
    """One rank consistently slower than the others, as found at a save: the median time of its batches' own work
    (fetch and forward, before the first gradient collective) against the median of the other ranks' medians."""

    step: int  # the global step of the save where it was found
    rank: int
    seconds: float  # the rank's median
    others: float  # the median of the other ranks' medians
    batches: int | None = None  # batches the rank's median is taken over

    @property
    def factor(self) -> float:
        return self.seconds / self.others if self.others > 0 else math.inf

    def describe(self) -> str:
        over = f" over its last {self.batches} batches" if self.batches else ""
        return (f"rank {self.rank} is {self.factor:.1f}x slower than the others at step {self.step}: its batches' own"
                f" work (fetch and forward) takes {self.seconds * 1000:.1f} ms (median{over}), the other ranks'"
                f" {self.others * 1000:.1f} ms")

    def to_json(self) -> list[Any]:
        return [self.step, self.rank, self.seconds, self.others, self.batches]

    @classmethod
    def from_json(cls, raw: Any) -> StragglerReport:
        if not isinstance(raw, list) or len(raw) < 4:
            raise ValueError(f"a straggler report is [step, rank, seconds, others, batches], got {raw!r:.80}")
        return cls(_whole(raw[0], "a straggler's step"), _whole(raw[1], "a straggler's rank"),
                   _number(raw[2], "a straggler's seconds"), _number(raw[3], "a straggler's others"),
                   _optional_whole(raw[4] if len(raw) > 4 else None, "a straggler's batches"))


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
    # The goodput ledger's fields (see the module docstring); None or empty in a record written before them.
    progress: Progress | None = None
    timings: Timings | None = None
    end: str | None = None  # one of END_KINDS, beside the ``ended`` text; None: killed, running, or an older record
    stragglers: list[StragglerReport] = field(default_factory=list)
    # The incarnation of the root the attempt trained in (its pointer's ``root_id``): a record copied from another
    # root (or from before the root was deleted and written again) names another, and the audit ignores it.
    root_id: str | None = None

    def header(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.extra, "record": _KIND, "format": FORMAT, "attempt": self.attempt, "rank": self.rank,
            "world_size": self.world_size, "started": self.started, "resumed_step": self.resumed_step,
            "resumed_from": self.resumed_from, "facts": self.facts}
        if self.audit is not None:
            out["audit"] = self.audit.to_json()
        if self.ended is not None:
            out["ended"] = self.ended
        for name in ("progress", "timings", "end"):
            value = getattr(self, name)
            if value is not None:
                out[name] = _json(value)
        if self.stragglers:
            out["stragglers"] = _json(self.stragglers)
        if self.root_id is not None:
            out["root_id"] = self.root_id
        return out

    def to_bytes(self) -> bytes:
        lines = [_line(self.header()), *(_line(s.to_json()) for s in self.steps)]
        return "".join(lines).encode()

    @property
    def last_step(self) -> StepDigest | None:
        return self.steps[-1] if self.steps else None


_HEADER_FIELDS = {"record", "format", "attempt", "rank", "world_size", "started", "resumed_step", "resumed_from",
                  "facts", "audit", "ended", "progress", "timings", "end", "stragglers", "root_id"}


def end_kind(record: AttemptRecord) -> str | None:
    """How the attempt ended (one of :data:`END_KINDS`), read from ``end``, or from the ``ended`` text of a record
    written before ``end`` existed; None: it recorded no end (killed, or still running)."""
    if record.end is not None:
        return record.end
    text = record.ended
    if text is None:
        return None
    if text == "finished":
        return "finished"
    if "PreemptedExit" in text or "SIGTERMException" in text:
        return "preempted"
    return "interrupted" if "KeyboardInterrupt" in text else "error"


def _json(value: Any) -> Any:
    """A header value as JSON: the typed parts by their ``to_json``."""
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    to_json = getattr(value, "to_json", None)
    return to_json() if callable(to_json) else value


def _line(value: Any) -> str:
    # NaN and infinite losses are written as JSON's non-standard literals, which json reads back exactly.
    return json.dumps(value, separators=(",", ":")) + "\n"


def parse_record(data: bytes, where: str, *, attempt: str | None = None, rank: int | None = None) -> AttemptRecord:
    """Read a stored record. A last line cut short (a write the process did not finish) is ignored; anything else
    that does not parse, or a newer format, raises (the caller reports the record and skips it).

    Nothing a record says is taken unchecked: a damaged record, or one someone else wrote, must not move the goodput
    ledger's figures nor print as something it is not. Its header fields must be what a writer writes
    (:func:`_check_header`), and ``attempt`` and ``rank``, where the caller knows them (the record's name), what its
    header says; a later line may update only the fields that are updated by design, never one that says what the
    record is (:data:`_IDENTITY`); a step's numbers are counts."""
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
                _check_update(header, value, where, number)
                header.update(value)
            else:
                steps.append(_checked_step(StepDigest.from_json(value)))
        except UnsupportedFormatError:
            raise
        except (ValueError, RecursionError) as exc:  # (RecursionError: JSON nested deeper than any writer nests it)
            if number == len(lines) and not complete:
                break  # the last write was cut short
            raise CheckpointCorruptedError(f"attempt record {where} is damaged at line {number}: {exc}") from None
    if header is None:
        raise CheckpointCorruptedError(f"attempt record {where} is empty")
    try:
        audit = header.get("audit")
        progress, timings, end = header.get("progress"), header.get("timings"), header.get("end")
        stragglers = header.get("stragglers") or []
        if not isinstance(stragglers, list):
            raise ValueError(f"stragglers is a list, got {stragglers!r:.80}")
        if end is not None and not isinstance(end, str):  # (a later version's kind of end is kept as it is)
            raise ValueError(f"end is a string, got {end!r:.80}")
        _check_header(header, steps, attempt=attempt, rank=rank)
        return AttemptRecord(
            attempt=str(header["attempt"]), rank=int(header["rank"]), world_size=int(header["world_size"]),
            started=float(header.get("started", math.nan)), resumed_step=_optional_int(header.get("resumed_step")),
            resumed_from=header.get("resumed_from"), facts=dict(header.get("facts") or {}),
            audit=None if audit is None else AuditResult.from_json(audit), ended=header.get("ended"), steps=steps,
            extra={k: v for k, v in header.items() if k not in _HEADER_FIELDS},
            progress=None if progress is None else Progress.from_json(progress),
            timings=None if timings is None else Timings.from_json(timings), end=end,
            stragglers=[StragglerReport.from_json(r) for r in stragglers],
            root_id=_optional_text(header.get("root_id"), "root_id"))
    except (KeyError, TypeError, ValueError) as exc:
        detail = str(exc) if type(exc) is ValueError else repr(exc)  # (the checks' messages name the field)
        raise CheckpointCorruptedError(f"attempt record {where} has a damaged header ({detail})") from None


_IDENTITY = ("record", "format", "attempt", "rank", "world_size", "started", "resumed_step", "resumed_from", "facts")
"""The header fields that say what a record is, written once in its header: a later line that changes one makes the
record damaged. Later lines update the others (``audit``, ``ended``, ``progress``, ``timings``, ``end``,
``stragglers``, a later version's fields) and set ``root_id`` once (:data:`_SET_ONCE`)."""
_SET_ONCE = ("root_id",)  # learned after the header was written: a later line may set it where unset, never change it


def _check_update(header: Mapping[str, Any], update: Mapping[str, Any], where: str, number: int) -> None:
    """A later line of a record (``update``, at line ``number``) changes none of its :data:`_IDENTITY` fields."""
    for name in (*_IDENTITY, *_SET_ONCE):
        if name not in update or update[name] == header.get(name):
            continue
        if name in _SET_ONCE and header.get(name) is None:
            continue
        raise CheckpointCorruptedError(
            f"attempt record {where} is damaged at line {number}: it changes {name} ({header.get(name)!r:.80} in the"
            f" header, {update[name]!r:.80} there), which no writer changes after the header")


def _count(raw: Any, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise ValueError(f"{what} is an int >= 0, got {raw!r:.80}")
    return raw


def _checked_step(step: StepDigest) -> StepDigest:
    """``step``, whose epoch, batch_idx, global step and sample count are counts (ValueError naming the one that is
    not)."""
    counts = {"epoch": step.epoch, "batch_idx": step.batch, "global step": step.step,
              "sample count": None if step.samples is None else step.samples[0]}
    for what, n in counts.items():
        if n is not None and n < 0:
            raise ValueError(f"a step's {what} is an int >= 0, got {n} in {step.to_json()!r:.80}")
    return step


def _plain(value: Any) -> bool:
    """Whether ``value`` is a plain JSON value: null, true or false, a finite number or a string."""
    return value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))


def _check_header(header: Mapping[str, Any], steps: list[StepDigest], *, attempt: str | None,
                  rank: int | None) -> None:
    """The header's fields as a writer writes them (ValueError naming the field): an attempt id (the record's own,
    where ``attempt`` says it), ``rank`` (``rank``'s, where given) below ``world_size``, a finite ``started``, a
    ``resumed_step`` that is a count no later than what the record itself reached (its first step, its progress,
    the first step its timings timed: an attempt trains from the step it resumed), texts where texts go, and facts
    of plain values."""
    name = header.get("attempt")
    if not isinstance(name, str) or not _ATTEMPT_RE.fullmatch(name):
        raise ValueError(f"attempt is an attempt id (a<sequence>-<6 hex digits>), got {name!r:.80}")
    if attempt is not None and name != attempt:
        raise ValueError(f"attempt is {name!r}, but the record is {attempt}'s (copied or renamed)")
    own, world = _count(header.get("rank"), "rank"), _count(header.get("world_size"), "world_size")
    if own >= world:
        raise ValueError(f"rank {own} is not below world_size {world}")
    if rank is not None and own != rank:
        raise ValueError(f"rank is {own}, but the record is rank {rank}'s (copied or renamed)")
    started = header.get("started")
    if isinstance(started, bool) or not isinstance(started, (int, float)) or not math.isfinite(started):
        raise ValueError(f"started is a finite number (a clock time), got {started!r:.80}")
    _optional_text(header.get("resumed_from"), "resumed_from")
    _optional_text(header.get("ended"), "ended")
    facts = header.get("facts")
    if facts is not None and not (isinstance(facts, dict) and all(_plain(v) for v in facts.values())):
        raise ValueError(f"facts is an object of plain values (null, true/false, finite numbers, strings), got"
                         f" {facts!r:.80}")
    resumed = header.get("resumed_step")
    if resumed is None:
        return
    resumed = _count(resumed, "resumed_step")
    progress, timings = header.get("progress"), header.get("timings")
    reached = (("its first recorded step", steps[0].step if steps else None),
               ("its progress", None if progress is None else Progress.from_json(progress).step),
               ("the first step timed in its timings",
                None if timings is None else Timings.from_json(timings).first_step))
    for what, step in reached:
        if step is not None and resumed > step:
            raise ValueError(f"resumed_step {resumed} is past {what}, global step {step}: an attempt trains from the"
                             " step it resumed")


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _check_format(found: Any, where: str) -> None:
    if found == FORMAT:
        return
    if isinstance(found, int) and not isinstance(found, bool) and found > FORMAT:
        raise UnsupportedFormatError(f"attempt record {where} has format {found}, but this lightning_resilient reads"
                                     f" format {FORMAT}: it was written by a newer version (skipped)")
    raise CheckpointCorruptedError(f"attempt record {where} has format {found!r}, which no version wrote")


def read_record(store: Store, attempt: str, rank: int, spool: str | None = None) -> AttemptRecord:
    """Rank ``rank``'s record of ``attempt``: this node's spooled copy when it went further than the store's (see
    :func:`spool_folder`), else the store's; ``FileNotFoundError`` when there is none."""
    spooled = _read_spooled(spool, attempt, rank)
    rel = record_name(attempt, rank)
    try:
        stored = parse_record(store.read(rel), store.url(rel), attempt=attempt, rank=rank)
    except FileNotFoundError:
        if spooled is None:
            raise
        return spooled
    except Exception:
        if spooled is None:
            raise
        return spooled
    return spooled if spooled is not None and _further(spooled, stored) else stored


_OPEN: weakref.WeakSet[AttemptLog] = weakref.WeakSet()  # the logs of this process between start() and close()
_COMPACT_AFTER = 512  # header updates appended on local disk before the file is rewritten with them folded in


CLOSE_SECONDS = 30.0
"""The longest :meth:`AttemptLog.close` waits for the record's last write to an object store."""


def open_logs() -> list[AttemptLog]:
    """The attempt records this process is writing (started, not closed yet)."""
    return list(_OPEN)


class AttemptLog:
    """Writes one rank's :class:`AttemptRecord` as the attempt goes (see the module docstring for when).

    Every method may be called from the training thread: none raises (a failed write is logged, and the next flush
    writes everything again), and on an object store none waits for a request except :meth:`close`.
    """

    def __init__(self, store: Store, record: AttemptRecord, *, flush_seconds: float,
                 flush_steps: int | None, spool: str | None = None) -> None:
        self.store = store
        self.record = record
        self.rel = record_name(record.attempt, record.rank)
        self.flush_seconds = flush_seconds
        self.flush_steps = flush_steps
        self.local = isinstance(store, LocalStore)
        # The file every step is appended to as it ends: the record itself on local disk, else the spool's copy (a
        # node-local folder, see spool_folder) that the background thread ships to the store.
        self.spool = None if self.local else spool
        self.path: str | None = (store.path(self.rel) if self.local else
                                 None if spool is None else os.path.join(spool, _basename(self.rel)))
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._unflushed = 0  # steps not yet on the store
        self._dirty = False  # the header changed since the last write
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._progressed = 0  # progress updates not yet on the store (an object store's flush_steps counts them too)
        self._appended_updates = 0  # header updates appended on local disk since the file was last rewritten
        self.writes = 0  # objects (or, on local disk, lines) written: for the tests and the benchmark

    # -- training thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        _OPEN.add(self)
        if self.path is not None:
            self._rewrite_local()
        if self.local:
            return
        self._dirty = True  # the header: written with the first steps (or at close)
        self._thread = threading.Thread(target=self._run, name="lightning_resilient-audit", daemon=True)
        self._thread.start()

    def add(self, step: StepDigest) -> None:
        with self._lock:
            self.record.steps.append(step)
            self._unflushed += 1
            due = self.flush_steps is not None and self._unflushed >= self.flush_steps
        if self.path is not None:
            self._append(step.to_json())
        if not self.local and due:
            self._wake.set()

    def update(self, **fields: Any) -> None:
        """Set header fields (``audit``, ``ended``, the ledger's): appended on local disk, in the next flush
        elsewhere."""
        with self._lock:
            self.record = replace(self.record, **fields)
            self._dirty = True
        if self.path is not None:
            self._append_update({k: _json(v) for k, v in fields.items()})
        if not self.local:
            self._wake.set()

    def progress(self, progress: Progress) -> None:
        """The global step reached, at every optimizer step: appended on local disk (a SIGKILL loses none), kept
        for the next flush elsewhere (``flush_steps`` counts these updates as it counts steps)."""
        with self._lock:
            self.record.progress = progress
            self._dirty = True
            self._progressed += 1
            due = self.flush_steps is not None and self._progressed >= self.flush_steps
        if self.path is not None:
            self._append_update({"progress": progress.to_json()})
        if not self.local and due:
            self._wake.set()

    def _append_update(self, changes: dict[str, Any]) -> None:
        self._appended_updates += 1
        if self._appended_updates >= _COMPACT_AFTER:  # fold the updates into the header: the file stays small
            self._rewrite_local()
        else:
            self._append(changes)

    def prune(self, after: tuple[int, int]) -> None:
        """Forget the steps at or before ``after`` (an (epoch, batch_idx) key): no resume replays them any more."""
        with self._lock:
            kept = [s for s in self.record.steps if s.key > after]
            if len(kept) == len(self.record.steps):
                return
            self.record.steps[:] = kept
        if self.path is not None:
            self._rewrite_local()

    def close(self) -> None:
        """Write what is left and stop the background thread: waits for the last write, at most
        :data:`CLOSE_SECONDS` (a store that does not answer keeps what reached it before; a warning says so)."""
        _OPEN.discard(self)
        if self._thread is not None:
            self._stopping.set()
            self._wake.set()
            thread, self._thread = self._thread, None

            def last_write() -> None:
                thread.join()
                self._flush()

            # In a thread of its own (a daemon): the end of a fit never waits on a store that stopped answering.
            final = threading.Thread(target=last_write, name="lightning_resilient-audit-close", daemon=True)
            final.start()
            final.join(CLOSE_SECONDS)
            if final.is_alive():
                log.warning("the attempt record %s was not written within %g s (the store does not answer); it keeps"
                            " what reached the store before", self.store.url(self.rel), CLOSE_SECONDS)
        if self._file is not None:
            with suppress(OSError):
                self._file.close()
            self._file = None

    # -- local disk ------------------------------------------------------------------------------------------------
    def _append(self, value: Any) -> None:
        assert self.path is not None
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
            self._file.write(_line(value))
            self._file.flush()  # in the kernel: a SIGKILL of this process loses nothing written
            self.writes += self.local  # (the spool's lines are not writes to the store)
            self._ok()
        except OSError as exc:
            self._failed(exc)

    def _rewrite_local(self) -> None:
        """The whole record, replacing the file atomically (a kill leaves the old one or the new one)."""
        path = self.path
        assert path is not None
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
            self._appended_updates = 0
            self.writes += self.local
            self._ok()
        except OSError as exc:
            self._failed(exc)

    # -- object stores: the background thread ----------------------------------------------------------------------
    def _run(self) -> None:
        if self.spool is not None:
            ship_spooled(self.store, self.spool, self.record.rank, keep=self.record.attempt)
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
            progressed, self._progressed = self._progressed, 0
            data = self.record.to_bytes()
        try:
            self.store.write(self.rel, data)
            self.writes += 1
            self._ok()
        except Exception as exc:  # the audit never stops training: logged, written again next time
            with self._lock:
                self._unflushed += count
                self._progressed += progressed
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
