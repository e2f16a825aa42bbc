"""Tiered checkpoints: every save commits to a node-local root, every Nth is persisted to the durable root behind it.

The local tier is an ordinary checkpoint root (same objects, manifest, pointer and verification) at
``<local_tier>/<name>-<hash of the durable URL>``, written as the *durable* root's writer epoch: the job claims the
durable root first (which fences older jobs there), then *adopts* that epoch and lineage in its local root. A commit
therefore has one name (``<name>/c<time>-e<epoch>-<id>``) and one place in the lineage in both tiers.

Persisting copies a committed local checkpoint's objects (each verified against the manifest on the way) into the
same folder of the durable root, then publishes the very manifest there through the durable protocol: checked,
manifest last, conditional pointer move fenced by the writer epoch. The durable pointer so only ever names
checkpoints complete in the durable tier, a kill during a persist leaves it on the previous durable checkpoint (the
half-copied folder is garbage of this epoch, collected once a later job has claimed), and a fenced job keeps writing
its local tier but gets :class:`~lightning_resilient.StaleWriterError` from its next persist and its next save.
While a persist copies a folder, the local pointer holds it so local retention cannot delete it.

Resume reads both tiers (:class:`TierView`): the durable pointer gives the lineage (the authority: a local
checkpoint outside it belongs to a job that was fenced or a branch that was abandoned, and is never loaded), and
the candidates are the durable lineage's checkpoints plus the local ones inside it, newest first by (writer epoch,
step). Each is read from the local tier when it holds it and it verifies, else from the durable tier, else the next
older candidate. An empty local tier (a new node) therefore resumes from the durable tier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_resilient._checks import check_int, check_number, check_optional_int
from lightning_resilient._warnings import warn
from lightning_resilient.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    PersistFailedError,
    SettingTypeError,
    StaleWriterError,
)
from lightning_resilient.io import layout, paths
from lightning_resilient.io._lanes import map_in_lanes
from lightning_resilient.io.async_save import raise_from_background
from lightning_resilient.io.catalog import NOT_FOUND, Together
from lightning_resilient.io.folders import TIER_RECORD, writer_epoch_of
from lightning_resilient.io.lineage import Lineage, Origin
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest, chunk_digests
from lightning_resilient.io.pointer import Entry, Pointer
from lightning_resilient.io.retry import is_transient
from lightning_resilient.io.root import CheckpointRoot, Loaded, Prepared

__all__ = ["Claim", "PERSIST_STATUS", "TIER_RECORD", "TierSettings", "TierView", "TieredResolved", "TieredRoot",
           "adopt_claim", "durable_of", "find_latest_tiered", "load_tiered", "local_tier_url", "read_status",
           "resolve_tiered", "retarget", "save_key", "set_aside_if_foreign", "split_tiered", "write_status"]

log = logging.getLogger(__name__)

_PERSISTING = "being persisted to the durable tier"


def local_tier_url(local_tier: str, durable_url: str) -> str:
    """The node-local root that holds the local tier of ``durable_url`` under the folder ``local_tier``."""
    if paths.split_protocol(durable_url)[0] in (None, "file", "local"):
        # One local tier per physical folder, as one root per physical folder (a dirpath reached by a symlink).
        durable_url = os.path.realpath(durable_url.split("://", 1)[-1])
    tail = re.sub(r"[^A-Za-z0-9._=-]+", "_", durable_url.split("://", 1)[-1].strip("/"))[-48:].strip("_") or "root"
    digest = hashlib.sha256(durable_url.encode()).hexdigest()[:12]
    return os.path.join(os.path.realpath(os.path.expanduser(local_tier)), f"{tail}-{digest}")


def is_local_tier_url(local_tier: str, url: str) -> bool:
    """Whether ``url`` has the form of a local tier root under the folder ``local_tier`` (see local_tier_url)."""
    return os.path.dirname(url) == local_tier and re.search(r"-[0-9a-f]{12}$", os.path.basename(url)) is not None


def tier_record(local_root: CheckpointRoot) -> dict[str, str] | None:
    """The local tier root's record: ``durable`` (the URL) and ``root_id`` (the incarnation of that root whose
    lineage it holds); None if it has none."""
    try:
        raw = json.loads(local_root.store.read(TIER_RECORD))
        return {"durable": str(raw["durable"]), "root_id": str(raw.get("root_id", ""))}
    except (FileNotFoundError, KeyError, ValueError, TypeError):
        return None


def durable_of(local_root: CheckpointRoot) -> str | None:
    """The durable root URL a local tier root belongs to (its tier record), or None if it is no local tier."""
    record = tier_record(local_root)
    return record["durable"] if record is not None else None


def save_key(entry: Entry) -> tuple[int, int] | str:
    """What makes two saves one training state: (writer epoch, step), as retention counts them; a save without a
    step (a Fabric or hand-made state) is a state of its own."""
    return (entry.writer_epoch, entry.step) if entry.step > 0 else entry.commit


# -- writing -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TierSettings:
    """``AtomicCheckpointIO(local_tier=..., persist_every=..., local_keep=..., replicas=..., max_persist_failures=...,
    max_seconds_without_durable=...)``, checked when made."""

    local_tier: str | None  # a node-local folder, absolute with symlinks resolved (see given()); None: no local tier
    persist_every: int = 1
    local_keep: int = 2
    replicas: int | None = None  # None: 2 on several nodes, 1 (none) on one (see resolved_replicas)
    max_persist_failures: int | None = 5
    max_seconds_without_durable: float | None = None

    @classmethod
    def given(cls, local_tier: Any, persist_every: Any, local_keep: Any, replicas: Any = None,
              max_persist_failures: Any = 5, max_seconds_without_durable: Any = None) -> TierSettings:
        """The settings as a user gives them: ``local_tier`` a path or ``os.PathLike`` (checked, made absolute)."""
        return cls(_check_local_tier(local_tier), persist_every, local_keep, replicas, max_persist_failures,
                   max_seconds_without_durable)

    def __post_init__(self) -> None:
        # Frozen: the checked values (plain ints) are set once, here.
        object.__setattr__(self, "persist_every", check_int("persist_every", self.persist_every, minimum=1,
                                                            typed=False, hint="persist every N-th saved step"))
        object.__setattr__(self, "local_keep", check_int("local_keep", self.local_keep, minimum=1, typed=False,
                                                         hint="checkpoints kept in the local tier"))
        object.__setattr__(self, "replicas", check_optional_int(
            "replicas", self.replicas, minimum=1, none_means="2 on several nodes, 1 on one", typed=False))
        object.__setattr__(self, "max_persist_failures", check_optional_int(
            "max_persist_failures", self.max_persist_failures, minimum=1, none_means="never stop for failed persists",
            typed=False))
        if self.max_seconds_without_durable is not None:
            object.__setattr__(self, "max_seconds_without_durable", check_number(
                "max_seconds_without_durable", self.max_seconds_without_durable, above=0,
                hint="seconds without a durable commit while persists fail; None: no limit"))
        if self.local_tier is None:
            given = [f"{name}={value}" for name, value, default in (
                ("persist_every", self.persist_every, 1), ("replicas", self.replicas, None)) if value != default]
            if given:
                raise ValueError(f"{given[0]} needs local_tier: without a local tier every save goes to the durable"
                                 " root. Pass local_tier='/local/nvme/ckpt' (a node-local folder).")

    def resolved_replicas(self, nodes: int) -> int:
        """How many nodes hold each local commit (a sharded commit's part) in a job on ``nodes`` nodes: ``replicas``
        (at most ``nodes``), by default 2 on several nodes."""
        wanted = self.replicas if self.replicas is not None else (2 if nodes > 1 else 1)
        return max(1, min(wanted, nodes))


def _check_local_tier(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)):
        raise SettingTypeError(f"local_tier must be a node-local folder path or None, got {value!r}")
    path = str(os.fspath(value))
    protocol = paths.split_protocol(path)[0]
    if protocol not in (None, "file", "local"):
        raise ValueError(f"local_tier must be a node-local folder (local NVMe, /dev/shm), not a {protocol}:// URL"
                         f" ({path!r}): the durable tier is the ModelCheckpoint dirpath")
    if protocol is not None:
        path = path.split("://", 1)[1]
    return os.path.realpath(os.path.expanduser(path))


class TieredRoot:
    """The save side of one durable root and its local tier, for one plugin (see the module docstring).

    Quacks like :class:`~lightning_resilient.io.root.CheckpointRoot` where saves use one (``prepare``, ``commit``,
    ``save``, ``remove``), so the synchronous and the async save paths take it unchanged.

    A persist that fails (the store is down) never stops training by itself: it is reported (a warning, and the
    status ``ls --local-tier`` shows), and retried with backoff at the next saves (the newest state: an older one is
    never worth more) until one succeeds. Only past a bound (``max_persist_failures`` failures in a row, or
    ``max_seconds_without_durable`` since the last durable commit) does the next save raise
    :class:`~lightning_resilient.PersistFailedError`, after committing locally. A fenced job
    (:class:`~lightning_resilient.StaleWriterError`) is stopped at its next save, whatever the bounds.
    """

    def __init__(self, durable: CheckpointRoot, local: CheckpointRoot, *, persist_every: int,
                 executor: Callable[[], Executor], max_persist_failures: int | None = None,
                 max_seconds_without_durable: float | None = None, retry_delay: float = 10.0) -> None:
        self.durable = durable
        self.local = local
        # Lightning names the local commits by the durable folder: what a save's ModelCheckpoints report is read
        # against it, and a persist carries it there.
        local.writer.folder_url = durable.writer.folder_url
        self.persist_every = persist_every
        self.max_persist_failures = max_persist_failures
        self.max_seconds_without_durable = max_seconds_without_durable
        self.retry_delay = retry_delay  # the first backoff after a failed persist; doubles per failure in a row
        self._executor = executor
        self._lock = threading.Lock()
        self._jobs: deque[tuple[Callable[[], None], str]] = deque()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # fatal: raised by the next save (a fenced job, a bound passed)
        self._saves = 0  # distinct training states saved by this writer (a top-k save and save_last count once)
        self._last: tuple[int, int] | str | None = None  # the save key of the last one
        self._persisting_state = False
        self._latest: list[Entry] = []  # this writer's local commits of its newest state, in save order
        self._persisted: set[str] = set()  # commits that are in the durable tier
        self._pending: set[str] = set()  # commits queued for a persist that has not finished
        self._newest_key: tuple[int, int] | str | None = None  # the save key of the newest persist queued
        self._held: dict[str, int] = {}  # local folders held (persists, replication), with how many holds each
        # Failed persists in a row, the last one's error, since when they fail, when the next retry is due, and when
        # this writer last had a checkpoint made durable (or first asked for one).
        self._failures = 0
        self._failure: BaseException | None = None
        self._failing_since: float | None = None
        self._retry_at = 0.0
        self._durable_at: float | None = None
        #: Called with every local commit, once committed (replication to other nodes: ``io/replicas.py``).
        self.on_commit: Callable[[Entry], None] | None = None
        #: Copies a manifest's objects into the durable root and returns the manifest to publish there, or None to
        #: leave it to this node (a sharded commit written across nodes is copied by every node: io/replicas.py).
        self.copier: Callable[[Manifest], Manifest | None] | None = None
        self._claim_made: Claim | None = None
        # The durable catalog's names as this writer last read or wrote them (None: not read yet), so that
        # ModelCheckpoint's "does this name exist" never waits for a store that may be down (:meth:`knows`).
        self._durable_names: set[str] | None = None
        # Lightning's removals of names from the durable tier that the store did not take (an outage), in order:
        # run after the next persist that succeeds (one of the same name supersedes its removal).
        self._deferred: list[str] = []
        self._unreachable = False  # the durable store failed the last request this writer sent it (cleared on success)
        self._progress_at = time.monotonic()  # when the durable work last moved (see wait's stall)
        # The persists persist_latest asked for (tried whatever the backoff), when, and when one of them last failed.
        self._asked: set[str] = set()
        self._asked_at: float | None = None
        self._asked_failed_at = float("-inf")

    # What saves and logs need of a root.
    @property
    def url(self) -> str:
        return self.durable.url

    @property
    def store(self) -> Any:
        return self.durable.store

    def claim(self) -> Claim:
        """Claim the durable root (if this writer has not yet: that fences older jobs) and write the local tier as
        the claimed writer epoch, with the durable lineage; returns the claim (what another node's local tier
        adopts: ``adopt_claim``)."""
        self.durable.claim_once()
        origin = self.durable.origin
        assert self.durable.writer_epoch is not None and origin is not None
        claim = self._claim_made
        if claim is None or claim.writer_epoch != self.durable.writer_epoch:
            pointer, _ = self.durable.read_pointer()
            if pointer is not None:
                # A job fenced before its first save (a newer claim, or the root deleted and written again since
                # its claim) never adopts the local tier: its epoch would take it over from the job writing now.
                self.durable.fence.check_current(pointer)
            # The incarnation this writer claimed (a pointer rebuilt since may carry none).
            root_id = self.durable.fence.root_id or (pointer.root_id if pointer is not None else "")
            claim = Claim(self.durable.url, self.durable.writer_epoch, origin,
                          dict(pointer.origins) if pointer else {}, root_id)
            self._claim_made = claim
            with self._lock:
                self._durable_names = set(pointer.checkpoints) if pointer is not None else set()
        if self.local.writer_epoch != claim.writer_epoch:
            adopt_claim(self.local, claim)
            if origin.here and not self.durable.store.exists(f"{origin.commit}/{MANIFEST_NAME}"):
                # Resumed from a checkpoint only this node holds: the durable tier is behind by saves of earlier
                # jobs, and a process that just failed may fail again before its N-th save. Its first save is
                # persisted, so every restart moves the durable tier forward.
                with self._lock:
                    self._saves = self.persist_every - 1
        return claim

    def prepare(self, checkpoint: dict[str, Any], name: str, snapshot: layout.Snapshot | None = None,
                before_fill: Callable[[], None] | None = None, *, reported: list[str] | None = None) -> Prepared:
        return self.local.prepare(checkpoint, name, snapshot, before_fill, reported=reported)

    def save(self, checkpoint: dict[str, Any], name: str, *, reported: list[str] | None = None) -> Entry:
        return self.commit(self.prepare(checkpoint, name, reported=reported))

    def commit(self, prepared: Prepared) -> Entry:
        """Commit to the local tier (the save is done then), and queue the persist of every Nth saved state. A
        fatal error of an earlier persist is raised after this save is committed locally (an emergency save is
        never lost to an earlier persist's failure)."""
        self.claim()
        return self.committed(self.local.commit(prepared))

    def committed(self, entry: Entry) -> Entry:
        """``entry`` is committed to the local tier (by :meth:`commit`, or by a sharded save, whose every rank
        wrote its part): count it, queue its persist when it is due (or a retry of a failed one, when its backoff
        has passed), hand it to :attr:`on_commit`; then raise a fatal error of an earlier persist."""
        with self._lock:
            key = save_key(entry)
            if key != self._last:
                self._last = key
                self._saves += 1
                self._persisting_state = self._saves % self.persist_every == 0
                self._latest = []
            self._latest.append(entry)
            retry = self._failures > 0 and time.monotonic() >= self._retry_at
            persist = self._persisting_state or retry
            if self._durable_at is None:
                self._durable_at = time.time()  # the clock of max_seconds_without_durable starts with the first save
        if persist:
            if retry and not self._persisting_state:
                log.info("retrying the persist to %s with the newest state (step %d)", self.durable.url, entry.step)
            self._enqueue(entry)
        if self.on_commit is not None:
            self.on_commit(entry)
        self._check_bounds()
        self.raise_error()
        return entry

    def remove(self, name: str) -> None:
        """Lightning's removal of a checkpoint name: from the local tier now, from the durable tier after the
        persists queued before it (so a persist never resurrects a name removed after it). While the durable store
        is down the durable removal waits for the next persist that succeeds (:meth:`_remove_durable`)."""
        self.local.settle()  # (a restored commit is listed behind training: after it, not over this removal)
        pointer, _ = self.local.read_pointer()
        if pointer is not None and name in pointer.checkpoints:
            self.claim()
            self.local.remove(name)
        self._submit(lambda: self._remove_durable(name), f"removal of {self.durable.store.url(name)}")

    def _remove_durable(self, name: str) -> None:
        """Remove ``name`` from the durable catalog; while the store is down (the last request failed), or when
        this one fails, keep the removal for after the next persist that succeeds instead: each request to a store
        that is down waits out the client's retries, and a queue of them would hold up the persist behind them and
        the end of the fit. Nothing is lost by the wait: the name stays catalogued (and kept) a little longer."""
        with self._lock:
            unreachable = self._unreachable
        if not unreachable:
            try:
                self.durable.remove(name)
            except StaleWriterError:
                raise
            except Exception as exc:
                if not is_transient(exc):
                    raise
                with self._lock:
                    self._unreachable = True
                log.warning("the durable tier %s does not answer (%s): removing %s from it waits for the next"
                            " persist that succeeds", self.durable.url, exc, name)
            else:
                with self._lock:
                    if self._durable_names is not None:
                        self._durable_names.discard(name)
                return
        with self._lock:
            if name not in self._deferred:
                self._deferred.append(name)

    def _run_deferred(self) -> None:
        """After a persist succeeded: the durable removals that waited for the store (see :meth:`_remove_durable`)."""
        with self._lock:
            names, self._deferred = self._deferred, []
        for name in names:
            self._remove_durable(name)

    @property
    def unreachable(self) -> bool:
        """Whether the durable store failed the last request this writer sent it (an outage, until a persist
        succeeds)."""
        with self._lock:
            return self._unreachable

    def knows(self, name: str) -> bool:
        """Whether a checkpoint named ``name`` exists in either tier as far as this writer knows, without waiting
        for the durable store: the local tier's catalog, then the durable one as this writer last read or wrote it
        (read once if never; unknown while the store is down: no). ModelCheckpoint asks it at every save for its
        version counter (``-v1`` names), which would otherwise ask the store and stop the fit in an outage."""
        pointer, _ = self.local.read_pointer()
        if pointer is not None and name in pointer.checkpoints:
            return True
        with self._lock:
            names = None if self._durable_names is None else set(self._durable_names)
        if names is None:
            try:
                durable, _ = self.durable.read_pointer()
            except Exception as exc:  # an outage: the local tier answers alone
                log.info("the durable tier %s does not answer (%s): %s is looked up in the local tier only",
                         self.durable.url, exc, name)
                return False
            names = set(durable.checkpoints) if durable is not None else set()
            with self._lock:
                self._durable_names = self._durable_names if self._durable_names is not None else names
        return name in names

    def forget_stock(self, name: str) -> bool:
        return self.durable.writer.forget_stock(name)

    # -- holds on local folders --------------------------------------------------------------------------------
    def hold(self, entry: Entry, why: str) -> None:
        """Keep ``entry``'s local folders from local retention until :meth:`release` (each hold counted)."""
        with self._lock:
            first = [f for f in entry.folders if not self._held.get(f)]
            for folder in entry.folders:
                self._held[folder] = self._held.get(folder, 0) + 1
        if first:
            self.local.hold(first, why)

    def release(self, entry: Entry) -> None:
        with self._lock:
            released = []
            for folder in entry.folders:
                self._held[folder] -= 1
                if not self._held[folder]:
                    del self._held[folder]
                    released.append(folder)
        if released:
            try:
                self.local.release(released)
            except Exception as exc:  # the hold is dropped by the next adopt of this local tier at the latest
                log.warning("could not release %s: %s", self.local.store.url(entry.commit), exc)

    # -- persisting ----------------------------------------------------------------------------------------------
    def _enqueue(self, entry: Entry, *, older: bool = False) -> None:
        """Queue the persist of ``entry``; ``older``: an older state than the newest, persisted all the same (a
        checkpoint a ModelCheckpoint reports, at the end of a fit), never superseded by a newer one."""
        with self._lock:
            if entry.commit in self._persisted or entry.commit in self._pending:
                return
            self._pending.add(entry.commit)
            if not older:
                self._newest_key = save_key(entry)
        # Held from now (not from when the copy starts): local retention would otherwise delete a queued checkpoint
        # while the saves go on. Its folders include those whose bytes it shares (last.ckpt and its top-k twin).
        self.hold(entry, _PERSISTING)
        self._status("pending", entry)
        self._submit(lambda: self._persist(entry, older=older), f"persist of {self.local.store.url(entry.commit)}")

    def _submit(self, job: Callable[[], None], what: str) -> None:
        """Run ``job`` after the jobs queued before it, in one background thread that ends when the queue is empty
        (so nothing lingers between persists), and is not a daemon: an interpreter that exits normally first
        finishes the persists it queued."""
        with self._lock:
            self._jobs.append((job, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="lightning_resilient-persist")
                self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job, what = self._jobs.popleft()
                self._progress_at = time.monotonic()
            try:
                job()
            except StaleWriterError as exc:  # a newer job claimed the durable root: this one must stop
                with self._lock:
                    self._error = self._error or exc
                log.error("%s failed; the durable tier keeps its previous checkpoint: %s", what, exc)
            except Exception as exc:  # a removal from a store that is down: it stays in the durable catalog for now
                log.warning("%s failed (training goes on; the durable tier's retention catches up later): %s",
                            what, exc)

    def _persist(self, entry: Entry, *, older: bool = False) -> None:
        try:
            with self._lock:
                # (one the end of the fit asked for, a reported older state, is never superseded)
                superseded = not older and save_key(entry) != self._newest_key and entry.commit not in self._asked
            if superseded:
                # A newer state is queued behind this one: the durable tier gets that one instead, so a store slower
                # than the saves never builds a backlog (of uploads, or of held local checkpoints).
                log.info("not persisting %s (step %d): a newer save is queued after it", entry.commit, entry.step)
                return
            with self._lock:
                # Asked for now (the end of a fit, an emergency save): tried, unless a persist failed since it was.
                asked = (self._asked_at is not None and entry.commit in self._asked
                         and self._asked_failed_at < self._asked_at)
                waiting = self._unreachable and time.monotonic() < self._retry_at and not asked
            if waiting:
                # The store failed the last persist and its backoff has not passed: this one would wait out the
                # client's retries only to fail too (a second name of the same state, the end of the fit). It is
                # retried with the newest state at the first save after the backoff, as a failed one is.
                log.info("not persisting %s (step %d) now: the durable tier %s does not answer; retried after the"
                         " backoff", entry.commit, entry.step, self.durable.url)
                self._status("failed", entry)
                return
            try:
                self._publish(self.local.read_manifest(entry.commit))
            except StaleWriterError:
                raise
            except Exception as exc:
                self._failed(entry, exc)
                return
            with self._lock:
                self._persisted.add(entry.commit)
                recovered, self._failures, self._failure, self._failing_since = self._failures, 0, None, None
                self._durable_at = time.time()
                if isinstance(self._error, PersistFailedError):  # the store is back before a save raised it
                    self._error = None
                self._unreachable = False
                # The persist of a name supersedes a removal of it that waited (that one was of an older save).
                self._deferred = [name for name in self._deferred if name != entry.name]
                if self._durable_names is not None:
                    self._durable_names.add(entry.name)
            self._status("ok", entry)
            log.info("persisted %s to %s", entry.commit, self.durable.url)
            if recovered:
                log.warning("the durable tier %s takes checkpoints again (step %d persisted, after %d failed"
                            " persist(s))", self.durable.url, entry.step, recovered)
            self._run_deferred()
        finally:
            with self._lock:
                self._pending.discard(entry.commit)  # a failed persist may be queued again
            self.release(entry)

    def _publish(self, manifest: Manifest) -> None:
        self.durable.writer.make_room(manifest.name)  # a stock file of that name (a run from before the plugin)
        try:
            copied = self.copier(manifest) if self.copier is not None else None
            self.durable.publish(copied if copied is not None else self._copy(manifest))
        except BaseException as exc:
            self.durable.writer.abandon(manifest.commit, exc)
            self.durable.writer.put_back(manifest.name)
            raise

    def _failed(self, entry: Entry, exc: BaseException) -> None:
        """A persist failed (after the store's own retries): report it, schedule its retry, check the bounds."""
        now = time.time()
        with self._lock:
            if entry.commit in self._asked:  # (the others asked for with it wait for the backoff)
                self._asked_failed_at = time.monotonic()
            self._unreachable = is_transient(exc)
            self._failures += 1
            self._failure = exc
            self._failing_since = self._failing_since or now
            failures = self._failures
            delay = min(self.retry_delay * 2 ** (failures - 1), _MAX_RETRY_DELAY)
            self._retry_at = time.monotonic() + delay
        self._status("failed", entry, exc)
        message = (f"persisting {entry.commit} (step {entry.step}) to the durable tier {self.durable.url} failed"
                   f" ({failures} in a row): {exc}. Training goes on from the local tier; the newest state is"
                   f" persisted again at the first save after {delay:.0f} s")
        log.warning(message)
        if failures == 1:  # once per outage: each later failure is logged
            warn(message, RuntimeWarning)
        self._check_bounds()

    def _check_bounds(self) -> None:
        """Past ``max_persist_failures`` failed persists in a row, or ``max_seconds_without_durable`` without a
        durable commit while persists fail: the next save raises (the durable tier is too far behind to go on)."""
        with self._lock:
            if self._error is not None or self._failure is None:
                return
            failures, since = self._failures, self._durable_at
            limit = self.max_persist_failures
            seconds = self.max_seconds_without_durable
            why = None
            if limit is not None and failures >= limit:
                why = f"{failures} persists in a row failed (max_persist_failures={limit})"
            elif seconds is not None and since is not None and time.time() - since > seconds:
                why = (f"no checkpoint was made durable for {time.time() - since:.3g} s"
                       f" (max_seconds_without_durable={seconds:g})")
            if why is None:
                return
            error = PersistFailedError(
                f"the durable tier {self.durable.url} does not take checkpoints: {why}; the last failure:"
                f" {self._failure}. The local tier {self.local.url} holds the newest checkpoints (resume from it on"
                " this node); fix the store, or raise the bound, and resume.")
            error.__cause__ = self._failure
            self._error = error

    def _status(self, state: str, entry: Entry, error: BaseException | None = None) -> None:
        """Record the persist status beside the local tier (``ls --local-tier`` shows it): never fails a save."""
        with self._lock:
            error = error if error is not None else self._failure  # a retry pending: the failure it retries
            status = {"state": state, "commit": entry.commit, "step": entry.step, "at": time.time(),
                      "failures": self._failures, "failing_since": self._failing_since,
                      "error": f"{type(error).__name__}: {error}" if error is not None else None,
                      "durable": self.durable.url}
        try:
            write_status(self.local, status)
        except OSError as exc:
            log.debug("could not record the persist status: %s", exc)

    def copy_targets(self, manifest: Manifest) -> list[str]:
        """Where each of ``manifest``'s objects goes in the durable root ("" for one that is there already): an
        object shared with another commit of the same step stays shared when that commit is durable already;
        otherwise it is copied into this commit's own folder."""
        pointer, _ = self.durable.read_pointer()
        live = pointer.live_folders() if pointer is not None else set()
        commit = manifest.commit
        targets: list[str] = []
        for i, obj in enumerate(manifest.objects):
            folder = obj.path.rsplit("/", 1)[0]
            if folder == commit:
                targets.append(obj.path)
            elif folder in live:
                targets.append("")  # already durable: referenced, not copied
            else:
                targets.append(f"{commit}/shared-{i:05d}-{obj.path.rsplit('/', 1)[-1]}")
        return targets

    def copy_objects(self, manifest: Manifest, indices: list[int], targets: list[str]) -> None:
        """Copy objects ``indices`` of ``manifest`` from the local tier to ``targets`` in the durable one, each
        verified against the manifest on the way (a damaged local copy is never persisted)."""
        def copy(i: int) -> int:
            obj, target = manifest.objects[i], targets[i]
            if not target:
                return 0
            data = memoryview(self.local.store.read(obj.path))
            if manifest.chunk_size and chunk_digests([data], manifest.chunk_size) != obj.chunks:
                raise CheckpointCorruptedError(f"{self.local.store.url(obj.path)} does not match its manifest: the"
                                               " local copy is damaged and was not persisted",
                                               object=self.local.store.url(obj.path))
            self.durable.store.write_pieces(target, [data])
            self._progress()
            return len(data)

        with self._executor() as pool:  # behind training: as many writers as the durable store gains from
            map_in_lanes(pool, copy, indices, self.durable.store.write_threads(self.durable.writer.max_concurrency))

    def _copy(self, manifest: Manifest) -> Manifest:
        """Copy ``manifest``'s objects from the local tier into the durable one, verifying each; returns the
        manifest to publish there."""
        targets = self.copy_targets(manifest)
        self.copy_objects(manifest, list(range(len(manifest.objects))), targets)
        return retarget(manifest, targets)

    def persist_latest(self, *, stall: float | None = None, reported: bool = False) -> list[Entry]:
        """Persist this writer's newest saved step (every name saved at it, e.g. a top-k name and ``last.ckpt``)
        if it is not durable yet, wait for every queued persist and raise the first error: what ``fit``'s end and
        an emergency save need. ``reported``: also every older checkpoint of this writer that a ModelCheckpoint
        still reports and it has not persisted (:meth:`_reported_here`), after the newest. ``stall``: give up waiting
        once the persists made no progress for so many seconds (a store that stopped answering), raising
        :class:`~lightning_resilient.PersistFailedError`."""
        with self._lock:
            latest = list(self._latest)
        older = self._reported_here(latest) if reported else []
        with self._lock:
            # Tried now, backoff or not (the node may go away); if one fails, the others wait for the backoff.
            self._asked_at, self._asked = time.monotonic(), {entry.commit for entry in [*latest, *older]}
        for entry in latest:
            self._enqueue(entry)
        for entry in older:
            self._enqueue(entry, older=True)
        if not self.wait(stall=stall):
            self._abandon()
            raise PersistFailedError(f"the durable tier {self.durable.url} made no progress for {stall:g} s (it does"
                                     f" not answer): gave up waiting for {self._newest(latest)}."
                                     f" {self._where_newest()}")
        self.raise_failure()
        return latest

    def _reported_here(self, latest: list[Entry]) -> list[Entry]:
        """This writer's local checkpoints that a ModelCheckpoint still reports (the local pointer's ``reported``),
        other than ``latest``, that it has not persisted: the local tier keeps them (its retention never drops a
        reported one), and the end of the fit persists them, so that what the callback reports (its
        ``best_model_path`` names the durable root) is durable. None on a process that saved nothing (another node's
        leader: its tier holds copies; global rank 0 persists)."""
        if not latest:
            return []
        try:
            pointer, _ = self.local.read_pointer()
        except Exception as exc:  # (the newest state is still persisted; the error is the local tier's to report)
            log.warning("could not read the local tier %s to persist what the ModelCheckpoints report: %s",
                        self.local.url, exc)
            return []
        if pointer is None or self.local.writer_epoch is None:
            return []
        newest = {entry.commit for entry in latest}
        with self._lock:
            persisted = set(self._persisted)
        found = []
        for name in pointer.reported:
            entry = pointer.checkpoints.get(name)
            if (entry is not None and entry.commit not in newest and entry.commit not in persisted
                    and entry.writer_epoch == self.local.writer_epoch):
                found.append(entry)
        return found

    def _newest(self, latest: list[Entry]) -> str:
        return f"the persist of {latest[-1].commit} (step {latest[-1].step})" if latest else "the last persist"

    def _where_newest(self) -> str:
        return (f"The local tier {self.local.url} holds the newest checkpoints: a restart on this node resumes from it,"
                " and the job's next save that reaches the store persists it.")

    def wait(self, *, stall: float | None = None) -> bool:
        """Block until every queued persist and removal has run (errors are kept for :meth:`raise_error`); True.
        With ``stall``: False as soon as none of them made progress (started, copied an object, ended) for that many
        seconds."""
        while True:
            with self._lock:
                thread, progress = self._thread, self._progress_at
            if thread is None:
                return True
            if stall is None:
                thread.join()
                continue
            thread.join(timeout=min(1.0, stall))
            with self._lock:
                progress = max(progress, self._progress_at)
            if thread.is_alive() and time.monotonic() - progress > stall:
                return False

    def _progress(self) -> None:
        with self._lock:
            self._progress_at = time.monotonic()

    def _abandon(self) -> None:
        """Give up the durable work still queued (the end of a fit whose store stopped answering): the job running
        ends with its request (the client's own timeouts); what was queued behind it is dropped, its holds left to
        the next job's adoption of the local tier."""
        with self._lock:
            dropped, self._jobs = list(self._jobs), deque()
        for _, what in dropped:
            log.warning("not waiting for the %s: the durable tier %s does not answer", what, self.durable.url)

    def raise_error(self) -> None:
        """Raise a fatal error of a background persist (a fenced job, a bound passed): what a save raises."""
        with self._lock:
            error, self._error = self._error, None
        raise_from_background(error, "raised by a background persist to the durable tier; the durable tier keeps"
                                     " its previous checkpoint")

    def raise_failure(self) -> None:
        """Raise a fatal error, else the failure of the last persist if it failed: what a caller that waits for the
        durable tier (the end of a fit, an emergency save, :meth:`AtomicCheckpointIO.wait`) must hear."""
        self.raise_error()
        with self._lock:
            failure = self._failure
        raise_from_background(failure, "raised by a background persist to the durable tier; the durable tier keeps"
                                       " its previous checkpoint")

    @property
    def failures(self) -> int:
        """Persists that failed in a row (0 once one succeeds)."""
        return self._failures

    def close(self) -> None:
        """Persist the newest local checkpoint (the last of a fit) and every older one a ModelCheckpoint still reports
        that is not durable yet (its ``best_model_path`` names the durable root), wait, raise any error: a
        :class:`~lightning_resilient.PersistFailedError` that names the local tier when the store does not answer, at
        the latest once the persist made no progress for :data:`TEARDOWN_STALL_SECONDS`."""
        try:
            self.persist_latest(stall=TEARDOWN_STALL_SECONDS, reported=True)
        except PersistFailedError:
            raise
        except Exception as exc:
            if not is_transient(exc):
                raise
            with self._lock:
                latest = list(self._latest)
            raise PersistFailedError(f"the durable tier {self.durable.url} does not answer ({exc}):"
                                     f" {self._newest(latest)} failed. {self._where_newest()}") from exc


def retarget(manifest: Manifest, targets: list[str]) -> Manifest:
    """``manifest`` with each object at its target path in the durable root (see :meth:`TieredRoot.copy_targets`)."""
    objects = [obj if not target or target == obj.path else replace(obj, path=target)
               for obj, target in zip(manifest.objects, targets, strict=True)]
    return replace(manifest, objects=objects)


@dataclass(frozen=True)
class Claim:
    """A job's claim of a durable root, as its local tiers (one per node) adopt it: one writer epoch and lineage in
    every tier of every node."""

    durable: str
    writer_epoch: int
    origin: Origin
    origins: dict[int, Origin]
    root_id: str


def adopt_claim(local: CheckpointRoot, claim: Claim) -> None:
    """Write the local tier root ``local`` as the job's claim of its durable root (once per writer epoch): set the
    local tier aside first when it belongs to another incarnation of the durable root, or is damaged."""
    if local.writer_epoch == claim.writer_epoch:
        return
    local.settle()  # (before the tier may be set aside: a restore's copy may still be written into it)
    set_aside_if_foreign(local, claim.durable, claim.root_id)
    # The record first: a local root holding commits always says which durable root it belongs to.
    _write_tier_record(local, claim.durable, claim.root_id)
    local.adopt(claim.writer_epoch, claim.origin, claim.origins, claim.root_id)


def set_aside_if_foreign(local: CheckpointRoot, durable_url: str, root_id: str) -> None:
    """Move the local tier root aside (kept, renamed) when it cannot be this durable root's: it holds the lineage of
    another incarnation of the root (deleted and written again under the same URL), or its pointer is damaged. Its
    checkpoints could otherwise be taken for this run's, or stop every save."""
    if not local.store.exists(""):
        return
    record = tier_record(local)
    try:
        pointer, _ = local.read_pointer()
    except CheckpointError as exc:
        why = f"its pointer is damaged ({exc})"
    else:
        if pointer is None and record is None:
            return
        if record is not None and record["root_id"] == root_id:
            return
        why = (f"it holds checkpoints of an earlier incarnation of {durable_url} (that root was deleted and"
               " written again since)")
    path = local.store.path("").rstrip("/")
    # The time says when; the random tail keeps two set-asides of one second apart (a rename onto an existing folder
    # fails, or, onto an empty one, replaces it).
    aside = f"{path}.set-aside-{int(time.time())}-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    local.fence.writer_epoch = local.fence.root_id = local.fence.lineage_id = None  # set aside: the next save adopts
    warn(f"the local tier {path} was moved to {aside}: {why}. Nothing of it is resumed; delete it once"
         " you no longer need it.", RuntimeWarning)


#: Beside a local tier root: the persist status of the job writing it (``ls --local-tier`` shows it).
PERSIST_STATUS = ".lightning_resilient/persist.json"
_MAX_RETRY_DELAY = 600.0  # the longest wait before a failed persist is tried again

TEARDOWN_STALL_SECONDS = 120.0
"""How long the end of a fit waits for its last persist while that makes no progress (no object copied, no request
of it ended): a store that stopped answering gets this long, one that is slow but moving as long as it needs."""


def write_status(local: CheckpointRoot, status: dict[str, Any]) -> None:
    """Replace the persist status beside ``local`` (a local folder): written whole, then renamed over the old one."""
    path = local.store.path(PERSIST_STATUS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def read_status(local: CheckpointRoot) -> dict[str, Any] | None:
    """The persist status beside ``local``, or None when no job recorded one (or it cannot be read)."""
    try:
        raw = json.loads(local.store.read(PERSIST_STATUS))
    except (FileNotFoundError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _write_tier_record(local: CheckpointRoot, durable_url: str, root_id: str) -> None:
    if tier_record(local) != {"durable": durable_url, "root_id": root_id}:
        local.store.write(TIER_RECORD, json.dumps({"durable": durable_url, "root_id": root_id}).encode())


# -- reading -------------------------------------------------------------------------------------------------------
@dataclass
class TierView:
    """Both tiers of one durable root as a resume sees them."""

    durable: CheckpointRoot
    local: CheckpointRoot
    durable_pointer: Pointer | None
    local_pointer: Pointer | None
    #: The local commits other nodes' local tiers hold (a job on several nodes: io/replicas.py), candidates too.
    others: list[Entry] = field(default_factory=list)

    @classmethod
    def read(cls, durable: CheckpointRoot, local: CheckpointRoot) -> TierView:
        pointer, _ = durable.read_pointer()
        if pointer is None:
            scan = durable.scan()
            if scan.manifests or scan.max_epoch:
                pointer = scan.pointer()
        return cls(durable, local, pointer, _local_pointer(local, pointer))

    @property
    def lineage(self) -> Lineage:
        """The durable root's current lineage: the authority on what a resume may continue."""
        return self.durable_pointer.lineage() if self.durable_pointer is not None else Lineage({}, 0)

    def local_entries(self) -> list[Entry]:
        """This node's local commits that may be resumed: under a writer epoch the durable root still knows
        (:meth:`_known_epoch`; any other may be a fenced job's, past its fork)."""
        return [e for e in (self.local_pointer.entries() if self.local_pointer is not None else [])
                if self._known_epoch(e.writer_epoch)]

    def _known_epoch(self, epoch: int) -> bool:
        """An epoch whose origin the durable pointer records, or one its current lineage reaches through an origin
        it records (bounded there by that origin's step: a chain of resumes of local-only checkpoints, whose older
        epochs the pointer's pruning forgot)."""
        origins = self.durable_pointer.origins if self.durable_pointer is not None else {}
        return epoch in origins or epoch in self.lineage.bounds

    def _entries(self) -> list[Entry]:
        durable = self.durable_pointer.entries() if self.durable_pointer is not None else []
        others = [e for e in self.others if self._known_epoch(e.writer_epoch)]
        seen: dict[str, Entry] = {}
        for entry in [*self.local_entries(), *others, *durable]:
            seen.setdefault(entry.commit, entry)
        return list(seen.values())

    def candidates(self) -> list[Entry]:
        """The checkpoints a resume may load, newest first: the durable lineage's, in either tier."""
        return self.lineage.members(self._entries())

    def local_only(self) -> list[Entry]:
        durable = {e.commit for e in self.durable_pointer.entries()} if self.durable_pointer is not None else set()
        return [e for e in self.candidates() if e.commit not in durable]

    def older(self, entry: Entry) -> list[Entry]:
        origins = dict(self.durable_pointer.origins) if self.durable_pointer is not None else {}
        return [e for e in Lineage.below(origins, entry).members(self._entries()) if e.commit != entry.commit]

    def entry(self, commit: str) -> Entry | None:
        for entry in self._entries():
            if entry.commit == commit:
                return entry
        for root in (self.local, self.durable):
            if root.store.exists(f"{commit}/{MANIFEST_NAME}"):
                try:
                    return Entry.from_manifest(root.read_manifest(commit))
                except CheckpointCorruptedError:
                    continue
        return None

    def holders(self, commit: str) -> list[CheckpointRoot]:
        """The tiers holding a committed copy of ``commit``, the local one first."""
        return [root for root in (self.local, self.durable) if root.store.exists(f"{commit}/{MANIFEST_NAME}")]


@dataclass
class TieredResolved:
    durable_url: str
    entry: Entry
    fallbacks: list[Entry]


def resolve_tiered(url: str, local_tier: str, root_for: Callable[[str], CheckpointRoot], *,
                   shown: str | None = None, others: list[Entry] | None = None) -> TieredResolved | None:
    """What ``url`` names across the two tiers of its durable root; None when neither tier knows it (the caller's
    single-tier resolution then handles it: a plain file, a stock checkpoint, the error message).

    ``url`` may name the durable root (its newest checkpoint in either tier), a name in it, a commit folder in it, or
    the same in its local tier root (``<local_tier>/<...>``). ``shown``: ``url`` as the caller gave it, for messages.
    ``others``: the local commits of other nodes of the job (see :attr:`TierView.others`).
    """
    durable_url, rel = split_tiered(url, local_tier, root_for)
    if durable_url is None:
        return None
    view = TierView.read(root_for(durable_url), root_for(local_tier_url(local_tier, durable_url)))
    view.others = list(others or [])
    if rel == "":
        candidates = view.candidates()
        if not candidates:
            return None
        return TieredResolved(durable_url, candidates[0], candidates[1:])
    if writer_epoch_of(rel) is not None:
        entry = view.entry(rel)
        if entry is None:
            raise FileNotFoundError(f"{NOT_FOUND}{shown or url}. Neither {durable_url} nor its local tier"
                                    f" {view.local.url} holds a committed {rel!r}")
        return TieredResolved(durable_url, entry, view.older(entry))
    candidates = view.candidates()
    named = [e for e in candidates if e.name == rel]
    if named:
        return TieredResolved(durable_url, named[0], view.older(named[0]))
    if rel.startswith("last") and candidates:
        # ModelCheckpoint's last.ckpt (last-v1.ckpt, ...) means the newest: when the run's lineage has no checkpoint
        # of that name yet (a rollback or a fresh start, whose last.ckpt is not persisted yet), the name in the
        # catalogs is an abandoned branch's, never what "last" should resume.
        log.info("%s: no %s in the current lineage of %s yet; resuming its newest checkpoint, %s", url, rel,
                 durable_url, candidates[0].commit)
        return TieredResolved(durable_url, candidates[0], candidates[1:])
    return None


def _local_pointer(local: CheckpointRoot, durable: Pointer | None) -> Pointer | None:
    """The local tier's pointer when it belongs to this incarnation of the durable root; else None (ignored)."""
    if durable is None or not local.store.exists(""):
        return None
    record = tier_record(local)
    if record is None or not durable.root_id or record["root_id"] != durable.root_id:
        return None  # another incarnation of the root (or none recorded): never this run's
    try:
        pointer, _ = local.read_pointer()
    except CheckpointError as exc:
        warn(f"the local tier {local.url} is unreadable ({exc}); resuming from the durable tier. The next"
             " job that saves moves it aside.", RuntimeWarning)
        return None
    return pointer


def split_tiered(url: str, local_tier: str, root_for: Callable[[str], CheckpointRoot]) -> tuple[str | None, str]:
    """(durable root URL, path relative to it) for a URL in a durable root or in a local tier root."""
    base = os.path.realpath(os.path.expanduser(local_tier))
    plain = url[len("file://"):] if url.startswith("file://") else url
    if paths.split_protocol(url)[0] in (None, "file", "local") and \
            os.path.realpath(plain).startswith(base + os.sep):
        inside = os.path.relpath(os.path.realpath(plain), base).split(os.sep)
        durable = durable_of(root_for(os.path.join(base, inside[0])))
        return durable, "/".join(inside[1:])
    name = paths.basename(url)
    if writer_epoch_of(name) is not None:
        return paths.dirname(paths.dirname(url)), f"{paths.basename(paths.dirname(url))}/{name}"
    if _has_pointer(root_for(url)) or root_for(local_tier_url(local_tier, url)).store.exists(TIER_RECORD):
        return url, ""
    parent = paths.dirname(url)
    return parent, name


def _has_pointer(root: CheckpointRoot) -> bool:
    pointer, _ = root.read_pointer()
    return pointer is not None


def load_tiered(found: TieredResolved, local_tier: str, root_for: Callable[[str], CheckpointRoot],
                load_for: Callable[[CheckpointRoot], Callable[..., Loaded]], *, fallback: bool,
                together: Together | None, **load_kwargs: Any) -> tuple[Entry, CheckpointRoot, Loaded]:
    """Load ``found`` (falling back to older candidates when ``fallback``): from the local tier when it holds a
    copy that verifies, else from the durable tier. With ``together`` every rank loads the same commit (each from
    its own node's local tier or from the durable one); returns (entry, the tier it was read from, loaded)."""
    durable = root_for(found.durable_url)
    local = root_for(local_tier_url(local_tier, found.durable_url))
    candidates = [found.entry, *(found.fallbacks if fallback else [])]
    first: str | None = None
    last_error: BaseException | None = None
    for candidate in candidates:
        loaded: Loaded | None = None
        source: CheckpointRoot | None = None
        errors: list[str] = []
        for root in (local, durable):
            if not root.store.exists(f"{candidate.commit}/{MANIFEST_NAME}"):
                continue
            try:
                loaded = (root.load if root is local else load_for(root))(candidate.commit, **load_kwargs)
                source = root
                break
            except CheckpointCorruptedError as exc:
                errors.append(f"{root.store.url(candidate.commit)}: {exc}")
                last_error = exc
                message = f"checkpoint {root.store.url(candidate.commit)} is corrupted and was NOT loaded: {exc}"
                log.error(message)
                warn(message, RuntimeWarning)
        ok = loaded is not None
        if together is not None:
            ok = together.all_true(ok)
        if ok:
            assert loaded is not None and source is not None
            log.info("read %s (step %d) from the %s tier, %s", candidate.commit, candidate.step,
                     "local" if source is local else "durable", source.url)
            if first is not None:
                message = (f"loaded the previous committed checkpoint {candidate.commit} (step {candidate.step}) of"
                           f" {found.durable_url} instead of {first}, which no tier could load")
                log.error(message)
                warn(message, RuntimeWarning)
            return candidate, source, loaded
        first = first or candidate.commit
        if not errors and loaded is None:
            log.warning("%s is in neither tier this process can read (%s, %s)", candidate.commit, local.url,
                        durable.url)
    raise CheckpointCorruptedError(
        f"no valid checkpoint to load from {found.durable_url} or its local tier: tried {len(candidates)}, the last"
        f" being {candidates[-1].commit}" + (f" ({last_error})" if last_error is not None else ""),
        object=None)


def find_latest_tiered(durable: CheckpointRoot, local: CheckpointRoot) -> str | None:
    """The newest checkpoint of the durable root's lineage in either tier, as a URL in the durable root (a plugin
    with the local tier reads it from there); None when neither tier holds one."""
    view = TierView.read(durable, local)
    for entry in view.candidates():
        for root in view.holders(entry.commit):
            try:
                root.read_manifest(entry.commit)
            except CheckpointCorruptedError as exc:
                warn(f"skipping {root.store.url(entry.commit)}: {exc}", RuntimeWarning)
                continue
            return durable.store.url(entry.commit)
    return None

