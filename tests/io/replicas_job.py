"""Three "nodes" of one process each, on gloo, with the API of io/replicas.py alone (no Lightning, which costs seconds
to import per process), for tests/io/test_replicas.py: sharded saves into every node's local tier with ``replicas=3``,
then a new job resumes after a node was replaced, with the replicas it would restore from damaged one after the other,
and once with the replaced node killed between its load (from the restored bytes, in memory) and their disk copy, once
with a ``gc --grace 0`` on its tier while that copy is written.

Each process asserts what it loads; rank 0 writes ``result.json`` (what each rank loaded, from where, and what it
logged about restoring) into BASE.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The node of each global rank: one process per node, or two on node 2 (the node that is replaced), whose second
# process reads the restored copy from the tier (not from the leader's memory).
LAYOUTS = {"one process per node": [0, 1, 2], "two processes on node 2": [0, 1, 2, 2]}


def value(step: int, world: int) -> torch.Tensor:
    return torch.arange(world * 8 * 4, dtype=torch.float32).reshape(world * 8, 4) + 1000 * step


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


class Job:
    """One job's view of the tiers on this node: the roots, the nodes, the copies between them (what the plugin
    wires up, see ``AtomicCheckpointIO.nodes_for``)."""

    def __init__(self, base: str, rank: int, node_of: list[int], *, dedup: bool = False,
                 shard_size: int = 2**20) -> None:
        from lightning_resilient.io.local_tier import local_tier_url
        from lightning_resilient.io.parts import spans_nodes
        from lightning_resilient.io.replicas import Access, Nodes, Replicator
        from lightning_resilient.io.root import RootSettings, SerialExecutor, open_root
        from lightning_resilient.io.tiered import TieredRoot, save_key

        node = node_of[rank]
        self.local_tier = os.path.join(base, f"nvme{node}")
        settings = RootSettings(keep_last=None, shard_size=256, chunk_size=64, orphan_grace_seconds=3600.0,
                                fallback_on_corruption=True)
        if dedup:  # (a frozen base of a few objects, not thousands)
            settings = replace(settings, shard_size=shard_size, chunk_size=2**16, dedup=True)
        roots: dict[str, Any] = {}
        tiers: dict[str, TieredRoot] = {}

        def root_for(url: str) -> Any:
            if url not in roots:
                local = url.startswith(self.local_tier)
                roots[url] = open_root(url, settings=replace(settings, keep_last=2) if local else settings)
            return roots[url]

        def tiers_for(url: str) -> TieredRoot:
            if url not in tiers:
                tier = tiers[url] = TieredRoot(root_for(url), root_for(local_tier_url(self.local_tier, url)),
                                               persist_every=2, executor=SerialExecutor)
                if rank == 0:
                    tier.on_commit = lambda entry: self.replicator.replicate(tier, entry, save_key(entry))
                    tier.copier = lambda m: self.replicator.persist_parts(tier, m) if spans_nodes(m) else None
            return tiers[url]

        self.root_for, self.tiers_for = root_for, tiers_for
        self.nodes = Nodes.join(node_rank=node, local_rank=node_of[:rank].count(node))
        self.replicator = Replicator(self.nodes, Access(tiers_for), replicas=len(set(node_of)))
        self.replicator.start()


def replica(job: Job, root: str, step: int, part: int) -> Path:
    """This node's copy of object 0 of ``part`` of the commit of ``step``."""
    from lightning_resilient.io import parts

    local = job.tiers_for(root).local
    pointer, _ = local.read_pointer()
    entry = next(e for e in pointer.entries() if e.step == step)
    manifest = local.read_manifest(entry.commit)
    return Path(local.store.path(manifest.objects[parts.part_objects(manifest, part)[0]].path))


def listed(job: Job, root: str, settle: bool = False) -> list[int]:
    """The steps this node's tier lists (after the copy a restore left to finish, with ``settle``)."""
    from lightning_resilient.io.local_tier import local_tier_url

    local = job.root_for(local_tier_url(job.local_tier, root))
    if settle:
        local.settle()
    pointer, _ = local.read_pointer()
    return sorted(e.step for e in pointer.entries()) if pointer is not None else []


