"""The checkpoint roots one ``AtomicCheckpointIO`` has open, and the work that spans all of them.

:class:`OpenRoots` holds one :class:`~lightning_resilient.io.root.CheckpointRoot` per root URL and storage options
(a local folder by its real path: a dirpath reached through a symlink is the same writer, with one claim and one
lineage), shared by the plugin's saves and loads, and, with ``local_tier``, one
:class:`~lightning_resilient.io.tiered.TieredRoot` per durable root (its two tiers, as saves use them). It reopens a
root for a new job (which claims anew), reads a commit through the node cache where several processes share a node
(:meth:`OpenRoots.loader`), and runs what the end of a fit does over every root: let what a resume left finish, act on
every root's tiers, delete what the fit retired. :func:`check_storage_options` and :func:`checkpoint_path` check what a
caller hands the plugin.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from lightning_resilient.io import paths
from lightning_resilient.io.catalog import normalize
from lightning_resilient.io.local_tier import TierSettings, is_local_tier_url, local_tier_url
from lightning_resilient.io.node_cache import NodeCache
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.root import CheckpointRoot, Loaded, RootSettings, open_root
from lightning_resilient.io.store import LocalStore, MemoryStore
from lightning_resilient.io.tiered import TieredRoot

__all__ = ["OpenRoots", "check_storage_options", "checkpoint_path"]

log = logging.getLogger(__name__)


class OpenRoots:
    """The roots and tiers a plugin opened (see the module docstring), with the plugin's settings.

    ``root_for`` is the plugin's ``root`` (a subclass may wrap it): the tiers' roots are opened through it.
    """

    def __init__(self, *, storage_options: dict[str, Any], settings: RootSettings, tier: TierSettings,
                 retry: RetryPolicy, max_concurrency: int, node_cache: bool, node_cache_dir: str | None,
                 root_for: Callable[..., CheckpointRoot]) -> None:
        self.storage_options = storage_options
        self.settings = settings
        self.tier = tier
        self.retry = retry
        self.max_concurrency = max_concurrency
        self.node_cache = node_cache
        self.node_cache_dir = node_cache_dir
        self._root_for = root_for
        self._lock = threading.Lock()
        self.roots: dict[tuple[str, str], CheckpointRoot] = {}
        self.tiered: dict[str, TieredRoot] = {}  # durable root URL -> its two tiers, for saves

    def executor(self) -> Executor:
        # One pool per save or load: its threads end with the operation, so nothing lingers between saves
        # or after a one-off load, and teardown has no thread to chase.
        return ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="lightning_resilient-io")

    def options(self, storage_options: Any) -> dict[str, Any]:
        """The plugin's storage options, with those a call passes (``save_checkpoint(storage_options=...)``)."""
        extra = check_storage_options(storage_options, "save_checkpoint(storage_options=...)")
        return {**self.storage_options, **extra}

    def open(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> CheckpointRoot:
        """The protocol object of the checkpoint root ``url`` (one per root, shared by saves and loads)."""
        options = self.options(storage_options)
        url = normalize(url)
        if paths.split_protocol(url)[0] in (None, "file", "local"):
            # One root per physical folder: ModelCheckpoint saves into the realpath of its dirpath, and a resume
            # through a symlinked dirpath must be the same writer (one claim, one lineage), not a second one.
            url = os.path.realpath(url)
        key = (url, repr(sorted(options.items())))
        with self._lock:
            root = self.roots.get(key)
            if root is None:
                local_tier = self.tier.local_tier
                local = local_tier is not None and is_local_tier_url(local_tier, url)
                # A local tier keeps local_keep checkpoints, and those older that a ModelCheckpoint still reports (the
                # best, say: with persist_every > 1 its only copy may be there until the end of the fit persists it).
                settings = replace(self.settings, keep_last=self.tier.local_keep) if local else self.settings
                root = open_root(url, {} if local else options, settings=settings, retry=self.retry,
                                 executor=self.executor)
                self.roots[key] = root
            return root

    def tiers(self, url: str, storage_options: dict[str, Any] | None = None) -> TieredRoot:
        """The durable root ``url`` and its local tier, as the plugin saves to them (needs ``local_tier``)."""
        local_tier = self.tier.local_tier
        assert local_tier is not None
        durable = self._root_for(url, storage_options)
        if isinstance(durable.store, LocalStore) and (durable.url + os.sep).startswith(local_tier + os.sep):
            raise ValueError(f"the checkpoint folder {durable.url} is inside local_tier={local_tier!r}: the"
                             " durable tier must be another place (an object store, a shared filesystem) than the"
                             " node-local folder. Give local_tier a folder of its own.")
        with self._lock:
            tiers = self.tiered.get(durable.url)
        if tiers is None or tiers.durable is not durable:  # first save, or a new fit reopened the root
            local = self._root_for(local_tier_url(local_tier, durable.url))
            tiers = TieredRoot(durable, local, persist_every=self.tier.persist_every, executor=self.executor,
                               max_persist_failures=self.tier.max_persist_failures,
                               max_seconds_without_durable=self.tier.max_seconds_without_durable,
                               retry_delay=self.retry.max_delay)
            with self._lock:
                self.tiered[durable.url] = tiers
        return tiers

    def reopen(self, root: CheckpointRoot) -> CheckpointRoot:
        """A fresh protocol object for ``root``, in its place: a new job of the plugin, which claims anew."""
        root.settle()  # (the fresh one would not wait for what the old one still writes)
        fresh = CheckpointRoot(root.store, root.settings, self.executor)
        with self._lock:
            for key, value in self.roots.items():
                if value is root:
                    self.roots[key] = fresh
        return fresh

    def loader(self, root: CheckpointRoot) -> Callable[..., Loaded]:
        """How this process reads a commit of ``root``: through the node cache when several processes share it."""
        shared = (self.node_cache and not isinstance(root.store, (LocalStore, MemoryStore))
                  and torch.distributed.is_available() and torch.distributed.is_initialized()
                  and torch.distributed.get_world_size() > 1)
        if not shared:
            return root.load
        cache = NodeCache(self.node_cache_dir, root.url)

        def local_root(path: str) -> CheckpointRoot:
            return open_root(path, settings=self.settings, retry=self.retry, executor=self.executor)

        return lambda commit, **kwargs: cache.load(root, commit, local_root, **kwargs)

    def claimed(self) -> list[CheckpointRoot]:
        """The roots this plugin claimed (it is their writer)."""
        with self._lock:
            return [root for root in self.roots.values() if root.writer_epoch is not None]

    def tier_list(self) -> list[TieredRoot]:
        """Every durable root's tiers opened so far."""
        with self._lock:
            return list(self.tiered.values())

    def settle(self) -> None:
        """Wait for what a resume left to finish in a root (a replaced node's copy restored from a peer, written to
        its local tier behind training: ``CheckpointRoot.finish_later``)."""
        with self._lock:
            roots = list(self.roots.values())
        for root in roots:
            root.settle()

    def each_tier(self, action: Callable[[TieredRoot], Any], *, first: Callable[[], None] | None) -> None:
        """``first()``, then ``action`` on every root's tiers, each whatever the others raised; then the first error."""
        errors: list[BaseException] = []
        for step in ([first] if first is not None else []):
            try:
                step()
            except BaseException as exc:
                errors.append(exc)
        for tier in self.tier_list():
            try:
                action(tier)
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def end_of_writers(self) -> None:
        """The end of a fit: delete what it retired since its last commit in each root it wrote, but in none whose
        store does not answer (each request would wait out the retries: the next commit or gc deletes them)."""
        with self._lock:
            written = [root for root in self.roots.values() if root.writer_epoch is not None]
            down = {tiers.durable.url for tiers in self.tiered.values() if tiers.unreachable}
        for root in written:
            if root.url in down:
                log.info("not deleting what the fit retired under %s now: the store does not answer", root.url)
                continue
            try:
                root.end_of_writer()
            except Exception as exc:  # what was retired stays until the next commit or gc: nothing is lost
                log.warning("could not delete the folders retired under %s at the end of the fit: %s", root.url, exc)


def check_storage_options(value: Any, field: str) -> dict[str, Any]:
    """``value`` as fsspec storage options (a dict with str keys; None: none), or a TypeError naming ``field``."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{field} must be a dict of fsspec options with str keys or None, got {value!r}")
    return dict(value)


def checkpoint_path(path: Any) -> str:
    """A checkpoint path as a caller gives it (a str or an ``os.PathLike``), as a str."""
    if isinstance(path, str):
        return path
    fspath = os.fspath(path) if isinstance(path, os.PathLike) else None
    if isinstance(fspath, str):
        return fspath
    raise TypeError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
