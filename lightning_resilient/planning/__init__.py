"""Planning tools: how often to checkpoint, which cluster to pay for, and what stalls the GPU.

- :mod:`~lightning_resilient.planning.cadence`: Young's and Daly's optimal checkpoint intervals and the
  expected waste of any interval.
- :mod:`~lightning_resilient.planning.tiers`: the same for a node-local tier in front of the durable store:
  the local interval and ``persist_every`` with the least expected waste, against the single-tier plan.
- :mod:`~lightning_resilient.planning.cost`: wall-clock hours and cost per cluster option, the value of time,
  and the scaling benchmark's JSON read into options.
- :class:`TransferAudit`: a callback that flags pageable batch tensors, blocking host-to-device copies and
  host syncs inside the training step.

``CheckpointCadence``, the callback that measures each save and applies these formulas in training, lives above
this package, in :mod:`lightning_resilient.checkpoint_cadence`: it reads the goodput ledger of ``state/``, which
builds on this package. ``planning/`` imports neither ``state/`` nor the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_resilient._lazy import lazy_exports

# Imported on first use (PEP 562): TransferAudit imports Lightning, which `lightning-resilient cadence` and `cost`
# (and their `--help`) do not need.
_WHERE = {
    "ClusterOption": "lightning_resilient.planning.cost",
    "Comparison": "lightning_resilient.planning.cost",
    "OptionCost": "lightning_resilient.planning.cost",
    "SCALING_SCHEMA": "lightning_resilient.planning.cost",
    "TierCosts": "lightning_resilient.planning.tiers",
    "TieredPlan": "lightning_resilient.planning.tiers",
    "TransferAudit": "lightning_resilient.planning.audit",
    "TransferAuditWarning": "lightning_resilient.planning.audit",
    "compare": "lightning_resilient.planning.cost",
    "daly_interval": "lightning_resilient.planning.cadence",
    "expected_waste": "lightning_resilient.planning.cadence",
    "load_scaling": "lightning_resilient.planning.cost",
    "plan_tiers": "lightning_resilient.planning.tiers",
    "steps_for_interval": "lightning_resilient.planning.cadence",
    "tiered_waste": "lightning_resilient.planning.tiers",
    "young_interval": "lightning_resilient.planning.cadence",
}

__all__ = [
    "ClusterOption",
    "Comparison",
    "OptionCost",
    "SCALING_SCHEMA",
    "TierCosts",
    "TieredPlan",
    "TransferAudit",
    "TransferAuditWarning",
    "compare",
    "daly_interval",
    "expected_waste",
    "load_scaling",
    "plan_tiers",
    "steps_for_interval",
    "tiered_waste",
    "young_interval",
]

if TYPE_CHECKING:
    from lightning_resilient.planning.audit import TransferAudit, TransferAuditWarning
    from lightning_resilient.planning.cadence import daly_interval, expected_waste, steps_for_interval, young_interval
    from lightning_resilient.planning.cost import (
        SCALING_SCHEMA,
        ClusterOption,
        Comparison,
        OptionCost,
        compare,
        load_scaling,
    )
    from lightning_resilient.planning.tiers import TierCosts, TieredPlan, plan_tiers, tiered_waste


__getattr__, __dir__ = lazy_exports('lightning_resilient.planning', _WHERE, globals())
