"""A local tier on every node of a job (io/parts.py, io/replicas.py): sharded checkpoints in local tiers, every node
holding every DDP commit, peer replicas of sharded parts, and the one decision a resume makes across them.

In-process: which objects form each node's part, where replicas go, what each node needs, the order of the sources a
restore tries and what a half-received replica counts for. Real processes (slow, each node with its own local-tier
folder, on loopback):

- three gloo processes without Lightning: a replaced node restores its part from the next replica when the first is
  damaged, and from the durable root when every replica is; a commit no source can give is never loaded; a node
  killed after its load but before the restored copy was on its disk restores it again; a ``gc --grace 0`` from
  another process while that copy is written takes nothing of it;
- Lightning DDP on 2 nodes: SIGKILL while a node receives a commit and a persist is between its copy and its
  manifest; the restart resumes the newest commit on both nodes from their local tiers (the node that lacked it
  restores it from its peer), never a half-received copy, and the durable pointer never names the half-persisted one;
  SIGKILL again while that node writes the restored copy behind training: the next restart resumes locally again;
- FSDP2 (``AtomicModelParallelStrategy``) on 2 nodes: killed, one node's tier wiped and the replica it would restore
  the newest commit from damaged: the job resumes the previous commit, restored from the intact replica;
- FSDP1 (``AtomicFSDPStrategy``) on one node of 2 processes: killed and resumed from the local tier.

Each run that ends is bit-identical (``torch.equal``) to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient.io import parts
from lightning_resilient.io.catalog import reader
from lightning_resilient.io.folders import part_record
from lightning_resilient.io.lineage import Origin
from lightning_resilient.io.local_tier import local_tier_url
from lightning_resilient.io.manifest import Manifest, ObjectEntry, ShardedRecord, chunk_digests, object_digest
from lightning_resilient.io.replicas import DURABLE, plan_sources
from lightning_resilient.io.sharded import load_full
from tests import procs

from .test_crash import _env
from .test_sharded import BASE, uninterrupted

CHILD = Path(__file__).with_name("nodes_child.py")


# -- in-process ------------------------------------------------------------------------------------------------------
def sharded_manifest(nodes: list[list[int]], data: dict[str, bytes] | None = None) -> Manifest:
    """A sharded commit's manifest as io/sharded.py writes it: per rank a shard object and a whole-items object, then
    DCP's metadata, the skeleton and the rest's stream. ``data``: object bytes by name (default: the name)."""
    world = sum(len(n) for n in nodes)
    names = [n for r in range(world) for n in (f"r{r:05d}-shard-00000.bin", f"r{r:05d}-whole-shard-00000.bin")]
    names += ["dcp.metadata", "skeleton.pt", "shard-00000.bin"]
    objects = []
    for name in names:
        raw = (data or {}).get(name, name.encode())
        chunks = chunk_digests([memoryview(raw)], 16)
        objects.append(ObjectEntry(f"a.ckpt/c0000000000001-e1-00000000/{name}", len(raw), object_digest(chunks),
                                   chunks))
    return Manifest(name="a.ckpt", commit="a.ckpt/c0000000000001-e1-00000000", step=4, epoch=0, created=1.0,
                    writer_epoch=1, chunk_size=16, skeleton=len(names) - 2, stream=[len(names) - 1], objects=objects,
                    sharded=ShardedRecord(world, 2 * world, [[2 * r, 2 * r + 1] for r in range(world)], nodes),
                    origin=Origin(None, 0, 0))


def test_a_nodes_part_is_its_ranks_shards_and_every_node_keeps_the_common_objects():
    manifest = sharded_manifest([[0, 1], [2, 3]])
    name = lambda i: manifest.objects[i].path.rsplit("/", 1)[1]  # noqa: E731
    assert [name(i) for i in parts.part_objects(manifest, 1)] == ["r00002-shard-00000.bin", "r00003-shard-00000.bin"]
    assert {name(i) for i in parts.common_objects(manifest)} == {
        *(f"r{r:05d}-whole-shard-00000.bin" for r in range(4)), "dcp.metadata", "skeleton.pt", "shard-00000.bin"}
    assert parts.spans_nodes(manifest) and not parts.spans_nodes(sharded_manifest([[0, 1]]))
    # A full checkpoint is one part, every object of it.
    full = Manifest(name="b", commit="b/c", step=1, epoch=0, created=1.0, writer_epoch=1, chunk_size=16, skeleton=0,
                    objects=manifest.objects[:1])
    assert parts.part_objects(full, 0) == [0] and parts.common_objects(full) == [] and parts.save_layout(full) == [[0]]


def test_replicas_go_to_the_next_nodes_and_a_restore_asks_the_writer_first():
    assert parts.placement(1, 4, 3) == [2, 3]
    assert parts.placement(3, 4, 3) == [0, 1]  # wraps around
    assert parts.placement(0, 2, 5) == [1]  # never more than the other nodes
    assert parts.placement(0, 1, 2) == [] and parts.placement(2, 4, 1) == []
    # Part 1 for node 2: the node that wrote it, then its replica holders in placement order, then anyone else.
    assert parts.sources_of(1, [0, 1, 2, 3], 4, 2, exclude={2}) == [1, 0, 3]
    assert parts.sources_of(1, [0, 3], 4, 3, exclude=set()) == [3, 0]
    assert parts.sources_of(3, [0, 1, 2], 4, 3, exclude={1}) == [0, 2]


def test_what_each_node_needs_depends_on_where_its_ranks_were():
    manifest = sharded_manifest([[0, 1], [2, 3]])
    assert parts.needs(manifest, [[0, 1], [2, 3]]) == [{0}, {1}]
    assert parts.needs(manifest, [[2, 3], [0, 1]]) == [{1}, {0}]  # the nodes came back in another order
    assert parts.needs(manifest, [[0, 2], [1, 3]]) == [{0, 1}, {0, 1}]
    assert parts.needs(manifest, [[0, 1, 2]]) == [{0, 1}]  # another world size: DCP reshards, any shard may be read


def test_a_plan_tries_the_own_tier_then_peers_by_placement_then_the_durable_root():
    manifest = sharded_manifest([[0], [1], [2]])
    layout = [[0], [1], [2]]
    everything = frozenset({0, 1, 2})
    # Node 2 was replaced: its part from node 0 (its first replica holder), then node 1, then the durable root.
    plan = plan_sources(manifest, layout, [everything, everything, frozenset()], replicas=3, durable=True,
                        excluded=set())
    assert plan is not None and plan.sources == [{0: [0, 1, DURABLE]}, {1: [1, 0, DURABLE]}, {2: [0, 1, DURABLE]}]
    # A copy found bad is never tried again; nor the durable root's.
    plan = plan_sources(manifest, layout, [everything, everything, frozenset()], replicas=3, durable=True,
                        excluded={(0, 2), (DURABLE, 0)})
    assert plan is not None and plan.sources[2] == {2: [1]}
    # No source left for node 2's part: the commit cannot be loaded (the job falls back together).
    assert plan_sources(manifest, layout, [everything, everything, frozenset()], replicas=3, durable=False,
                        excluded={(0, 2), (1, 2)}) is None
    assert plan_sources(manifest, layout, [frozenset({0}), frozenset({1}), frozenset()], replicas=1, durable=False,
                        excluded=set()) is None


def test_a_half_received_replica_counts_for_nothing(tmp_path):
    """A node holds a part only with its record, written after every object verified: a copy cut short (objects
    written, no record) or an object gone since does not count."""
    from lightning_resilient.io.root import open_root

    data = {f"r{r:05d}-shard-00000.bin": bytes([r]) * 40 for r in range(2)}
    manifest = sharded_manifest([[0], [1]], data)
    root = open_root(str(tmp_path / "tier"))
    for obj in parts.held_objects(manifest, [0, 1]):
        name = obj.path.rsplit("/", 1)[1]
        root.store.write(obj.path, data.get(name, name.encode()))
    assert parts.held(root, manifest) == frozenset()  # every object is there, no record yet: a copy cut short
    parts.write_record(root, manifest, 0)
    parts.write_record(root, manifest, 1)
    assert parts.held(root, manifest) == {0, 1}
    root.store.remove_object(manifest.objects[parts.part_objects(manifest, 1)[0]].path)
    assert parts.held(root, manifest) == {0}
    assert root.store.exists(part_record(manifest.commit, 1))  # (the record alone never makes a part held)


def _stored_objects(tmp_path: Path, count: int) -> tuple[Any, Manifest, dict[str, bytes]]:
    """A local tier holding the objects of a sharded commit of two nodes, of different bytes, each smaller than the
    one before (so two reused buffers never need to grow)."""
    from lightning_resilient.io.root import open_root

    names = [f"r{r:05d}-{kind}-00000.bin" for r in range(2) for kind in ("shard", "whole-shard")]
    names += ["dcp.metadata", "skeleton.pt", "shard-00000.bin"]
    data = {name: bytes([i + 1]) * (1000 - 97 * i) for i, name in enumerate(names[:count])}
    manifest = sharded_manifest([[0], [1]], data)
    root = open_root(str(tmp_path / "tier"))
    for obj in manifest.objects:
        root.store.write(obj.path, data.get(obj.path.rsplit("/", 1)[1], obj.path.rsplit("/", 1)[1].encode()))
    return root, manifest, data


def test_a_sender_reads_each_object_into_one_of_two_buffers_never_one_still_being_sent(tmp_path, monkeypatch):
    """Objects in transit reuse two buffers (no fresh memory per object); the next object is read into the other one
    while one is on the wire, so every object leaves whole (a slow send would show the read-ahead's overwrite)."""
    from lightning_resilient.io import replicas

    root, manifest, _ = _stored_objects(tmp_path, 7)
    sent: list[bytes] = []
    buffers: set[int] = set()

    def slow_send(data: torch.Tensor | None, dst: int, group: Any) -> None:
        assert data is not None
        buffers.add(data.untyped_storage().data_ptr())
        time.sleep(0.02)  # the read of the next object runs meanwhile
        sent.append(bytes(data.numpy()))

    monkeypatch.setattr(replicas, "_send", slow_send)
    indices = list(range(len(manifest.objects)))
    replicas.send_objects(root, manifest, indices, dst=1, group=None)
    assert sent == [root.store.read(manifest.objects[i].path) for i in indices]
    assert len(buffers) == 2


def test_a_receiver_checks_each_object_while_the_next_arrives_and_keeps_only_what_it_holds(tmp_path, monkeypatch):
    """Objects written and dropped arrive in two reused buffers, each checked (slowly here) while the next one
    arrives in the other; held ones get memory of their own, since the load reads them after the transfer."""
    from lightning_resilient.io import replicas
    from lightning_resilient.io.root import open_root

    source, manifest, _ = _stored_objects(tmp_path, 7)
    indices = list(range(len(manifest.objects)))
    queue = [source.store.read(manifest.objects[i].path) for i in indices]
    buffers: list[int] = []

    def recv(src: int, group: Any, into: Any = None) -> torch.Tensor:
        raw = queue.pop(0)
        data = into(len(raw)) if into is not None else torch.empty(len(raw), dtype=torch.uint8)
        data.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        buffers.append(data.untyped_storage().data_ptr() if into is not None else -1)
        return data

    checked = replicas._verified

    def slow_check(manifest: Manifest, index: int, data: torch.Tensor | None) -> str | None:
        time.sleep(0.02)  # the next object arrives meanwhile
        return checked(manifest, index, data)

    monkeypatch.setattr(replicas, "_recv", recv)
    monkeypatch.setattr(replicas, "_verified", slow_check)
    target = open_root(str(tmp_path / "target"))
    assert replicas.receive_objects(target, manifest, indices, src=0, group=None) is None
    assert [target.store.read(manifest.objects[i].path) for i in indices] == \
        [source.store.read(manifest.objects[i].path) for i in indices]
    assert len(set(buffers)) == 2

    # Held for the load (a budget for the first three objects): those three have their own memory, the rest reuse.
    monkeypatch.setattr(replicas, "HOLD_FOR_LOAD_BYTES", sum(manifest.objects[i].size for i in indices[:3]))
    queue[:] = [source.store.read(manifest.objects[i].path) for i in indices]
    buffers.clear()
    again = open_root(str(tmp_path / "again"))
    assert replicas.receive_objects(again, manifest, indices, src=0, group=None, hold=True) is None
    assert buffers[:3] == [-1, -1, -1] and len(set(buffers[3:])) == 2
    for i in indices[:3]:
        held = again.reader._take_held(manifest.objects[i])
        assert held is not None and bytes(held.numpy()) == source.store.read(manifest.objects[i].path)


def test_a_copy_that_fails_over_an_object_the_tier_holds_leaves_that_object_whole(tmp_path, monkeypatch):
    """An object a copy writes may be there already (shared with a commit the tier lists: a restore brings the
    objects a commit shares with an earlier one). A local write truncates in place; so such an object is replaced
    whole (written beside it, renamed over it): a copy cut short leaves the listed commit's object as it was."""
    from lightning_resilient.io import replicas

    root, manifest, _ = _stored_objects(tmp_path, 1)
    path = manifest.objects[0].path
    before = root.store.read(path)
    write = type(root.store).write_pieces

    def cut_short(store: Any, rel: str, pieces: Any) -> None:
        raw = b"".join(bytes(p) for p in pieces)
        write(store, rel, [raw[: len(raw) // 2]])  # half of it reaches the disk, then the node dies
        raise OSError("killed mid-copy")

    monkeypatch.setattr(type(root.store), "write_pieces", cut_short)
    incoming = torch.frombuffer(bytearray(before), dtype=torch.uint8)
    with pytest.raises(OSError, match="killed mid-copy"):
        replicas._write(root, manifest, 0, incoming)
    assert root.store.read(path) == before
    assert sorted(p.name for p in Path(root.store.path(manifest.commit)).iterdir()) == \
        sorted(o.path.rsplit("/", 1)[1] for o in manifest.objects)  # (nothing left beside it)
    monkeypatch.setattr(type(root.store), "write_pieces", write)
    replicas._write(root, manifest, 0, incoming)  # and a copy that completes replaces it
    assert root.store.read(path) == before


# -- real processes ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one process per node", "two processes on node 2"])
def test_a_replaced_node_restores_from_the_next_replica_then_from_the_durable_root(tmp_path, layout):
    import torch.multiprocessing as mp

    from . import replicas_job

    node_of = replicas_job.LAYOUTS[layout]
    mp.start_processes(replicas_job.job, args=(free_port(), str(tmp_path), layout), nprocs=len(node_of),
                       start_method="spawn")
    ranks = json.loads((tmp_path / "result.json").read_text())
    a, b = zip(*[(rank["a"], rank["b"]) for rank in ranks], strict=True)
    # (a) the newest commit on every rank, node 2's part restored from node 1 after node 0's copy failed; on a node of
    # one process the load read it from memory and the copy reached the tier behind it, on a node of two the copy
    # was written first (its second process read it from there). Listed on node 2 either way, once settled.
    assert [step for step, _, _ in a] == [3] * len(node_of)
    assert [tier for _, tier, _ in a] == ["local"] * len(node_of)
    restored = " ".join(a[2][2])
    assert "restoring part 2" in restored and "from node 0 failed" in restored and "fails its blake3" in restored
    assert "node 2 restored part 2" in restored and "from node 1" in restored
    assert [r["a listed"] for r, n in zip(ranks, node_of, strict=True) if n == 2] == [[3]] * node_of.count(2)
    # (b) every replica damaged: step 3 (never persisted) has no source left; step 2 is loaded, node 2's part from
    # the durable root, the others from their own tiers.
    assert list(b) == [[2, "local"] if n < 2 else [2, "durable"] for n in node_of]
    if layout == "one process per node":
        # (c) node 2 killed between that load and the disk copy (one object written): its tier lists nothing and
        # holds no part record, so the next job restores the part from a peer again, listed once settled.
        assert [rank["c killed"][:2] for rank in ranks] == [[3, "local"]] * 3
        assert ranks[2]["c at the kill"] == [[], [], 1]
        assert ranks[2]["c again"][:2] == [3, "local"]
        assert "node 2 restored part 2" in " ".join(ranks[2]["c again"][2])
        assert ranks[2]["c listed"] == [3]
        # (d) a `gc --grace 0` from another process while that copy is written takes nothing of it.
        assert [rank["d loaded"] for rank in ranks] == [[3, "local"]] * 3
        assert ranks[2]["d collected"] == [] and ranks[2]["d listed"] == [3]
        assert ranks[2]["d verified"] == [[3, [2]]]  # listed: node 2's part and the common objects verify
        assert [rank["d again"] for rank in ranks] == [[3, "local", []]] * 3  # nothing restored again


@pytest.mark.slow
def test_incremental_commits_reach_a_peer_node_with_only_what_it_lacks_and_a_replaced_node_resumes_from_it(tmp_path):
    """dedup on two nodes (io/replicas.py's _lacking): node 1 is sent only the objects its tier lacks; the base, first
    met as objects of a commit whose own copy was dropped, is written at its paths and kept live by the commit that
    references it; node 0, replaced, restores the newest commit from node 1 and the job's next saves reference it."""
    import torch.multiprocessing as mp

    from . import dedup_nodes_job

    mp.start_processes(dedup_nodes_job.job, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    node0, node1 = json.loads((tmp_path / "result.json").read_text())
    commits = {int(k): v for k, v in node0["commits"].items()}
    base_bytes = dedup_nodes_job.BASE_NUMEL * 4
    written = node1["written"]
    # Step 1's copy was dropped: node 1 never received it. Step 2's copy brought the base's objects along, at their
    # paths in step 1's folder; steps 3 and 4 sent only their own small objects.
    assert commits[1] not in written and set(written) == {commits[2], commits[3], commits[4]}
    base_paths = [p for p, _ in written[commits[2]] if p.startswith(commits[1] + "/")]
    assert sum(n for p, n in written[commits[2]] if p in base_paths) == base_bytes
    for step in (3, 4):
        assert all(p.startswith(commits[step] + "/") for p, _ in written[commits[step]]), written[commits[step]]
        assert sum(n for _, n in written[commits[step]]) < 64 * 1024
    # Each tier lists its newest two (local_keep) and every byte of them verifies; node 1 lists what it never held
    # whole (step 1's folder, partly) alive through them.
    assert node0["node 0 first"] == {"listed": [3, 4], "verified": [3, 4]}
    assert node1["node 1 first"] == {"listed": [3, 4], "verified": [3, 4]}
    # Node 0 replaced: every rank resumed step 4 bit-identically (node 0 from the copy it restored from node 1).
    assert node0["resumed"] == node1["resumed"] == [4, "local", True, True]
    # The resumed job's saves reference the restored base; node 1 is sent only their own objects.
    again = node1["written again"]
    assert set(again) == {commits[5], commits[6]}
    for step in (5, 6):
        assert all(p.startswith(commits[step] + "/") for p, _ in again[commits[step]]), again[commits[step]]
        assert sum(n for _, n in again[commits[step]]) < 64 * 1024
    assert node0["node 0 resumed"] == {"listed": [5, 6], "verified": [5, 6]}
    assert node1["node 1 resumed"] == {"listed": [5, 6], "verified": [5, 6]}
    # Step 6 is durable (persist_every=2) and verifies: the durable root's pointer names only folders it holds.
    assert node0["durable"] == [6, []]


@pytest.mark.slow
def test_incremental_sharded_saves_across_nodes_copy_only_new_objects_and_a_replaced_node_restores(tmp_path):
    """dedup with a sharded save into every node's local tier (io/replicas.py, io/sharded.py): each rank references
    its frozen shards in the commit that stored them; a node's part goes to its peer with only the objects the peer
    lacks; the durable root holds every 2nd commit, each verifying and consolidating exactly; a replaced node
    restores the newest commit (its part from the peer) and the job loads it bit-exactly."""
    import torch.multiprocessing as mp

    from . import dedup_shards_job

    mp.start_processes(dedup_shards_job.job, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    node0, node1 = json.loads((tmp_path / "result.json").read_text())
    commits = {int(k): v for k, v in node0["commits"].items()}
    frozen_part = dedup_shards_job.ROWS * 8 * 4 // 2
    for node in (node0, node1):
        # The newest commit references the frozen shards stored by the first (both ranks, both parts).
        assert node["referenced"] == [commits[1]], node["referenced"]
        received = {int(step): node["received"].get(commits[step], 0) for step in commits}
        assert received[1] >= frozen_part, received  # the first copy of the peer's part carries its frozen shards
        assert all(received[s] < 16 * 1024 for s in (2, 3, 4)), received  # then only what changed
        assert node["listed"] == [3, 4] and node["held"] == {"3": [0, 1], "4": [0, 1]}
    assert node0["durable"] == [2, 4] and node0["durable full"] == [4, True, True]
    assert node0["resumed"] == node1["resumed"] == [4, "local", True, True]
    assert node1["held after"] == [1]  # (its own part, restored with the objects it references; replicas come later)
    assert node1["listed after"] == [4]  # listed there, the folders it references kept live by it


class Node:
    """One node's launcher process (it starts the node's other processes) and its output, read as it comes."""

    def __init__(self, rank: int, root: str, out: Path, options: dict[str, Any], env: dict[str, str]) -> None:
        self.proc = procs.popen([sys.executable, str(CHILD), root, str(out), json.dumps(options)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        self.lines: list[str] = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


class Job:
    """A job of ``options["nodes"]`` nodes on loopback, each with its own local tier and temp folder."""

    def __init__(self, base: Path, root: str, out: Path, options: dict[str, Any]) -> None:
        port = str(free_port())
        self.nodes = []
        for rank in range(options["nodes"]):
            (base / f"tmp{rank}").mkdir(parents=True, exist_ok=True)
            env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank),
                       LOCAL_TIER=str(base / f"nvme{rank}"), TMPDIR=str(base / f"tmp{rank}"))
            self.nodes.append(Node(rank, root, out, options, env))

    @property
    def lines(self) -> list[str]:
        return [line for node in self.nodes for line in node.lines]

    def kill_when(self, seen: list[str], timeout: float = 240) -> None:
        """SIGKILL every node once each of ``seen`` was printed (by any node)."""
        deadline = time.monotonic() + timeout
        while not all(line in self.lines for line in seen):
            if time.monotonic() > deadline or any(n.proc.poll() is not None for n in self.nodes):
                raise AssertionError(f"never saw {seen}: {self.lines[-8:]} {self.nodes[0].err[-2000:]}")
            time.sleep(0.02)
        for node in self.nodes:
            node.kill()

    def finish(self, timeout: float = 300) -> list[str]:
        for node in self.nodes:
            node.proc.wait(timeout=timeout)
            assert node.proc.returncode == 0, node.err[-4000:]
        time.sleep(0.2)  # the reader threads drain the last lines
        return self.lines


def starts(lines: list[str]) -> dict[str, tuple[int, str, str]]:
    """rank -> (step, commit, tier) of each START line."""
    out = {}
    for line in lines:
        if line.startswith("START"):
            fields = dict(f.split("=", 1) for f in line.split()[1:])
            out[fields["rank"]] = (int(fields["step"]), fields["commit"], fields["tier"])
    return out


def local_steps(base: Path, node: int, root: str) -> list[int]:
    pointer, _ = reader(local_tier_url(str(base / f"nvme{node}"), root)).read_pointer()
    return sorted(e.step for e in pointer.entries()) if pointer is not None else []


def durable_step(root: str) -> int | None:
    pointer, _ = reader(root).read_pointer()
    return pointer.latest.step if pointer is not None and pointer.latest is not None else None


def same_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


NODES_DDP = {"nodes": 2, "devices": 1, "max_steps": 8, "every": 2, "strategy": "ddp"}


@pytest.mark.slow
def test_ddp_on_two_nodes_every_node_holds_every_commit_through_kills_in_a_copy_and_a_persist(tmp_path, shared_runs):
    def reference(folder: Path) -> None:
        Job(folder, str(folder / "root"), folder / "weights.pt", {**NODES_DDP, "tier": False}).finish()

    full = shared_runs.get("nodes-ddp", NODES_DDP, reference) / "weights.pt"
    root, out = str(tmp_path / "root"), tmp_path / "weights.pt"
    # Killed while node 1 receives step 4's commit (one object written) and while step 4's persist is between its
    # copy and its manifest.
    # (Training stops after step 4's save: on a busy machine the two windows can open after step 6 was committed.)
    job = Job(tmp_path, root, out, {**NODES_DDP, "persist_every": 2, "hold": "receive:4,persist:4,after:4"})
    job.kill_when(["RECEIVING 4", "COPIED 4"])
    assert durable_step(root) is None  # the half-persisted step 4 was never published
    assert local_steps(tmp_path, 0, root) == [2, 4]
    assert local_steps(tmp_path, 1, root) == [2]  # step 2 was sent to node 1; the half-received 4 is invisible
    # The restart resumes step 4 on both nodes from their local tiers: node 1 restores it from node 0 first, loads
    # it from memory and writes its copy behind training. Killed there (one object of the copy written): node 1's
    # tier still does not list step 4.
    job = Job(tmp_path, root, out, {**NODES_DDP, "persist_every": 2, "hold": "restored:4"})
    job.kill_when(["RESTORED 4"])  # (printed by the thread that writes the copy after the load: see nodes_child.py)
    assert 4 not in local_steps(tmp_path, 1, root)
    # The next restart resumes the newest commit on both nodes from their local tiers (node 1 restores it again;
    # node 0 may have saved step 6 before the kill).
    lines = Job(tmp_path, root, out, {**NODES_DDP, "persist_every": 2}).finish()
    step, commit, _ = starts(lines)["0"]
    assert step in (4, 6) and starts(lines) == {"0": (step, commit, "local"), "1": (step, commit, "local")}
    assert same_weights(out, full), "not bit-identical"
    # Every local commit of the run that ended is in both nodes' local tiers; its last one is durable.
    assert local_steps(tmp_path, 0, root) == local_steps(tmp_path, 1, root) == [6, 8]
    assert durable_step(root) == 8


@pytest.mark.slow
def test_nodes_given_different_checkpoints_by_find_latest_make_one_decision_and_a_replaced_node_restores_it(
        tmp_path, shared_runs):
    """The multi-node idiom as the README shows it: every node calls find_latest_checkpoint(root, local_tier=...) and
    passes what it got. A replaced node (its tier wiped) gets None, then an older commit than the other node; Lightning
    then loads on some ranks only (or different commits), and the job hung in the load's collectives. Now every rank
    gives its path, rank 0 decides (the root's newest across every node's tier), every rank loads it."""

    def reference(folder: Path) -> None:
        Job(folder, str(folder / "root"), folder / "weights.pt", {**NODES_DDP, "tier": False}).finish()

    full = shared_runs.get("nodes-ddp", NODES_DDP, reference) / "weights.pt"
    root, out = str(tmp_path / "root"), tmp_path / "weights.pt"
    options = {**NODES_DDP, "persist_every": 2, "resume": "each"}
    # 1. Killed after step 2's save, before any persist: node 0 holds step 2, the durable root none. Node 1 replaced.
    Job(tmp_path, root, out, options).kill_when(["SAVED 2"], timeout=120)
    shutil.rmtree(tmp_path / "nvme1", ignore_errors=True)
    # 2. Node 0 is given step 2's commit, node 1 None: both resume step 2 (node 1 restores it from node 0). Killed
    #    after step 6's save, step 4 persisted: node 0 holds 6, the durable root 4. Node 1 replaced again.
    job = Job(tmp_path, root, out, options)
    job.kill_when(["SAVED 6", "PERSISTED 4"], timeout=120)
    given = given_paths(job.lines)
    assert "step=2.ckpt/" in given["rank=0"] and given["rank=1"] == "None", given
    step, commit, _ = starts(job.lines)["0"]
    assert step == 2 and starts(job.lines) == {"0": (2, commit, "local"), "1": (2, commit, "local")}
    assert durable_step(root) == 4 and 6 in local_steps(tmp_path, 0, root)
    shutil.rmtree(tmp_path / "nvme1", ignore_errors=True)
    # 3. Node 0 is given step 6's commit, node 1 step 4's (the durable root's newest): both resume step 6.
    lines = Job(tmp_path, root, out, options).finish(timeout=120)
    given = given_paths(lines)
    assert "step=6.ckpt/" in given["rank=0"] and "step=4.ckpt/" in given["rank=1"], given
    step, commit, _ = starts(lines)["0"]
    assert step == 6 and starts(lines) == {"0": (6, commit, "local"), "1": (6, commit, "local")}
    assert same_weights(out, full), "not bit-identical"


def given_paths(lines: list[str]) -> dict[str, str]:
    """What find_latest_checkpoint gave each node ("rank=<node>" -> the path, or "None")."""
    return dict(line.split(" ", 2)[1:] for line in lines if line.startswith("GIVEN"))  # type: ignore[misc]


SHARDED = {**BASE, "strategy": "model_parallel"}  # the uninterrupted run tests/io/test_sharded.py also uses


@pytest.mark.slow
def test_fsdp2_on_two_nodes_a_replaced_node_restores_its_part_from_the_durable_root_past_a_damaged_replica(
        tmp_path, shared_runs):
    full = Path(str(uninterrupted(shared_runs, SHARDED)) + ".weights")
    root, out = str(tmp_path / "root"), tmp_path / "weights.pt"
    options = {"nodes": 2, "devices": 1, "max_steps": BASE["max_steps"], "every": BASE["every"],
               "strategy": "model_parallel", "persist_every": 2, "replicas": 2}
    # Killed while a node receives a replica of step 6 (rounds run in order: step 4's are complete), once step 4
    # (the 2nd save) is durable.
    Job(tmp_path, root, out, {**options, "hold": "receive:6"}).kill_when(["RECEIVING 6", "PERSISTED 4"])
    assert durable_step(root) == 4
    held = {node: held_parts(tmp_path, node, root) for node in (0, 1)}
    assert held[0][4] == held[1][4] == {0, 1}  # each node: its own part and the other's replica
    assert held[0][6] == {0} and held[1][6] == {1}  # step 6's replicas never completed: nothing counts of them
    # Node 1 is replaced, and node 0's replica of node 1's part of step 4 is damaged.
    shutil.rmtree(tmp_path / "nvme1")
    local = reader(local_tier_url(str(tmp_path / "nvme0"), root))
    step4 = next(e for e in local.read_pointer()[0].entries() if e.step == 4)
    manifest = local.read_manifest(step4.commit)
    damaged = Path(local.store.path(manifest.objects[parts.part_objects(manifest, 1)[0]].path))
    damaged.write_bytes(bytes(b ^ 0xFF for b in damaged.read_bytes()))
    # Step 6: node 1's part has no source at all. Step 4: node 0's replica fails its checksums on arrival, so node 1
    # reads its part from the durable root; node 0 reads its own from its tier. One commit for the whole job.
    lines = Job(tmp_path, root, out, options).finish()
    assert starts(lines) == {"0": (4, step4.commit, "local"), "1": (4, step4.commit, "durable")}
    assert same_weights(out, full), "not bit-identical"
    assert durable_step(root) == 6  # the last save of the fit, persisted with both nodes' parts
    consolidated = load_full(root)  # every rank's shards are in the durable root
    assert all(torch.equal(consolidated["state_dict"][k], v) for k, v in torch.load(out).items())


def held_parts(base: Path, node: int, root: str) -> dict[int, set[int]]:
    local = reader(local_tier_url(str(base / f"nvme{node}"), root))
    pointer, _ = local.read_pointer()
    return {e.step: set(parts.held(local, local.read_manifest(e.commit))) for e in pointer.entries()}


@pytest.mark.slow
def test_dedup_fsdp2_on_two_nodes_with_local_tiers_resumes_bit_exact_and_its_first_save_references_the_base(
        tmp_path, shared_runs):
    """FSDP2 on two loopback nodes, a local tier on each, ``dedup``, a frozen layer and table: killed after the step-6
    save, resumed from the nodes' tiers (the plugin's path), bit-identical to an uninterrupted run without a tier or
    ``dedup``; the resumed job's first save references, on both ranks, the frozen shards its node's tier holds of the
    checkpoint it loaded."""
    reference = {**BASE, "max_steps": 8, "frozen": True}  # (the same run tests/io/test_sharded.py's dedup test uses)
    full = Path(str(uninterrupted(shared_runs, reference)) + ".weights")
    root, out = str(tmp_path / "root"), tmp_path / "weights.pt"
    options = {"nodes": 2, "devices": 1, "max_steps": 8, "every": 2, "strategy": "model_parallel",
               "persist_every": 2, "replicas": 2, "dedup": True, "frozen": True}
    Job(tmp_path, root, out, options).kill_when(["SAVED 6", "PERSISTED 4"])
    lines = Job(tmp_path, root, out, options).finish()
    assert starts(lines)["0"][0] == 6 and starts(lines)["0"][2] == "local", starts(lines)
    assert same_weights(out, full), "not bit-identical"
    local = reader(local_tier_url(str(tmp_path / "nvme0"), root))
    pointer, _ = local.read_pointer()
    newest = local.read_manifest(pointer.latest.commit)
    assert newest.step == 8
    shared = [o.path for o in newest.objects if not o.path.startswith(newest.commit + "/")]
    assert {p.rsplit("/", 1)[1][:7] for p in shared} >= {"r00000-", "r00001-"}, shared


@pytest.mark.slow
def test_fsdp1_on_one_node_resumes_its_shards_from_the_local_tier(tmp_path, shared_runs):
    full = Path(str(uninterrupted(shared_runs, {**BASE, "strategy": "fsdp"})) + ".weights")
    root, out = str(tmp_path / "root"), tmp_path / "weights.pt"
    options = {"nodes": 1, "devices": 2, "max_steps": BASE["max_steps"], "every": BASE["every"], "strategy": "fsdp",
               "persist_every": 1}
    # Killed while step 4's persist is between its copy and its manifest.
    Job(tmp_path, root, out, {**options, "hold": "persist:4"}).kill_when(["COPIED 4"])
    assert durable_step(root) in (None, 2)  # never the half-persisted 4 (2: unless skipped for the newer 4)
    lines = Job(tmp_path, root, out, options).finish()
    commit = starts(lines)["0"][1]
    assert "-step=4.ckpt/" in commit
    assert starts(lines) == {"0": (4, commit, "local"), "1": (4, commit, "local")}
    assert same_weights(out, full), "not bit-identical"
    assert durable_step(root) == 6
    manifest = reader(root).read_manifest(reader(root).read_pointer()[0].latest.commit)
    assert manifest.sharded is not None and manifest.sharded.world_size == 2  # both ranks' shards, durable
