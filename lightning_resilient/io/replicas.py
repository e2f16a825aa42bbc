"""Local tiers across the nodes of a job: who is on which node, the copies of local commits between nodes, and the
job's one decision of what to resume when each node's local tier holds something else.

**The nodes** (:class:`Nodes`): when a ``fit`` with a local tier starts on several processes, every process tells the
others its node (Lightning's ``node_rank``) and two gloo groups are made, on every rank at the same point: ``sync``
(every rank) for the collectives of a save or a resume, which run in the training thread, and ``background`` (the
first process of each node, its *leader*) for the copies that run behind training. Two groups, because gloo
collectives of two threads on one group would interleave.

**What goes where** (see ``io/parts.py`` for parts and placement):

- Under DDP global rank 0 commits each checkpoint to its node's local tier; its background thread then sends the
  commit, object by object, to every other node's leader, which checks every chunk against the manifest, writes the
  objects, then commits the manifest in its own local tier (manifest last: a copy cut short is no checkpoint). So
  every node's local tier holds every local commit, and a restart on the same nodes resumes locally everywhere.
- A sharded save (``AtomicModelParallelStrategy``, ``AtomicFSDPStrategy``) writes each rank's shards into its own
  node's local tier; the leaders then share the common objects (DCP's metadata, the non-sharded rest, every rank's
  whole items) in the training thread, and each commits the manifest with its part (:func:`save_sharded_tiered`).
  With ``replicas=R`` the background threads then copy node ``k``'s part to nodes ``k+1..k+R-1``, record last.
  Every ``persist_every``-th commit is persisted by every node copying its own part into the durable root, after
  which global rank 0 alone publishes the manifest there (the durable pointer moves once every rank's shards are
  stored: ``RootWriter.publish`` checks every object the manifest names first).

Global rank 0's background thread starts every background round (a header broadcast to the leaders), so every
leader runs the same rounds in the same order; a source that cannot read an object says so in-band (size -1) rather
than skipping a message, so one failure never desynchronises the others. A peer that dies breaks the group: the
survivors stop replicating (with a warning) and go on training.

**The resume** (:func:`load_across_nodes`): every leader reports the local commits its tier holds and the parts of
each; global rank 0 resolves the path over the durable root and all of them, and for each candidate (newest first)
decides where each node gets each part it needs: its own tier, else a peer that holds it (the node that wrote it,
then the replica holders by placement), else the durable root. Peers send the missing parts in the training
thread's ``sync`` group, each checked chunk by chunk on arrival; a copy that fails moves that part to its next
source. The checked bytes (up to :data:`HOLD_FOR_LOAD_BYTES`) stay in memory for the load, which reads them from
there; on a node of one process they are written to its tier, recorded and listed there behind training once every
rank has loaded (:meth:`CheckpointRoot.finish_later`: the tier's next change waits for it; a kill before leaves the
part without its record, which the next restart restores again), on a node of several processes before the load
(its other processes read the tier). Every rank then loads the commit, each byte verified as it is read; a node
whose own copy fails verification has that copy excluded and the job decides again (the next replica, then the
durable root). Only when no source of some part is left does the whole job fall back, together, to the previous
commit: never a wrong or partial state.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_resilient._warnings import warn
from lightning_resilient.errors import CheckpointCorruptedError, CheckpointError
from lightning_resilient.io import layout, parts
from lightning_resilient.io.collectives import named
from lightning_resilient.io.local_tier import Claim, adopt_claim, local_tier_url
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest, chunk_digests
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.root import CheckpointRoot, Loaded
from lightning_resilient.io.tier_view import TieredResolved, TierView, resolve_tiered, split_tiered
from lightning_resilient.io.tiered import TieredRoot, retarget

__all__ = ["Access", "DURABLE", "Load", "NodeLoad", "Nodes", "Plan", "Replicator", "Sources", "load_across_nodes",
           "plan_sources", "receive_objects", "save_sharded_tiered", "send_objects"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 1800.0
"""Seconds a collective between the job's processes waits for the others (``AtomicCheckpointIO(collective_timeout=)``):
the default of torch's own process groups."""
_REPLICATING = "being copied to other nodes"


# -- the nodes of a job --------------------------------------------------------------------------------------------
class Nodes:
    """The processes of one job by node, and the two gloo groups between them (see the module docstring)."""

    def __init__(self, rank: int, layout: list[list[int]], sync: Any, background: Any, *,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.rank = rank
        self.layout = layout  # global ranks of each node, by node index (the order of Lightning's node_rank)
        self.sync = sync  # None: one process, without torch.distributed (every collective is that process alone)
        self.background = background  # None on one node: nothing to copy between nodes
        self.timeout = timeout  # seconds each collective of the two groups waits for the others

    @classmethod
    def solo(cls) -> Nodes:
        """A job of one process that has no process group."""
        return cls(0, [[0]], None, None)

    @classmethod
    def join(cls, node_rank: int, local_rank: int, *, timeout: float = DEFAULT_TIMEOUT) -> Nodes:
        """Every rank of the job calls this at the same point (a collective): gathers each rank's node, makes the
        groups, each of whose collectives waits at most ``timeout`` seconds for the others."""
        rank = dist.get_rank()
        bound = datetime.timedelta(seconds=timeout)
        with named("making the local tiers' process group", rank, _bound(timeout)):
            sync = dist.new_group(backend="gloo", timeout=bound)
        places: list[Any] = [None] * dist.get_world_size()
        with named("telling the other processes which node this one is on", rank, _bound(timeout)):
            dist.all_gather_object(places, (int(node_rank), int(local_rank)), group=sync)
        by_node: dict[int, list[tuple[int, int]]] = {}
        for r, (node, local) in enumerate(places):
            by_node.setdefault(node, []).append((local, r))
        layout = [[r for _, r in sorted(by_node[node])] for node in sorted(by_node)]
        leaders = [ranks[0] for ranks in layout]
        if leaders[0] != 0:
            raise RuntimeError(f"global rank 0 is not the first process of the first node (leaders {leaders}):"
                               " lightning_resilient's local tier needs Lightning's node_rank/local_rank layout")
        # Made on every rank (new_group is a collective of the whole job), whether or not it is a member. Its
        # members wait for the next round as long as training runs between two saves: rank 0 sends a round that does
        # nothing whenever it has had none for a while (Replicator.tick), so each wait stays within the timeout.
        background = None
        if len(layout) > 1:
            with named("making the process group of the copies between nodes", rank, _bound(timeout)):
                background = dist.new_group(ranks=leaders, backend="gloo", timeout=bound)
        return cls(rank, layout, sync, background, timeout=timeout)

    @property
    def count(self) -> int:
        return len(self.layout)

    def node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.layout) if rank in ranks)

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def leader(self, node: int) -> int:
        return self.layout[node][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader(self.node)

    # Collectives of the sync group (every rank calls each); ``operation`` names it in a failure or a timeout.
    def named(self, operation: str) -> contextlib.AbstractContextManager[None]:
        return named(operation, self.rank, _bound(self.timeout))

    def broadcast(self, obj: Any, operation: str) -> Any:
        if self.sync is None:
            return obj
        box = [obj]
        with self.named(operation):
            dist.broadcast_object_list(box, src=0, group=self.sync)
        return box[0]

    def all_gather(self, obj: Any, operation: str) -> list[Any]:
        if self.sync is None:
            return [obj]
        out: list[Any] = [None] * sum(len(r) for r in self.layout)
        with self.named(operation):
            dist.all_gather_object(out, obj, group=self.sync)
        return out

    def agree(self, error: BaseException | None, operation: str) -> None:
        """Raise, on every rank, the first error any rank had (or nothing when none had one)."""
        errors = self.all_gather(error, operation)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


def _bound(timeout: float) -> str:
    return f"each wait bounded by AtomicCheckpointIO(collective_timeout={timeout:g}) seconds"


# -- moving objects between nodes ----------------------------------------------------------------------------------
class _Slots:
    """Reusable byte buffers for objects in transit that nothing keeps after sending or writing them (slot ``i``
    grows to the largest object it carried). Reading or receiving each object into fresh memory pays its page faults
    every time: on this project's 2-core VM a fresh 512 MiB fill costs about 0.3 s against 0.05 s for memory already
    mapped, CPU time taken from training (replication) or from the nodes' own loads (a restore)."""

    def __init__(self, count: int) -> None:
        self._buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(count)]

    def get(self, slot: int, size: int) -> torch.Tensor:
        i = slot % len(self._buffers)
        if self._buffers[i].numel() < size:
            self._buffers[i] = torch.empty(0, dtype=torch.uint8)  # (the old one goes before the new one is made)
            self._buffers[i] = torch.empty(size, dtype=torch.uint8)
        return self._buffers[i][:size]


