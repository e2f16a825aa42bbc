"""Two "nodes" of one process each, on gloo, with the API of io/replicas.py alone (no Lightning), for
tests/io/test_replicas.py: incremental (``dedup``) sharded saves into every node's local tier (``replicas=2``: each
node's part also on the other), a frozen DTensor beside a trained one, every 2nd save persisted. Then node 1 is
replaced (its tier gone) and the job resumes the newest commit across the nodes.

Rank 0 writes ``result.json`` into BASE: the commits, what each node received of the other's part per commit, what
each tier lists and verifies, what the durable root holds, what the resume loaded.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from tests.io.replicas_job import Job, report_and_exit, sharded_loader

ROWS = 2**15  # frozen: ROWS x 8 float32 = 1 MiB, 512 KiB per rank (its own unit: shard_size 256 KiB here)


def job(rank: int, port: int, base: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_resilient.io import parts, replicas
    from lightning_resilient.io.local_tier import local_tier_url
    from lightning_resilient.io.replicas import load_across_nodes, save_sharded_tiered
    from lightning_resilient.io.sharded import load_full

    received: dict[str, int] = defaultdict(int)  # bytes this node wrote of the other node's part, per commit
    write = replicas._write

    def counted(local: Any, manifest: Any, index: int, data: torch.Tensor) -> None:
        received[manifest.commit] += data.numel()
        write(local, manifest, index, data)

    replicas._write = counted
    mesh = init_device_mesh("cpu", (2,))
    root = os.path.join(base, "root")
    torch.manual_seed(0)
    frozen_full, w_full = torch.randn(ROWS, 8), torch.randn(64, 8)
    frozen = distribute_tensor(frozen_full.clone(), mesh, [Shard(0)])
    w = distribute_tensor(w_full.clone(), mesh, [Shard(0)])
    trained = w_full.clone()  # what w holds after the saves below (the same four additions)
    for _ in range(4):
        trained.add_(1.0)
    out: dict[str, Any] = {"commits": {}}
    first = Job(base, rank, [0, 1], dedup=True, shard_size=2**18)
    tiers = first.tiers_for(root)
    for step in (1, 2, 3, 4):
        w.to_local().add_(1.0)  # in place: the trained shards change, the frozen ones do not
        entry = save_sharded_tiered({"state_dict": {"frozen": frozen, "w": w}}, tiers, f"step={step}.ckpt",
                                    {"global_step": step} if rank == 0 else None, first.nodes)
        out["commits"][step] = entry.commit
        tiers.wait()
        first.replicator.flush()  # (each copy between nodes done before the next save: nothing dropped)
    dist.barrier()
    local = tiers.local
    out["received"] = dict(received)
    newest = local.read_manifest(out["commits"][4])
    out["referenced"] = sorted({o.path.rsplit("/", 1)[0] for o in newest.objects} - {newest.commit})
    pointer, _ = local.read_pointer()
    out["listed"] = sorted(e.step for e in pointer.entries())
    out["held"] = {e.step: sorted(parts.held(local, local.read_manifest(e.commit))) for e in pointer.entries()}
    for e in pointer.entries():
        local.reader.verify(e.commit, only=[i for i, o in enumerate(local.read_manifest(e.commit).objects)
                                            if local.store.exists(o.path)])
    if rank == 0:
        durable, _ = tiers.durable.read_pointer()
        out["durable"] = sorted(e.step for e in durable.entries())
        for e in durable.entries():
            tiers.durable.reader.verify(e.commit)
        full = load_full(tiers.durable.url)
        out["durable full"] = (full["global_step"], torch.equal(full["state_dict"]["frozen"], frozen_full),
                               torch.equal(full["state_dict"]["w"], trained))
    first.replicator.stop()
    dist.barrier()

    # Node 1 is replaced: the job resumes the newest commit, node 1's part restored from node 0's replica.
    if rank == 1:
        shutil.rmtree(first.local_tier)
    dist.barrier()
    resumed = Job(base, rank, [0, 1], dedup=True, shard_size=2**18)
    target = {"state_dict": {"frozen": distribute_tensor(torch.zeros(ROWS, 8), mesh, [Shard(0)]),
                             "w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])}}

    done = load_across_nodes(root, shown=root, nodes=resumed.nodes, local_tier=resumed.local_tier,
                             root_for=resumed.root_for, replicas=2, fallback=False, load=sharded_loader(target))
    assert done is not None
    out["resumed"] = (done.loaded.checkpoint["global_step"], "local" if done.sources.local is not None else "durable",
                      torch.equal(target["state_dict"]["frozen"].full_tensor(), frozen_full),
                      torch.equal(target["state_dict"]["w"].full_tensor(), trained))
    restored = resumed.root_for(local_tier_url(resumed.local_tier, root))
    restored.settle()
    manifest = restored.read_manifest(out["commits"][4])
    out["held after"] = sorted(parts.held(restored, manifest))
    pointer, _ = restored.read_pointer()
    out["listed after"] = sorted(e.step for e in pointer.entries()) if pointer is not None else []
    resumed.replicator.stop()
    replicas._write = write
    report_and_exit(rank, 2, base, out)
