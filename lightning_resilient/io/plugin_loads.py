"""The load paths of ``AtomicCheckpointIO``: which commit a checkpoint path means, and reading it from where it is.

:class:`PluginLoads` resolves a path (a root, a name, a commit folder; in a resuming fit, a ModelCheckpoint's
``last.ckpt`` means the newest committed checkpoint of its root's run: :meth:`PluginLoads.resolve_last`) and loads it
from one root (through the node cache where several processes share a node), from the two tiers of a root with a
local tier, across every node's local tier of a job on several nodes (a node lacking the copy restores it from a peer:
``io/replicas.py``), or, for a sharded strategy, its shards across those tiers. Under a strategy every rank loads the
commit rank 0 resolved, and a commit that fails verification on any rank makes them all fall back to the same older
one. A path no root knows is read as a plain file (a stock Lightning checkpoint). What the load means for writing (the
claim) is :class:`~lightning_resilient.io.load_claims.LoadClaims`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from lightning_resilient.errors import CheckpointCorruptedError
from lightning_resilient.io import parts, paths
from lightning_resilient.io.calling_trainer import (
    fn_of,
    mark_resumed_step_saved,
    names_last,
    together,
    trainer_loading,
)
from lightning_resilient.io.catalog import ALONE, Together, load_resolved, normalize
from lightning_resilient.io.load_claims import LoadClaims
from lightning_resilient.io.local_tier import TierSettings
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest
from lightning_resilient.io.plugin_nodes import NodesLink
from lightning_resilient.io.plugin_roots import checkpoint_path
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.replicas import Sources, load_across_nodes
from lightning_resilient.io.root import CheckpointRoot, Loaded, LoadStats, RootSettings
from lightning_resilient.io.sharded import AtomicStorageReader
from lightning_resilient.io.tier_view import TieredResolved, load_tiered, resolve_tiered

__all__ = ["PluginLoads"]

log = logging.getLogger(__name__)


class PluginLoads:
    """The load paths of a plugin (see the module docstring), with its settings.

    ``root_for`` opens a root and ``loader_for`` says how this process reads one of its commits (the plugin's
    ``root`` and ``_loader``: a subclass may wrap them); ``options`` gives the storage options a plain file is read
    with; ``claims`` makes what a load claims; ``nodes`` are the job's nodes; ``settle`` waits for the saves in flight
    (a load never races one) and raises their error; ``loaded`` is told what each load read (``last_load``).
    """

    def __init__(self, *, settings: RootSettings, tier: TierSettings, pin_memory: bool,
                 root_for: Callable[[str], CheckpointRoot],
                 loader_for: Callable[[CheckpointRoot], Callable[..., Loaded]],
                 options: Callable[[Any], dict[str, Any]], claims: LoadClaims, nodes: NodesLink,
                 settle: Callable[[], None], loaded: Callable[[LoadStats | None], None]) -> None:
        self.settings = settings
        self.tier = tier
        self.pin_memory = pin_memory
        self._root_for = root_for
        self._loader_for = loader_for
        self._options = options
        self._claims = claims
        self._nodes = nodes
        self._settle = settle
        self._loaded = loaded

    def load(self, path: Any, map_location: Any, weights_only: bool | None, *,
             claim_on_load: bool | None) -> dict[str, Any]:
        """``CheckpointIO.load_checkpoint`` (see ``AtomicCheckpointIO.load_checkpoint``)."""
        given = checkpoint_path(path)  # messages name the path as the caller gave it
        url = normalize(given)
        self._settle()  # a load never races a save in flight (of Lightning's AsyncCheckpointIO, or ours)
        trainer = trainer_loading()
        url = self.resolve_last(url, trainer)
        kwargs = {"map_location": map_location, "weights_only": weights_only,
                  "pin_memory": self.pin_memory and _targets_cuda(map_location)}
        ranks = together(trainer)
        if self.tier.local_tier is not None:
            tiered = self._load_tiered(url, trainer, ranks, kwargs, shown=given, claim_on_load=claim_on_load)
            if tiered is not None:
                return tiered
        # Under a strategy, every rank of the job loads the commit rank 0 resolved.
        done = load_resolved(url, self._root_for, fallback=self.settings.fallback_on_corruption,
                             load_for=self._loader_for, together=ranks or ALONE, shown=given, **kwargs)
        if done is None:
            return _load_plain_file(url, self._options(None), map_location, weights_only)
        found, loaded = done
        self._loaded(loaded.stats)
        root = found.root
        resumed = next((e for e in [found.entry, *found.fallbacks] if e.commit == loaded.entry_commit), found.entry)
        root = self._claims.continue_from(root, resumed, trainer, claim_on_load=claim_on_load)
        root.remember_loaded(loaded)
        if trainer is not None and fn_of(trainer) == "fit":
            mark_resumed_step_saved(trainer, loaded.checkpoint)
        return loaded.checkpoint

    def resolve_last(self, url: str, trainer: Any) -> str:
        """What a resuming fit's checkpoint ``url`` means (see ``AtomicCheckpointIO.resolve_last``)."""
        if trainer is None or fn_of(trainer) != "fit":
            return url
        name, dirpath = paths.basename(url), paths.dirname(url)
        root_for = self._root_for
        if not any(names_last(callback, name) and root_for(str(callback.dirpath)).url == root_for(dirpath).url
                   for callback in getattr(trainer, "checkpoint_callbacks", []) if getattr(callback, "dirpath", None)):
            return url
        pointer, _ = self._root_for(dirpath).read_pointer()
        candidates = pointer.candidates() if pointer is not None else []
        if not candidates:
            return url  # no run of ours there (stock files), or none of the current run yet: the name as it is
        named = pointer.checkpoints.get(name) if pointer is not None else None
        if named is None or named.commit != candidates[0].commit:
            log.info("%s: resuming %s, the newest committed checkpoint of the run in %s (step %d), not %s", url,
                     candidates[0].commit, dirpath, candidates[0].step,
                     f"{name} (step {named.step})" if named is not None else name)
        return dirpath

    def _load_tiered(self, url: str, trainer: Any, ranks: Together | None, kwargs: dict[str, Any], *, shown: str,
                     claim_on_load: bool | None) -> dict[str, Any] | None:
        """Load across the local and the durable tier (see ``io/tier_view.py``); None when neither tier knows ``url``
        (a plain file, a stock checkpoint: the single-tier path handles it)."""
        local_tier = self.tier.local_tier
        assert local_tier is not None
        if ranks is not None and self._nodes.nodes is not None:
            return self._load_across_nodes(url, trainer, kwargs, shown=shown, claim_on_load=claim_on_load)
        found: TieredResolved | None = None
        if ranks is None or ranks.rank == 0:
            try:
                found = resolve_tiered(url, local_tier, self._root_for, shown=shown)
            except Exception as exc:
                if ranks is None:
                    raise
                ranks.broadcast({"error": exc})
                raise
        if ranks is not None:
            plan = ranks.broadcast({"found": found})
            if "error" in plan:
                raise plan["error"]
            found = plan["found"]
        if found is None:
            return None
        entry, source, loaded = load_tiered(found, local_tier, self._root_for, self._loader_for,
                                            fallback=self.settings.fallback_on_corruption, together=ranks,
                                            **kwargs)
        durable = self._root_for(found.durable_url)
        self._loaded(replace(loaded.stats, tier="durable" if source is durable else "local")
                     if loaded.stats is not None else None)
        self._claims.continue_from(durable, entry, trainer, claim_on_load=claim_on_load,
                                   elsewhere=not durable.store.exists(f"{entry.commit}/{MANIFEST_NAME}"))
        if source is not durable:  # (saves go to the local tier: only its own bytes may be shared)
            source.remember_loaded(loaded)
        if trainer is not None and fn_of(trainer) == "fit":
            mark_resumed_step_saved(trainer, loaded.checkpoint)
        return loaded.checkpoint

    def _load_across_nodes(self, url: str, trainer: Any, kwargs: dict[str, Any], *, shown: str,
                           claim_on_load: bool | None) -> dict[str, Any] | None:
        """Under DDP with the job's nodes known: one decision across every node's local tier, restoring a node's
        copy from a peer where it lacks it (``io/replicas.py``)."""
        nodes = self._nodes.nodes
        assert self.tier.local_tier is not None and nodes is not None

        def load(entry: Entry, manifest: Manifest, sources: Sources, failed: set[CheckpointRoot]) -> Loaded:
            root = sources.local if sources.local is not None else sources.durable
            assert root is not None
            try:
                if root is sources.local:
                    return root.load(entry.commit, manifest=manifest, **kwargs)
                return self._loader_for(root)(entry.commit, **kwargs)
            except CheckpointCorruptedError:
                failed.add(root)
                raise

        done = load_across_nodes(url, shown=shown, nodes=nodes, local_tier=self.tier.local_tier,
                                 root_for=self._root_for, replicas=self.tier.resolved_replicas(nodes.count),
                                 fallback=self.settings.fallback_on_corruption, load=load)
        if done is None:
            return None
        loaded, durable = done.loaded, done.durable
        self._loaded(replace(loaded.stats, tier="local" if done.sources.local is not None else "durable")
                     if loaded.stats is not None else None)
        self._claims.continue_from(durable, done.entry, trainer, claim_on_load=claim_on_load,
                                   elsewhere=not durable.store.exists(f"{done.entry.commit}/{MANIFEST_NAME}"))
        if done.sources.local is not None:
            done.sources.local.remember_loaded(loaded)
        if trainer is not None and fn_of(trainer) == "fit":
            mark_resumed_step_saved(trainer, loaded.checkpoint)
        return loaded.checkpoint

    def load_sharded(self, url: str, strategy: Any, load_shards: Callable[[AtomicStorageReader], None], *,
                     shown: str, weights_only: bool | None, claim_on_load: bool | None) -> dict[str, Any] | None:
        """A sharded strategy's resume with a local tier (see ``AtomicCheckpointIO.load_sharded_tiered``)."""
        assert self.tier.local_tier is not None
        nodes = self._nodes.nodes_for(strategy, sharded=True)
        assert nodes is not None

        def load(entry: Entry, manifest: Manifest, sources: Sources, failed: set[CheckpointRoot]) -> Loaded:
            roots = sources.roots()
            reader = AtomicStorageReader(roots[0], entry.commit, manifest=manifest, weights_only=weights_only,
                                         sources=roots)
            try:
                load_shards(reader)
            except CheckpointCorruptedError:
                failed.update(reader.failed)
                raise
            error: CheckpointCorruptedError | None = None
            for root in roots:  # the rest (loops, callbacks, RNG): from the first copy that verifies
                try:
                    return root.load(entry.commit, map_location=None, weights_only=weights_only, sharded_rest=True,
                                     manifest=manifest)
                except CheckpointCorruptedError as exc:
                    failed.add(root)
                    error = exc
            assert error is not None
            raise error

        done = load_across_nodes(url, shown=shown, nodes=nodes, local_tier=self.tier.local_tier,
                                 root_for=self._root_for, replicas=self.tier.resolved_replicas(nodes.count),
                                 fallback=self.settings.fallback_on_corruption, load=load)
        if done is None:
            return None
        trainer = getattr(strategy, "lightning_module", None)
        trainer = getattr(trainer, "trainer", None)
        self._loaded(replace(done.loaded.stats, tier="local" if done.sources.local is not None else "durable")
                     if done.loaded.stats is not None else None)
        fit = trainer is not None and fn_of(trainer) == "fit"
        self._claims.continue_sharded(done.durable, done.entry, fit=fit, rank=nodes.rank, claim_on_load=claim_on_load)
        if fit:
            mark_resumed_step_saved(trainer, done.loaded.checkpoint)
        local = done.sources.local
        if fit and self.settings.dedup and local is not None:
            # Every rank's first save references by digest what it finds unchanged among what its node's tier holds
            # of the commit (its saves go there; a part it read from the durable root is not).
            manifest = done.loaded.manifest
            local.remember_loaded(done.loaded, held=parts.held_objects(manifest, parts.held(local, manifest)))
        return done.loaded.checkpoint


def _targets_cuda(map_location: Any) -> bool:
    if map_location is None or callable(map_location):
        return False
    targets = map_location.values() if isinstance(map_location, dict) else [map_location]
    try:
        return any(torch.device(t).type == "cuda" for t in targets)
    except (TypeError, RuntimeError):
        return False


def _load_plain_file(url: str, options: dict[str, Any], map_location: Any,
                     weights_only: bool | None) -> dict[str, Any]:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **options)
    with fs.open(path, "rb") as f:
        kwargs: dict[str, Any] = {"map_location": map_location}
        if weights_only is not None:
            kwargs["weights_only"] = weights_only
        checkpoint: dict[str, Any] = torch.load(f, **kwargs)
        return checkpoint
