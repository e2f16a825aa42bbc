"""A randomized run of the protocol against moto S3: saves, SIGKILLs at random instants of saves, restarts, rollbacks
to random earlier checkpoints, ``gc`` (beside a save in flight, too), pointer deletions and corrupted objects.

An independent model (the oracle below) knows which job committed which checkpoint, where each job's training
came from, and what ``keep_last`` retired; after every operation it checks against the store that:

(a) no committed, non-retired checkpoint of the current lineage was deleted (its objects are all stored, and the
    pointer, when there is one, still references it);
(b) the resume target is the newest intact checkpoint of the current lineage (``find_latest_checkpoint`` names the
    newest one whose manifest is intact; a load, with its fallback, loads the newest one intact altogether);
(c) nothing partial ever loads (every checkpoint loaded equals, bit for bit, what its job saved at that step).

100 operations in the suite with a fixed seed; ``pytest --soak`` runs 2000 with a new seed (``--protocol-seed N``
replays one). Every failure message starts with the seed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_resilient import AtomicCheckpointIO, CheckpointCorruptedError, find_latest_checkpoint
from lightning_resilient.io.catalog import reader
from lightning_resilient.io.folders import writer_epoch_of
from lightning_resilient.io.lineage import ORIGINS_DIR
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import POINTER_NAME

from .protocol_worker import content
from .test_crash import _env

WORKER = Path(__file__).with_name("protocol_worker.py")
KEEP_LAST = 3
SUITE_SEED = 20261203


@dataclass(eq=False)
class Launch:
    """One job: a worker process, where its training came from, and what it committed."""

    tag: str
    origin: Ckpt | None
    epoch: int | None = None  # its writer epoch, once it claimed the root
    step: int = 0  # the step it has reached


@dataclass(frozen=True)
class Ckpt:
    commit: str
    step: int
    epoch: int
    launch: Launch = field(compare=False, hash=False)


class Oracle:
    """The model: committed checkpoints, lineage by launch, retention, damage."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.committed: dict[str, Ckpt] = {}
        self.alive: set[str] = set()  # committed and not retired by keep_last
        self.damaged: dict[str, str] = {}  # commit -> "manifest" | "data"
        # Saves killed after their manifest and before their pointer update. A folder with a manifest is a
        # committed checkpoint whatever the pointer says: while the pointer is lost, one in the lineage counts.
        self.strays: dict[str, Ckpt] = {}

    def head(self) -> Launch | None:
        claimed = [launch for launch in self.launches if launch.epoch is not None]
        return max(claimed, key=lambda launch: launch.epoch) if claimed else None  # type: ignore[arg-type, return-value]

    def chain(self) -> list[tuple[Launch, float]]:
        head = self.head()
        out: list[tuple[Launch, float]] = []
        bound = float("inf")
        launch, origin = head, head.origin if head else None
        while launch is not None:
            out.append((launch, bound))
            if origin is None:
                break
            bound = min(bound, origin.step)
            launch, origin = origin.launch, origin.launch.origin
        return out

    def in_lineage(self, ckpt: Ckpt) -> bool:
        return any(ckpt.launch is launch and ckpt.step <= bound for launch, bound in self.chain())

    def members(self, strays: bool = False) -> list[Ckpt]:
        found = [c for c in self.committed.values() if c.commit in self.alive and self.in_lineage(c)]
        if strays:
            found += [c for c in self.strays.values() if self.in_lineage(c)]
        return sorted(found, key=lambda c: (c.epoch, c.step), reverse=True)

    def commit(self, ckpt: Ckpt) -> None:
        self.strays.pop(ckpt.commit, None)
        self.committed[ckpt.commit] = ckpt
        self.alive.add(ckpt.commit)
        head = self.head()
        protected = head.origin.commit if head is not None and head.origin is not None else None
        for old in self.members()[KEEP_LAST:]:
            if old.commit != protected:
                self.alive.discard(old.commit)


