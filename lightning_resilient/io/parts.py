"""What each node's local tier holds of a commit, in a job on several nodes: parts, replicas and their placement.

A full (not sharded) checkpoint is one part, part 0: all of its objects. Every node's local tier holds it (global
rank 0 commits it, and sends it to every other node: ``io/replicas.py``).

A sharded checkpoint written across nodes has one part per node that wrote it: part ``k`` is the shards of the ranks
of node ``k`` (``ShardedRecord.nodes`` records the ranks of each node). Beside the parts it holds, every node's local
tier holds the commit's *common* objects: DCP's metadata, the non-sharded rest (loops, callbacks, RNG) and every
rank's whole items (``r<rank>-whole-...``: DCP's deduplicated replicated tensors and bytes, which any rank may need
whatever its shards). A node holds its own part and, with ``replicas=R``, the parts of the R-1 nodes before it:
node ``k``'s part goes to nodes ``k+1, ..., k+R-1`` (mod the number of nodes). The placement is a function of the
node index alone, so a restart knows where to look without asking anyone.

A node *holds* a part when the part's record (``folders.part_record``) is in its local tier and every object of the
part and the common objects are stored there with the sizes the manifest gives. The record is written last, after
every object was verified against the manifest's checksums: a half-received replica has no record and counts for
nothing. A full checkpoint needs no record: its manifest, written last, is one. Holding says nothing of the bytes
since they were written: every byte is verified again when it is read, and a copy that fails is replaced by the next
source (another replica, then the durable root).
"""

from __future__ import annotations

import json
from collections.abc import Collection

from lightning_resilient.io.folders import is_whole_object, part_record
from lightning_resilient.io.manifest import Manifest, ObjectEntry
from lightning_resilient.io.root import CheckpointRoot

__all__ = ["common_objects", "held", "held_objects", "needs", "part_count", "part_objects", "placement", "save_layout",
           "sources_of", "spans_nodes", "write_record"]


def spans_nodes(manifest: Manifest) -> bool:
    """Whether ``manifest`` is a sharded commit written across nodes (each node's local tier holds parts of it)."""
    return manifest.sharded is not None and len(manifest.sharded.nodes) > 1


def save_layout(manifest: Manifest) -> list[list[int]]:
    """The global ranks of each node that wrote ``manifest``'s checkpoint, by part: one part for a full checkpoint
    (``[[0]]``) and for a sharded one whose nodes were not recorded."""
    if manifest.sharded is None:
        return [[0]]
    return [list(node) for node in manifest.sharded.nodes] or [list(range(manifest.sharded.world_size))]


def part_count(manifest: Manifest) -> int:
    return len(save_layout(manifest))


def part_objects(manifest: Manifest, part: int) -> list[int]:
    """Indices (into ``manifest.objects``) of part ``part``: every object of a full checkpoint; the shards of the
    part's ranks for a sharded one."""
    if manifest.sharded is None:
        return list(range(len(manifest.objects)))
    return [i for rank in save_layout(manifest)[part] for i in manifest.sharded.ranks[rank]
            if not is_whole_object(manifest.objects[i].path)]


def common_objects(manifest: Manifest) -> list[int]:
    """Indices of the objects every node holding any part of a sharded checkpoint holds (none for a full one)."""
    if manifest.sharded is None:
        return []
    shards = {i for part in range(part_count(manifest)) for i in part_objects(manifest, part)}
    return [i for i in range(len(manifest.objects)) if i not in shards]


def held_objects(manifest: Manifest, parts: Collection[int]) -> list[ObjectEntry]:
    """The objects a local tier holding ``parts`` of ``manifest``'s checkpoint stores: the common ones and theirs."""
    indices = set(common_objects(manifest))
    for part in parts:
        indices.update(part_objects(manifest, part))
    return [manifest.objects[i] for i in sorted(indices)]


def placement(part: int, nodes: int, replicas: int) -> list[int]:
    """The nodes that hold replicas of node ``part``'s part, in the order a restore asks them: ``part+1, ...,
    part+replicas-1`` (mod ``nodes``). Never the node itself, never more than the other nodes."""
    return [(part + i) % nodes for i in range(1, min(replicas, nodes))]


def sources_of(part: int, holders: list[int], nodes: int, replicas: int, *, exclude: set[int]) -> list[int]:
    """The nodes to fetch part ``part`` from, in order, among ``holders`` (those that report holding it), less
    ``exclude``: the node that wrote it, then its replica holders by placement, then any other holder."""
    order = [part, *placement(part, nodes, replicas)] if part < nodes else []
    ranked = [n for n in order if n in holders] + sorted(n for n in holders if n not in order)
    return [n for n in dict.fromkeys(ranked) if n not in exclude]


def needs(manifest: Manifest, layout: list[list[int]]) -> list[set[int]]:
    """The parts each node of ``layout`` (the current job's global ranks by node) needs to load the checkpoint.

    A full checkpoint: part 0, on every node. A sharded one loaded by as many processes as wrote it: the parts
    holding the shards of the node's ranks (DCP reads each rank's own shards, and whole items from anywhere: the
    common objects). Loaded by another number of processes, DCP reshards and a rank may read any shard: every part.
    """
    parts = save_layout(manifest)
    if manifest.sharded is None:
        return [{0} for _ in layout]
    if sum(len(node) for node in layout) != manifest.sharded.world_size:
        return [set(range(len(parts))) for _ in layout]
    return [{k for k, saved in enumerate(parts) if set(saved) & set(node)} for node in layout]


def held(root: CheckpointRoot, manifest: Manifest) -> frozenset[int]:
    """The parts of ``manifest``'s checkpoint that the local tier ``root`` holds (see the module docstring)."""
    count = part_count(manifest)
    if manifest.sharded is None:
        candidates = [0]
    else:
        candidates = [k for k in range(count) if root.store.exists(part_record(manifest.commit, k))]
    if not candidates:
        return frozenset()
    stored = root.reader.stored_sizes(o.path for o in held_objects(manifest, candidates))
    common = [manifest.objects[i] for i in common_objects(manifest)]
    if not all(stored.get(o.path, -1) in (o.size, None) for o in common):
        return frozenset()
    return frozenset(k for k in candidates if all(stored.get(manifest.objects[i].path, -1) in (manifest.objects[i].size,
                                                                                           None)
                                                  for i in part_objects(manifest, k)))


def write_record(root: CheckpointRoot, manifest: Manifest, part: int) -> None:
    """Record that ``root`` holds part ``part`` of ``manifest``'s checkpoint: written last, once every object of the
    part (and the common ones) is stored and verified. A full checkpoint's manifest is its record."""
    if manifest.sharded is None:
        return
    paths = [manifest.objects[i].path for i in part_objects(manifest, part)]
    root.store.sync_folder(manifest.commit)
    root.store.write(part_record(manifest.commit, part),
                     json.dumps({"commit": manifest.commit, "part": part, "ranks": save_layout(manifest)[part],
                                 "objects": paths}).encode())

