"""The nodes of a job as one ``AtomicCheckpointIO`` sees them: with a local tier on several processes, which node each
process is on, and the copies of local commits between nodes.

:class:`NodesLink` joins the job's nodes when a fit starts (a collective of every rank: ``Nodes`` of
``io/replicas.py``), starts the background copies between them (its ``Replicator``) and wires each durable root's
tiers to them: global rank 0 hands every local commit to the copies, and persists a sharded commit written across
nodes with every node's part. It stops the copies at the end of a fit, after the last persist.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lightning_resilient.io.local_tier import TierSettings
from lightning_resilient.io.parts import spans_nodes
from lightning_resilient.io.replicas import Access, Nodes, Replicator
from lightning_resilient.io.tiered import TieredRoot, save_key

__all__ = ["NodesLink"]

log = logging.getLogger(__name__)


class NodesLink:
    """The job's nodes and the copies between them, for a plugin with the tier settings ``tier``.

    ``tiers_for(url)`` gives a durable root's tiers (the plugin's ``tiers``: the copies reach any root through it);
    ``open_tiers()`` those opened so far. ``collective_timeout`` bounds each collective between the job's processes.
    """

    def __init__(self, tier: TierSettings, collective_timeout: float, *, tiers_for: Callable[[str], TieredRoot],
                 open_tiers: Callable[[], list[TieredRoot]]) -> None:
        self.tier = tier
        self.collective_timeout = collective_timeout
        self._tiers_for = tiers_for
        self._open_tiers = open_tiers
        self.nodes: Nodes | None = None
        self.replicator: Replicator | None = None

    def nodes_for(self, strategy: Any, *, fresh: bool = False, sharded: bool = False) -> Nodes | None:
        """The job's nodes (joined now if not yet: a collective of every rank); None without a local tier, or for a
        single process that is not ``sharded``. ``fresh``: join anew (a new fit)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.tier.local_tier is None or not (sharded or (distributed and torch.distributed.get_world_size() > 1)):
            return None
        if self.nodes is not None and not fresh:
            return self.nodes
        self.stop()
        if not distributed:
            self.nodes = Nodes.solo()
            return self.nodes
        nodes = Nodes.join(int(getattr(strategy, "node_rank", 0)), int(getattr(strategy, "local_rank", 0)),
                           timeout=self.collective_timeout)
        replicas = self.tier.resolved_replicas(nodes.count)
        if self.tier.replicas is not None and self.tier.replicas > nodes.count and nodes.rank == 0:
            log.warning("replicas=%d but the job runs on %d node(s): each local commit is held by all of them",
                        self.tier.replicas, nodes.count)
        self.nodes = nodes
        self.replicator = Replicator(nodes, Access(self._tiers_for), replicas)
        self.replicator.start()
        for tier in self._open_tiers():
            self.wire(tier)
        return nodes

    def wire(self, tiers: TieredRoot) -> None:
        """Hand ``tiers``'s local commits to the copies between nodes (global rank 0 starts each), and persist a
        sharded commit written across nodes with every node's part."""
        replicator = self.replicator
        if replicator is None or replicator.nodes.background is None or replicator.nodes.rank != 0:
            tiers.on_commit = tiers.copier = None
            return
        tiers.on_commit = lambda entry: replicator.replicate(tiers, entry, save_key(entry))
        tiers.copier = lambda manifest: replicator.persist_parts(tiers, manifest) if spans_nodes(manifest) else None

    def flush(self) -> None:
        """Wait for the copies of local commits to the other nodes (global rank 0 of a job on several nodes)."""
        if self.replicator is not None:
            self.replicator.flush()

    def stop(self) -> None:
        """Stop the copies between nodes (every node's copying thread ends)."""
        replicator, self.replicator = self.replicator, None
        if replicator is not None:
            replicator.stop()
