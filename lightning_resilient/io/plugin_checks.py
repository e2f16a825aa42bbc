"""What the fit-start check and ModelCheckpoint ask ``AtomicCheckpointIO`` about its checkpoint folders.

:class:`FitChecks` refuses, when a ``fit`` starts, a folder that cannot hold checkpoints (:meth:`FitChecks.check_root`)
and a fit that resumes nothing over a committed run (:meth:`FitChecks.check_new_run`), warns when ``keep_last`` is
smaller than what the fit's ModelCheckpoints keep (:meth:`FitChecks.check_retention`), and answers ModelCheckpoint's
"does this checkpoint exist" without waiting for a store that may be down (:meth:`FitChecks.knows_checkpoint`).
:func:`check_filenames` refuses a ModelCheckpoint ``filename`` with a folder in it when the fit starts, and
:func:`check_not_nested` a save into a sub-folder of a checkpoint folder (a separate root) when it is made.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from lightning_resilient._warnings import warn
from lightning_resilient.errors import RunExistsError
from lightning_resilient.io import paths
from lightning_resilient.io.calling_trainer import fit_roots, together
from lightning_resilient.io.catalog import check_bucket, check_not_a_file, normalize
from lightning_resilient.io.fit_lifecycle import FitLifecycle
from lightning_resilient.io.folders import writer_epoch_of
from lightning_resilient.io.plugin_roots import checkpoint_path
from lightning_resilient.io.reported import kept_by
from lightning_resilient.io.root import CheckpointRoot, RootSettings
from lightning_resilient.io.store import probe_write
from lightning_resilient.io.tiered import TieredRoot

__all__ = ["FitChecks", "check_filenames", "check_not_nested"]


class FitChecks:
    """The checks of a plugin's checkpoint folders (see the module docstring), with its settings.

    ``root_for``, ``tiers_for`` and ``find_latest`` are the plugin's ``root``, ``tiers`` and
    ``find_latest_checkpoint``; ``fit`` says whether the current fit continues the previous one.
    """

    def __init__(self, *, settings: RootSettings, local_tier: str | None, root_for: Callable[[str], CheckpointRoot],
                 tiers_for: Callable[[str], TieredRoot], find_latest: Callable[[str], str | None],
                 fit: FitLifecycle) -> None:
        self.settings = settings
        self.local_tier = local_tier
        self._root_for = root_for
        self._tiers_for = tiers_for
        self._find_latest = find_latest
        self._fit = fit

    def check_root(self, root: str) -> None:
        """Raise now, naming what to fix, when ``root`` cannot hold checkpoints: it is not a URL a store reads as
        meant (``StoreURLError``), its bucket does not exist, it is a file, this process may not list or write it
        (a probe object is written and deleted: ``StorePermissionError`` about the folder's permissions on local
        disk, ``StoreCredentialsError`` on a cloud store), or the store ignores conditional writes
        (``UnfencedStoreError``, unless ``allow_unfenced_store``). The fit-start check calls it for every checkpoint
        folder of the fit, so any of these stops the run before its first step rather than at its first save."""
        checked = self._root_for(root)
        check_bucket(checked.store)
        check_not_a_file(checked.store, root)
        checked.store.list_dir("")  # credentials that can name the bucket but not list it fail here
        probe_write(checked.store)
        checked.check_fencing()

    def check_retention(self, trainer: Any) -> None:
        """Warn, once when a fit of ``trainer`` starts, for each of its checkpoint folders where ``keep_last`` is
        smaller than what the ModelCheckpoints writing it keep (``save_top_k`` plus ``last``): retention never deletes
        a checkpoint a ModelCheckpoint still reports (``best_model_path``, ``best_k_models``, ``last_model_path``, see
        ``io/reported.py``), so those older than the ``keep_last`` newest are kept besides them, and the folder holds
        more than ``keep_last`` checkpoints."""
        keep = self.settings.keep_last
        if keep is None:
            return
        by_root: dict[str, list[Any]] = {}
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            dirpath = getattr(callback, "dirpath", None)
            if isinstance(dirpath, (str, os.PathLike)) and str(dirpath):
                by_root.setdefault(self._root_for(str(dirpath)).url, []).append(callback)
        for url, callbacks in by_root.items():
            kept = sum(kept_by(c) for c in callbacks)
            if keep >= kept:
                continue
            settings = ", ".join(_keeps(c) for c in callbacks if kept_by(c))
            if kept == math.inf:
                bound = "every checkpoint a save_top_k=-1 with a monitor ranks stays, whatever keep_last says"
                fix = "give it a save_top_k >= 0, or set keep_last=None"
            else:
                bound = f"{url} may hold up to {keep} + {int(kept)} checkpoints"
                fix = f"lower save_top_k, or set keep_last to at least {int(kept)} (or None)"
            warn(f"AtomicCheckpointIO(keep_last={keep}) is smaller than what the ModelCheckpoint(s) writing {url} keep"
                 f" ({settings}). Retention never deletes a checkpoint a ModelCheckpoint still reports"
                 " (best_model_path, best_k_models, last_model_path): keep_last keeps the newest checkpoints, and those"
                 " reported ones"
                 f" older than them besides, so {bound}. To settle it, {fix}.", RuntimeWarning, rank_zero=True)

    def check_new_run(self, trainer: Any, *, new_run: bool) -> None:
        """Refuse, when a fit of ``trainer`` starts, a fit that loads no checkpoint into a checkpoint folder that holds
        a committed run (:class:`~lightning_resilient.RunExistsError`, naming the checkpoint to resume): trained
        from step 0, it would leave that run behind as an abandoned branch. Not refused: a fit that resumed a
        checkpoint (``trainer.ckpt_path``), one that continues the previous fit of this plugin in memory, one whose
        folders hold no run of ours (empty, or stock files), and any fit with ``new_run=True``.

        Rank 0 decides and every rank raises the same error (one that raised alone would leave the others waiting at
        the next collective). The fit-start check calls it once the checkpoint is loaded: in ``on_fit_start``, or in
        ``on_train_start`` for strategies that restore after setup (FSDP, model parallel)."""
        if new_run or self._fit.continuing or getattr(trainer, "ckpt_path", None) is not None:
            return
        ranks = together(trainer)
        verdict: list[tuple[str, str]] | BaseException = []
        if ranks is None or ranks.rank == 0:
            try:
                verdict = [(root, latest) for root in fit_roots(trainer)
                           if (latest := self._committed_latest(root)) is not None]
            except Exception as exc:  # every rank raises what rank 0 found
                verdict = exc
        if ranks is not None:
            verdict = ranks.broadcast(verdict)
        if isinstance(verdict, BaseException):
            raise verdict
        if verdict:
            raise RunExistsError(_run_exists_message(verdict))

    def _committed_latest(self, root: str) -> str | None:
        """The newest committed checkpoint of the run in ``root`` (either tier); None when it holds none of ours."""
        latest = self._find_latest(root)
        return latest if latest is not None and writer_epoch_of(paths.basename(latest)) is not None else None

    def knows_checkpoint(self, path: str | os.PathLike[str]) -> bool:
        """Whether a committed checkpoint ``path`` (``<dirpath>/<name>``) exists: with ``local_tier``, answered without
        waiting for the store, from the local tier's catalog and the durable one as this plugin last saw it
        (:meth:`TieredRoot.knows`); without, from the root's pointer. ``ModelCheckpoint.file_exists`` asks it at every
        save (see ``io/fit_check.py``): with a local tier a store outage would otherwise stop training at the first
        save, and without one a save cut off earlier would count as a checkpoint of its name."""
        url = normalize(checkpoint_path(path))
        if self.local_tier is None:
            # The root's catalog: a folder a save left without its manifest (killed, or cut off by an outage) is no
            # checkpoint, though the store lists objects under its name (Lightning would name the next save "-v1").
            pointer, _ = self._root_for(paths.dirname(url)).read_pointer()
            return pointer is not None and paths.basename(url) in pointer.checkpoints
        return self._tiers_for(paths.dirname(url)).knows(paths.basename(url))


def _run_exists_message(found: list[tuple[str, str]]) -> str:
    root, latest = found[0]
    also = "".join(f"; {other} also holds one (latest: {url})" for other, url in found[1:])
    return (f"this fit loads no checkpoint, but its checkpoint folder {root} holds a committed run (latest: {latest})"
            f"{also}: it would train from step 0 and leave that run behind. To resume it, pass"
            f" ckpt_path=find_latest_checkpoint({root!r}) to trainer.fit (ckpt_path=\"last\" finds no last.ckpt on"
            " S3/GCS, where Lightning lists it without its protocol, Lightning issue #18261, nor without"
            " ModelCheckpoint(save_last=True); with LightningCLI, lightning-resilient train resumes by itself). To"
            " start a new run there instead, keeping the old one as an abandoned branch until `lightning-resilient gc"
            " --abandoned`, pass AtomicCheckpointIO(new_run=True); or give the new run a ModelCheckpoint dirpath of its"
            " own.")


def _keeps(callback: Any) -> str:
    """What a ModelCheckpoint keeps, in its own settings (for messages)."""
    top_k = getattr(callback, "save_top_k", 1)
    kept = [f"save_top_k={top_k}" + ("" if getattr(callback, "monitor", None) is not None else " without a monitor")]
    if not top_k:
        kept = []
    if getattr(callback, "save_last", None):
        kept.append("save_last")
    return f"{type(callback).__name__}({', '.join(kept)})"


def check_not_nested(url: str, checkpoint: dict[str, Any], fit_dirpaths: list[str]) -> None:
    """Refuse a save into a sub-folder of a ModelCheckpoint's dirpath (``filename="{epoch}/{step}"``).

    The checkpoint root is the folder a checkpoint is saved in; a sub-folder would be a root of its own, with its
    own pointer, fencing and retention, and ``find_latest_checkpoint(dirpath)`` would find nothing. The dirpaths are
    those of the fit (``fit_dirpaths``) and those the checkpoint's callback state names (a full checkpoint's; a
    weights-only one has none).
    """
    dirpaths = list(fit_dirpaths)
    for state in (checkpoint.get("callbacks") or {}).values():  # ModelCheckpoint's, or a subclass's (keyed by its name)
        dirpath = state.get("dirpath") if isinstance(state, dict) else None
        if isinstance(dirpath, str) and dirpath:
            dirpaths.append(normalize(dirpath))
    parent = paths.dirname(url)
    for root in dirpaths:
        if parent != root and parent.startswith(root.rstrip("/") + "/"):
            raise ValueError(
                f"checkpoint {url!r} would be saved in a sub-folder of the ModelCheckpoint dirpath {root!r} (its"
                f" filename contains '/'): with AtomicCheckpointIO every folder is a separate checkpoint root, so the"
                f" run would be split across roots and find_latest_checkpoint({root!r}) would not see it. Use a"
                " filename without '/', e.g. ModelCheckpoint(filename='{epoch}-{step}').")


def check_filenames(trainer: Any) -> None:
    """Refuse, when a fit starts, a checkpoint callback whose ``filename`` has a folder in it (``"{epoch}/{step}"``):
    each of its saves would go to a sub-folder of the dirpath, a separate checkpoint root (see
    :func:`check_not_nested`, which also refuses such a save; this stops the fit before its first step)."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        filename = getattr(callback, "filename", None)
        if isinstance(filename, str) and ("/" in filename or os.sep in filename):
            dirpath = getattr(callback, "dirpath", None)
            raise ValueError(
                f"{type(callback).__name__}(filename={filename!r}) would save each checkpoint in a sub-folder of its"
                f" dirpath {str(dirpath)!r}: with AtomicCheckpointIO every folder is a separate checkpoint root, so"
                " the run would be split across roots and find_latest_checkpoint(dirpath) would not see it. Use a"
                " filename without '/', e.g. ModelCheckpoint(filename='{epoch}-{step}').")
