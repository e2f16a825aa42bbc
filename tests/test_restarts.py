"""In-job restart: under ``torchrun --max-restarts 1``, a rank SIGKILLed mid-run makes torchrun restart the group, which
resumes by itself (the script looks up the newest committed checkpoint: here the local tier's, newer than the durable
root's) and ends bit-identical to an uninterrupted run; the goodput ledger of that root then reports both attempts and
the steps the restart recomputed, and the straggler (rank 1 sleeps in every training step) is in the log and the
ledger. One child run checks all of it (docs/restarts.md is the recipe)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.state.attempts import list_attempts, read_record
from lightning_resilient.state.goodput import measure
from tests import procs

TESTS = Path(__file__).parent
OPTIONS = {"max_steps": 16, "every": 2, "persist_every": 2, "slow": 0.08}


def torchrun(root: Path, out: Path, options: dict[str, Any], *, restarts: int) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:  # a free port for the group's store (loopback only)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(TESTS / "restart_child.py"), str(root), str(out), json.dumps(options)]
    proc = procs.run(command, capture_output=True, text=True, timeout=240,
                     env={**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_torchrun_restarts_the_group_after_a_kill_from_the_newest_commit_bit_identical(tmp_path, shared_runs):
    full = shared_runs.get("torchrun", OPTIONS,
                           lambda folder: torchrun(folder / "root", folder / "run", OPTIONS, restarts=0)) / "run"
    root = tmp_path / "root"
    proc = torchrun(root, tmp_path / "run", {**OPTIONS, "kill_at": 8}, restarts=1)
    starts = sorted(line for line in proc.stdout.splitlines() if line.startswith("START"))
    # No one reran anything: torchrun restarted the group, which resumed the local tier's step-6 commit (the durable
    # root's newest is step 4: every second save is persisted).
    assert starts == ["START rank=0 restart=0 step=0 tier=-", "START rank=0 restart=1 step=6 tier=local",
                      "START rank=1 restart=0 step=0 tier=-", "START rank=1 restart=1 step=6 tier=local"]
    assert "KILLING rank 1 at step 8" in proc.stdout
    weights, resumed = torch.load(f"{full}.weights"), torch.load(tmp_path / "run.weights")
    assert weights.keys() == resumed.keys() and all(torch.equal(weights[k], resumed[k]) for k in weights)
    assert "resume audit: the 2 replayed training step(s) (global steps 6 to 7) were identical on every rank" \
        in proc.stderr

    # The ledger: two attempts, the 2 steps after the step-6 commit recomputed, the restore from the local tier.
    store = open_store(str(root), {}, RetryPolicy())
    ledger = measure(store)
    killed, restarted = ledger.attempts
    assert [a.attempt for a in ledger.attempts] == list_attempts(store)
    assert (killed.last_step, restarted.resumed_step, ledger.lost_steps, killed.lost_steps) == (8, 6, 2, 2)
    assert killed.end != "finished" and restarted.end == "finished" and restarted.last_step == 16
    assert ledger.failures == 1 and ledger.mtbf_seconds is not None and 0 < (ledger.goodput or 0) < 1
    for rank in (0, 1):  # every rank loaded the local tier's copy
        timings = read_record(store, restarted.attempt, rank).timings
        assert timings is not None and timings.resumed_tier == "local"
        assert (timings.resumed_commit or "").startswith("epoch=0-step=6.ckpt/c")

    # The straggler: rank 1, in the log and in both attempts' ledger.
    assert "straggler: rank 1 is " in proc.stderr
    assert {(attempt, s.rank) for attempt, s in ledger.stragglers} == {(killed.attempt, 1), (restarted.attempt, 1)}
