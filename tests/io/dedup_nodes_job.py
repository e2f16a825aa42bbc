"""Two "nodes" of one process each, on gloo, with the API of io/replicas.py alone (no Lightning), for
tests/io/test_replicas.py: incremental (``dedup``) commits of a fine-tune (a frozen base, a small adapter) in node 0's
local tier, copied to node 1 as DDP's are. The copy of the commit that first stored the base is dropped (as a newer
save's copy replaces a queued one on a slow network), so node 1 first meets the base as objects of a folder it never
held. Then node 0 is replaced (its tier gone), the job resumes from node 1's copy and saves again.

Rank 0 writes ``result.json`` into BASE: what node 1 wrote of each copy, what each tier lists and verifies, what the
resumed job loaded.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from tests.io.replicas_job import Job, report_and_exit

BASE_NUMEL = 2**19  # a 2 MiB float32 frozen base: two objects of its own (shard_size 1 MiB)


def state(frozen: torch.Tensor, adapter: torch.Tensor, step: int) -> dict[str, Any]:
    return {"state_dict": {"base": frozen, "adapter": adapter}, "global_step": step}


def tier_report(job: Job, root: str) -> dict[str, Any]:
    """What this node's tier lists (steps), and whether each listed commit verifies (every byte checked)."""
    from lightning_resilient.io.local_tier import local_tier_url

    local = job.root_for(local_tier_url(job.local_tier, root))
    local.settle()
    pointer, _ = local.read_pointer()
    listed, verified = [], []
    for entry in sorted(pointer.entries() if pointer is not None else [], key=lambda e: e.step):
        listed.append(entry.step)
        try:
            local.reader.verify(entry.commit)
            verified.append(entry.step)
        except Exception as exc:
            verified.append(f"{entry.step}: {exc}")
    return {"listed": listed, "verified": verified}


def job(rank: int, port: int, base: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lightning_resilient.io import replicas
    from lightning_resilient.io.replicas import load_across_nodes

    # Every object node 1 writes, by the commit being copied (the folder of the object's manifest).
    written: dict[str, list[tuple[str, int]]] = defaultdict(list)
    write = replicas._write

    def counted(local: Any, manifest: Any, index: int, data: torch.Tensor) -> None:
        written[manifest.commit].append((manifest.objects[index].path, data.numel()))
        write(local, manifest, index, data)

    replicas._write = counted
    root = os.path.join(base, "root")
    torch.manual_seed(0)
    frozen, adapter = torch.randn(BASE_NUMEL), torch.zeros(64)
    out: dict[str, Any] = {}

    first = Job(base, rank, [0, 1], dedup=True)
    tiers = first.tiers_for(root)
    commits: dict[int, str] = {}
    for step in (1, 2, 3, 4):
        adapter.add_(1.0)  # in place: the adapter changes, the base does not
        if rank == 0:
            hook = tiers.on_commit
            if step == 1:
                tiers.on_commit = None  # this copy is dropped (a newer save's replaced it in the queue)
            commits[step] = tiers.save(state(frozen, adapter, step), f"step={step}.ckpt").commit
            tiers.on_commit = hook
            first.replicator.flush()  # (no other copy is dropped: each is done before the next save)
    if rank == 0:
        tiers.wait()
        first.replicator.flush()  # every copy queued so far is done on every node
        out["commits"] = commits
        out["node 0 first"] = tier_report(first, root)
    dist.barrier()
    if rank == 1:
        out["written"] = {commit: list(paths) for commit, paths in written.items()}
        out["node 1 first"] = tier_report(first, root)
        written.clear()
    dist.barrier()
    first.replicator.stop()

    # Node 0 is replaced: its tier is gone. The job resumes step 4 from node 1's copy, and saves steps 5 and 6.
    if rank == 0:
        shutil.rmtree(first.local_tier)
    dist.barrier()
    resumed = Job(base, rank, [0, 1], dedup=True)

    def load(entry: Any, manifest: Any, sources: Any, failed: set[Any]) -> Any:
        source = sources.local if sources.local is not None else sources.durable
        return source.load(entry.commit, map_location=None, weights_only=None, manifest=manifest)

    done = load_across_nodes(root, shown=root, nodes=resumed.nodes, local_tier=resumed.local_tier,
                             root_for=resumed.root_for, replicas=2, fallback=True, load=load)
    assert done is not None
    loaded = done.loaded.checkpoint
    out["resumed"] = (loaded["global_step"], "local" if done.sources.local is not None else "durable",
                      torch.equal(loaded["state_dict"]["base"], frozen),
                      torch.equal(loaded["state_dict"]["adapter"], adapter))
    tiers = resumed.tiers_for(root)
    if rank == 0:  # (what the plugin does with a fit's load: it continues that run, its saves reference the load)
        done.durable.resumed(done.entry, elsewhere=not done.durable.store.exists(f"{done.entry.commit}/manifest.json"))
        tiers.local.remember_loaded(done.loaded)
        frozen_loaded, adapter_loaded = loaded["state_dict"]["base"], loaded["state_dict"]["adapter"]
        for step in (5, 6):
            adapter_loaded.add_(1.0)
            commits[step] = tiers.save(state(frozen_loaded, adapter_loaded, step), f"step={step}.ckpt").commit
            resumed.replicator.flush()
        tiers.wait()
        resumed.replicator.flush()
        out["commits"] = commits
        out["node 0 resumed"] = tier_report(resumed, root)
        durable = tiers.durable
        pointer, _ = durable.read_pointer()
        durable.reader.verify(pointer.latest.commit)
        out["durable"] = (pointer.latest.step, sorted(f for f in pointer.live_folders() if not durable.store.exists(f)))
    dist.barrier()
    if rank == 1:
        out["written again"] = {commit: list(paths) for commit, paths in written.items()}
        out["node 1 resumed"] = tier_report(resumed, root)
    dist.barrier()
    resumed.replicator.stop()
    replicas._write = write
    report_and_exit(rank, 2, base, out)