def records(job: Job, root: str) -> list[str]:
    """The part records in this node's tier."""
    return sorted(p.name for p in Path(job.local_tier).rglob("part-*.json"))


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def sharded_loader(target: dict[str, Any]) -> Any:
    """A ``load`` for ``load_across_nodes`` that loads a sharded commit into ``target`` (DTensors) in place, as the
    plugin's sharded resume does: the shards from the sources in order, the rest from the first."""
    from lightning_resilient.io.sharded import AtomicStorageReader, load_sharded

    def load(entry: Any, manifest: Any, sources: Any, failed: set[Any]) -> Any:
        roots = sources.roots()
        reader = AtomicStorageReader(roots[0], entry.commit, manifest=manifest, sources=roots)
        try:
            load_sharded(target, reader.root, reader.commit, reader=reader)
        except Exception:
            failed.update(reader.failed)
            raise
        return roots[0].load(entry.commit, map_location=None, weights_only=None, sharded_rest=True, manifest=manifest)

    return load


def report_and_exit(rank: int, world: int, base: str, outcomes: dict[str, Any]) -> None:
    """Gather every rank's ``outcomes`` into ``BASE/result.json`` (rank 0) and end the process."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcomes)
    if rank == 0:
        Path(base, "result.json").write_text(json.dumps(gathered))
    dist.barrier()
    os._exit(0)  # gloo teardown at interpreter exit can abort on CPU (see tests/io/sharded_child.py)


def job(rank: int, port: int, base: str, layout: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    node_of = LAYOUTS[layout]
    world, node, leader = len(node_of), node_of[rank], node_of.index(node_of[rank]) == rank
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_resilient.io.replicas import load_across_nodes, save_sharded_tiered

    messages = Messages()
    logging.getLogger("lightning_resilient").addHandler(messages)
    logging.getLogger("lightning_resilient").setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (world,))
    root = os.path.join(base, "root")

    first = Job(base, rank, node_of)
    for step in (1, 2, 3):  # the 2nd is persisted (persist_every=2)
        state = {"state_dict": {"w": distribute_tensor(value(step, world), mesh, [Shard(0)])}}
        save_sharded_tiered(state, first.tiers_for(root), f"step={step}.ckpt",
                            {"global_step": step} if rank == 0 else None, first.nodes)
    first.tiers_for(root).wait()
    first.replicator.flush()  # rank 0: every copy between nodes queued so far is done, on every node
    dist.barrier()
    # That job ends here as a killed one would (no end-of-fit persist); a new one resumes, on the same nodes.
    resumed = Job(base, rank, node_of)

    def resume(resumed: Job) -> tuple[int, str]:
        target = {"state_dict": {"w": distribute_tensor(torch.zeros(world * 8, 4), mesh, [Shard(0)])}}

        done = load_across_nodes(root, shown=root, nodes=resumed.nodes, local_tier=resumed.local_tier,
                                 root_for=resumed.root_for, replicas=3, fallback=True, load=sharded_loader(target))
        assert done is not None
        step = done.loaded.checkpoint["global_step"]
        assert torch.equal(target["state_dict"]["w"].full_tensor(), value(step, world)), f"rank {rank}: wrong values"
        return step, "local" if done.sources.local is not None else "durable"

    outcomes: dict[str, Any] = {}
    # (a) node 2 is replaced (its local tier is gone); node 0's replica of its part of step 3 is damaged: node 2
    # restores its part from node 1's replica.
    if node == 2 and leader:
        shutil.rmtree(resumed.local_tier)
    if rank == 0:
        damage(replica(resumed, root, 3, 2))
    dist.barrier()
    messages.seen.clear()
    outcomes["a"] = (*resume(resumed), [m for m in messages.seen if "restor" in m])
    # The restored copy reaches node 2's tier behind the load; settled, the tier lists it like its own commits.
    outcomes["a listed"] = listed(resumed, root, settle=True)
    dist.barrier()
    # (c) node 2 is replaced again, and dies after its load but before the restored copy is on its disk (its first
    # object written, the rest stalled): its tier neither lists the commit nor records the part, and the next job
    # restores it from a peer again. (A node of one process: one of several writes the copy before the load.)
    again = collected = None
    if len(node_of) == 3:
        again = _killed_after_the_load(base, rank, node_of, root, resumed, resume, messages, outcomes)
        # (d) node 2 replaced again; while its restored copy is written behind training (first object written, the
        # rest stalled), an operator runs `gc --grace 0` on its tier from another process: the folder is an
        # unfinished save of the tier's current writer (the restore adopted the commit's writer epoch before
        # writing), which no grace setting lets gc take; the copy is listed once written, its part verifies, and
        # the next job resumes it locally without restoring.
        collected = _collected_while_written(base, rank, node_of, root, resume, messages, outcomes)
    # (b) node 2 is replaced again; now every replica of its part is damaged, of step 3 and of step 2: step 3 has no
    # source left (it was never persisted), step 2 is read from the durable root where node 2 lacks it.
    if node == 2 and leader:
        shutil.rmtree(resumed.local_tier)
    if rank in (0, 1):
        for step in (2, 3):
            if rank == 1 or step == 2:  # (node 0's copy of step 3 is damaged already)
                copy = replica(resumed, root, step, 2)
                # (A replication of step 2 may have been dropped for step 3's on a slow machine: a node that never
                # got its copy holds none to damage, which is as unusable.)
                if step == 3 or copy.exists():
                    damage(copy)
    dist.barrier()
    outcomes["b"] = resume(resumed)
    for ending in (first, resumed, again, collected):
        if ending is not None:
            ending.replicator.stop()
    report_and_exit(rank, world, base, outcomes)


def _stall_writes_after_the_first() -> tuple[Any, list[int], threading.Event]:
    """From now on, a restore's object writes into this node's tier stop after the first one until the event is set
    (never, for a process that "dies" there): the original write, the indices written, the event."""
    from lightning_resilient.io import replicas

    write, written, go = replicas._write, [], threading.Event()

    def stalled(*args: Any) -> None:
        if written:
            go.wait()
        written.append(args[2])
        write(*args)

    replicas._write = stalled
    return write, written, go


def _collected_while_written(base: str, rank: int, node_of: list[int], root: str, resume: Any, messages: Messages,
                             outcomes: dict[str, Any]) -> Job:
    from lightning_resilient.io import parts, replicas
    from lightning_resilient.io.local_tier import local_tier_url
    from lightning_resilient.io.root import INSPECTING, open_root

    if rank == 2:
        shutil.rmtree(Path(base, "nvme2"))
    dist.barrier()
    job = Job(base, rank, node_of)
    if rank == 2:
        write, written, go = _stall_writes_after_the_first()
    messages.seen.clear()
    outcomes["d loaded"] = resume(job)
    if rank == 2:
        while not written:
            time.sleep(0.01)
        # (another process's view of the tier: a root of its own, as `lightning-resilient gc` opens it)
        try:
            gc = open_root(local_tier_url(job.local_tier, root),
                           settings=replace(INSPECTING, orphan_grace_seconds=0.0))
            outcomes["d collected"] = [url.rsplit("/", 1)[-1] for url, _ in gc.collect_garbage()]
        finally:
            go.set()
        local = job.root_for(local_tier_url(job.local_tier, root))
        outcomes["d listed"] = listed(job, root, settle=True)
        # what the tier lists of its part and the common objects verifies
        pointer, _ = local.read_pointer()
        outcomes["d verified"] = []
        for entry in pointer.entries() if pointer is not None else []:
            manifest = local.read_manifest(entry.commit)
            mine = sorted({*parts.part_objects(manifest, 2), *parts.common_objects(manifest)})
            held = sorted(parts.held(local, manifest))
            local.reader.verify(entry.commit, only=mine)
            outcomes["d verified"].append((entry.step, held))
        replicas._write = write
    dist.barrier()
    after = Job(base, rank, node_of)
    messages.seen.clear()
    outcomes["d again"] = (*resume(after), [m for m in messages.seen if "restor" in m])
    outcomes["d again listed"] = listed(after, root, settle=True)
    dist.barrier()
    job.replicator.stop()
    return after


def _killed_after_the_load(base: str, rank: int, node_of: list[int], root: str, resumed: Job, resume: Any,
                           messages: Messages, outcomes: dict[str, Any]) -> Job:
    if rank == 2:
        shutil.rmtree(resumed.local_tier)
    dist.barrier()
    killed = Job(base, rank, node_of)
    if rank == 2:
        from lightning_resilient.io import replicas

        write, written, _ = _stall_writes_after_the_first()  # never released: the process "dies" there
    messages.seen.clear()
    outcomes["c killed"] = (*resume(killed), [m for m in messages.seen if "restor" in m])
    if rank == 2:
        while not written:
            time.sleep(0.01)
        time.sleep(0.2)
        outcomes["c at the kill"] = (listed(killed, root), records(killed, root), len(written))
        replicas._write = write
    dist.barrier()
    again = Job(base, rank, node_of)
    messages.seen.clear()
    outcomes["c again"] = (*resume(again), [m for m in messages.seen if "restor" in m])
    outcomes["c listed"] = listed(again, root, settle=True)
    dist.barrier()
    return again
