"""Who may write a checkpoint root: the pointer's conditional updates, writer epochs (claims), lineage origins, holds.

The pointer (``.lightning_resilient/latest.json``) is the one mutable object of a root, and every change to it is a
compare-and-swap loop here (:meth:`WriterFence.update`). A job becomes the root's writer by *claiming* it: a writer
epoch higher than any before, so the job writing before it is fenced off (its next pointer update raises
``StaleWriterError``). A claim also records where the new writer's training came from (its *origin*), which defines
the lineage that resumes and retention follow. Folders that an update stops referencing are retired in the same write
(deleted later by ``retention``); a missing pointer is rebuilt from the manifests before any update, so an update
never forgets what is committed.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import uuid
import weakref
from collections.abc import Callable, Iterable

from lightning_resilient._warnings import warn
from lightning_resilient.errors import CheckpointError, StaleWriterError, UnfencedStoreError
from lightning_resilient.io.folders import writer_identity
from lightning_resilient.io.lineage import Origin
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest
from lightning_resilient.io.origin_records import OriginRecords
from lightning_resilient.io.pointer import LEGACY_NAMES, LEGACY_POINTER_NAME, POINTER_NAME, Entry, Pointer
from lightning_resilient.io.reader import RootReader
from lightning_resilient.io.retired import RetiredDeletions
from lightning_resilient.io.store import Store

__all__ = ["RESUMED", "WriterFence", "is_resumed", "protect"]

log = logging.getLogger(__name__)

_CAS_ATTEMPTS = 50
# The protection reason of the checkpoint a job resumed from starts with this (retention never drops it).
RESUMED = "resumed from"
# That of a checkpoint an earlier job resumed that the catalog does not name, kept while the lineage holds it.
_IN_LINEAGE = "a checkpoint of the lineage the catalog does not name"
_warned_fencing: set[str] = set()
# What a probe of each store client found (None: conditional writes enforced), so it runs once per client.
_probed: weakref.WeakKeyDictionary[Store, str | None] = weakref.WeakKeyDictionary()


class WriterFence:
    """One process's view of a root's pointer: reads it, updates it conditionally, claims the root as its writer."""

    def __init__(self, store: Store, reader: RootReader, *, allow_unfenced_store: bool = False) -> None:
        self.store = store
        self.reader = reader  # rebuilds a missing pointer from the manifests
        self.records = OriginRecords(store)  # each claim's record of its epoch, beside the pointer
        self.allow_unfenced_store = allow_unfenced_store
        self.writer = writer_identity()
        self.writer_epoch: int | None = None  # the writer epoch this process claimed, once it did
        #: The incarnation of the root (the pointer's ``root_id``) this process claimed, once it did: a root deleted
        #: and written again under the same URL starts its writer epochs over, so an epoch alone cannot tell a
        #: writer of the old incarnation from the new one's.
        self.root_id: str | None = None
        #: The incarnation this writer's commits name in their manifests: ``root_id`` for a root it claimed, the
        #: durable root's for a local tier it adopted (whose own pointer has a ``root_id`` of its own)
        self.lineage_id: str | None = None
        self.origin: Origin | None = None  # where this writer's training came from, once it claimed
        self.resumed_from: str | None = None
        #: What this process last loaded from the root: a fit that resumed from it claims the root with it as
        #: origin at its first save. A process that only reads never writes, so never claims (never fences).
        self.pending_resume: Entry | None = None
        self.pending_resume_elsewhere = False  # ``pending_resume`` is held by another tier (io/tiered.py), not here
        #: A checkpoint of another root this process's fit resumed from, to write this root (a fork): the origin of
        #: its claim when nothing of this root was loaded.
        self.pending_fork: Origin | None = None
        self._resumed_entry: Entry | None = None  # what this writer claimed with as its origin
        # Another writer's, when its claim got this writer's epoch again (see _record_origin): fenced for good.
        self._epoch_taken_by: str | None = None
        #: What this process deleted of the retired folders (their records leave the pointer at its next update).
        self.deletions = RetiredDeletions(store)
        # The pointer this process last wrote and its version: the next update tries its conditional write against
        # it without reading the pointer first (one round trip less per commit); if another process wrote since,
        # the condition fails and the update reads it.
        self._written: tuple[Pointer, str] | None = None

    @property
    def url(self) -> str:
        return self.store.root_url

    def read_pointer(self) -> tuple[Pointer | None, str | None]:
        """The pointer and its version (None when there is none, or only a legacy one: the next update creates it)."""
        pointer, version, _ = self._read_pointer()
        return pointer, version

    def _read_pointer(self) -> tuple[Pointer | None, str | None, bool]:
        got = self.store.read_versioned(POINTER_NAME)
        if got is not None:
            data, version = got
            return Pointer.from_bytes(data, where=self.store.url(POINTER_NAME)), version, False
        legacy = self.store.read_versioned(LEGACY_POINTER_NAME)  # a root written by release 0.1
        if legacy is None:
            return None, None, False
        pointer = Pointer.from_bytes(legacy[0], where=self.store.url(LEGACY_POINTER_NAME))
        if self.records.newest_epoch() > pointer.writer_epoch:
            # A leftover of a migration whose new pointer was lost since: older than what has been claimed, so
            # the root is read by scanning (never a licence to delete) instead of resuming an old state.
            return None, None, False
        return pointer, None, True

    def check_current_by_records(self) -> None:
        """Without a pointer (lost, not rebuilt yet): refuse this writer (``StaleWriterError``) when the origin
        records say a newer claim was made, or that the root was deleted and written again since its claim. What a
        job fenced before its first save checks before it takes over anything else (a node-local tier)."""
        if self.writer_epoch is None:
            return
        newest, root_id = self.records.newest()
        if self.root_id and root_id and root_id != self.root_id:
            raise StaleWriterError(self.url, self.writer_epoch, newest, "a job of the root written again",
                                   recreated=True)
        if newest > self.writer_epoch:
            raise StaleWriterError(self.url, self.writer_epoch, newest, "a newer job")

    def _drop_legacy_pointer(self) -> None:
        # The pointer now lives in the dot-folder and is read first: the old one is a stale copy. A reader that
        # found no new pointer a moment ago and then no old one either reads the root by scanning (never deletes).
        for name in sorted(LEGACY_NAMES):
            try:
                self.store.remove(name)
            except OSError as exc:  # cosmetic: it is never read again once the new pointer exists
                log.warning("could not remove the legacy %s: %s", self.store.url(name), exc)

    def update(self, mutate: Callable[[Pointer], Pointer | None], *, fenced: bool, retire_now: bool = False,
               defer_manifests: bool = False) -> tuple[Pointer, Pointer]:
        """Apply ``mutate`` to the current pointer with a compare-and-swap loop; returns (new, old).

        Folders the old pointer kept alive and the new one does not are retired in the same write (deletable
        after the next commit, or at once with ``retire_now``: an operator's explicit retention), and their
        manifests deleted once it landed (``defer_manifests``: by the caller, ``deletions.remove_manifests`` of the
        folders in new's ``retired`` and not in old's). A missing pointer is rebuilt from the manifests first, so an
        update never forgets what is committed.
        """
        cached, self._written = self._written, None
        for attempt in range(_CAS_ATTEMPTS):
            current: Pointer | None
            version: str | None
            if cached is not None:  # (what this process wrote last: its version is checked by the write below)
                current, version, legacy, cached = cached[0].copy(), cached[1], False, None
                guessed = True
            else:
                current, version, legacy = self._read_pointer()
                guessed = False
            if current is None:
                scan = self.reader.scan()
                base = scan.pointer()
                if scan.manifests or scan.max_epoch:
                    log.warning("%s is missing: rebuilt it from the %d manifest(s) under %s",
                                self.store.url(POINTER_NAME), len(scan.manifests), self.url)
                if self._resumed_entry is not None and self.writer_epoch == base.writer_epoch:
                    protect(base, self._resumed_entry, self.writer)  # this writer's own protection, lost with it
                _protect_resumed_strays(base, scan.manifests)
            else:
                base = current
            if fenced:
                try:
                    self.check_current(base)
                except StaleWriterError:
                    if guessed:
                        continue  # (read it: only a write proves a guess, and a guess never refuses this writer)
                    raise
            new = base.copy()
            self.deletions.prune(new)
            try:
                mutated = mutate(new)
            except Exception:
                if guessed:
                    continue  # (a guess decides nothing: read the pointer and decide on it)
                raise
            if mutated is None:
                if guessed:
                    continue  # nothing to change in what it wrote last: read whether that is still so
                return base, base
            live = new.live_folders()
            for folder in base.live_folders() - live:
                new.retired.setdefault(folder, -1 if retire_now else new.saves)
            for folder in [f for f in new.retired if f in live]:  # referenced again (a rebuilt catalog): keep it
                del new.retired[folder]
            new.txn = uuid.uuid4().hex
            # A pointer rebuilt from origin records that predate root_id has none: this writer's incarnation goes on.
            new.root_id = new.root_id or self.root_id or uuid.uuid4().hex
            written = self.store.write_versioned(POINTER_NAME, new.to_bytes(), version)
            if written is not None or self._landed(new):
                if current is None and not legacy and self._overtook_a_claim(new):
                    continue  # read again: a fenced writer is refused now, a claim claims above the newer one
                # A guess needs a condition the store enforces: without one, a stale writer would not be refused.
                self._written = (new.copy(), written) if written and self._conditions_enforced() else None
                if legacy:
                    self._drop_legacy_pointer()
                self.deletions.written(base, new)
                if not defer_manifests:
                    self.deletions.remove_manifests(set(new.retired) - set(base.retired))
                return new, base
            if not guessed:  # (a guess that missed is no contention: read at once)
                time.sleep(random.uniform(0, min(0.5, 0.01 * 2**attempt)))
        raise TimeoutError(f"could not update {self.store.url(POINTER_NAME)}: {_CAS_ATTEMPTS} conditional writes"
                           " in a row lost to other writers")

    def _conditions_enforced(self) -> bool:
        """Whether the store's conditional writes are known to be enforced (its probe found nothing ignored)."""
        return self.store.supports_cas and self.store in _probed and _probed[self.store] is None

    def _overtook_a_claim(self, new: Pointer) -> bool:
        """After this process created the pointer that was missing: whether a newer claim was lost by it. The create
        is conditional (only if there is none), but between this process's scan and its create a newer job may have
        claimed (creating the pointer) and the pointer been lost again: the create then succeeds and turns the root
        back to this writer epoch. Every claim records its epoch beside the pointer; one newer than ``new``'s means
        that happened. The pointer is then rebuilt again (if it is still the one created here), so that the newer
        claim holds again, and the caller's update reads it anew."""
        if self.records.newest_epoch() <= new.writer_epoch:
            return False
        got = self.store.read_versioned(POINTER_NAME)
        if got is not None and Pointer.from_bytes(got[0], where=self.store.url(POINTER_NAME)).txn == new.txn:
            restored = self.reader.scan().pointer()
            restored.root_id = restored.root_id or new.root_id
            restored.txn = uuid.uuid4().hex
            self.store.write_if(POINTER_NAME, restored.to_bytes(), got[1])
        log.warning("%s was lost twice while this writer (epoch %d) rebuilt it: a newer writer epoch claimed the root"
                    " meanwhile, so it was rebuilt again", self.store.url(POINTER_NAME), new.writer_epoch)
        return True

    def check_current(self, pointer: Pointer) -> None:
        """Raise ``StaleWriterError`` when ``pointer`` is no longer this writer's to change: a newer writer epoch
        claimed it, or it is another incarnation of the root (deleted and written again since this claim). A
        pointer rebuilt from the manifests keeps the incarnation its origin records name; one without a
        ``root_id`` (rebuilt from records that predate it) is this root's, whoever rebuilt it."""
        if self.writer_epoch is None:
            return
        if self._epoch_taken_by is not None:
            raise StaleWriterError(self.url, self.writer_epoch, self.writer_epoch, f"{self._epoch_taken_by}, which"
                                   " claimed this epoch again after the pointer was lost")
        if self.root_id and pointer.root_id and pointer.root_id != self.root_id:
            raise StaleWriterError(self.url, self.writer_epoch, pointer.writer_epoch, pointer.writer, recreated=True)
        if pointer.writer_epoch > self.writer_epoch:
            raise StaleWriterError(self.url, self.writer_epoch, pointer.writer_epoch, pointer.writer)

    def _landed(self, new: Pointer) -> bool:
        # The swap failed: someone else wrote, or our own write landed and only its response was lost (the retried
        # request then fails its precondition). The txn tells which.
        try:
            again, _ = self.read_pointer()
        except CheckpointError:
            return False
        return again is not None and again.txn == new.txn

    def claim(self, *, resumed_from: Entry | None = None) -> int:
        """Become the writer of this root: a newer epoch than any before, so older jobs are fenced off.

        ``resumed_from`` (default: what this process loaded from the root) is the origin of this writer's lineage:
        it becomes the latest, and checkpoints of older epochs after it are an abandoned branch from now on. None
        is a fresh start, or a fork when this process's fit resumed a checkpoint of another root (:meth:`forked`):
        every older checkpoint is then an abandoned branch (kept until ``gc --abandoned``).

        An origin that only the node-local tier holds (see :mod:`~lightning_resilient.io.tiered`, where
        ``pending_resume_elsewhere`` is set) is recorded as the lineage's origin all the same; this root cannot
        protect or name it as latest, and its own checkpoints up to the origin's step stay the lineage's fallbacks.
        """
        elsewhere = resumed_from is None and self.pending_resume_elsewhere
        if resumed_from is None:
            resumed_from = self.pending_resume
        self.check_fencing()
        fork = self.pending_fork if resumed_from is None else None
        if resumed_from is not None:
            origin = Origin(resumed_from.commit, resumed_from.writer_epoch, resumed_from.step)
        else:
            origin = fork or Origin(None)
        if resumed_from is not None and not elsewhere \
                and not self.store.exists(f"{resumed_from.commit}/{MANIFEST_NAME}"):
            raise self._origin_gone(resumed_from)

        # What the run's ModelCheckpoints report from now on: what they reported at the save this job resumed (a
        # resume restores their state from it), nothing for a fresh start or a fork (their state is new, or names
        # another folder). Unknown (an origin held elsewhere, a save that carried no ModelCheckpoint state): as before.
        reported: list[str] | None = [] if resumed_from is None else None
        if resumed_from is not None and not elsewhere:
            resumed_from, reported = self._as_stored_here(resumed_from)

        fresh_over: list[Entry] = []
        recorded = [origin]

        def bump(p: Pointer) -> Pointer:
            if resumed_from is not None and not elsewhere and resumed_from.commit in p.retired:
                raise self._origin_gone(resumed_from)
            fresh_over[:] = p.candidates()[:1] if resumed_from is None else []
            p.writer_epoch += 1
            p.writer = self.writer
            # With the chain it continues, from the origins known now: pruned later (here, by gc), they stay known.
            recorded[0] = p.origins[p.writer_epoch] = origin.with_ancestors(p.origins)
            # The newest checkpoint of the new lineage: what a restart of this job resumes until it saves (with an
            # origin held elsewhere, this root's newest checkpoint of the lineage it continues).
            p.latest = resumed_from if not elsewhere else next(iter(p.lineage().members(p.entries())), None)
            # Protections belong to the job that set them; this job protects what it resumed from. Only a checkpoint
            # an earlier job resumed that the pointer does not name (a stray), and that this job's lineage continues,
            # stays kept: nothing else keeps it, and a lineage never loses a checkpoint to a claim.
            p.protected = _strays_of_the_lineage(p)
            if resumed_from is not None and not elsewhere:
                protect(p, resumed_from, self.writer)
            if reported is not None:
                p.reported = list(reported)
            _prune_origins(p)
            return p

        new, _ = self.update(bump, fenced=False)
        # A migration that died before deleting it. (A read, one request: an existence check on S3 is a HEAD, then a
        # listing when the object is missing, as it is on every root but one such migration left.)
        if self.store.read_versioned(LEGACY_POINTER_NAME) is not None:
            self._drop_legacy_pointer()
        self.writer_epoch, self.root_id = new.writer_epoch, new.root_id
        self.lineage_id = new.root_id
        origin = self.origin = recorded[0]
        self._resumed_entry = resumed_from if not elsewhere else None
        # After the swap (a record is only ever written for an epoch that was claimed): a crash between the two loses
        # nothing while the pointer lives (it holds the origin too); only a pointer lost as well makes a rebuild guess.
        self._record_origin(self.writer_epoch, origin)

        self.resumed_from = resumed_from.commit if resumed_from else None
        self.pending_resume = None
        self.pending_resume_elsewhere = False
        self.pending_fork = None
        if fresh_over and fork is not None:
            warn(f"this job forked {fork.root}'s checkpoint {fork.commit} (step {fork.step}) into {self.url}, which"
                 f" holds another run up to step {fresh_over[0].step}; that run is kept as an abandoned branch (until"
                 " gc --abandoned). Give the fork a ModelCheckpoint dirpath of its own to keep the two apart.",
                 RuntimeWarning)
        elif fresh_over:
            # Legitimate (a new experiment in the same folder), but more often a resume that found nothing:
            # ckpt_path="last" on S3/GCS (Lightning lists last*.ckpt without the protocol and finds none) or a
            # forgotten ckpt_path. Nothing is lost: the old run stays, an abandoned branch, until gc --abandoned.
            warn(f"this job started from scratch (no checkpoint loaded) in {self.url}, which holds a run up to step"
                 f" {fresh_over[0].step}; that run is kept as an abandoned branch. To resume it instead, pass"
                 f" ckpt_path=find_latest_checkpoint({self.url!r}) (ckpt_path=\"last\" finds nothing on S3/GCS:"
                 " Lightning"
                 " lists last.ckpt without its protocol); with Lightning Fabric, load it with the same plugin before"
                 " the first save: fabric.load(find_latest_checkpoint(root), state).", RuntimeWarning)
        log.info("claimed %s as writer epoch %d (%s), %s", self.url, self.writer_epoch, self.writer,
                 f"resuming {resumed_from.commit}" if resumed_from else
                 f"forked from {fork.root}/{fork.commit}" if fork else "starting fresh")
        return self.writer_epoch

    def _as_stored_here(self, entry: Entry) -> tuple[Entry, list[str] | None]:
        """``entry`` as this root stores its commit (from its manifest here), and the names the ModelCheckpoints
        reported at its save (None when unknown). A commit persisted from a node's local tier keeps its name but not
        always its folders: objects it shared with a local commit that was never persisted were copied into its own
        folder, or are referenced in another durable one. What a job resumed from a local copy is protected and named
        latest with this root's folders, never with the local tier's (which this root may not hold: it would keep them
        live, and a persist would reference objects that are not here)."""
        try:
            manifest = self.reader.read_manifest(entry.commit)
        except (CheckpointError, OSError) as exc:  # the claim goes on; the pointer keeps what it reported before
            log.warning("could not read the manifest of %s, the checkpoint this job resumed from: %s",
                        self.store.url(entry.commit), exc)
            # Its own folder only: the folders the caller's view names may not be this root's.
            return dataclasses.replace(entry, folders=(entry.commit,)), None
        return Entry.from_manifest(manifest), manifest.reported

    def _origin_gone(self, resumed: Entry) -> CheckpointError:
        return CheckpointError(
            f"{self.store.url(resumed.commit)}, the checkpoint this job resumed from, was deleted before this job"
            f" claimed {self.url}: by the retention of a job still writing it, or by gc (a checkpoint no catalog"
            " names: its writer died before committing it). This job's lineage cannot be recorded: nothing of it was"
            " committed. Stop the old job if one runs, then run this one again: it resumes the newest checkpoint. (A"
            " fit that resumes claims the root as soon as it loads, unless claim_on_load=False; Fabric and a plain"
            " load claim at the first save.)")

    def _record_origin(self, epoch: int, origin: Origin) -> None:
        """Record writer epoch ``epoch``'s origin beside the pointer (``origin_records.py``), so that the lineage
        survives a lost pointer even for a job that dies before its first commit. A record of this epoch by another
        writer means that another claim got the same epoch: this claim's pointer swap left no trace before the
        pointer was lost (no record yet, no folder), the rebuilt pointer did not count it, and a newer job claimed
        that epoch again. This writer is then fenced for good (:class:`~lightning_resilient.StaleWriterError` now and
        at every later update): two writers of one epoch would pass each other's fence."""
        holder = self.records.create(epoch, origin, self.writer, self.root_id or "")
        if holder is not None:
            self._epoch_taken_by = holder
            raise StaleWriterError(self.url, epoch, epoch, f"{holder}, which claimed this epoch again after the"
                                   " pointer was lost")

    def check_fencing(self) -> None:
        """Before this process writes the root as its writer (and when ``fit`` starts): refuse a store that accepts
        conditional writes without enforcing them (a server, or a proxy in front of it, that ignores the conditions),
        since two jobs would then overwrite each other's pointer, silently losing checkpoints; with
        ``allow_unfenced_store`` (the user knows one job at a time writes the root), warn once instead. The store is
        probed once per store client. A store without any conditional write warns by itself (see ``Store``)."""
        if not self.store.supports_cas:
            return
        if self.store not in _probed:
            _probed[self.store] = self.store.check_fencing()
        reason = _probed[self.store]
        if reason is None:
            return
        conditions = self.store.conditions
        ignored = f"{conditions.replace} / {conditions.create}" if conditions is not None else "its conditions"
        if not self.allow_unfenced_store:
            raise UnfencedStoreError(
                f"writer fencing cannot work on {self.url}: {reason}, so the store (or a proxy in front of it) ignores"
                f" the conditions of conditional writes ({ignored}). Two jobs writing this root at once would"
                " overwrite each other's pointer and lose checkpoints without an error. Reach the store through an"
                " endpoint that enforces them, or, if you are sure only one job at a time ever writes this root, pass"
                " AtomicCheckpointIO(allow_unfenced_store=True).")
        if self.url not in _warned_fencing:
            _warned_fencing.add(self.url)
            warn(f"writer fencing is OFF for {self.url}: {reason} (the store ignores {ignored}), so two jobs writing"
                 " this root at once can overwrite each other's pointer (last writer wins); allowed by"
                 " allow_unfenced_store=True. Checkpoints stay atomic and verified; make sure only one job writes the"
                 " root (stop the old one before starting its replacement).", RuntimeWarning)

    def adopt(self, epoch: int, origin: Origin, origins: dict[int, Origin], lineage_id: str = "") -> Pointer:
        """Write this root as writer epoch ``epoch`` of another root: the node-local tier of a durable root whose
        claim gave ``epoch`` and ``origin`` (``origins``: that root's lineage; ``lineage_id``: its incarnation).
        Commits here then carry the durable writer epoch, lineage and incarnation, so the two tiers order and compare
        their checkpoints alike, and a commit persisted from here belongs to the durable root's incarnation.

        A newer epoch already adopted here (a newer job on this node) makes this writer stale. Local checkpoints
        outside the adopted lineage can never be resumed again (a lineage only grows): they are dropped. What the
        job resumed from, when only this tier holds it and its catalog does not name it (a local save whose writer
        died before its pointer move), is protected with its data, as a claim protects what it resumed; so are
        such strays earlier adopters resumed that the lineage still holds (``gc`` collects every other stray).
        """
        resumed = self._stray_here(origin)

        def bump(p: Pointer) -> Pointer:
            if p.writer_epoch > epoch:
                raise StaleWriterError(self.url, epoch, p.writer_epoch, p.writer)
            p.writer_epoch = epoch
            p.writer = self.writer
            p.origins.update(origins)
            p.origins[epoch] = origin
            p.protected = _strays_of_the_lineage(p)
            if resumed is not None and resumed.commit not in {e.commit for e in p.entries()}:
                protect(p, resumed, self.writer)
            for entry in p.lineage().outside(p.entries()):
                p.checkpoints.pop(entry.name, None)
            p.latest = next(iter(p.lineage().members(p.entries())), None)
            _prune_origins(p)
            return p

        new, _ = self.update(bump, fenced=False)
        self.writer_epoch, self.origin, self.root_id = epoch, origin, new.root_id
        self.lineage_id = lineage_id
        return new

    def _stray_here(self, origin: Origin) -> Entry | None:
        """The checkpoint ``origin`` names, when this root holds it (None: a fresh start, a fork, or not here)."""
        if not origin.here or not self.store.exists(f"{origin.commit}/{MANIFEST_NAME}"):
            return None
        try:
            return Entry.from_manifest(self.reader.read_manifest(str(origin.commit)))
        except CheckpointError as exc:  # a damaged one protects nothing: the resume read it whole, or fell back
            log.warning("could not read what this job resumed from, %s: %s", self.store.url(str(origin.commit)), exc)
            return None

    def hold(self, folders: Iterable[str], why: str) -> None:
        """Keep ``folders`` (of committed checkpoints) from retention until :meth:`release`: they are to be copied.
        Recorded in the pointer, so a ``gc`` run by another process keeps them too; a writer's next claim or adopt
        drops what a dead one held."""
        folders = list(folders)

        def add(p: Pointer) -> Pointer:
            for folder in folders:
                p.protected[folder] = why
            return p

        self.update(add, fenced=False)

    def release(self, folders: Iterable[str]) -> Pointer:
        """End :meth:`hold` of ``folders``; returns the new pointer (retention deletes what is now due)."""
        folders = list(folders)

        def drop(p: Pointer) -> Pointer | None:
            dropped = [f for f in folders if p.protected.pop(f, None) is not None]
            return p if dropped else None

        new, _ = self.update(drop, fenced=False)
        return new

    def forked(self, entry: Entry, root: str) -> None:
        """Record that this process's fit, which writes this root, resumed ``entry`` of the root ``root`` (a fork):
        the origin of its claim here, unless it loads from this root too."""
        if self.writer_epoch is None:
            self.pending_fork = Origin(entry.commit, entry.writer_epoch, entry.step, root=root)

    def resumed(self, entry: Entry, *, elsewhere: bool = False) -> None:
        """Record that this process loaded ``entry`` from the root (a fit's resume claims with it as origin);
        ``elsewhere``: only the root's node-local tier holds it (see :meth:`claim`)."""
        if self.writer_epoch is None:
            self.pending_resume = entry
            self.pending_resume_elsewhere = elsewhere


def _prune_origins(p: Pointer) -> None:
    """Forget the origins of epochs older than every checkpoint the pointer still names: no lineage reaches them.
    Those of the current lineage's chain down to the epoch that resumed a protected checkpoint stay: they tell that
    the checkpoint is in the lineage (see ``_strays_of_the_lineage``); so does the epoch of the current writer's
    origin when only a local tier holds it."""
    epochs = [e.writer_epoch for e in p.entries()] + [p.writer_epoch]
    oldest = min(epochs)
    keep = {k for k in p.origins if k >= oldest}
    chain: list[int] = []
    epoch = p.writer_epoch
    while epoch in p.origins and epoch not in chain:
        chain.append(epoch)
        origin = p.origins[epoch]
        if not origin.here or origin.writer_epoch >= epoch:
            break
        epoch = origin.writer_epoch
    needed = [i for i, e in enumerate(chain) if p.origins[e].commit in p.protected]
    if needed:
        keep.update(chain[:needed[-1] + 1])
    # The current writer's origin, when the pointer does not list it, is held elsewhere (a node's local tier, never
    # persisted): its epoch stays too, or a restart before this writer's first commit would not count that tier's
    # checkpoints as the lineage's (TierView.local_entries) and could resume nothing. (Only the head's: once this
    # writer commits, the next claim prunes as before, and the pointer stays bounded.)
    head = p.origins.get(p.writer_epoch)
    if head is not None and head.here and head.commit not in {e.commit for e in p.entries()}:
        keep.add(head.writer_epoch)
    p.origins = {k: v for k, v in p.origins.items() if k in keep}


def _resumer(why: str) -> str | None:
    """The writer a protection reason says resumed the checkpoint (None: not such a reason)."""
    if why.startswith(f"{RESUMED} by "):
        return why[len(f"{RESUMED} by "):]
    if why.startswith(f"{_IN_LINEAGE} (resumed by ") and why.endswith(")"):
        return why[len(f"{_IN_LINEAGE} (resumed by "):-1]
    return None


def _data_reason(writer: str) -> str:
    return f"data of the checkpoint {writer} resumed from"


def _strays_of_the_lineage(p: Pointer) -> dict[str, str]:
    """Of ``p``'s protections (the job before the claim updating ``p``, and those it kept), what stays protected:
    each checkpoint a job resumed that the catalog does not name (a stray: its writer stopped between its manifest
    and its pointer move) and that ``p``'s lineage holds, with the folders its data lies in. The catalog keeps
    every other checkpoint a later job may need; this one only its protection does."""
    cataloged = {e.commit for e in p.entries()}
    where = {o.commit: (o.writer_epoch, o.step) for o in p.origins.values() if o.here}
    lineage = p.lineage()
    kept: dict[str, str] = {}
    for commit, why in p.protected.items():
        writer = _resumer(why)
        if writer is None or commit in cataloged or commit not in where or not lineage.holds(*where[commit]):
            continue
        kept[commit] = f"{_IN_LINEAGE} (resumed by {writer})"
        kept.update((f, other) for f, other in p.protected.items() if other == _data_reason(writer) and f not in kept)
    return kept


def _protect_resumed_strays(p: Pointer, manifests: list[Manifest]) -> None:
    """In a pointer rebuilt after a loss (its protections lost with it): keep, as the lost pointer's protections
    did (``_strays_of_the_lineage``), each commit an epoch of the lineage resumed from that no name catalogs (its
    name went to a newer commit, or its writer died before its pointer move), with the folders its data lies in.
    Otherwise retention takes the folder of data it shares with a cataloged checkpoint of its step when it drops
    that one, and the commit a later resume may still read is left without its data."""
    cataloged = {e.commit for e in p.entries()}
    found = {m.commit: m for m in manifests}
    lineage = p.lineage()
    for epoch, origin in sorted(p.origins.items()):
        manifest = found.get(origin.commit or "")
        if (manifest is None or not origin.here or origin.commit in cataloged or epoch not in lineage.bounds
                or not lineage.holds(origin.writer_epoch, origin.step)):
            continue
        writer = f"writer epoch {epoch}"
        for folder in manifest.folders:
            p.protected.setdefault(folder, _data_reason(writer))
        # (setdefault: what this writer itself resumed from keeps its own reason, which says so: ``is_resumed``)
        p.protected.setdefault(manifest.commit, f"{_IN_LINEAGE} (resumed by {writer})")


def protect(p: Pointer, resumed: Entry, writer: str) -> None:
    """Keep what ``writer`` resumed from (and the folders its data lies in) from retention, in ``p``."""
    p.protected.update(dict.fromkeys(resumed.folders, _data_reason(writer)))
    p.protected[resumed.commit] = f"{RESUMED} by {writer}"


def is_resumed(p: Pointer, entry: Entry) -> bool:
    """Whether ``entry`` is what the job writing ``p`` resumed from."""
    return p.protected.get(entry.commit, "").startswith(RESUMED)


