"""What the ``ModelCheckpoint`` callbacks of a run report: the checkpoint names retention never drops.

A ``ModelCheckpoint`` tells its user which checkpoints it keeps: ``best_model_path``, the keys of ``best_k_models``,
``kth_best_model_path`` and ``last_model_path``. They are loaded after training (``trainer.test(ckpt_path="best")``,
``load_from_checkpoint(callback.best_model_path)``) and restored by a resume, so retention (``keep_last``, an
operator's ``gc --keep-last`` or ``gc --abandoned``) never drops a name they still report: ``keep_last`` keeps its
newest states as before, and a reported checkpoint older than those besides (see ``retention``). A commit records the
names its save reports in its own root (the manifest's ``reported``: it survives a restart and a lost pointer) and the
pointer holds those of the newest save (so a ``gc`` in another process keeps them too; a claim takes those of the save
it resumed, a fresh start none).

Where the names come from: the checkpoint Lightning hands the plugin holds every callback's state as it was when the
save was made (``checkpoint["callbacks"]``, one entry per ModelCheckpoint, keyed by its settings). ModelCheckpoint
updates that state *before* it saves: a top-k save's own path is in ``best_k_models`` already, and the path it
displaces is gone from it (Lightning removes that file right after the save); ``last_model_path`` is set before
``last.ckpt`` is saved. So a save's states name exactly what the callbacks keep once that save and the removal after
it are done. A weights-only save (``save_weights_only=True``) carries no callback state: the plugin reads the same
states from the Trainer's callbacks instead. Names are matched to the root by folder: a callback writing another
folder reports nothing here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from lightning_resilient.io import paths

__all__ = ["folder_key", "kept_by", "reported_in", "reported_names"]

# The fields of a ModelCheckpoint's state that name a checkpoint it keeps (``best_k_models`` too: its keys).
_PATH_FIELDS = ("best_model_path", "kth_best_model_path", "last_model_path")


def folder_key(url: str) -> str:
    """``url`` (a folder) as two names of the same folder compare equal: a local path absolute, ``~`` expanded and
    symlinks resolved (ModelCheckpoint resolves its dirpath so, and the plugin its roots), any other URL without its
    trailing slash."""
    protocol, rest = paths.split_protocol(url)
    if protocol in (None, "file", "local"):
        return os.path.realpath(os.path.abspath(os.path.expanduser(rest)))
    return paths.strip_trailing(url)


def _is_model_checkpoint_state(state: Any) -> bool:
    # ModelCheckpoint's state (or a subclass's: keyed by its own name) is recognised by its fields, not its key.
    return isinstance(state, dict) and "best_model_path" in state and "best_k_models" in state


def reported_names(states: Iterable[Any], folder: str) -> list[str] | None:
    """The checkpoint names in ``folder`` (a root's URL) that the ModelCheckpoint states among ``states`` report,
    sorted; None when none of ``states`` is a ModelCheckpoint's (then nothing is known: a save without them)."""
    key = folder_key(folder)
    found = False
    names: set[str] = set()
    keys: dict[str, str] = {}  # folder -> its key (a local one costs a realpath; the paths share one or two folders)
    for state in states:
        if not _is_model_checkpoint_state(state):
            continue
        found = True
        best_k = state.get("best_k_models")
        named = [state.get(f) for f in _PATH_FIELDS] + (list(best_k) if isinstance(best_k, dict) else [])
        for path in named:
            if isinstance(path, os.PathLike):
                path = os.fspath(path)
            if not isinstance(path, str) or not path:
                continue
            # The file's own folder, not the file: ``last.ckpt`` may be a link (save_last="link") to another name.
            name, parent = paths.basename(path), paths.dirname(path)
            if parent not in keys:
                keys[parent] = folder_key(parent)
            if name and not name.startswith(".") and keys[parent] == key:
                names.add(name)
    return sorted(names) if found else None


def reported_in(checkpoint: dict[str, Any], folder: str) -> list[str] | None:
    """The names in ``folder`` that the ModelCheckpoint states a checkpoint dict carries report (see
    :func:`reported_names`); None for a checkpoint without them (a weights-only save, Fabric's, a plain dict)."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return None
    return reported_names(callbacks.values(), folder)


def kept_by(callback: Any) -> float:
    """How many checkpoint names ``callback`` (a ModelCheckpoint) reports at most: its ``save_top_k`` when it monitors
    a metric (``math.inf`` for ``save_top_k=-1``: it ranks and keeps every one), one when it monitors nothing
    (``best_model_path`` names its newest save; with ``save_top_k=-1`` Lightning keeps the others unreported), none
    for ``save_top_k=0``; plus one for ``save_last``."""
    top_k = getattr(callback, "save_top_k", 1)
    kept = 0.0
    if isinstance(top_k, int) and top_k != 0:
        kept = (math.inf if top_k < 0 else float(top_k)) if getattr(callback, "monitor", None) is not None else 1.0
    return kept + (1.0 if getattr(callback, "save_last", None) else 0.0)