def _read(local: CheckpointRoot, path: str, into: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor | None:
    """An object of a local tier as a uint8 tensor (to send it), read into ``into(size)`` when given (else fresh
    memory); None when it is missing or unreadable."""
    try:
        size = local.store.size(path)
        if size is None:
            return None
        buffer = into(size) if into is not None else torch.empty(size, dtype=torch.uint8)
        got = local.store.read_into(path, 0, [layout.raw_bytes(buffer)]) if size else 0
        return buffer if got == size else None
    except OSError:
        return None


def _send(data: torch.Tensor | None, dst: int, group: Any) -> None:
    dist.send(torch.tensor([-1 if data is None else data.numel()], dtype=torch.int64), dst=dst, group=group)
    if data is not None and data.numel():
        dist.send(data, dst=dst, group=group)


def _recv(src: int, group: Any, into: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor | None:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    n = int(size.item())
    if n < 0:
        return None
    data = into(n) if into is not None else torch.empty(n, dtype=torch.uint8)
    if n:
        dist.recv(data, src=src, group=group)
    return data


def _broadcast_object(data: torch.Tensor | None, src: int, group: Any,
                      into: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor | None:
    size = torch.tensor([-1 if data is None else data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if n < 0:
        return None
    buffer = data if data is not None else into(n) if into is not None else torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buffer, src=src, group=group)
    return buffer


def _verified(manifest: Manifest, index: int, data: torch.Tensor | None) -> str | None:
    """Why ``data`` is not object ``index`` of ``manifest`` (None when every chunk matches its digest)."""
    obj = manifest.objects[index]
    if data is None:
        return f"{obj.path}: the sending node could not read it"
    if data.numel() != obj.size:
        return f"{obj.path}: {data.numel()} bytes arrived, the manifest says {obj.size}"
    if chunk_digests([layout.raw_bytes(data)], manifest.chunk_size, manifest.hash) != obj.chunks:
        return f"{obj.path}: fails its {manifest.hash} checksum (the sending node's copy is damaged)"
    return None


def _write(local: CheckpointRoot, manifest: Manifest, index: int, data: torch.Tensor) -> None:
    """Write object ``index`` of ``manifest`` (checked) into the local tier. An object that is there already belongs
    to another commit too (an object shared with an earlier one: ``last.ckpt`` at a top-k save's step, ``dedup``),
    perhaps one this tier lists; a local write truncates in place, so it is replaced whole instead (written beside,
    then renamed over it): a kill mid-copy never tears an object a listed commit needs."""
    path = manifest.objects[index].path
    if not local.store.exists(path):
        local.store.write_pieces(path, [layout.raw_bytes(data)])
        return
    beside = f"{path}.{uuid.uuid4().hex[:8]}.incoming"
    try:
        local.store.write_pieces(beside, [layout.raw_bytes(data)])
        local.store.move(beside, path)
    except BaseException:
        with contextlib.suppress(OSError):
            local.store.remove_object(beside)
        raise


def _send_indices(indices: list[int], dst: int, group: Any) -> None:
    dist.send(torch.tensor([len(indices)], dtype=torch.int64), dst=dst, group=group)
    if indices:
        dist.send(torch.tensor(indices, dtype=torch.int64), dst=dst, group=group)


def _recv_indices(src: int, group: Any) -> list[int]:
    count = torch.empty(1, dtype=torch.int64)
    dist.recv(count, src=src, group=group)
    if not int(count.item()):
        return []
    indices = torch.empty(int(count.item()), dtype=torch.int64)
    dist.recv(indices, src=src, group=group)
    return [int(i) for i in indices.tolist()]


def _lacking(local: CheckpointRoot, manifest: Manifest, among: list[int] | None = None) -> list[int]:
    """The objects of a commit (``among`` them: a sharded commit's part; all by default) a peer's local tier must be
    sent to hold them: those of the commit's own folder,
    and those it references in other folders unless stored there with their size in a folder this tier keeps live
    (a commit it listed: an object the commit shares with an earlier one, ``last.ckpt`` at a top-k save's step or,
    with ``dedup``, a frozen base; a live folder holds every object its commit named). Referenced objects it lacks
    (the earlier commit's copy was dropped for a newer one, or retired here) are sent and written at their paths,
    which the commit then keeps live (``RootWriter.publish``'s ``brought``). Everything when the tier cannot be
    read."""
    commit = manifest.commit
    indices = list(range(len(manifest.objects))) if among is None else list(among)
    outside = {i: manifest.objects[i] for i in indices if manifest.objects[i].path.rsplit("/", 1)[0] != commit}
    if not outside:
        return indices
    try:
        pointer, _ = local.read_pointer()
        live = pointer.live_folders() if pointer is not None else set()
        stored = local.reader.stored_sizes(o.path for o in outside.values()
                                           if o.path.rsplit("/", 1)[0] in live)
    except Exception as exc:  # (a damaged pointer: the tier rebuilds it at its next update)
        log.info("node's local tier %s could not tell what it holds of %s (%s): all of it is copied", local.url,
                 commit, exc)
        return indices
    return [i for i in indices if i not in outside or outside[i].path.rsplit("/", 1)[0] not in live
            or stored.get(outside[i].path, -1) != outside[i].size]


# What a restore keeps in memory of the copies it received and checked, for the load that follows (it then reads
# them from there, not back from disk and through the hash again): at most this many bytes, beyond which the load
# reads the rest from the local tier as usual. A replaced node's part of a large checkpoint would otherwise be
# held twice in host memory during the load (these bytes and the state built from them).
HOLD_FOR_LOAD_BYTES = 1 << 30


def send_objects(local: CheckpointRoot, manifest: Manifest, indices: list[int], dst: int, group: Any) -> None:
    """Send objects ``indices`` of ``manifest`` from the local tier ``local`` to global rank ``dst``, in order, each
    read from disk while the one before it is on the wire (two objects in memory at most)."""
    if not indices:
        return
    # Object i is read into slot i % 2 while object i - 1 is sent from the other; slot i % 2 is read into again
    # only once object i is sent (dist.send returns when its buffer may be reused).
    slots = _Slots(2)
    with ThreadPoolExecutor(1, thread_name_prefix="lightning_resilient-send") as pool:
        ahead = pool.submit(_read, local, manifest.objects[indices[0]].path, functools.partial(slots.get, 0))
        for i in range(len(indices)):
            data = ahead.result()
            if i + 1 < len(indices):
                ahead = pool.submit(_read, local, manifest.objects[indices[i + 1]].path,
                                    functools.partial(slots.get, i + 1))
            _send(data, dst, group)
            data = None


def receive_objects(local: CheckpointRoot | None, manifest: Manifest, indices: list[int], src: int,
                    group: Any, hold: bool = False, later: _Later | None = None) -> str | None:
    """Receive objects ``indices`` of ``manifest`` from global rank ``src`` and write each into the local tier
    ``local`` once every chunk checks against the manifest; returns why not all did (None: all did). Every object is
    received whatever happened to the ones before it: the sender does not wait for a verdict. Each object is checked
    and written while the next one arrives (two in memory at most, besides what ``hold`` keeps). ``local`` None:
    receive and drop (this node cannot use them). ``hold``: keep the checked bytes for the load that follows, up to
    :data:`HOLD_FOR_LOAD_BYTES` (:meth:`RootReader.hold_verified`). With ``later`` (a restore's, whose budget it
    shares across transfers), the objects held are not written here but left in it, for the caller to write once
    the load has taken them; an object it holds already (a common object an earlier transfer brought) is dropped."""
    problem: str | None = None if local is not None else "no local tier to write to"
    budget = HOLD_FOR_LOAD_BYTES if hold else 0
    slots = _Slots(2)

    def check_and_write(index: int, data: torch.Tensor | None, keep: str) -> str | None:
        why = _verified(manifest, index, data)
        if why is not None:
            return why
        assert data is not None and local is not None
        if keep == "later":
            assert later is not None
            local.reader.hold_verified(manifest.objects[index], data)
            later.objects.append((index, data))
            later.indices.add(index)
            return None
        if keep == "checked":
            return None
        try:
            _write(local, manifest, index, data)
        except OSError as exc:
            return f"{manifest.objects[index].path}: {exc}"
        if keep == "held":
            local.reader.hold_verified(manifest.objects[index], data)
        return None

    # (named after the thread it works for: the background rounds' or the resume's)
    with ThreadPoolExecutor(1, thread_name_prefix=f"{threading.current_thread().name}-receive") as pool:
        pending: Future[str | None] | None = None
        for i, index in enumerate(indices):
            # What becomes of this object's bytes, decided before they arrive (so that only bytes kept after the
            # check get memory of their own; the rest arrive in slot i % 2, which the check of object i - 2 has
            # released: it is waited for below before object i + 1 arrives). The budgets count the sizes the
            # manifest declares; an object that then fails its check leaves its share unused.
            size = manifest.objects[index].size
            keep = "written"
            if local is None:
                keep = "dropped"
            elif later is not None and index in later.indices:
                keep = "checked"  # held already (a common object an earlier transfer brought)
            elif later is not None and size <= later.budget:
                later.budget -= size
                keep = "later"
            elif size <= budget:
                budget -= size
                keep = "held"
            data = _recv(src, group, None if keep in ("later", "held") else functools.partial(slots.get, i))
            if pending is not None:
                problem = problem or pending.result()
                pending = None
            if problem is None:
                pending = pool.submit(check_and_write, index, data, keep)
            data = None  # (the check holds it while it needs it)
        if pending is not None:
            problem = problem or pending.result()
    return problem


# -- the background rounds -----------------------------------------------------------------------------------------
class Access:
    """What the background rounds need of the plugin on each node: the tiers of a durable root URL."""

    def __init__(self, tiers: Callable[[str], TieredRoot]) -> None:
        self.tiers = tiers


@dataclass
class _Round:
    header: dict[str, Any]
    future: Future[list[Any]] = field(default_factory=Future)
    key: Any = None  # replications: the save key, so that an older one still queued is dropped for a newer one
    done: Callable[[], None] | None = None  # run once the round is over (or dropped), whatever its outcome


class Replicator:
    """One background thread per node leader running the rounds global rank 0 starts (see the module docstring)."""

    def __init__(self, nodes: Nodes, access: Access, replicas: int) -> None:
        self.nodes = nodes
        self.access = access
        self.replicas = replicas
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Round] = deque()
        self._thread: threading.Thread | None = None
        self.broken: BaseException | None = None  # the error that broke the background group
        #: Each leader's outcome of the last replication (None: complete), on global rank 0: for logs and tests.
        self.last: list[Any] = []

    def start(self) -> None:
        if self.nodes.background is None or not self.nodes.is_leader or self._thread is not None:
            return
        target = self._lead if self.nodes.rank == 0 else self._follow
        # A daemon: a follower waits for rounds for as long as the job trains, and must never hold up an exit.
        self._thread = threading.Thread(target=target, name="lightning_resilient-replicas", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Rank 0: end every node's thread after the rounds queued; elsewhere: wait for that."""
        if self._thread is None:
            return
        if self.nodes.rank == 0:
            self._submit(_Round({"kind": "stop"}))
        self._thread.join()
        self._thread = None

    # -- rank 0's side ---------------------------------------------------------------------------------------
    def replicate(self, tiers: TieredRoot, entry: Entry, key: Any) -> None:
        """Copy local commit ``entry`` to the other nodes (all of it under DDP, the parts by placement for a sharded
        one), behind training; an older replication still queued is dropped for it."""
        if self.broken is not None or self._thread is None:
            return
        tiers.hold(entry, _REPLICATING)
        self._submit(_Round({"kind": "replicate", "durable": tiers.durable.url, "commit": entry.commit,
                             "claim": tiers.claim()}, key=key, done=lambda: tiers.release(entry)))

    def persist_parts(self, tiers: TieredRoot, manifest: Manifest) -> Manifest:
        """Copy a sharded commit written across nodes into the durable root, each node its own part (rank 0 also the
        common objects); returns the manifest to publish there. Raises when any node's copy failed."""
        if self.broken is not None:
            raise CheckpointError(f"the nodes can no longer work together ({self.broken}): a sharded checkpoint"
                                  " written across nodes cannot be persisted")
        targets = tiers.copy_targets(manifest)
        round_ = _Round({"kind": "persist", "durable": tiers.durable.url, "manifest": manifest, "targets": targets})
        self._submit(round_)
        problems = [p for p in round_.future.result() if p]
        if problems:
            raise CheckpointError(f"persisting {manifest.commit} failed on {len(problems)} node(s): {problems[0]}")
        return retarget(manifest, targets)

    def flush(self) -> None:
        """Rank 0: block until every round queued so far has ended on every node (a round that ends nothing:
        rounds run in order on every leader). Elsewhere: nothing."""
        if self.nodes.rank != 0 or self._thread is None or self.broken is not None:
            return
        round_ = _Round({"kind": "flush"})
        self._submit(round_)
        round_.future.exception()

    def _submit(self, round_: _Round) -> None:
        dropped: list[_Round] = []
        with self._lock:
            if round_.key is not None:
                keep: deque[_Round] = deque()
                for queued in self._queue:
                    older = (queued.key is not None and queued.header.get("durable") == round_.header["durable"]
                             and queued.key != round_.key)
                    (dropped if older else keep).append(queued)
                self._queue = keep
            self._queue.append(round_)
            self._wake.notify()
        for old in dropped:  # a newer state is replicated instead: no backlog behind a slow network
            log.info("not replicating %s: a newer save is queued after it", old.header["commit"])
            self._finish(old, [])

    def _finish(self, round_: _Round, result: list[Any] | BaseException) -> None:
        if round_.done is not None:
            round_.done()
        if isinstance(result, BaseException):
            round_.future.set_exception(result)
        else:
            round_.future.set_result(result)

    @property
    def tick(self) -> float:
        """Seconds without a round after which rank 0 sends one that does nothing (a tick): every other leader waits
        for the next round in a collective, which must end within the group's timeout."""
        return min(60.0, self.nodes.timeout / 4)

    def _lead(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._wake.wait(self.tick)
                round_ = self._queue.popleft() if self._queue else None
            if round_ is None:
                if self.broken is None:
                    try:
                        self._broadcast_header({"kind": "tick"})
                    except Exception as exc:  # a peer died (or hangs past the timeout): no more rounds in this job
                        self._break(exc)
                continue
            header = self._prepare(round_.header)
            if header["kind"] == "stop":
                try:  # even after a failure: the leaders that are left wait for it to end their fit
                    self._broadcast_header(header)
                except Exception as exc:
                    log.debug("could not tell the other nodes to stop: %s", exc)
                self._finish(round_, [])
                return
            if self.broken is not None:
                self._finish(round_, self.broken)
                continue
            try:
                self._broadcast_header(header)
                with self._named(f"a {header['kind']} round"):
                    outcome = self._run(header)
                results: list[Any] = [None] * self.nodes.count
                with self._named(f"the outcome of a {header['kind']} round"):
                    dist.gather_object(outcome, results, dst=0, group=self.nodes.background)
            except Exception as exc:  # a peer died (gloo: connection closed): no more rounds in this job
                self._break(exc)
                self._finish(round_, exc)
                continue
            if header["kind"] == "replicate":
                self.last = results
                problems = [p for p in results if p]
                if problems:
                    log.warning("copying %s to the other nodes failed on %d node(s): %s", header["commit"],
                                len(problems), problems[0])
                else:
                    log.info("copied %s to the other nodes", header["commit"])
            self._finish(round_, results)

    def _prepare(self, header: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 fills in what the round needs that only it has (the manifest of the commit to replicate)."""
        if header["kind"] != "replicate":
            return header
        try:
            manifest = self.access.tiers(header["durable"]).local.read_manifest(header["commit"])
        except Exception as exc:  # retired meanwhile: nothing to copy (the round still runs: everyone in step)
            log.info("not copying %s to the other nodes: %s", header["commit"], exc)
            manifest = None
        return {**header, "manifest": manifest}

    def _named(self, operation: str) -> contextlib.AbstractContextManager[None]:
        return named(f"{operation} (the copies of local checkpoints between nodes)", self.nodes.rank,
                     _bound(self.nodes.timeout))

    def _broadcast_header(self, header: dict[str, Any]) -> dict[str, Any]:
        box = [header]
        with self._named("the next round"):
            dist.broadcast_object_list(box, src=0, group=self.nodes.background)
        received: dict[str, Any] = box[0]
        return received

    def _break(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
            message = (f"copying local checkpoints between nodes stopped: {exc}. Training goes on; each node's local"
                       " tier keeps what it holds, and the durable root what was persisted")
            log.warning(message)
            warn(message, RuntimeWarning)

    # -- every leader ------------------------------------------------------------------------------------------
    def _follow(self) -> None:
        while True:
            try:
                header = self._broadcast_header({})
                if header["kind"] == "stop":
                    return
                if header["kind"] == "tick":
                    continue
                with self._named(f"a {header['kind']} round"):
                    outcome = self._run(header)
                with self._named(f"the outcome of a {header['kind']} round"):
                    dist.gather_object(outcome, None, dst=0, group=self.nodes.background)
            except Exception as exc:  # global rank 0's process ended (or another leader's): the group is gone
                self._break(exc)
                return

    def _run(self, header: dict[str, Any]) -> Any:
        """This leader's share of one round; what it returns is gathered on rank 0 (None: nothing went wrong).
        Whatever fails here is reported, never raised: the messages of the round go on (only a broken group, a
        peer gone, raises)."""
        if header["kind"] == "flush":
            return None
        manifest: Manifest | None = header.get("manifest")
        try:
            tiers: TieredRoot | None = self.access.tiers(header["durable"])
        except Exception as exc:
            log.warning("node %d cannot open the tiers of %s: %s", self.nodes.node, header["durable"], exc)
            tiers = None
        if header["kind"] == "persist":
            assert manifest is not None
            return self._persist(tiers, manifest, header["targets"])
        if manifest is None:
            return None  # rank 0 no longer holds it
        local = tiers.local if tiers is not None else None
        if manifest.sharded is None:
            return self._replicate_full(local, manifest, header["claim"])
        return self._replicate_parts(local, manifest)

    def _replicate_full(self, local: CheckpointRoot | None, manifest: Manifest, claim: Claim) -> str | None:
        """Every other leader tells which objects of a full commit its tier lacks (:func:`_lacking`: with ``dedup``
        or an object shared with an earlier commit, only some); rank 0 broadcasts each object some leader lacks, and
        each of them checks and writes those it lacks, then commits the manifest (the same manifest, so that every
        node's copy names the same paths: what a restore between nodes relies on)."""
        problem: str | None = None if local is not None else "no local tier"
        mine = _lacking(local, manifest) if self.nodes.rank != 0 and local is not None else []
        wanted: list[Any] = [None] * self.nodes.count
        dist.all_gather_object(wanted, mine, group=self.nodes.background)
        needed = sorted({i for lacks in wanted for i in lacks or []})
        lacks = set(mine)
        slot = functools.partial(_Slots(1).get, 0)  # (each object is written before the next one is read)
        for index in needed:
            data = (_read(local, manifest.objects[index].path, slot) if self.nodes.rank == 0 and local is not None
                    else None)
            data = _broadcast_object(data, 0, self.nodes.background, slot)
            if index in lacks and problem is None:
                problem = _verified(manifest, index, data)
                if problem is None:
                    assert data is not None and local is not None
                    try:
                        _write(local, manifest, index, data)
                    except OSError as exc:
                        problem = f"{manifest.objects[index].path}: {exc}"
        if self.nodes.rank == 0 or problem is not None:
            return problem
        assert local is not None
        # Folders it wrote objects into (they need not be live yet), less those it found live holding others of
        # them (those keep the liveness check at the pointer update).
        folder = [o.path.rsplit("/", 1)[0] for o in manifest.objects]
        brought = frozenset(folder[i] for i in lacks) - {folder[i] for i in range(len(folder)) if i not in lacks} - {
            manifest.commit}
        try:
            adopt_claim(local, claim)
            local.publish(manifest, brought=brought)  # the manifest last: a copy cut short is not a checkpoint here
        except Exception as exc:
            return f"committing {manifest.commit} on node {self.nodes.node}: {exc}"
        if brought:
            log.info("node %d holds %s with objects of %s it lacked (copied with it)", self.nodes.node,
                     manifest.commit, ", ".join(sorted(brought)))
        return None

    def _replicate_parts(self, local: CheckpointRoot | None, manifest: Manifest) -> str | None:
        """Node ``k``'s leader sends part ``k`` to the nodes of its placement; each receiver records it last."""
        problems: list[str] = []
        count = min(parts.part_count(manifest), self.nodes.count)
        have = local is not None and local.store.exists(f"{manifest.commit}/{MANIFEST_NAME}")
        for part in range(count):
            indices = parts.part_objects(manifest, part)
            for target in parts.placement(part, self.nodes.count, self.replicas):
                src, dst = self.nodes.leader(part), self.nodes.leader(target)
                if self.nodes.rank == src:
                    # Only what the receiver lacks (with dedup, objects earlier commits stored are held already).
                    wanted = _recv_indices(dst, self.nodes.background)
                    slot = functools.partial(_Slots(1).get, 0)
                    for index in wanted:
                        _send(_read(local, manifest.objects[index].path, slot) if local is not None else None, dst,
                              self.nodes.background)
                elif self.nodes.rank == dst:
                    lacks = _lacking(local, manifest, indices) if have and local is not None else indices
                    _send_indices(lacks, src, self.nodes.background)
                    problem = receive_objects(local if have else None, manifest, lacks, src, self.nodes.background)
                    if problem is None:
                        assert local is not None
                        try:
                            parts.write_record(local, manifest, part)
                        except OSError as exc:
                            problem = str(exc)
                    if problem is not None:
                        problems.append(f"part {part} on node {target}: {problem}")
        return problems[0] if problems else None

    def _persist(self, tiers: TieredRoot | None, manifest: Manifest, targets: list[str]) -> str | None:
        """Copy this node's part (and on rank 0 the common objects) into the durable root."""
        node = self.nodes.node
        if tiers is None:
            return f"node {node} cannot open the durable root"
        indices = parts.part_objects(manifest, node) if node < parts.part_count(manifest) else []
        if self.nodes.rank == 0:
            indices = sorted({*indices, *parts.common_objects(manifest)})
        entry = Entry.from_manifest(manifest)
        held = False
        try:
            if self.nodes.rank != 0:  # (rank 0 holds it from when the persist was queued)
                tiers.hold(entry, "being persisted to the durable tier")
                held = True
            tiers.copy_objects(manifest, indices, targets)
        except Exception as exc:
            return f"node {node}: {exc}"
        finally:
            if held:
                tiers.release(entry)
        return None


# -- the sharded save across nodes ---------------------------------------------------------------------------------
def save_sharded_tiered(state: dict[str, Any], tiers: TieredRoot, name: str, rest: dict[str, Any] | None,
                        nodes: Nodes, **dcp_kwargs: Any) -> Entry:
    """Save ``state`` (every rank's shards) as checkpoint ``name`` into every node's local tier: each rank writes its
    shards into its node's tier, the leaders share the common objects, and each commits the manifest with the part
    it holds. Every rank calls it; returns the committed entry. Global rank 0 then counts it for persisting
    (:meth:`TieredRoot.committed`), which also starts its replication."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from lightning_resilient.io.sharded import AtomicStorageWriter, own_errors

    # The claim: rank 0 claims the durable root; every node's local tier writes as that writer epoch.
    claim: Claim | BaseException | None = None
    if nodes.rank == 0:
        try:
            claim = tiers.claim()
        except Exception as exc:
            claim = exc
    claim = nodes.broadcast(claim, "the sharded save's claim of the durable root")
    if isinstance(claim, BaseException):
        raise claim
    assert claim is not None
    error: BaseException | None = None
    if nodes.is_leader and nodes.rank != 0:
        try:
            adopt_claim(tiers.local, claim)
        except Exception as exc:
            error = exc
    nodes.agree(error, "every node's local tier adopting the sharded save's claim")

    # (with dedup, each rank records what its streams stored only once every node committed: rank_streams)
    within: set[str] | None = None
    if tiers.local.settings.dedup:
        # Each rank references only folders every node's tier keeps: a node's commit refuses a reference to one its
        # own pointer dropped (Lightning removes checkpoints on global rank 0 alone).
        live: set[str] | None = None
        if nodes.is_leader:
            try:
                pointer, _ = tiers.local.read_pointer()
                live = pointer.live_folders() if pointer is not None else set()
            except Exception:
                live = set()
        kept = [x for x in nodes.all_gather(live, "the folders every node's local tier keeps") if x is not None]
        within = set.intersection(*kept) if kept else set()
    with tiers.local.rank_streams.outcome():
        writer = AtomicStorageWriter(tiers.local, name, rest, nodes=nodes.layout, stage=True, within=within)
        with own_errors():
            dcp_save(state, storage_writer=writer, **dcp_kwargs)
        manifest: Manifest = nodes.broadcast(writer.manifest if nodes.rank == 0 else None,
                                             "the sharded save's manifest")

        # The common objects: each leader says which it lacks (with dedup, those an earlier commit stored are held
        # already), then sends those of them its node's ranks wrote; every leader keeps the others'.
        lacking: set[str] = set()
        if nodes.is_leader:
            try:
                lacking = _lacking_common(tiers.local, manifest)
            except Exception as exc:
                error = exc
        wanted: set[str] = set()
        for lacks in nodes.all_gather(lacking if nodes.is_leader else None, "the common objects each node lacks"):
            wanted |= lacks or set()
        mine: dict[str, bytes] = {}
        if nodes.is_leader and error is None:
            try:
                mine = _written_here(tiers.local, manifest, nodes, wanted)
            except Exception as exc:
                error = exc
        shared = nodes.all_gather(mine if nodes.is_leader else None,
                                  "the sharded save's objects common to every node")
        if nodes.is_leader and error is None:
            try:
                _keep_common(tiers.local, manifest, shared)
                part = nodes.node
                parts.write_record(tiers.local, manifest, part)
                tiers.local.publish(manifest, held=parts.held_objects(manifest, {part}))
            except Exception as exc:
                error = exc
        nodes.agree(error, "the sharded save's commit in every node's local tier")
    entry = Entry.from_manifest(manifest)
    if nodes.rank == 0:
        tiers.committed(entry)
    return entry


def _lacking_common(local: CheckpointRoot, manifest: Manifest) -> set[str]:
    """The common objects of ``manifest`` this node's local tier does not hold (with their size) yet."""
    paths = [manifest.objects[i] for i in parts.common_objects(manifest)]
    stored = local.reader.stored_sizes(o.path for o in paths)
    return {o.path for o in paths if stored.get(o.path, -1) != o.size}


def _written_here(local: CheckpointRoot, manifest: Manifest, nodes: Nodes, wanted: set[str]) -> dict[str, bytes]:
    """The common objects of ``manifest`` among ``wanted`` (some node lacks them) that this node's ranks wrote (rank
    0's node: also those of no rank)."""
    assert manifest.sharded is not None
    owner: dict[int, int] = {}
    for rank, indices in enumerate(manifest.sharded.ranks):
        for index in indices:
            owner[index] = rank
    out: dict[str, bytes] = {}
    for index in parts.common_objects(manifest):
        writer = owner.get(index, 0)
        path = manifest.objects[index].path
        if path in wanted and nodes.node_of(writer) == nodes.node:
            out[path] = local.store.read(path)
    return out


def _keep_common(local: CheckpointRoot, manifest: Manifest, shared: list[dict[str, bytes] | None]) -> None:
    """Write the common objects other nodes sent that this local tier lacks, each checked against the manifest."""
    by_path = {o.path: i for i, o in enumerate(manifest.objects)}
    stored = local.reader.stored_sizes(by_path)
    for sent in shared:
        for path, data in (sent or {}).items():
            index = by_path[path]
            if stored.get(path) == manifest.objects[index].size:
                continue  # written by this node's own ranks (or an earlier save of the same step)
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            problem = _verified(manifest, index, tensor)
            if problem is not None:
                raise CheckpointCorruptedError(f"a common object of {manifest.commit} sent by another node: {problem}",
                                               object=path)
            _write(local, manifest, index, tensor)


# -- the resume ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Report:
    """What one node's local tier holds: its resumable local commits, their manifests and the parts held of each."""

    entries: list[Entry]
    manifests: dict[str, Manifest]
    held: dict[str, frozenset[int]]


def _report(durable: CheckpointRoot, local: CheckpointRoot) -> _Report:
    view = TierView.read(durable, local)
    entries = view.local_entries()
    manifests: dict[str, Manifest] = {}
    held: dict[str, frozenset[int]] = {}
    for entry in entries:
        try:
            manifest = local.read_manifest(entry.commit)
        except CheckpointError:
            continue
        manifests[entry.commit] = manifest
        held[entry.commit] = parts.held(local, manifest)
    return _Report([e for e in entries if e.commit in manifests], manifests, held)


#: ``load(entry, manifest, sources, failed)``: see :func:`load_across_nodes`.
Load = Callable[[Entry, Manifest, "Sources", set[CheckpointRoot]], Loaded]

DURABLE = -1  # a source: the durable root (a peer is its node index; the node's own tier is the node itself)


@dataclass
class Plan:
    """Where each node gets each part of one commit it needs: ``sources[node][part]`` is an ordered list of node
    indices (the node itself: its own tier; another: a peer to copy it from) and :data:`DURABLE`."""

    commit: str
    manifest: Manifest
    sources: list[dict[int, list[int]]]
    #: The commit's writer epoch as a claim of the durable root: a node that restores the commit from a peer commits
    #: it in its own local tier as that epoch (so that its pointer lists it, as the node it came from does).
    claim: Claim | None = None


def plan_sources(manifest: Manifest, layout: list[list[int]], held: list[frozenset[int]], *, replicas: int,
                 durable: bool, excluded: set[tuple[int, int]]) -> Plan | None:
    """Where each node of ``layout`` gets the parts of ``manifest``'s checkpoint it needs, in the order to try
    them: its own tier when it holds the part, then the peers holding it (the node that wrote it, then its replica
    holders by placement, then any other), then the durable root when it holds the commit. ``held[n]``: the parts
    node ``n`` reports; ``excluded``: (node, part) copies found bad, and (:data:`DURABLE`, 0) for a durable copy
    found bad. None when some node has no source left for some part."""
    count = len(layout)
    needed = parts.needs(manifest, layout)
    sources: list[dict[int, list[int]]] = []
    for node in range(count):
        mine: dict[int, list[int]] = {}
        for part in sorted(needed[node]):
            order = [node] if part in held[node] and (node, part) not in excluded else []
            holders = [n for n in range(count) if part in held[n] and (n, part) not in excluded]
            order += parts.sources_of(part, holders, count, replicas, exclude={node})
            if durable and (DURABLE, 0) not in excluded:
                order.append(DURABLE)
            if not order:
                return None
            mine[part] = order
        sources.append(mine)
    return Plan(manifest.commit, manifest, sources)


@dataclass(frozen=True)
class Sources:
    """Where this rank reads the commit it loads: its node's local tier (holding every part it needs), the durable
    root, or both (a sharded load reads each object from the first that holds it)."""

    local: CheckpointRoot | None
    durable: CheckpointRoot | None

    def roots(self) -> list[CheckpointRoot]:
        return [r for r in (self.local, self.durable) if r is not None]


@dataclass(frozen=True)
class NodeLoad:
    """What :func:`load_across_nodes` loaded: the commit, its durable root, where this rank read it, the state."""

    entry: Entry
    durable: CheckpointRoot
    sources: Sources
    loaded: Loaded


def load_across_nodes(url: str, *, shown: str, nodes: Nodes, local_tier: str,
                      root_for: Callable[[str], CheckpointRoot], replicas: int, fallback: bool,
                      load: Load) -> NodeLoad | None:
    """Load what ``url`` names, deciding once for the whole job across every node's local tier (see the module
    docstring). Every rank calls it. ``load(entry, manifest, sources, failed)`` reads this rank's state of the commit
    and raises :class:`~lightning_resilient.CheckpointCorruptedError` when a copy fails verification, after adding to
    ``failed`` the roots whose copy failed (a sharded load raises on every rank when one rank's copy fails: only
    that rank names a root). None: no tier knows ``url``."""
    # 1. Rank 0 names the durable root; every leader reports what its local tier holds of it.
    head: tuple[str | None, str] | BaseException | None = None
    if nodes.rank == 0:
        try:
            head = split_tiered(url, local_tier, root_for)
        except Exception as exc:
            head = exc
    head = nodes.broadcast(head, "the resume decision (the durable root)")
    if isinstance(head, BaseException):
        raise head
    assert head is not None
    durable_url = head[0]
    if durable_url is None:
        return None
    durable = root_for(durable_url)
    local = root_for(local_tier_url(local_tier, durable_url))
    local.settle()  # (a restore of an earlier load still writing into this tier)
    report: _Report | None = None
    if nodes.is_leader:
        try:
            report = _report(durable, local)
        except Exception as exc:  # this node's tier is unreadable: it holds nothing (the others decide)
            log.warning("the local tier %s cannot be read (%s): this node resumes from its peers or the durable"
                        " root", local.url, exc)
            report = _Report([], {}, {})
    gathered = nodes.all_gather(report, "the resume decision (what each node's local tier holds)")
    reports: list[_Report] = [gathered[nodes.leader(n)] for n in range(nodes.count)]

    # 2. Rank 0 resolves over the durable root and every node's local commits.
    found: TieredResolved | BaseException | None = None
    if nodes.rank == 0:
        try:
            others = [e for r in reports for e in r.entries]
            found = resolve_tiered(url, local_tier, root_for, shown=shown, others=others)
        except Exception as exc:
            found = exc
    found = nodes.broadcast(found, "the resume decision (the checkpoint to load)")
    if isinstance(found, BaseException):
        raise found
    if found is None:
        return None
    candidates = [found.entry, *(found.fallbacks if fallback else [])]
    first: str | None = None
    for candidate in candidates:
        try:
            done = _load_candidate(candidate, reports, nodes=nodes, durable=durable, local=local, replicas=replicas,
                                   load=load)
        finally:
            local.reader.drop_held()  # (what a restore kept for a load that did not take it)
        if done is not None:
            if first is not None:
                message = (f"loaded the previous committed checkpoint {candidate.commit} (step {candidate.step}) of"
                           f" {durable_url} instead of {first}, which no node could load from any source")
                log.error(message)
                warn(message, RuntimeWarning)
            return NodeLoad(candidate, durable, done[0], done[1])
        first = first or candidate.commit
    raise CheckpointCorruptedError(
        f"no valid checkpoint to load from {durable_url}, its local tiers or their replicas: tried {len(candidates)},"
        f" the last being {candidates[-1].commit}", object=None)


def _load_candidate(candidate: Entry, reports: list[_Report], *, nodes: Nodes, durable: CheckpointRoot,
                    local: CheckpointRoot, replicas: int, load: Load) -> tuple[Sources, Loaded] | None:
    excluded: set[tuple[int, int]] = set()
    for _ in range(nodes.count + 2):  # each retry excludes at least one copy
        plan: Plan | BaseException | None = None
        if nodes.rank == 0:
            try:
                plan = _plan(candidate, reports, nodes, durable, replicas, excluded)
            except Exception as exc:
                plan = exc
        plan = nodes.broadcast(plan, f"the resume's plan of where each node reads {candidate.commit}")
        if isinstance(plan, BaseException):
            raise plan
        if plan is None:
            log.warning("%s: some node has no source for a part of it", candidate.commit)
            return None
        later = _Later()
        final = _restore(plan, nodes, local, later)
        if final is None:
            _make_durable_now(local, plan, later)  # (checked copies of parts this try cannot use: a later one can)
            return None
        mine = final[nodes.node]
        sources = Sources(local if any(s == nodes.node for s in mine.values()) else None,
                          durable if any(s == DURABLE for s in mine.values()) or not mine else None)
        outcome: Loaded | BaseException
        failed: set[CheckpointRoot] = set()
        try:
            outcome = load(candidate, plan.manifest, sources, failed)
        except CheckpointCorruptedError as exc:
            outcome = exc
        verdicts = nodes.all_gather((not isinstance(outcome, BaseException), local in failed, durable in failed),
                                    f"every rank's verdict on its load of {candidate.commit}")
        if all(ok for ok, _, _ in verdicts):
            assert not isinstance(outcome, BaseException)
            if later:  # the load took the restored bytes from memory: the disk copy is made behind training
                local.finish_later(functools.partial(_make_durable, local, plan, later),
                                   f"the copy of {candidate.commit} restored from a peer")
            return sources, outcome
        _make_durable_now(local, plan, later)  # (checked copies: on disk now rather than held through the next try)
        if isinstance(outcome, BaseException):
            where = ", ".join(sorted(root.store.url(candidate.commit) for root in failed)) or candidate.commit
            message = (f"checkpoint {where} is corrupted and was NOT loaded (rank {nodes.rank}: {outcome}); the job"
                       " tries its next copy (another node's replica, then the durable root), then the previous"
                       " committed checkpoint")
            log.error(message)
            warn(message, RuntimeWarning)
        for rank, (_, local_bad, durable_bad) in enumerate(verdicts):
            node = nodes.node_of(rank)
            if local_bad:
                excluded.update((node, part) for part in final[node] if final[node][part] == node)
            if durable_bad:
                excluded.add((DURABLE, 0))
        if not any(bad for _, bad, _ in verdicts) and not any(bad for _, _, bad in verdicts):
            return None  # failed for a reason no other source changes
    return None


def _plan(candidate: Entry, reports: list[_Report], nodes: Nodes, durable: CheckpointRoot, replicas: int,
          excluded: set[tuple[int, int]]) -> Plan | None:
    manifest = next((r.manifests[candidate.commit] for r in reports if candidate.commit in r.manifests), None)
    in_durable = durable.store.exists(f"{candidate.commit}/{MANIFEST_NAME}")
    if manifest is None:
        if not in_durable:
            return None
        manifest = durable.read_manifest(candidate.commit)
    held = [r.held.get(candidate.commit, frozenset()) for r in reports]
    held += [frozenset()] * (nodes.count - len(held))
    plan = plan_sources(manifest, nodes.layout, held, replicas=replicas, durable=in_durable, excluded=excluded)
    pointer, _ = durable.read_pointer()
    if plan is not None and pointer is not None and manifest.writer_epoch in pointer.origins:
        plan.claim = Claim(durable.url, manifest.writer_epoch, pointer.origins[manifest.writer_epoch],
                           dict(pointer.origins), pointer.root_id)
    return plan


@dataclass
class _Later:
    """What a restore received and checked on this node but left for after the load (:func:`_make_durable`): the
    objects held in memory for it (and their indices: each once, however many transfers brought it), the parts
    received whole, whether the commit is to be listed, and how many more bytes it may hold (one budget per
    restore)."""

    objects: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    indices: set[int] = field(default_factory=set)
    parts: list[int] = field(default_factory=list)
    commit: bool = False
    budget: int = field(default_factory=lambda: HOLD_FOR_LOAD_BYTES)

    def __bool__(self) -> bool:
        return bool(self.objects or self.parts or self.commit)


def _make_durable(local: CheckpointRoot, plan: Plan, later: _Later) -> None:
    """Write what a restore held for the load into the local tier, then each part's record, then list the commit
    (the order a copy is made in: objects, record, manifest; cut short, it counts for nothing)."""
    while later.objects:
        index, data = later.objects.pop(0)  # (each object's memory goes once it is written)
        _write(local, plan.manifest, index, data)
        del data
    for part in later.parts:
        parts.write_record(local, plan.manifest, part)
    if later.commit:
        _commit_restored(local, plan, later.parts)
    later.parts.clear()
    later.commit = False


def _make_durable_now(local: CheckpointRoot, plan: Plan, later: _Later) -> None:
    try:
        _make_durable(local, plan, later)
    except Exception as exc:  # this node's tier then lacks the copy: the next try or restart restores it again
        log.warning("the copy of %s restored from a peer could not be written to %s: %s", plan.commit, local.url,
                    exc)
    later.objects.clear()


def _restore(plan: Plan, nodes: Nodes, local: CheckpointRoot, later: _Later) -> list[dict[int, int]] | None:
    """Copy from peers every part some node needs and lacks, each to its leader, trying the plan's sources in
    order; returns each node's final source of each part (its own tier, or :data:`DURABLE`), or None when some part
    has no source left. Every rank calls it (only leaders move data). What the load reads from memory is left in
    ``later``."""
    chosen: list[dict[int, int]] = [{} for _ in range(nodes.count)]
    remaining = {(node, part): list(order) for node, mine in enumerate(plan.sources) for part, order in mine.items()}
    while remaining:
        transfers: list[tuple[int, int, int]] = []  # (source node, target node, part)
        for (node, part), order in sorted(remaining.items()):
            if not order:
                return None
            if order[0] in (node, DURABLE):
                chosen[node][part] = order[0]
                continue
            transfers.append((order[0], node, part))
        for node, part in [(n, p) for (n, p) in remaining if p in chosen[n]]:
            del remaining[(node, part)]
        if not transfers:
            break
        outcomes = _transfer(plan, transfers, nodes, local, later)
        for (src, node, part), ok in zip(transfers, outcomes, strict=True):
            if ok:
                chosen[node][part] = node
                del remaining[(node, part)]
                log.info("node %d restored part %d of %s from node %d", node, part, plan.commit, src)
            else:
                remaining[(node, part)].pop(0)  # that peer's copy failed: the next source
    return chosen


def _adopt_for_restore(local: CheckpointRoot, plan: Plan) -> None:
    """Make this node's local tier the commit's writer epoch before a restore writes into it, unless it already
    lists the commit or holds a newer epoch (its pointer is then left as it is: the restored copy is loadable by its
    folder all the same)."""
    if plan.claim is None:
        return
    try:
        pointer, _ = local.read_pointer()
        if pointer is not None and (plan.commit in {e.commit for e in pointer.entries()}
                                    or pointer.writer_epoch > plan.claim.writer_epoch):
            return
        adopt_claim(local, plan.claim)
    except Exception as exc:
        log.info("restoring %s without listing it in %s: %s", plan.commit, local.url, exc)


def _commit_restored(local: CheckpointRoot, plan: Plan, received: Collection[int]) -> None:
    """List a restored commit in this node's local tier pointer (manifest last), else write its manifest alone.
    ``received``: the parts the restore wrote here (each with the common objects)."""
    manifest = plan.manifest
    try:
        held = parts.held_objects(manifest, parts.held(local, manifest)) if manifest.sharded is not None else None
        # The restore wrote these objects, those a commit shares with other commits at their paths too: their
        # folders need not be live here already (a replaced node holds none); the others' must be.
        written = {i for part in received for i in parts.part_objects(manifest, part)} | set(
            parts.common_objects(manifest))
        brought = frozenset(manifest.objects[i].path.rsplit("/", 1)[0] for i in written) - {manifest.commit}
        if local.writer_epoch == manifest.writer_epoch:
            local.publish(manifest, held=held, brought=brought)
            return
    except Exception as exc:
        log.info("restored %s without listing it in %s: %s", plan.commit, local.url, exc)
    try:  # (never raised: a collective of every rank follows)
        if not local.store.exists(f"{manifest.commit}/{MANIFEST_NAME}"):
            local.store.write(f"{manifest.commit}/{MANIFEST_NAME}", manifest.to_bytes())
    except Exception as exc:
        log.warning("could not write the manifest of %s restored into %s: %s", plan.commit, local.url, exc)


def _transfer(plan: Plan, transfers: list[tuple[int, int, int]], nodes: Nodes, local: CheckpointRoot,
              later: _Later) -> list[bool]:
    """Run ``transfers`` (source node, target node, part) in order over the sync group; the targets check every
    object, write those the load will not take from memory, and leave in ``later`` the held ones, the part's record
    and the commit of the manifest in their local tier (then loadable from there, and listed like any local commit).
    A node of several processes writes all of it now: its other processes read the tier, not the leader's memory.
    Returns each transfer's outcome, as every rank sees it."""
    manifest = plan.manifest
    mine: list[tuple[int, str | None]] = []
    received: set[int] = set()
    deferred = len(nodes.layout[nodes.node]) == 1
    for i, (src, dst, part) in enumerate(transfers):
        indices = sorted({*parts.part_objects(manifest, part), *parts.common_objects(manifest)})
        if nodes.rank == nodes.leader(src):
            with nodes.named(f"sending part {part} of {manifest.commit} to node {dst} for its resume"):
                send_objects(local, manifest, indices, nodes.leader(dst), nodes.sync)
        elif nodes.rank == nodes.leader(dst):
            if not received:
                _adopt_for_restore(local, plan)  # before anything is written: it may set a foreign tier aside
            with nodes.named(f"receiving part {part} of {manifest.commit} from node {src} for this node's resume"):
                problem = receive_objects(local, manifest, indices, nodes.leader(src), nodes.sync, hold=True,
                                          later=later if deferred else None)
            if problem is None and not deferred:
                try:
                    parts.write_record(local, manifest, part)
                except OSError as exc:
                    problem = str(exc)
            if problem is None:
                if deferred:
                    later.parts.append(part)
                received.add(part)
            else:
                log.warning("restoring part %d of %s from node %d failed: %s", part, manifest.commit, src, problem)
            mine.append((i, problem))
    if received and deferred:
        later.commit = True
    elif received:
        _commit_restored(local, plan, received)
    gathered = nodes.all_gather(mine, f"the outcome of each node's restore of {manifest.commit}")
    ok = [True] * len(transfers)
    for outcomes in gathered:
        for i, problem in outcomes or []:
            ok[i] = ok[i] and problem is None
    return ok

