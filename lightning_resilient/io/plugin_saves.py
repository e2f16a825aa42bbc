"""The save and removal paths of ``AtomicCheckpointIO``, and the order they run in.

:class:`PluginSaves` checks a save's path (a name that is hidden, a sub-folder of a checkpoint folder: refused;
Lightning's own hand-over files stay plain files), picks its root (the durable root, or its two tiers with a local
tier), records its timings, and runs it in the caller's thread, or in the background from a reusable host snapshot
(``async_save``: ``AsyncSaver`` of ``io/async_save.py``). Lightning's ``AsyncCheckpointIO`` wrapped around the plugin
is the other background: its worker thread runs the saves, and ``WrappedSaves`` orders the removals the plugin gets on
the Trainer's thread behind them. Either way a removal runs only once the saves handed over before it committed, a
load never races a save in flight, and a background error is raised by the next call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_resilient.io import paths
from lightning_resilient.io.async_save import AsyncSaver, SaveStats, WrappedSaves
from lightning_resilient.io.catalog import normalize
from lightning_resilient.io.fit_lifecycle import FitLifecycle
from lightning_resilient.io.load_claims import LoadClaims
from lightning_resilient.io.plugin_checks import check_not_nested
from lightning_resilient.io.plugin_roots import checkpoint_path
from lightning_resilient.io.reported import reported_in
from lightning_resilient.io.root import CheckpointRoot
from lightning_resilient.io.tiered import TieredRoot

__all__ = ["PluginSaves"]


class PluginSaves:
    """The saves and removals of a plugin (see the module docstring), with its settings.

    ``root_for``, ``tiers_for`` and ``stats_for`` are the plugin's ``root``, ``tiers`` and ``save_stats_for``;
    ``options`` gives the storage options a plain file is written with; ``claims`` continues a load outside a Trainer
    at the save that may claim; ``fit`` gives the fit's checkpoint folders and what its ModelCheckpoints report.
    """

    def __init__(self, *, local_tier: str | None, async_save: bool, pin_memory: bool,
                 root_for: Callable[..., CheckpointRoot], tiers_for: Callable[..., TieredRoot],
                 stats_for: Callable[[str, dict[str, Any]], SaveStats], options: Callable[[Any], dict[str, Any]],
                 claims: LoadClaims, fit: FitLifecycle) -> None:
        self.local_tier = local_tier
        self._root_for = root_for
        self._tiers_for = tiers_for
        self._stats_for = stats_for
        self._options = options
        self._claims = claims
        self._fit = fit
        #: The background saves of ``async_save`` (None without).
        self.async_saver = AsyncSaver(pin_memory=pin_memory) if async_save else None
        self.wrapped: WrappedSaves | None = None  # Lightning's AsyncCheckpointIO around the plugin (wrapped_by)

    def save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None) -> None:
        """``CheckpointIO.save_checkpoint``: behind Lightning's wrapper, one of the saves it runs on its worker."""
        wrapped = self.wrapped
        with wrapped.saving() if wrapped is not None else contextlib.nullcontext():
            self._save(checkpoint, path, storage_options)

    def _save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None) -> None:
        if not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
        url = normalize(checkpoint_path(path))
        name = paths.basename(url)
        if not name:
            raise ValueError(f"checkpoint path {url!r} names no checkpoint (it ends at a folder or bucket)")
        if _is_handover(name):
            # Lightning's own transfer, not a checkpoint: ddp_spawn hands the trained weights to the main process as
            # <default_root_dir>/.temp.ckpt, the tuner saves .lr_find_*/.scale_batch_size_* and restores them. Each
            # stays one plain file, as stock, instead of making the working folder a checkpoint root.
            _save_plain_file(checkpoint, url, self._options(storage_options))
            return
        if name.startswith("."):
            raise ValueError(f"checkpoint name {name!r} starts with '.': such names are hidden from the root's listing"
                             " (find_latest_checkpoint and retention would never see it). Use a ModelCheckpoint"
                             " filename that does not start with '.'.")
        check_not_nested(url, checkpoint, self._fit.dirpaths)
        root: CheckpointRoot | TieredRoot = (self._root_for(paths.dirname(url), storage_options)
                                             if self.local_tier is None
                                             else self._tiers_for(paths.dirname(url), storage_options))
        self._claims.continue_outside(root if isinstance(root, CheckpointRoot) else root.durable)
        reported = self._fit.reported_by_trainer(root.url) if reported_in(checkpoint, root.url) is None else None
        started = time.perf_counter()
        stats = self._stats_for(name, checkpoint)
        if self.async_saver is not None:
            self.async_saver.save(root, checkpoint, name, stats,  # type: ignore[arg-type]  # a TieredRoot quacks alike
                                  reported=reported)
        else:
            root.save(checkpoint, name, reported=reported)
            stats.upload = time.perf_counter() - started
            stats.committed = True
        stats.blocked = time.perf_counter() - started

    def remove(self, path: Any) -> None:
        """``CheckpointIO.remove_checkpoint``: run once the saves handed over before it committed."""
        url = normalize(checkpoint_path(path))
        name = paths.basename(url)
        root: CheckpointRoot | TieredRoot = (self._root_for(paths.dirname(url)) if self.local_tier is None
                                             else self._tiers_for(paths.dirname(url)))
        self._claims.continue_outside(root if isinstance(root, CheckpointRoot) else root.durable)  # (it may claim)

        def remove() -> None:
            # A stock file or link (a run from before this plugin, a save_last="link" link) goes as stock Lightning
            # would delete it: that object alone. Our checkpoint of that name (on an object store the two can
            # coexist) is retired by the protocol; a name the pointer does not know costs no claim and no write.
            root.forget_stock(name)
            root.remove(name)

        def after_save() -> None:
            if self.async_saver is not None:
                # Lightning removes the checkpoint a new save replaces right after starting that save: only once
                # the new one is committed may the old one go.
                self.async_saver.after_pending(remove, f"removal of {url}")
            else:
                remove()

        wrapped = self.wrapped
        if wrapped is not None:
            # Lightning's AsyncCheckpointIO runs our saves on its worker thread, and hands us this removal on the
            # Trainer's thread at once: it goes behind the saves that wrapper was given before it (WrappedSaves).
            wrapped.after_saves(after_save, f"removal of {url}")
        else:
            after_save()

    def wrapped_by(self, wrapper: Any) -> None:
        """``wrapper`` (Lightning's ``AsyncCheckpointIO``) holds the plugin, or None (see
        ``AtomicCheckpointIO.wrapped_by``)."""
        if wrapper is None:
            self.wrapped = None
        elif self.wrapped is None or not self.wrapped.wraps_for(wrapper):
            self.wrapped = WrappedSaves(wrapper)

    def before_load(self) -> None:
        """A load never races a save in flight (of Lightning's AsyncCheckpointIO, or ours): wait for them, raise
        their error."""
        self._drain()
        if self.async_saver is not None:
            self.async_saver.wait()
            self.async_saver.raise_error()

    def wait(self) -> None:
        """Wait for what the wrapper was handed and for the async save in flight; raise their errors."""
        self._drain()
        if self.async_saver is not None:
            self.async_saver.wait()
            self.async_saver.raise_error()
        if self.wrapped is not None:
            self.wrapped.raise_error()

    def close(self) -> None:
        """Teardown's first step: what Lightning's AsyncCheckpointIO was handed has run (its own teardown waited for
        it already, unless this is the teardown of a fit that failed), then the async save in flight; raise their
        errors."""
        self._drain()
        try:
            if self.async_saver is not None:
                self.async_saver.close()
        finally:
            if self.wrapped is not None:
                self.wrapped.raise_error()

    def _drain(self) -> None:
        if self.wrapped is not None:
            self.wrapped.drain()


def _is_handover(name: str) -> bool:
    """Lightning's hidden hand-over files (ddp_spawn's weights, the tuner's saved state), not checkpoints."""
    return name == ".temp.ckpt" or name.startswith((".lr_find_", ".scale_batch_size_"))


def _save_plain_file(checkpoint: dict[str, Any], url: str, options: dict[str, Any]) -> None:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **options)
    fs.makedirs(paths.dirname(path) or ".", exist_ok=True)
    with fs.open(path, "wb") as f:
        torch.save(checkpoint, f)
