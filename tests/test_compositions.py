"""Whole setups, as users combine the parts: every feature passes its own tests, and here they run together.

Seven choices a user makes (the store; one process, DDP on 2 processes or 2 loopback nodes; top-k + last or every-n
saves; no async, the plugin's own ``async_save`` or Lightning's ``AsyncCheckpointIO`` wrapper; a local tier or not;
incremental saves, ``dedup``, or not)
and the fault that hits the job (SIGKILL, SIGTERM with ``PreemptionCheckpoint``, a store outage: S3 behind a proxy
that closes its port, reached by Lightning's own client too). ``SETUPS`` covers every pair of choices (checked by
``test_the_setups_cover_every_pair_of_choices``) in 9 setups, each a real training job (``composition_child.py``):

- run until its 6th step's save, then the fault; every process ends within a bound (no hang);
- run the same command again (every process calls ``find_latest_checkpoint(root, local_tier=...)``): every rank
  resumes the newest checkpoint committed before the fault (nothing committed lost, one decision for the job), and
  ends within a bound;
- everything its ModelCheckpoint reports at the end loads, and the final weights equal an uninterrupted run's
  (``torch.equal``).

With a local tier, an outage does not stop the job: it trains through it (the store comes back after step 10's save,
while every rank waits at a gate so that the job cannot end before) and ends as the uninterrupted run. Without one,
the save that meets the outage ends the fit (bounded) and the run resumes once the store is back. A failure names its
setup (the test id). ``COMPOSITION_LOG=<folder>`` keeps each
process's whole stderr and stdout there, with the package's log at INFO; ``COMPOSITION_TRACE=1`` adds a line per step
with a digest of the batch, the RNG and the weights on every rank (``composition_child.py``).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient.io.catalog import reader
from lightning_resilient.io.local_tier import local_tier_url
from lightning_resilient.io.tier_view import TierView
from lightning_resilient.testing import StoreProxy

from . import procs
from .conftest import SEED_VARIABLES

CHILD = Path(__file__).parent / "composition_child.py"
MAX_STEPS = 16
BOUND = 180.0  # seconds any phase of a setup may take: past it, the setup hangs


@dataclass(frozen=True)
class Setup:
    procs: str  # "one", "ddp" (2 processes), "nodes" (2 loopback nodes of one process)
    fault: str  # "kill", "sigterm", "outage"
    async_: str  # "none", "own" (async_save=True), "wrapper" (Lightning's AsyncCheckpointIO)
    store: str  # "local", "s3"
    ckpt: str  # "topk_last", "every_n"
    tier: bool
    dedup: bool = False  # incremental saves (a frozen layer's objects referenced, not rewritten)

    @property
    def id(self) -> str:
        return "-".join([self.procs, self.fault, f"async={self.async_}", self.store, self.ckpt,
                         "tier" if self.tier else "no-tier", *(["dedup"] if self.dedup else [])])


# Every pair of choices at least once (an outage needs a store that can go down: S3).
SETUPS = [
    Setup("one", "kill", "none", "local", "every_n", False, dedup=True),
    Setup("one", "sigterm", "own", "local", "every_n", True),
    Setup("one", "outage", "wrapper", "s3", "topk_last", True, dedup=True),
    Setup("ddp", "kill", "own", "s3", "topk_last", True, dedup=True),
    Setup("ddp", "sigterm", "wrapper", "local", "topk_last", False),
    Setup("ddp", "outage", "none", "s3", "every_n", True),
    Setup("nodes", "kill", "wrapper", "local", "every_n", True),
    Setup("nodes", "sigterm", "none", "s3", "topk_last", True, dedup=True),
    Setup("nodes", "outage", "own", "s3", "topk_last", False),
]
CHOICES = {"procs": ("one", "ddp", "nodes"), "fault": ("kill", "sigterm", "outage"),
           "async_": ("none", "own", "wrapper"), "store": ("local", "s3"), "ckpt": ("topk_last", "every_n"),
           "tier": (False, True), "dedup": (False, True)}


def test_the_setups_cover_every_pair_of_choices():
    covered = {(a, x, b, y) for s in SETUPS for (a, x), (b, y) in itertools.combinations(asdict(s).items(), 2)}
    for a, b in itertools.combinations(CHOICES, 2):
        for x, y in itertools.product(CHOICES[a], CHOICES[b]):
            if {a, b} == {"fault", "store"} and "outage" in (x, y) and "local" in (x, y):
                continue  # a local folder does not go down
            assert (a, x, b, y) in covered, f"no setup has {a}={x} with {b}={y}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """One launcher process of the job (it starts its node's other ranks) and its output, read as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = procs.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True).start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        into.extend(line.rstrip("\n") for line in stream)  # (a line at a time, as it comes)

    def signal(self, number: int) -> None:
        os.killpg(self.proc.pid, number)  # every rank of the node (Lightning's ranks are in the launcher's group)


class Job:
    """A setup's job: one launcher, or one per node (each with its own local tier and temp folder)."""

    def __init__(self, setup: Setup, base: Path, root: str, out: Path, env: dict[str, str],
                 gate: int | None = None) -> None:
        self.setup = setup
        options = {"procs": setup.procs, "ckpt": setup.ckpt, "async": setup.async_, "tier": setup.tier,
                   "s3": setup.store == "s3", "dedup": setup.dedup, "max_steps": MAX_STEPS}
        # Training waits after step ``gate`` until the test opens it (:meth:`open_gate`).
        self.gate = base / f"gate-{os.getpid()}-{time.monotonic_ns()}"
        if gate is not None:
            options["gate"] = [gate, str(self.gate)]
        nodes = 2 if setup.procs == "nodes" else 1
        port = str(_free_port())
        # The same command as the reference run's: no seed a test of this worker left (DDP shuffles with it).
        env = {k: v for k, v in env.items() if k not in SEED_VARIABLES}
        self.processes = []
        for node in range(nodes):
            (base / f"tmp{node}").mkdir(parents=True, exist_ok=True)
            node_env = {**env, "LOCAL_TIER": str(base / f"nvme{node}"), "TMPDIR": str(base / f"tmp{node}"),
                        "PYTHONWARNINGS": "ignore"}
            if nodes > 1:
                node_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
            self.processes.append(Process([sys.executable, str(CHILD), root, str(out), json.dumps(options)], node_env))

    @property
    def lines(self) -> list[str]:
        return [line for p in self.processes for line in p.lines]

    def wait_for(self, line: str) -> None:
        deadline = time.monotonic() + BOUND
        while line not in self.lines:
            if time.monotonic() > deadline or any(p.proc.poll() is not None for p in self.processes):
                raise AssertionError(f"{self.setup.id}: never printed {line!r}: {self.lines[-6:]}\n{self.stderr()}")
            time.sleep(0.02)

    def open_gate(self) -> None:
        self.gate.touch()

    def signal(self, number: int) -> None:
        for p in self.processes:
            p.signal(number)

    def end(self) -> list[int]:
        """Every launcher's exit status, each within the bound (a hang fails the setup, after a SIGKILL)."""
        codes = []
        for p in self.processes:
            try:
                codes.append(p.proc.wait(timeout=BOUND))
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                raise AssertionError(f"{self.setup.id}: a process hung: {self.lines[-6:]}\n{self.stderr()}") from None
        time.sleep(0.1)  # (the reader threads take the last lines)
        if os.environ.get("COMPOSITION_LOG"):  # a folder: each process's whole stderr, to debug a setup
            for i, p in enumerate(self.processes):
                name = f"{self.setup.id}-{i}-{p.proc.pid}.err"
                Path(os.environ["COMPOSITION_LOG"], name).write_text("\n".join(p.err))
                Path(os.environ["COMPOSITION_LOG"], name[:-4] + ".out").write_text("\n".join(p.lines))
        return codes

    def stderr(self) -> str:
        return "\n".join("\n".join(p.err[-80:]) for p in self.processes)

    def starts(self) -> dict[str, int]:
        """rank -> the global step it started training at (its START line)."""
        return {line.split()[1]: int(line.split()[2].split("=")[1]) for line in self.lines if line.startswith("START")}


def newest_committed(setup: Setup, base: Path, root: str, options: dict[str, Any] | None) -> int | None:
    """The step of the newest checkpoint of the run committed anywhere: node 0's local tier (every node's holds
    every local commit under DDP) or the durable root."""
    durable = reader(root, options)
    if setup.tier:
        candidates = TierView.read(durable, reader(local_tier_url(str(base / "nvme0"), durable.url))).candidates()
    else:
        pointer, _ = durable.read_pointer()
        candidates = pointer.candidates() if pointer is not None else []
    return candidates[0].step if candidates else None


@pytest.fixture
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """(root, storage options, child environment, proxy or None) for the setup's store: S3 behind a proxy that can
    go down, which Lightning's own client reaches too (the environment)."""
    setup: Setup = request.param
    if setup.store == "local":
        yield str(tmp_path / "root"), None, dict(os.environ), None
        return
    backend = request.getfixturevalue("s3_backend")
    with StoreProxy(backend.endpoint) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}}
        yield backend.root, options, {**os.environ, "AWS_ENDPOINT_URL": proxy.url}, proxy
        proxy.come_back()


