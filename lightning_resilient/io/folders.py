"""The names of things inside a checkpoint root: commit folders, the objects in them, and the writer's identity.

A *commit folder* is ``<name>/c<ms>-e<writer epoch>-<random>``: the folder one save of checkpoint ``<name>`` writes
its objects and, last, its manifest into. Its name carries the writer epoch it was written under (which garbage
collection reads without opening it) and when it was started (for display only; no decision depends on clocks).
"""

from __future__ import annotations

import os
import re
import socket
import uuid

__all__ = ["ATTEMPTS_DIR", "REPLACED_DIR", "SKELETON_NAME", "TIER_RECORD", "WHOLE", "commit_time", "is_whole_object",
           "new_commit_folder", "part_record", "writer_epoch_of", "writer_identity"]

_COMMIT_RE = re.compile(r"^c(\d{13})-e(\d+)-[0-9a-f]{8}$")
# The non-tensor part of a checkpoint (torch.save of the checkpoint with its tensors replaced by slots).
SKELETON_NAME = "skeleton.pt"
# Stock checkpoint files a save of the same name replaces wait here until that save has committed.
REPLACED_DIR = ".lightning_resilient/replaced"
# One record per attempt of a training run and per rank (lightning_resilient/state/attempts.py): what each step
# consumed, for the resume audit. Nothing of the protocol reads it; retention and gc never list it.
ATTEMPTS_DIR = ".lightning_resilient/attempts"
# In a node-local tier root: which durable root it belongs to, and that root's incarnation (io/tiered.py).
TIER_RECORD = ".lightning_resilient/tier.json"
# In a sharded commit, the objects holding a rank's whole items (not its shards of sharded tensors):
# ``r<rank>-whole-shard-NNNNN.bin`` beside its ``r<rank>-shard-NNNNN.bin`` (io/sharded.py).
WHOLE = "whole-"
_WHOLE_RE = re.compile(r"^r\d{5}-whole-")


def is_whole_object(path: str) -> bool:
    """Whether an object of a sharded commit holds a rank's whole items (see :data:`WHOLE`)."""
    return _WHOLE_RE.match(path.rsplit("/", 1)[-1]) is not None


def part_record(commit: str, node: int) -> str:
    """In a local tier: the record, written last, that this node holds node ``node``'s part of ``commit`` (a sharded
    commit written across nodes, io/parts.py)."""
    return f"{commit}/part-{node:05d}.json"


def writer_identity() -> str:
    """Who writes: host, process and a random suffix (two plugins of one process are two writers)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def new_commit_folder(name: str, created: float, writer_epoch: int) -> str:
    """The folder of a new commit of checkpoint ``name``, started at ``created`` by writer epoch ``writer_epoch``."""
    return f"{name}/c{int(created * 1000):013d}-e{writer_epoch}-{uuid.uuid4().hex[:8]}"


def commit_time(folder: str) -> float | None:
    """When a commit folder was started, by its writer's clock (for display only: no decision depends on it)."""
    match = _COMMIT_RE.match(folder.rsplit("/", 1)[-1])
    return int(match.group(1)) / 1000 if match else None


def writer_epoch_of(folder: str) -> int | None:
    """The writer epoch a commit folder was written under (its name carries it), or None if it is not one."""
    match = _COMMIT_RE.match(folder.rsplit("/", 1)[-1])
    return int(match.group(2)) if match else None
