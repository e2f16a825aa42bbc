"""What may be deleted from a checkpoint root, and when: retention, the deletion of retired folders, garbage collection.

Nothing else in the package deletes a committed checkpoint's data. The rules (each enforced here):

- a folder the pointer no longer references (``keep_last``, Lightning's removals, a name saved again) is *retired*:
  recorded in the pointer, its manifest deleted at once (it is no checkpoint any more, even for a pointer rebuilt
  after a loss), and its data once a later commit has happened: a reader already reading it has a save interval to
  finish. Two events stand in for a later commit that will not come: the end of the writer's fit
  (:meth:`Retention.end_of_writer`, so that a finished run holds what Lightning kept and nothing more), and, for an
  operator's ``gc``, a pointer that has not changed for ``orphan_grace_seconds`` (the job that retired them stopped);
- a folder the pointer does not reference, written by a writer epoch older than the pointer's (a fenced writer,
  which can never commit it): without a manifest (a crashed upload), or with one (a *stray*: the writer died between
  its manifest and the pointer update, so no catalog ever named it), unless a job resumed it (the pointer then
  protects it). A stray inside the current lineage is collected too: no retention counts it, so it would outlive
  the folders whose objects it shares. A save in progress of the current writer is never touched, whatever its age
  or the clocks;
- with ``gc --abandoned`` only: checkpoints the pointer catalogs outside the current lineage (a branch a rollback
  left behind).

A folder with a manifest is a committed checkpoint whatever the pointer says: a missing pointer makes nothing
deletable (it is rebuilt from the manifests), a damaged one stops collection until it is repaired, and a commit the
pointer does not reference is kept for ``orphan_grace_seconds`` (by the store's timestamps) and while a job resumed
it; ``gc`` reads the pointer again before it deletes, so a stray a claim (or a rebuild) made live meanwhile is kept.
The latest checkpoint and the one a job
resumed from are never dropped, nor is a checkpoint whose name a ``ModelCheckpoint`` of the run still reports
(``best_model_path``, ``best_k_models``, ``last_model_path``: the pointer's ``reported``, see ``reported.py``):
``keep_last`` keeps the newest states as before, and a reported checkpoint older than those besides them (in a
node-local tier too: with ``persist_every`` > 1 the best checkpoint's only copy may be there until the end of the fit
persists it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable

from lightning_resilient.errors import CheckpointCorruptedError, StaleWriterError, UnsupportedFormatError
from lightning_resilient.io.fencing import WriterFence, is_resumed
from lightning_resilient.io.folders import TIER_RECORD, writer_epoch_of
from lightning_resilient.io.lineage import Lineage
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.origin_records import OriginRecords
from lightning_resilient.io.pointer import LEGACY_NAMES, LEGACY_POINTER_NAME, POINTER_NAME, Entry, Pointer
from lightning_resilient.io.reader import RootReader
from lightning_resilient.io.store import Store

__all__ = ["Retention"]

log = logging.getLogger(__name__)


class Retention:
    """Drops checkpoints from a root's catalog and deletes what no committed checkpoint needs."""

    def __init__(self, store: Store, fence: WriterFence, reader: RootReader, *, keep_last: int | None,
                 orphan_grace_seconds: float) -> None:
        self.store = store
        self.fence = fence
        self.reader = reader
        self.keep_last = keep_last
        self.orphan_grace_seconds = orphan_grace_seconds

    @property
    def url(self) -> str:
        return self.store.root_url

    def apply_keep_last(self, p: Pointer) -> None:
        """Inside a pointer update of a commit: drop what ``keep_last`` no longer keeps (retired by the update)."""
        if self.keep_last is not None:
            for entry in _beyond(p, self.keep_last):
                del p.checkpoints[entry.name]

    def retain(self, keep_last: int, *, dry_run: bool = False) -> list[Entry]:
        """Drop all but the ``keep_last`` newest checkpoints of the current lineage now (an operator's retention).

        The latest, what a job resumed from and what a ModelCheckpoint still reports are kept; abandoned branches are
        not counted (``gc --abandoned``).
        Does not claim the root: a job writing it is not fenced, and the conditional pointer update makes this
        safe to run beside it. Returns what was (would be) dropped.
        """
        return self._drop_now(lambda p: _beyond(p, keep_last), dry_run)

    def drop_abandoned(self, *, dry_run: bool = False) -> list[Entry]:
        """Drop from the catalog every checkpoint outside the current lineage (an operator's ``gc --abandoned``)."""
        return self._drop_now(_abandoned, dry_run)

    def _drop_now(self, select: Callable[[Pointer], list[Entry]], dry_run: bool) -> list[Entry]:
        """An operator's drop of what ``select`` picks from the pointer (chosen again on every try of the update):
        retired at once, deleted now. Returns what was (would be) dropped."""
        pointer, _ = self.fence.read_pointer()
        if pointer is None or dry_run:
            return select(pointer) if pointer is not None else []
        dropped: list[Entry] = []

        def drop(p: Pointer) -> Pointer | None:
            dropped[:] = select(p)
            for entry in dropped:
                del p.checkpoints[entry.name]
            return p if dropped else None

        new, _ = self.fence.update(drop, fenced=False, retire_now=True)
        self.delete_retired(new)
        return dropped

    def drop(self, commits: set[str], *, dry_run: bool = False) -> list[Entry]:
        """Drop the checkpoints ``commits`` from the catalog now and delete them (an operator's ``gc`` of a local
        tier, for its checkpoints outside the durable lineage). Returns what was (would be) dropped."""
        pointer, _ = self.fence.read_pointer()
        if pointer is None:
            return []
        if dry_run:
            return [e for e in pointer.entries() if e.commit in commits]
        dropped: list[Entry] = []

        def mutate(p: Pointer) -> Pointer | None:
            dropped[:] = [e for e in p.entries() if e.commit in commits]
            for entry in dropped:
                p.checkpoints.pop(entry.name, None)
                if p.latest is not None and p.latest.commit == entry.commit:
                    p.latest = None
            return p if dropped else None

        new, _ = self.fence.update(mutate, fenced=False, retire_now=True)
        self.delete_retired(new)
        return dropped

    def discard(self, commit: str) -> None:
        """Delete an uncommitted folder (best effort)."""
        try:
            self.store.remove(commit)
        except Exception as exc:
            log.warning("could not delete uncommitted %s: %s", self.store.url(commit), exc)

    def delete_committed(self, folder: str) -> bool:
        """Delete a retired (or abandoned) committed folder: its manifest first, so that a deletion interrupted
        half-way leaves a folder without a manifest (never a checkpoint with missing objects); one this process
        deleted when it retired the folder is not asked for again."""
        try:
            if not self.fence.deletions.manifest_removed(folder):
                self.store.remove_object(f"{folder}/{MANIFEST_NAME}")  # one object: one request (no listing, no stat)
            self.store.remove(folder)
        except Exception as exc:
            log.warning("could not delete %s: %s", self.store.url(folder), exc)
            return False
        return True

    def delete_retired(self, pointer: Pointer) -> list[str]:
        """Delete the retired folders whose time has come (a commit happened since they were retired)."""
        deleted = [f for f in sorted(pointer.retired_due()) if self.delete_committed(f)]
        self.fence.deletions.deleted(deleted)
        self.tidy_names({f.split("/", 1)[0] for f in deleted})
        return deleted

    def end_of_writer(self) -> list[str]:
        """This process's fit of the root has ended (the plugin's teardown): delete the folders it retired that are
        still waiting for a later commit (the last top-k removal, the last ``keep_last`` drop), and prune the
        records of what it deleted from the pointer. Returns the folders deleted.

        Why this is safe for readers, though no later commit gave them a save interval: a retired folder lost its
        manifest when it was retired, so no reader resolves it any more, and none ever loads part of it (every
        chunk is verified against a manifest read before); a reader that resolved it before and is still reading
        finds its objects gone, which the catalog tells from damage (the pointer no longer names it, its manifest
        is gone) and answers by resolving again to the newer checkpoint that replaced it (a reader that named that
        very commit is told it was deleted by retention). Held folders (being copied) and what a job resumed from
        are live, never retired. Waiting instead for the next commit would keep checkpoints Lightning removed until
        the next job's first save, and for ever once the run is done. Only the root's current writer does it: once
        a newer job has claimed the root, its own commits delete them."""
        if self.fence.writer_epoch is None:
            return []
        pointer, _ = self.fence.read_pointer()
        if pointer is None or pointer.writer_epoch != self.fence.writer_epoch:
            return []
        try:
            self.fence.check_current(pointer)
        except StaleWriterError:
            return []
        waiting = sorted(set(pointer.retired) - pointer.live_folders())
        deleted = [folder for folder in waiting if self.delete_committed(folder)]
        self.fence.deletions.deleted(deleted)
        self.tidy_names({f.split("/", 1)[0] for f in deleted})
        if self.fence.deletions.any:
            # The records of what it deleted leave the pointer. A newer writer that claimed meanwhile prunes them at
            # its next update instead (deleting a folder that is gone already is a no-op).
            with contextlib.suppress(StaleWriterError):
                self.fence.update(lambda p: p, fenced=True)
        if deleted:
            log.info("the fit writing %s ended: deleted the %d folder(s) it retired since its last commit", self.url,
                     len(deleted))
        return deleted

    def tidy_names(self, names: set[str]) -> None:
        # Local disk keeps empty name folders after their last commit is deleted; object stores have none.
        if not self.store.supports_read_into:  # i.e. not local disk
            return
        for name in names:
            with contextlib.suppress(OSError):  # not empty (a save of that name since), or gone already
                os.rmdir(self.store.path(name))

    def collect_garbage(self, *, dry_run: bool = False, abandoned: bool = False) -> list[tuple[str, str]]:
        """Delete what no committed checkpoint of the root needs; returns ``(url, why)`` of each folder deleted
        (or, with ``dry_run``, that would be).

        - retired folders whose time has come (a commit has happened since retention dropped them), or, for an
          operator's collection (this process does not write the root), whose pointer has not changed for
          ``orphan_grace_seconds`` (measured from the store's timestamp of the pointer, by this host's clock: a
          skewed clock only shortens or lengthens the time a reader that was reading one had to finish, since a
          retired folder is never loaded again);
        - folders the pointer does not reference, of a writer epoch older than the pointer's (their writer is
          fenced, so it can never commit them): those without a manifest, and those with one (a stray: the writer
          died between its manifest and the pointer update), inside the current lineage or not. A stray no job
          resumed is no checkpoint of the catalog, so retention never counts it and may delete the folders whose
          objects it shares (``last.ckpt`` saved at a top-k save's step, or an incremental save); kept, it would
          outlive them with a manifest naming objects that are gone. One a job resumed is live (the pointer protects
          it while the lineage holds it, with the folders of its data). A save in progress of the current writer is
          never touched, whatever its age or the clocks. ``orphan_grace_seconds`` leaves such a folder a while
          longer, measured with the store's own timestamps (its newest object against the pointer's last write),
          never against this host's clock;
        - with ``abandoned`` only: checkpoints the pointer catalogs outside the current lineage (a branch a
          rollback left behind).

        Also aborts incomplete multipart uploads and removes temp files of interrupted pointer writes. Without a
        pointer nothing is deleted (a missing pointer is never a licence to delete); a damaged one raises.
        """
        pointer, _ = self.fence.read_pointer()
        if pointer is None:
            if self.reader.scan().manifests:
                log.warning("%s is missing: nothing collected under %s (its checkpoints are found by scanning; the"
                            " next save, or repair_pointer, rebuilds it)", self.store.url(POINTER_NAME), self.url)
            return []
        doomed: list[tuple[str, str]] = []
        if abandoned:
            dropped = self.drop_abandoned(dry_run=dry_run)
            # A folder goes only when no checkpoint left needs it (last.ckpt shares the data of a top-k save at its
            # step), and is listed once, whichever checkpoints it served.
            remaining = pointer.copy()
            for entry in dropped:
                remaining.checkpoints.pop(entry.name, None)
            kept = remaining.live_folders()
            def why(entry: Entry) -> str:
                return f"checkpoint {entry.name} (step {entry.step}) of an abandoned branch"

            # Each folder under the checkpoint it holds the manifest of, before those that only share its data.
            doomed += [(self.store.url(e.commit), why(e)) for e in dropped if e.commit not in kept]
            doomed += [(self.store.url(f), why(e)) for e in dropped for f in e.folders if f not in kept]
            pointer, _ = self.fence.read_pointer()
            if pointer is None:
                return _once(doomed)
        head, live, due = pointer.writer_epoch, pointer.live_folders(), pointer.retired_due()
        lineage = pointer.lineage()
        written = self.store.modified(POINTER_NAME) or self.store.modified(LEGACY_POINTER_NAME)
        reference = written or time.time()
        grace = self.orphan_grace_seconds
        if self.fence.writer_epoch is None and written is not None and time.time() - written >= grace:
            due = set(pointer.retired)  # the job that retired them has not committed for the grace period
        partial: list[str] = []
        committed: list[str] = []
        # The incarnation this root's commits name: a local tier's are the durable root's (its record says which;
        # the tier's own pointer has an id of its own), any other root's its pointer's
        incarnation = pointer.root_id
        with contextlib.suppress(FileNotFoundError, KeyError, ValueError, TypeError):
            incarnation = str(json.loads(self.store.read(TIER_RECORD))["root_id"])
        for name in self.store.list_dir(""):
            if name in LEGACY_NAMES or name.startswith("."):
                continue
            for child in self.store.list_dir(name):
                epoch, folder = writer_epoch_of(child), f"{name}/{child}"
                if epoch is None or folder in live:
                    continue
                if folder in pointer.retired:
                    if folder in due:
                        committed.append(folder)
                        doomed.append((self.store.url(folder), "retired by retention"))
                    continue
                if epoch >= head:
                    continue  # the current writer may still commit it: never collected, whatever its age
                objects = self.store.list_detail(folder)
                newest = max((o.modified for o in objects.values() if o.modified is not None), default=None)
                if newest is not None and reference - newest < grace:
                    continue
                if MANIFEST_NAME not in objects:
                    partial.append(folder)
                    doomed.append((self.store.url(folder), f"no manifest, written by fenced writer epoch {epoch}"))
                elif (where := self._stray(lineage, folder, incarnation)) is not None:
                    # Its writer died (or was fenced) between the manifest and the pointer update: never cataloged,
                    # and no job resumed it (that one is live), so nothing needs it.
                    committed.append(folder)
                    doomed.append((self.store.url(folder), (f"manifest never referenced by the pointer, writer epoch"
                                                            f" {epoch} fenced, {where} the current lineage")))
        if not dry_run and (partial or committed):
            # A claim that resumed a stray protects it, and a pointer rebuilt after a loss catalogs it: either may
            # have happened since the pointer was read above. Read it again and keep what it references now (the
            # window left is this read to the deletes below); without a pointer, delete nothing.
            again, _ = self.fence.read_pointer()
            now = again.live_folders() if again is not None else None
            referenced = [f for f in partial + committed if now is None or f in now]
            if referenced:
                log.info("gc under %s keeps %d folder(s) the pointer references since it was read", self.url,
                         len(referenced))
                partial = [f for f in partial if f not in referenced]
                committed = [f for f in committed if f not in referenced]
                gone = {self.store.url(f) for f in referenced}
                doomed = [(url, why) for url, why in doomed if url not in gone]
        if not dry_run:
            for folder in partial:
                self.discard(folder)
            deleted = [f for f in committed if self.delete_committed(f)]
            self.tidy_names({f.split("/", 1)[0] for f in partial + deleted})
            self.fence.deletions.deleted(f for f in deleted if f in pointer.retired)
            if self.fence.deletions.any and self.fence.writer_epoch is None:
                # A writer prunes the records of what it deleted at its next commit; an operator's gc does it now.
                self.fence.update(lambda p: p, fenced=False)
            self._prune_origin_records(pointer)
            for key in self.store.abort_stale_uploads(reference - grace):
                log.info("aborted incomplete multipart upload %s", key)
            for name in self.store.remove_stale_temp_files(POINTER_NAME):
                log.info("removed %s, left by an interrupted pointer write", name)
        doomed = _once(doomed)
        if doomed:
            log.info("%s %d folder(s) under %s", "would delete" if dry_run else "deleted", len(doomed), self.url)
        return doomed

    def _prune_origin_records(self, pointer: Pointer) -> None:
        """Delete origin records of epochs older than every checkpoint the pointer names: no lineage reaches them
        (but those whose origins the pointer keeps: see ``fencing._prune_origins``)."""
        oldest = min([e.writer_epoch for e in pointer.entries()] + [pointer.writer_epoch])
        for epoch, record in OriginRecords(self.store).epochs().items():
            if epoch < oldest and epoch not in pointer.origins:
                self.discard(record)

    def _stray(self, lineage: Lineage, folder: str, root_id: str) -> str | None:
        """Where the unreferenced commit ``folder`` of a fenced writer lies ("inside" or "outside" this root's
        current lineage; another incarnation's commit, written into the recreated root by a job of a deleted one,
        is outside whatever its writer epoch), or None when it is not ours to collect."""
        try:
            manifest = self.reader.read_manifest(folder)
        except CheckpointCorruptedError:
            return "outside"  # a manifest that does not load makes nothing loadable
        except UnsupportedFormatError:
            return None  # a newer version wrote it: not ours to judge
        other = bool(manifest.root_id and root_id and manifest.root_id != root_id)
        return "outside" if other or not lineage.contains(manifest) else "inside"


