"""SIGKILL a real training process at random instants inside saves; every restart finds a whole checkpoint.

After each kill the newest committed checkpoint must load with full checksum verification and no fallback,
and it must be the newest one whose save returned (or the one being saved, if the kill fell between the
pointer swap and the return). The next launch resumes from it, as a restarted job would.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.io.folders import commit_time
from lightning_resilient.testing.lines import LineReader
from tests import procs

from .helpers import read_pointer

CHILD = Path(__file__).with_name("crash_child.py")
KILLS_IN_SAVES = 3  # on local disk; the randomized protocol test (test_protocol_random.py, its _with_sigkills items)
# SIGKILLs writer processes at random instants on local disk and S3, and test_tiered_crash.py during local-tier saves
# and persists to S3


def _stamped(line: str) -> tuple[float, str]:
    return time.monotonic(), line.strip()


class Job:
    """A child process (in a session of its own, so a kill takes its helpers too) and the lines it prints, each with
    when it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.output = LineReader(proc.stdout, _stamped)

    @classmethod
    def start(cls, args: list[str], env: dict[str, str]) -> Job:
        return cls(procs.popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True))

    @property
    def lines(self) -> list[tuple[float, str]]:
        return self.output.items()

    def wait_for(self, predicate, timeout: float = 120) -> tuple[float, str]:
        found = self.output.wait_for(lambda item: predicate(item[1]), timeout)
        if found is None:
            raise AssertionError(f"child never printed the expected line; got {self.lines[-5:]}")
        return found

    def wait_for_nth(self, prefix: str, n: int, timeout: float = 120) -> tuple[float, str]:
        """The n-th line starting with ``prefix`` (1-based), once the child has printed it."""
        self.wait_for(lambda _: sum(line.startswith(prefix) for _, line in self.lines) >= n, timeout)
        return [(t, line) for t, line in self.lines if line.startswith(prefix)][n - 1]

    def kill(self) -> list[str]:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.output.join(timeout=30)
        return [line for _, line in self.lines]


def run_crash_loop(backend, env: dict[str, str]) -> None:
    rng = random.Random(20261202)
    options = json.dumps(backend.storage_options)
    committed = 0  # newest step whose save returned, over all launches
    kills_in_saves = 0
    launches = 0
    while kills_in_saves < KILLS_IN_SAVES:
        launches += 1
        assert launches <= KILLS_IN_SAVES + 10, "too few kills landed inside saves"
        job = Job.start([backend.root, options], env)
        resumed = job.wait_for(lambda line: line.startswith("RESUME"))[1]
        if committed:
            assert resumed != "RESUME None", "a restart did not find the committed checkpoint"
        # Pick one of the first few saves of this launch, then a random instant within a save's duration.
        nth = 2 if launches == 1 else rng.randint(1, 2)  # the first launch commits one save before its kill
        t_begin, begin_line = job.wait_for_nth("BEGIN", nth)
        durations = _save_durations(job.lines) or [0.3]
        target = t_begin + rng.uniform(0, max(durations) * 1.1)
        time.sleep(max(0.0, target - time.monotonic()))
        lines = job.kill()
        step = int(begin_line.split()[1])
        ends = [int(line.split()[1]) for line in lines if line.startswith("END")]
        begun = [int(line.split()[1]) for line in lines if line.startswith("BEGIN")]
        in_flight = begun[-1] if begun and (not ends or ends[-1] != begun[-1]) else None
        if ends:
            committed = max(committed, ends[-1])
        if in_flight is not None and in_flight >= step:
            kills_in_saves += 1

        latest = find_latest_checkpoint(backend.root, backend.storage_options)
        if latest is None:
            assert committed == 0, "a committed checkpoint was lost"
            continue  # killed inside the very first save: a restart correctly starts fresh
        reader = AtomicCheckpointIO(storage_options=backend.storage_options, claim_on_load=False,
                                    fallback_on_corruption=False)
        loaded = reader.load_checkpoint(latest)  # every byte verified, no fallback allowed
        allowed = {committed} | ({in_flight} if in_flight is not None else set())
        assert loaded["global_step"] in allowed, (loaded["global_step"], allowed, lines[-4:])
        committed = loaded["global_step"]

    # Leftovers do not pile up: each new job collects what the previous one left, so at most the last launch's
    # debris (its interrupted save, the folder its last commit retired, one whose deletion was interrupted) is
    # stored beyond what the pointer needs; a next job's claim (grace 0 here) and first commit remove the debris,
    # leaving only what that commit retired, deleted after the next one.
    pointer = read_pointer(backend)
    live = pointer.live_folders()
    assert len(commit_folders(backend) - live) <= 3
    final = AtomicCheckpointIO(storage_options=backend.storage_options, orphan_grace_seconds=0, keep_last=3,
                               claim_on_load=True)
    final.load_checkpoint(find_latest_checkpoint(backend.root, backend.storage_options))  # a restart resumes...
    final.save_checkpoint({"global_step": 10**6, "state_dict": {}}, backend.url("final.ckpt"))  # ...and saves
    pointer = read_pointer(backend)
    assert commit_folders(backend) <= pointer.live_folders() | set(pointer.retired)
    # Only what the final commit itself retired is left (deleted after the next commit): usually one folder, two
    # when the claim moved the previous job's resume protection and keep_last dropped both at that commit.
    leftover = commit_folders(backend) - pointer.live_folders()
    assert all(pointer.retired.get(folder) == pointer.saves for folder in leftover), (leftover, pointer.retired)
    assert len(pointer.checkpoints) <= 3


def commit_folders(backend) -> set[str]:
    base = backend.path().rstrip("/")
    out = set()
    for path in backend.fs().find(base):
        parts = path[len(base) + 1:].split("/")
        if len(parts) == 3 and commit_time(parts[1]) is not None:
            out.add("/".join(parts[:2]))
    return out


def _save_durations(lines: list[tuple[float, str]]) -> list[float]:
    out, start = [], None
    for t, line in lines:
        if line.startswith("BEGIN"):
            start = t
        elif line.startswith("END") and start is not None:
            out.append(t - start)
            start = None
    return out


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_sigkill_during_saves_local(local_backend):
    run_crash_loop(local_backend, _env())

