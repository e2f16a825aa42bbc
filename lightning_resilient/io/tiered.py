"""Tiered checkpoints: every save commits to a node-local root, every Nth is persisted to the durable root behind it.

The local tier is an ordinary checkpoint root (same objects, manifest, pointer and verification) at
``<local_tier>/<name>-<hash of the durable URL>``, written as the *durable* root's writer epoch: the job claims the
durable root first (which fences older jobs there), then *adopts* that epoch and lineage in its local root
(``io/local_tier.py``). A commit therefore has one name (``<name>/c<time>-e<epoch>-<id>``) and one place in the
lineage in both tiers.

Persisting copies a committed local checkpoint's objects (each verified against the manifest on the way) into the
same folder of the durable root, then publishes the very manifest there through the durable protocol: checked,
manifest last, conditional pointer move fenced by the writer epoch. The durable pointer so only ever names
checkpoints complete in the durable tier, a kill during a persist leaves it on the previous durable checkpoint (the
half-copied folder is garbage of this epoch, collected once a later job has claimed), and a fenced job keeps writing
its local tier but gets :class:`~lightning_resilient.StaleWriterError` from its next persist and its next save.
While a persist copies a folder, the local pointer holds it so local retention cannot delete it.

This module owns :class:`TieredRoot`, the save side of the two tiers: the claim and its adoption, the saves to the
local tier, which of them are persisted (every Nth saved state, a retry with the newest, what the end of a fit asks
for) and the persist itself. It runs on collaborators with one job each: the queue of durable work and its thread
(``io/persist_queue.py``), the failures, backoff, bounds and status (``io/persist_health.py``), the holds on local
folders (``io/tier_holds.py``) and what the writer knows of the durable catalog, with the removals that wait for the
store (``io/durable_names.py``). Resume reads both tiers through ``io/tier_view.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from lightning_resilient.errors import CheckpointCorruptedError, CheckpointError, PersistFailedError, StaleWriterError
from lightning_resilient.io import layout
from lightning_resilient.io._lanes import map_in_lanes
from lightning_resilient.io.durable_names import DurableNames
from lightning_resilient.io.local_tier import Claim, adopt_claim
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest, chunk_digests
from lightning_resilient.io.persist_health import PersistHealth
from lightning_resilient.io.persist_queue import PersistQueue
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.retry import is_transient
from lightning_resilient.io.root import CheckpointRoot, Prepared
from lightning_resilient.io.tier_holds import LocalHolds

__all__ = ["TEARDOWN_STALL_SECONDS", "TieredRoot", "retarget", "save_key"]

log = logging.getLogger(__name__)

_PERSISTING = "being persisted to the durable tier"

TEARDOWN_STALL_SECONDS = 120.0
"""How long the end of a fit waits for its last persist while that makes no progress (no object copied, no request
of it ended): a store that stopped answering gets this long, one that is slow but moving as long as it needs."""


def save_key(entry: Entry) -> tuple[int, int] | str:
    """What makes two saves one training state: (writer epoch, step), as retention counts them; a save without a
    step (a Fabric or hand-made state) is a state of its own."""
    return (entry.writer_epoch, entry.step) if entry.step > 0 else entry.commit


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
        if durable.settings.dedup != local.settings.dedup:
            # Incremental local commits persist as incremental durable ones: the durable root must remember what it
            # stores across steps (``RootWriter.stored_like``) to reference it from the next persist.
            raise ValueError(f"dedup must be the same for a durable root and its local tier: dedup="
                             f"{durable.settings.dedup} for {durable.url}, {local.settings.dedup} for {local.url}")
        self.durable = durable
        # Its commits are persists, behind training already: their deletions stay in the persist, which the end of a
        # fit waits for only while it makes progress (a store that hangs is given up on, not waited for forever).
        durable.deletes_behind = False
        self.local = local
        # Lightning names the local commits by the durable folder: what a save's ModelCheckpoints report is read
        # against it, and a persist carries it there.
        local.writer.folder_url = durable.writer.folder_url
        self.persist_every = persist_every
        self._executor = executor
        #: Failures, backoff, bounds and status of the persists; the fatal error the next save raises.
        self.health = PersistHealth(durable.url, local, max_persist_failures=max_persist_failures,
                                    max_seconds_without_durable=max_seconds_without_durable, retry_delay=retry_delay)
        #: The persists and removals, in order, on one background thread.
        self.queue = PersistQueue(on_stale=self.health.fatal)
        self.holds = LocalHolds(local)
        #: The durable catalog's names as this writer knows them, and the removals waiting for the store.
        self.names = DurableNames(durable, self.health)
        self._lock = threading.Lock()
        self._saves = 0  # distinct training states saved by this writer (a top-k save and save_last count once)
        self._last: tuple[int, int] | str | None = None  # the save key of the last one
        self._persisting_state = False
        self._latest: list[Entry] = []  # this writer's local commits of its newest state, in save order
        self._persisted: set[str] = set()  # commits that are in the durable tier
        self._pending: set[str] = set()  # commits queued for a persist that has not finished
        self._newest_key: tuple[int, int] | str | None = None  # the save key of the newest persist queued
        # The persists persist_latest asked for (tried whatever the backoff), when, and when one of them last failed.
        self._asked: set[str] = set()
        self._asked_at: float | None = None
        self._asked_failed_at = float("-inf")
        #: Called with every local commit, once committed (replication to other nodes: ``io/replicas.py``).
        self.on_commit: Callable[[Entry], None] | None = None
        #: Copies a manifest's objects into the durable root and returns the manifest to publish there, or None to
        #: leave it to this node (a sharded commit written across nodes is copied by every node: io/replicas.py).
        self.copier: Callable[[Manifest], Manifest | None] | None = None
        self._claim_made: Claim | None = None

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
            # A job fenced before its first save (a newer claim, or the root deleted and written again since its
            # claim) never adopts the local tier: its epoch would take it over from the job writing now, and a job
            # of the old incarnation would even set aside the new one's local tier. Without a pointer (lost), the
            # origin records tell.
            if pointer is not None:
                self.durable.fence.check_current(pointer)
            else:
                self.durable.fence.check_current_by_records()
            # The incarnation this writer claimed (a pointer rebuilt since may carry none).
            root_id = self.durable.fence.root_id or (pointer.root_id if pointer is not None else "")
            claim = Claim(self.durable.url, self.durable.writer_epoch, origin,
                          dict(pointer.origins) if pointer else {}, root_id)
            self._claim_made = claim
            self.names.learned(set(pointer.checkpoints) if pointer is not None else set())
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
            persisting_state = self._persisting_state
        retry = self.health.saved()
        if persisting_state or retry:
            if retry and not persisting_state:
                log.info("retrying the persist to %s with the newest state (step %d)", self.durable.url, entry.step)
            self._enqueue(entry)
        if self.on_commit is not None:
            self.on_commit(entry)
        self.health.check_bounds()
        self.raise_error()
        return entry

    def remove(self, name: str) -> None:
        """Lightning's removal of a checkpoint name: from the local tier now, from the durable tier after the
        persists queued before it (so a persist never resurrects a name removed after it). While the durable store
        is down the durable removal waits for the next persist that succeeds (:meth:`DurableNames.remove`)."""
        self.local.settle()  # (a restored commit is listed behind training: after it, not over this removal)
        pointer, _ = self.local.read_pointer()
        if pointer is not None and name in pointer.checkpoints:
            self.claim()
            self.local.remove(name)
        self.queue.submit(lambda: self.names.remove(name), f"removal of {self.durable.store.url(name)}")

    @property
    def unreachable(self) -> bool:
        """Whether the durable store failed the last request this writer sent it (an outage, until a persist
        succeeds)."""
        return self.health.unreachable

    def knows(self, name: str) -> bool:
        """Whether a checkpoint named ``name`` exists in either tier as far as this writer knows, without waiting
        for the durable store: the local tier's catalog, then the durable one as this writer last read or wrote it
        (read once if never; unknown while the store is down: no). ModelCheckpoint asks it at every save for its
        version counter (``-v1`` names), which would otherwise ask the store and stop the fit in an outage."""
        pointer, _ = self.local.read_pointer()
        if pointer is not None and name in pointer.checkpoints:
            return True
        return self.names.knows(name)

    def forget_stock(self, name: str) -> bool:
        return self.durable.writer.forget_stock(name)

    def hold(self, entry: Entry, why: str) -> None:
        """Keep ``entry``'s local folders from local retention until :meth:`release` (each hold counted)."""
        self.holds.hold(entry, why)

    def release(self, entry: Entry) -> None:
        self.holds.release(entry)

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
        self.health.status("pending", entry)
        self.queue.submit(lambda: self._persist(entry, older=older),
                          f"persist of {self.local.store.url(entry.commit)}")

    def _persist(self, entry: Entry, *, older: bool = False) -> None:
        dropped = False  # (taken off the queue by the decision below: a request queued since is not this job's)
        try:
            with self._lock:
                seen = self._asked_at  # the end of the fit's request this attempt decides with (if any)
                # (one the end of the fit asked for, a reported older state, is never superseded)
                superseded = not older and save_key(entry) != self._newest_key and entry.commit not in self._asked
                # Asked for now (the end of a fit, an emergency save): tried, unless a persist failed since it was.
                asked = (self._asked_at is not None and entry.commit in self._asked
                         and self._asked_failed_at < self._asked_at)
                # The store failed the last persist and its backoff has not passed: this one would wait out the
                # client's retries only to fail too (a second name of the same state, the end of the fit). It is
                # retried with the newest state at the first save after the backoff, as a failed one is.
                waits = not superseded and not asked and self.health.backing_off()
                if superseded or waits:
                    # Off the queue now, under the lock `_enqueue` takes: the end of a fit asking for this state from
                    # now on queues it anew. (Left pending until the `finally`, that request found it still queued
                    # and queued nothing, and the fit ended raising the old failure although the store was back.)
                    self._pending.discard(entry.commit)
                    dropped = True
            if superseded:
                # A newer state is queued behind this one: the durable tier gets that one instead, so a store slower
                # than the saves never builds a backlog (of uploads, or of held local checkpoints).
                log.info("not persisting %s (step %d): a newer save is queued after it", entry.commit, entry.step)
                return
            if waits:
                log.info("not persisting %s (step %d) now: the durable tier %s does not answer; retried after the"
                         " backoff", entry.commit, entry.step, self.durable.url)
                self.health.status("failed", entry)
                return
            for attempt in range(2):
                try:
                    self._publish(self.local.read_manifest(entry.commit))
                    break
                except StaleWriterError:
                    raise
                except Exception as exc:
                    with self._lock:
                        # Decided before the end of the fit asked for this state (a persist its save queued, failing
                        # with the outage it began in, after the store's own retries): not the attempt asked for,
                        # which is made now, once, in this job (before what is queued behind it, still held), and
                        # decides for the others. Not once the end of the fit gave up on the store.
                        again = (attempt == 0 and self._asked_at is not None and self._asked_at != seen
                                 and entry.commit in self._asked)
                        if entry.commit in self._asked and not again:  # (the others asked with it wait the backoff)
                            self._asked_failed_at = time.monotonic()
                    self.health.failed(entry, exc)
                    if not again:
                        return
            with self._lock:
                self._persisted.add(entry.commit)
            recovered = self.health.succeeded()
            self.names.persisted(entry.name)  # (a removal of the name that waited was of an older save)
            self.health.status("ok", entry)
            log.info("persisted %s to %s", entry.commit, self.durable.url)
            if recovered:
                log.warning("the durable tier %s takes checkpoints again (step %d persisted, after %d failed"
                            " persist(s))", self.durable.url, entry.step, recovered)
            self.names.run_deferred()
        finally:
            if not dropped:
                with self._lock:
                    self._pending.discard(entry.commit)  # a failed persist may be queued again
            self.release(entry)

    def _publish(self, manifest: Manifest) -> None:
        self.durable.writer.make_room(manifest.name)  # a stock file of that name (a run from before the plugin)
        try:
            copied = self.copier(manifest) if self.copier is not None else None
            if copied is not None:
                self.durable.publish(copied)
                return
            durable = self._copy(manifest)
            try:
                self.durable.publish(durable)
            except CheckpointError as exc:
                if isinstance(exc, StaleWriterError) or not self._lost_a_reference(durable):
                    raise
                # A durable commit whose objects this persist referenced left the durable catalog while it copied
                # (an operator's gc --keep-last, a removal), and the commit was refused: copy what it lacks now,
                # with the targets of the pointer as it is, once.
                log.info("persisting %s again: a durable checkpoint it referenced was dropped meanwhile (%s)",
                         manifest.commit, exc)
                self.durable.publish(self._copy(manifest))
        except BaseException as exc:
            self.durable.writer.abandon(manifest.commit, exc)
            self.durable.writer.put_back(manifest.name)
            raise

    def _lost_a_reference(self, durable: Manifest) -> bool:
        """Whether an object ``durable`` references outside its own folder lies in a folder the durable pointer no
        longer keeps live."""
        pointer, _ = self.durable.read_pointer()
        live = pointer.live_folders() if pointer is not None else set()
        return any(o.path.rsplit("/", 1)[0] not in live for o in durable.objects
                   if o.path.rsplit("/", 1)[0] != durable.commit)

    def copy_targets(self, manifest: Manifest) -> list[str]:
        """Where each of ``manifest``'s objects goes in the durable root: "" for one that is there already at its
        path (an object shared with another commit, of the same step or, with ``dedup``, an earlier one, whose
        folder is durable and live), another commit's path for one the durable root holds with the same bytes
        elsewhere (with ``dedup``: the frozen base a persist copied before, known by its digest), otherwise a path
        in this commit's own folder, where it is copied.

        A commit's own objects are always copied to their own paths, never referenced elsewhere: so a persisted
        folder holds every object the local folder of that name held, which is what makes "" right for any other
        commit that shares them. Copies land only in the commit's own folder: a target outside it is an object the
        durable root holds (:meth:`copy_objects` skips it), which the durable pointer update checks is still live."""
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
            elif (held := self.durable.writer.stored_like(obj, live) if self.durable.settings.dedup else None):
                targets.append(held)
            else:
                targets.append(f"{commit}/shared-{i:05d}-{obj.path.rsplit('/', 1)[-1]}")
        return targets

    def copy_objects(self, manifest: Manifest, indices: list[int], targets: list[str]) -> None:
        """Copy objects ``indices`` of ``manifest`` from the local tier to ``targets`` in the durable one, each
        verified against the manifest on the way (a damaged local copy is never persisted)."""
        def copy(i: int) -> int:
            obj, target = manifest.objects[i], targets[i]
            if not target or not target.startswith(f"{manifest.commit}/"):
                return 0  # held by the durable root already (see copy_targets)
            data = memoryview(self.local.store.read(obj.path))
            if manifest.chunk_size and chunk_digests([data], manifest.chunk_size) != obj.chunks:
                raise CheckpointCorruptedError(f"{self.local.store.url(obj.path)} does not match its manifest: the"
                                               " local copy is damaged and was not persisted",
                                               object=self.local.store.url(obj.path))
            self.durable.store.write_pieces(target, [data])
            self.queue.progress()
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
            with self._lock:
                self._asked_at = None  # (given up on: an attempt failing from now on is not made again for it)
            self.queue.abandon(self.durable.url)
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
        return self.queue.wait(stall=stall)

    def raise_error(self) -> None:
        """Raise a fatal error of a background persist (a fenced job, a bound passed): what a save raises."""
        self.health.raise_error()

    def raise_failure(self) -> None:
        """Raise a fatal error, else the failure of the last persist if it failed: what a caller that waits for the
        durable tier (the end of a fit, an emergency save, :meth:`AtomicCheckpointIO.wait`) must hear."""
        self.health.raise_failure()

    @property
    def failures(self) -> int:
        """Persists that failed in a row (0 once one succeeds)."""
        return self.health.failures

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
