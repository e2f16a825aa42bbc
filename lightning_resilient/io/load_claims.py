"""What a load of ``AtomicCheckpointIO`` means for writing: the claim on load, and the loads outside a Trainer that a
later save continues.

A fit that resumes claims the roots it writes (its checkpoint folders), and only those: the root it loaded from with
the loaded checkpoint as the origin of its lineage when the fit writes it, any other with that checkpoint as the one
it was forked from (``claim_on_load=None``: at once on the writing rank; ``False``: at its first save; ``True``: every
load claims). Validate, test and predict only read. Outside a Trainer (Lightning Fabric's ``fabric.load``, a script's
``load_checkpoint``) a load claims nothing: :class:`LoadClaims` notes it, and the plugin's first save into a root
claims it with the last load of that root as the origin (a resume, or a rollback to an older one), or else with the
last load of another root (a fork), so that ``fabric.load(find_latest_checkpoint(root), state)`` then
``fabric.save(...)`` continues the run instead of abandoning it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_resilient.io.calling_trainer import fit_roots, fn_of, global_rank
from lightning_resilient.io.fit_lifecycle import FitLifecycle
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["LoadClaims"]


class LoadClaims:
    """The claims a plugin's loads make, and its loads outside a Trainer (see the module docstring).

    ``root_for`` opens a root (the plugin's ``root``), ``reopen`` gives a root a fresh protocol object for a new job
    (which claims anew), ``fit`` says whether a fit of the plugin runs.
    """

    def __init__(self, *, root_for: Callable[[str], CheckpointRoot], reopen: Callable[[CheckpointRoot], CheckpointRoot],
                 fit: FitLifecycle) -> None:
        self._root_for = root_for
        self._reopen = reopen
        self._fit = fit
        # Loads outside a Trainer (Lightning Fabric, a script) that a later save of this plugin continues: the last
        # of each root (by URL), and the last of all (see continue_outside).
        self._outside: dict[str, _OutsideLoad] = {}
        self._last_outside: _OutsideLoad | None = None

    def continue_from(self, root: CheckpointRoot, entry: Entry, trainer: Any, *, claim_on_load: bool | None,
                      elsewhere: bool = False) -> CheckpointRoot:
        """What loading ``entry`` of ``root`` means for writing (``elsewhere``: only the local tier holds it);
        returns the root this process writes from now on.

        A fit claims the roots it writes (its checkpoint folders, see :func:`fit_roots`), and only those: ``root``
        with ``entry`` as the origin of its lineage when the fit writes it, any other with ``entry`` as the checkpoint
        of another root it was forked from. A fit that forks a run into a folder of its own so never fences the job
        still writing the run it forked from, nor abandons that run's later checkpoints.

        Outside a Trainer (Lightning Fabric, a script) a load claims nothing (unless ``claim_on_load=True``): it is
        noted, and a later save of this plugin continues it (see :meth:`continue_outside`)."""
        fit = trainer is not None and fn_of(trainer) == "fit"
        if fit:
            self.forget()  # a fit is a job of its own: what it loads is its origin
        if fit and root.writer_epoch is not None:
            # This plugin already wrote this root in an earlier fit (a notebook, an in-process retry); a fit that
            # resumes is a new job: it claims anew, with what it loaded as its origin (a rollback stays a rollback).
            root = self._reopen(root)
        if trainer is None and not claim_on_load:
            self._note_outside(root, entry, elsewhere)
            return root  # read-only until this plugin saves (a process that only loads never fences anyone)
        if not (fit or claim_on_load):
            return root  # validate/test/predict are read-only: they never fence anyone
        # The origin of this root's lineage if this process writes it (at its first save, if not claimed below).
        root.resumed(entry, elsewhere=elsewhere)
        targets = [root]
        if fit:
            targets = []
            for other in (self._root_for(url) for url in fit_roots(trainer)):
                if other.url == root.url:
                    targets.append(root)
                    continue
                if other.writer_epoch is not None:
                    other = self._reopen(other)  # a new job of this plugin: it claims anew
                other.forked(entry, root.url)
                targets.append(other)
        claim_now = claim_on_load if claim_on_load is not None else fit
        if claim_now and global_rank() == 0:
            # Now, on the writing rank: the job each replaces is stopped before it can retire this checkpoint.
            for target in targets:
                if target.writer_epoch is None:
                    target.claim()
        return root

    def continue_sharded(self, durable: CheckpointRoot, entry: Entry, *, fit: bool, rank: int,
                         claim_on_load: bool | None) -> None:
        """A sharded strategy's resume with a local tier loaded ``entry`` of ``durable`` (``rank``: this process's
        rank among the job's nodes): a fit (or ``claim_on_load``) takes it as the origin of the root's lineage, and
        claims the root at once on rank 0 unless ``claim_on_load=False``."""
        if fit or claim_on_load:
            durable.resumed(entry, elsewhere=not durable.store.exists(f"{entry.commit}/{MANIFEST_NAME}"))
            claim_now = claim_on_load if claim_on_load is not None else fit
            if claim_now and rank == 0 and durable.writer_epoch is None:
                durable.claim()

    def _note_outside(self, root: CheckpointRoot, entry: Entry, elsewhere: bool) -> None:
        """A load of ``entry`` from ``root`` outside a Trainer: what a later save of this plugin continues. A load
        made while a fit of this plugin runs (a callback reading a checkpoint) is that fit's business, not noted. A
        root this plugin writes already keeps its writer and lineage (loading one of its checkpoints again, to
        evaluate it, is no rollback), but the load is still what a save into another root forks from."""
        if self._fit.fitting:
            return
        load = _OutsideLoad(root.url, entry, elsewhere)
        self._last_outside = load
        if root.writer_epoch is None:
            self._outside[root.url] = load

    def continue_outside(self, root: CheckpointRoot) -> None:
        """Before a save (or a removal) that may claim ``root``, outside a Trainer's fit: the loads of this plugin
        outside a Trainer (Lightning Fabric's ``fabric.load``, a script's ``load_checkpoint``) give the origin of its
        claim, as a Trainer's resume would, so that ``fabric.load(find_latest_checkpoint(root), state)`` followed by
        ``fabric.save`` continues that run instead of abandoning it. The last load of ``root`` itself makes it a
        resume of that checkpoint (a rollback when it is an older one); with none, the last load of another root
        makes it a fork of that root's checkpoint; with no load at all, it is a fresh start. The claim happens at the
        save, never at a load: a process that only loads (an evaluation script) never fences the training job, and
        under DDP only the rank that saves (Fabric's rank 0) claims."""
        if root.writer_epoch is not None or self._fit.fitting:
            return
        own = self._outside.get(root.url)
        last = self._last_outside
        if own is not None:
            root.resumed(own.entry, elsewhere=own.elsewhere)
        elif last is not None and last.root != root.url:
            root.forked(last.entry, last.root)

    def forget(self) -> None:
        """Forget the loads outside a Trainer (a fit starts: only what it resumes is its origin)."""
        self._outside = {}
        self._last_outside = None


@dataclass(frozen=True)
class _OutsideLoad:
    """A load outside a Trainer: the URL of the root it read, the commit it loaded, and whether only the local tier
    held it."""

    root: str
    entry: Entry
    elsewhere: bool