class Zygote:
    """protocol_worker.py, imported once; each writer is a fork of it (a real process, SIGKILLed for real)."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
        self.folder = folder
        self.spawned = 0
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ZYGOTE"

    def spawn(self) -> Worker:
        self.spawned += 1
        fifo_in, fifo_out = self.folder / f"in-{self.spawned}", self.folder / f"out-{self.spawned}"
        os.mkfifo(fifo_in)
        os.mkfifo(fifo_out)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"spawn {fifo_in} {fifo_out}\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline().split()[1])
        return Worker(pid, open(fifo_in, "w"), open(fifo_out))  # closed by Worker.kill

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class Worker:
    """One writer process: lines to it, lines from it (read by a thread, so a wait never blocks on a dead one)."""

    def __init__(self, pid: int, to: Any, back: Any) -> None:
        self.pid, self.to, self.back = pid, to, back
        self.lines: list[str] = []
        self.done = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.back:
            with self.cond:
                self.lines.append(line.strip())
                self.cond.notify_all()
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def send(self, line: str) -> None:
        self.to.write(line + "\n")
        self.to.flush()

    def wait(self, prefixes: tuple[str, ...], after: int, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines[after:]:
                    if line.startswith(prefixes):
                        return line
                if time.monotonic() > deadline or self.done:
                    raise AssertionError(f"writer never printed {prefixes}; got {self.lines[-5:]}")
                self.cond.wait(0.5)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with self.cond:
            self.cond.wait_for(lambda: self.done, timeout=30)
        for f in (self.to, self.back):
            with contextlib.suppress(OSError):
                f.close()


class Run:
    def __init__(self, backend: Any, seed: int, operations: int, folder: Path) -> None:
        self.backend, self.seed, self.operations = backend, seed, operations
        self.rng = random.Random(seed)
        self.oracle = Oracle()
        self.zygote = Zygote(_env(AWS_ENDPOINT_URL=backend.endpoint), folder)
        self.worker: Worker | None = None
        self.launch: Launch | None = None
        self.root = reader(backend.root, backend.storage_options)
        self.save_seconds = [0.2]
        self.log: list[str] = []
        self.counts: dict[str, int] = {}

    # -- jobs --------------------------------------------------------------------------------------------------
    def start(self, origin: Ckpt | None) -> None:
        """A new job (a new writer process) resuming ``origin`` (None: a fresh start)."""
        if origin is not None and origin.commit in self.oracle.strays:  # resumed while the pointer was lost
            self.oracle.commit(self.oracle.strays[origin.commit])
        worker = self.zygote.spawn()
        self.launch = Launch(f"j{len(self.oracle.launches)}", origin)
        self.oracle.launches.append(self.launch)
        target = self.backend.url(origin.commit) if origin else ""
        worker.send(f"{self.backend.root} {json.dumps(self.backend.storage_options).replace(' ', '')} {KEEP_LAST}"
                    f" {self.launch.tag} {target}".strip())
        ready = worker.wait(("READY",), 0)
        self.launch.step = int(ready.split()[1]) if origin else 0
        assert origin is None or self.launch.step == origin.step
        self.worker = worker

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker = None

    def save(self, *, kill: bool = False, gc: bool = False) -> None:
        assert self.worker is not None and self.launch is not None
        step = self.launch.step + 1
        mark = len(self.worker.lines)
        started = time.monotonic()
        self.worker.send(f"save {step}")
        if gc:
            self.worker.wait(("BEGIN",), mark)
            self.root.collect_garbage()  # grace 0, while the save is in flight
        if kill:
            time.sleep(self.rng.uniform(0, 1.3 * max(self.save_seconds[-5:])))
            self.worker.kill()
            self.worker = None
            self._after_kill(step)
            return
        line = self.worker.wait(("END", "ERROR"), mark)
        assert line.startswith("END"), line
        self.save_seconds.append(time.monotonic() - started)
        self._claimed()
        self._committed(line.split()[1], step)

    def _committed(self, commit: str, step: int) -> None:
        assert self.launch is not None and self.launch.epoch is not None
        self.oracle.commit(Ckpt(commit, step, self.launch.epoch, self.launch))
        self.launch.step = step

    def _claimed(self) -> None:
        """Whether the job claimed the root (its first save does, first thing): a newer writer epoch exists."""
        assert self.launch is not None
        if self.launch.epoch is not None:
            return
        head = self.oracle.head()
        known = head.epoch if head is not None and head.epoch is not None else 0
        seen = [writer_epoch_of(c) or 0 for n in self.root.store.list_dir("") if not n.startswith(".")
                for c in self.root.store.list_dir(n)]
        seen += [int(r[1:-5]) for r in self.root.store.list_dir(ORIGINS_DIR)]
        pointer, _ = self.root.read_pointer()
        seen.append(pointer.writer_epoch if pointer else 0)
        if max(seen) > known:
            self.launch.epoch = max(seen)

    def _after_kill(self, step: int) -> None:
        """Find out what the killed save left: committed (the pointer names it), a manifest the pointer does not
        name (a stray), or nothing."""
        assert self.launch is not None
        self._claimed()
        pointer, _ = self.root.read_pointer()
        name = f"{self.launch.tag}-step={step}.ckpt"
        if pointer is not None and name in pointer.checkpoints:
            self._committed(pointer.checkpoints[name].commit, step)
            return
        for child in self.root.store.list_dir(name):
            if MANIFEST_NAME in self.root.store.list_detail(f"{name}/{child}"):
                assert self.launch.epoch is not None
                if pointer is None:  # it was rebuilding a lost pointer: its rebuild will count it, as will ours
                    self._committed(f"{name}/{child}", step)
                else:
                    self.oracle.strays[f"{name}/{child}"] = Ckpt(f"{name}/{child}", step, self.launch.epoch,
                                                                 self.launch)

    # -- operations ----------------------------------------------------------------------------------------------
    def resume_latest(self) -> None:
        self.stop()
        self.start(self.check_resume())

    def rollback(self) -> None:
        members = [c for c in self.oracle.members() if c.commit not in self.oracle.damaged]
        if len(members) < 2:
            return
        self.stop()
        self.start(self.rng.choice(members[1:]))

    def delete_pointer(self) -> None:
        self.root.store.remove(POINTER_NAME)

    def damage(self) -> None:
        members = [c for c in self.oracle.members() if c.commit not in self.oracle.damaged]
        if not members:
            return
        victim = self.rng.choice(members)
        objects = sorted(self.root.store.list_detail(victim.commit))
        name = self.rng.choice(objects)
        rel = f"{victim.commit}/{name}"
        data = bytearray(self.root.store.read(rel))
        data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        self.root.store.write(rel, bytes(data))
        self.oracle.damaged[victim.commit] = "manifest" if name == MANIFEST_NAME else "data"

    def gc(self) -> None:
        self.root.collect_garbage(abandoned=self.rng.random() < 0.3)

    # -- the checks ----------------------------------------------------------------------------------------------
    def check(self) -> None:
        oracle = self.oracle
        pointer, _ = self.root.read_pointer()
        live = pointer.live_folders() if pointer is not None else None
        for commit in [c for c in oracle.strays if not self.root.store.exists(f"{c}/{MANIFEST_NAME}")]:
            del oracle.strays[commit]  # collected once a later job abandoned it
        for ckpt in oracle.members():  # (a) nothing committed and not retired of the lineage is gone
            assert live is None or ckpt.commit in live, f"{ckpt.commit} is no longer referenced"
            if oracle.damaged.get(ckpt.commit) != "manifest":
                self.root.reader.check_sizes(ckpt.commit)  # raises naming the missing object
        self.check_resume()

    def check_resume(self) -> Ckpt | None:
        """(b) and (c): what a restart finds and loads; returns the checkpoint loaded."""
        oracle = self.oracle
        pointer, _ = self.root.read_pointer()
        members = oracle.members(strays=pointer is None)
        readable = [c for c in members if oracle.damaged.get(c.commit) != "manifest"]
        intact = [c for c in members if c.commit not in oracle.damaged]
        options = self.backend.storage_options
        try:
            latest = find_latest_checkpoint(self.backend.root, options)
        except CheckpointCorruptedError:
            assert not readable, "find_latest_checkpoint failed with an intact manifest in the lineage"
            return None
        if readable:
            assert latest == self.backend.url(readable[0].commit), (latest, readable[0])
        elif latest is None:
            assert not members, "a root with a lineage resumed nothing"
            return None
        try:
            io = AtomicCheckpointIO(storage_options=options, retry_base_delay=0.01)
            loaded = io.load_checkpoint(latest)
        except CheckpointCorruptedError:
            assert not intact, "nothing loaded though an intact checkpoint is in the lineage"
            return None
        commit = io.last_load.commit
        ckpt = oracle.committed.get(commit) or oracle.strays.get(commit)
        if intact:
            assert ckpt == intact[0], (commit, intact[0])
        else:  # every checkpoint the model knows is damaged: an older one that retention had not deleted yet
            assert ckpt is not None and oracle.in_lineage(ckpt), commit
        expected = content(ckpt.launch.tag, ckpt.step)
        assert loaded["job"] == ckpt.launch.tag and loaded["global_step"] == ckpt.step
        for key, tensor in expected["state_dict"].items():  # (c) bit for bit what that job saved then
            assert torch.equal(loaded["state_dict"][key], tensor), key
        return ckpt

    # -- the run -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        operations = [(self.save, 40), (self.save_with_gc, 8), (self.kill_in_save, 12), (self.rollback, 5),
                      (self.gc, 8), (self.delete_pointer, 4), (self.damage, 4), (self.check, 6)]
        functions, weights = zip(*operations, strict=True)
        self.start(None)
        try:
            for _ in range(self.operations):
                op = self.rng.choices(functions, weights)[0]
                self.log.append(op.__name__)
                self.counts[op.__name__] = self.counts.get(op.__name__, 0) + 1
                op()
                self.check()
        except BaseException as exc:
            raise AssertionError(f"seed {self.seed}, operation {len(self.log)} ({self.log[-8:]}): {exc!r}") from exc
        finally:
            self.stop()
            self.zygote.stop()

    def save_with_gc(self) -> None:
        self.save(gc=True)

    def kill_in_save(self) -> None:
        self.save(kill=True)
        self.resume_latest()


def test_randomized_protocol_run(s3_backend, request, tmp_path):
    soak = request.config.getoption("--soak")
    seed = request.config.getoption("--protocol-seed")
    seed = seed if seed is not None else (random.SystemRandom().randrange(2**31) if soak else SUITE_SEED)
    run = Run(s3_backend, seed, 2000 if soak else 100, tmp_path)
    print(f"protocol run seed {seed}")
    run.run()
    assert run.counts.get("kill_in_save", 0) >= 10 and run.counts.get("rollback", 0) >= 3, run.counts
    assert len(run.oracle.launches) >= 10