def _once(doomed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each URL once, with the first reason given for it."""
    first: dict[str, str] = {}
    for url, why in doomed:
        first.setdefault(url, why)
    return list(first.items())


def _beyond(p: Pointer, keep: int) -> list[Entry]:
    """Catalog entries of the current lineage past the ``keep`` newest checkpoints, except the latest and what a job
    resumed from (what its restart would need). Abandoned branches are neither counted nor dropped here.

    A checkpoint is a training state (writer epoch, step), not a name: ``last.ckpt`` saved at the step of a top-k
    save is the same state under a second name, so it does not take one of the ``keep`` places. A
    state a ModelCheckpoint still reports (by any of its names: the pointer's ``reported``) is never beyond: one among
    the ``keep`` newest takes its place as any other (``last.ckpt`` and the newest top-k save usually are the newest
    state), an older one (the best, when the metric peaked early) is kept besides them. So ``keep_last`` keeps as many
    states as before, plus what the ModelCheckpoints report of older ones."""
    ordered = p.lineage().members(p.checkpoints.values())
    held = {_state(e) for e in ordered if e.name in set(p.reported)}
    kept: set[tuple[int, int] | str] = set()
    beyond = []
    for e in ordered:
        state = _state(e)
        if state in kept or len(kept) < keep:
            kept.add(state)
        elif state not in held:
            beyond.append(e)
    return [e for e in beyond if not (p.latest is not None and e.commit == p.latest.commit) and not is_resumed(p, e)]


def _state(e: Entry) -> tuple[int, int] | str:
    """The training state ``e`` holds; saves that record no step (Fabric's, a plain save_checkpoint) are each a state
    of their own."""
    return (e.writer_epoch, e.step) if e.step > 0 else e.commit


def _abandoned(p: Pointer) -> list[Entry]:
    """Catalog entries outside the current lineage (never the latest, a resumed-from checkpoint, or one whose name a
    ModelCheckpoint of the run still reports)."""
    named = set(p.reported)
    return [e for e in p.lineage().outside(p.checkpoints.values())
            if not (p.latest is not None and e.commit == p.latest.commit) and not is_resumed(p, e)
            and e.name not in named]


