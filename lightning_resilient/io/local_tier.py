"""The local tier's place and identity: where a durable root's local tier lives on node-local disk, whose it is, and
its settings.

A local tier root is an ordinary checkpoint root at ``<local_tier>/<name>-<hash of the durable URL>``
(:func:`local_tier_url`). Its record (``TIER_RECORD``) names the durable root and the incarnation of that root whose
lineage it holds (:func:`tier_record`). A job's claim of the durable root (:class:`Claim`) is *adopted* by each of its
nodes' local tiers (:func:`adopt_claim`): one writer epoch and lineage in every tier, so a commit has one name and one
place in the lineage in both. A local tier that cannot be the durable root's (another incarnation, a damaged pointer)
is moved aside first (:func:`set_aside_if_foreign`). :class:`TierSettings` checks the plugin's ``local_tier``,
``persist_every``, ``local_keep``, ``replicas`` and outage bounds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lightning_resilient._checks import check_int, check_number, check_optional_int
from lightning_resilient._warnings import warn
from lightning_resilient.errors import CheckpointError, SettingTypeError
from lightning_resilient.io import paths
from lightning_resilient.io.folders import TIER_RECORD
from lightning_resilient.io.lineage import Origin
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["Claim", "TierSettings", "adopt_claim", "durable_of", "is_local_tier_url", "local_tier_url",
           "set_aside_if_foreign", "tier_record"]


def local_tier_url(local_tier: str, durable_url: str) -> str:
    """The node-local root that holds the local tier of ``durable_url`` under the folder ``local_tier``."""
    if paths.split_protocol(durable_url)[0] in (None, "file", "local"):
        # One local tier per physical folder, as one root per physical folder (a dirpath reached by a symlink).
        durable_url = os.path.realpath(durable_url.split("://", 1)[-1])
    tail = re.sub(r"[^A-Za-z0-9._=-]+", "_", durable_url.split("://", 1)[-1].strip("/"))[-48:].strip("_") or "root"
    digest = hashlib.sha256(durable_url.encode()).hexdigest()[:12]
    return os.path.join(os.path.realpath(os.path.expanduser(local_tier)), f"{tail}-{digest}")


def is_local_tier_url(local_tier: str, url: str) -> bool:
    """Whether ``url`` has the form of a local tier root under the folder ``local_tier`` (see local_tier_url)."""
    return os.path.dirname(url) == local_tier and re.search(r"-[0-9a-f]{12}$", os.path.basename(url)) is not None


def tier_record(local_root: CheckpointRoot) -> dict[str, str] | None:
    """The local tier root's record: ``durable`` (the URL) and ``root_id`` (the incarnation of that root whose
    lineage it holds); None if it has none."""
    try:
        raw = json.loads(local_root.store.read(TIER_RECORD))
        return {"durable": str(raw["durable"]), "root_id": str(raw.get("root_id", ""))}
    except (FileNotFoundError, KeyError, ValueError, TypeError):
        return None


def durable_of(local_root: CheckpointRoot) -> str | None:
    """The durable root URL a local tier root belongs to (its tier record), or None if it is no local tier."""
    record = tier_record(local_root)
    return record["durable"] if record is not None else None



@dataclass(frozen=True)
class TierSettings:
    """``AtomicCheckpointIO(local_tier=..., persist_every=..., local_keep=..., replicas=..., max_persist_failures=...,
    max_seconds_without_durable=...)``, checked when made."""

    local_tier: str | None  # a node-local folder, absolute with symlinks resolved (see given()); None: no local tier
    persist_every: int = 1
    local_keep: int = 2
    replicas: int | None = None  # None: 2 on several nodes, 1 (none) on one (see resolved_replicas)
    max_persist_failures: int | None = 5
    max_seconds_without_durable: float | None = None

    @classmethod
    def given(cls, local_tier: Any, persist_every: Any, local_keep: Any, replicas: Any = None,
              max_persist_failures: Any = 5, max_seconds_without_durable: Any = None) -> TierSettings:
        """The settings as a user gives them: ``local_tier`` a path or ``os.PathLike`` (checked, made absolute)."""
        return cls(_check_local_tier(local_tier), persist_every, local_keep, replicas, max_persist_failures,
                   max_seconds_without_durable)

    def __post_init__(self) -> None:
        # Frozen: the checked values (plain ints) are set once, here.
        object.__setattr__(self, "persist_every", check_int("persist_every", self.persist_every, minimum=1,
                                                            typed=False, hint="persist every N-th saved step"))
        object.__setattr__(self, "local_keep", check_int("local_keep", self.local_keep, minimum=1, typed=False,
                                                         hint="checkpoints kept in the local tier"))
        object.__setattr__(self, "replicas", check_optional_int(
            "replicas", self.replicas, minimum=1, none_means="2 on several nodes, 1 on one", typed=False))
        object.__setattr__(self, "max_persist_failures", check_optional_int(
            "max_persist_failures", self.max_persist_failures, minimum=1, none_means="never stop for failed persists",
            typed=False))
        if self.max_seconds_without_durable is not None:
            object.__setattr__(self, "max_seconds_without_durable", check_number(
                "max_seconds_without_durable", self.max_seconds_without_durable, above=0,
                hint="seconds without a durable commit while persists fail; None: no limit"))
        if self.local_tier is None:
            given = [f"{name}={value}" for name, value, default in (
                ("persist_every", self.persist_every, 1), ("replicas", self.replicas, None)) if value != default]
            if given:
                raise ValueError(f"{given[0]} needs local_tier: without a local tier every save goes to the durable"
                                 " root. Pass local_tier='/local/nvme/ckpt' (a node-local folder).")

    def resolved_replicas(self, nodes: int) -> int:
        """How many nodes hold each local commit (a sharded commit's part) in a job on ``nodes`` nodes: ``replicas``
        (at most ``nodes``), by default 2 on several nodes."""
        wanted = self.replicas if self.replicas is not None else (2 if nodes > 1 else 1)
        return max(1, min(wanted, nodes))


def _check_local_tier(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)):
        raise SettingTypeError(f"local_tier must be a node-local folder path or None, got {value!r}")
    path = str(os.fspath(value))
    protocol = paths.split_protocol(path)[0]
    if protocol not in (None, "file", "local"):
        raise ValueError(f"local_tier must be a node-local folder (local NVMe, /dev/shm), not a {protocol}:// URL"
                         f" ({path!r}): the durable tier is the ModelCheckpoint dirpath")
    if protocol is not None:
        path = path.split("://", 1)[1]
    return os.path.realpath(os.path.expanduser(path))


@dataclass(frozen=True)
class Claim:
    """A job's claim of a durable root, as its local tiers (one per node) adopt it: one writer epoch and lineage in
    every tier of every node."""

    durable: str
    writer_epoch: int
    origin: Origin
    origins: dict[int, Origin]
    root_id: str


def adopt_claim(local: CheckpointRoot, claim: Claim) -> None:
    """Write the local tier root ``local`` as the job's claim of its durable root (once per writer epoch): set the
    local tier aside first when it belongs to another incarnation of the durable root, or is damaged."""
    if local.writer_epoch == claim.writer_epoch:
        return
    local.settle()  # (before the tier may be set aside: a restore's copy may still be written into it)
    set_aside_if_foreign(local, claim.durable, claim.root_id)
    # The record first: a local root holding commits always says which durable root it belongs to.
    _write_tier_record(local, claim.durable, claim.root_id)
    local.adopt(claim.writer_epoch, claim.origin, claim.origins, claim.root_id)


def set_aside_if_foreign(local: CheckpointRoot, durable_url: str, root_id: str) -> None:
    """Move the local tier root aside (kept, renamed) when it cannot be this durable root's: it holds the lineage of
    another incarnation of the root (deleted and written again under the same URL), or its pointer is damaged. Its
    checkpoints could otherwise be taken for this run's, or stop every save."""
    if not local.store.exists(""):
        return
    record = tier_record(local)
    try:
        pointer, _ = local.read_pointer()
    except CheckpointError as exc:
        why = f"its pointer is damaged ({exc})"
    else:
        if pointer is None and record is None:
            return
        if record is not None and record["root_id"] == root_id:
            return
        why = (f"it holds checkpoints of an earlier incarnation of {durable_url} (that root was deleted and"
               " written again since)")
    path = local.store.path("").rstrip("/")
    # The time says when; the random tail keeps two set-asides of one second apart (a rename onto an existing folder
    # fails, or, onto an empty one, replaces it).
    aside = f"{path}.set-aside-{int(time.time())}-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    local.fence.writer_epoch = local.fence.root_id = local.fence.lineage_id = None  # set aside: the next save adopts
    warn(f"the local tier {path} was moved to {aside}: {why}. Nothing of it is resumed; delete it once"
         " you no longer need it.", RuntimeWarning)


def _write_tier_record(local: CheckpointRoot, durable_url: str, root_id: str) -> None:
    if tier_record(local) != {"durable": durable_url, "root_id": root_id}:
        local.store.write(TIER_RECORD, json.dumps({"durable": durable_url, "root_id": root_id}).encode())