def reference(shared_runs: Any, setup: Setup) -> Path:
    """The uninterrupted run of the setup's processes (no fault, nothing that changes the training)."""
    plain = Setup(setup.procs, "none", "none", "local", "every_n", False)

    def make(folder: Path) -> None:
        job = Job(plain, folder, str(folder / "root"), folder / "weights.pt", dict(os.environ))
        assert job.end() == [0] * len(job.processes), job.stderr()

    return shared_runs.get("composition", {"procs": setup.procs, "max_steps": MAX_STEPS}, make) / "weights.pt"


@pytest.mark.slow
@pytest.mark.parametrize("where", SETUPS, ids=[s.id for s in SETUPS], indirect=True)
def test_a_whole_setup_survives_its_fault_and_resumes_bit_identical(where, tmp_path, shared_runs, request):
    setup: Setup = request.node.callspec.params["where"]
    root, options, env, proxy = where
    full = reference(shared_runs, setup)
    out = tmp_path / "weights.pt"
    job = Job(setup, tmp_path, root, out, env, gate=10 if setup.fault == "outage" and setup.tier else None)
    if setup.fault == "outage":
        job.wait_for("SAVED 4")
        proxy.go_down()
        if setup.tier:  # trains on from the local tier; the store is back before the end (the gate holds it)
            job.wait_for("SAVED 10")
            proxy.come_back()
            job.open_gate()
    else:
        job.wait_for("SAVED 6")
        job.signal(signal.SIGKILL if setup.fault == "kill" else signal.SIGTERM)
    codes = job.end()
    if proxy is not None:
        proxy.come_back()
    if setup.fault == "outage" and setup.tier:
        assert codes == [0] * len(codes), f"{setup.id}: {codes}\n{job.stderr()}"
        final = job
    else:
        if setup.fault == "sigterm":  # the emergency checkpoint committed, then 143 on every process
            assert set(codes) == {143}, f"{setup.id}: {codes}\n{job.stderr()}"
        elif setup.fault == "outage":  # the save that met the outage ended the fit, within the bound
            assert all(code != 0 for code in codes), f"{setup.id}: {codes}"
        newest = newest_committed(setup, tmp_path, root, options)
        # The save announced before the fault is committed (an async one may still have been uploading: the one
        # before it is, at most one save is in flight).
        announced = 4 if setup.fault == "outage" else 6
        least = announced - 2 if setup.async_ != "none" else announced
        assert newest is not None and newest >= least, f"{setup.id}: {newest} is the newest commit of the run"
        final = Job(setup, tmp_path, root, out, env)
        assert final.end() == [0] * len(final.processes), f"{setup.id}:\n{final.stderr()}"
        # Every rank resumed the newest checkpoint committed before the fault: nothing committed lost.
        world = 1 if setup.procs == "one" else 2
        assert final.starts() == {f"rank={r}": newest for r in range(world)}, f"{setup.id}: {final.lines}"
    loadable = [line for line in final.lines if line.startswith("LOADABLE")]
    assert loadable and int(loadable[0].split()[1]) >= 1, f"{setup.id}: {final.lines[-5:]}"
    mine, theirs = torch.load(out), torch.load(full)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), \
        f"{setup.id}: not bit-identical to the uninterrupted run (resumed {final.starts()})"
