"""Under DDP a save is committed once, by global rank 0, and every rank resumes from the same checkpoint.

Lightning calls the CheckpointIO on global rank 0 only (DDP state is replicated, so rank 0's dump is the
whole checkpoint) and holds every rank at a barrier until that call, the pointer swap included, returns.
The job runs in subprocesses: DDP must never run inside pytest.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests import procs

from .helpers import read_pointer

CHILD = Path(__file__).with_name("ddp_child.py")


def run(root: str, max_steps: int, io_options: dict | None = None, env: dict | None = None) -> str:
    proc = procs.run([sys.executable, str(CHILD), root, str(max_steps), json.dumps(io_options or {})],
                     capture_output=True, text=True, timeout=240, start_new_session=True,
                     env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_ddp_commits_once_on_rank_zero_and_resumes_every_rank_from_the_local_tier(local_backend, tmp_path):
    """Rank 0 saves and claims once per job; with a local tier (persist_every=2) rank 0 decides across both tiers
    and every rank of the node reads that one commit from the local tier."""
    root = local_backend.root
    options = {"local_tier": str(tmp_path / "nvme"), "persist_every": 2}
    out = run(root, 4, options)
    saves = re.findall(r"SAVE rank=(\d) pid=(\d+) step=(\d+)", out)
    assert [(r, s) for r, _, s in saves] == [("0", "2"), ("0", "4")], out
    pointer = read_pointer(local_backend)
    assert pointer.writer_epoch == 1 and f":{saves[0][1]}:" in pointer.writer  # rank 0 claimed, once
    assert sorted(e.step for e in pointer.checkpoints.values()) == [4]  # the 2nd save (and the last) persisted

    out = run(root, 8, options)
    starts = re.findall(r"START rank=(\d) pid=\d+ step=(\d+) commit=(\S+) tier=(\S+)", out)
    assert sorted(r for r, _, _, _ in starts) == ["0", "1"], out
    assert {(s, c, t) for _, s, c, t in starts} == {("4", starts[0][2], "local")}, out  # one commit, read locally
    ends = re.findall(r"END rank=(\d) step=(\d+) weight_sum=(\S+)", out)
    assert {s for _, s, _ in ends} == {"8"} and len({w for _, _, w in ends}) == 1  # ranks in sync
    saves = re.findall(r"SAVE rank=(\d) pid=(\d+) step=(\d+)", out)
    assert [(r, s) for r, _, s in saves] == [("0", "6"), ("0", "8")]
    pointer = read_pointer(local_backend)
    assert pointer.writer_epoch == 2, "each job claims once, not once per rank"
    assert pointer.latest.step == 8 and sorted(e.step for e in pointer.checkpoints.values()) == [4, 8]


# That a resume reads the store once per node (the node cache), not once per rank, is proven with two processes per
# node on two nodes by tests/io/test_multinode.py; that without the node cache every process reads everything, by
# tests/test_benchmarks.py::test_scaling_nodes_simulation_smoke.


@pytest.mark.slow
def test_a_damaged_read_on_one_rank_makes_every_rank_fall_back_to_the_same_commit(local_backend):
    """Rank 1's read of the newest checkpoint fails verification (simulated: a damaged read on its node only); the
    ranks decide together and both resume the previous commit, instead of each resuming its own."""
    root = local_backend.root
    run(root, 4)  # commits steps 2 and 4
    out = run(root, 6, env={"FAIL_RANK": "1"})
    starts = re.findall(r"START rank=(\d) pid=\d+ step=(\d+) commit=(\S+)", out)
    assert sorted(r for r, _, _ in starts) == ["0", "1"] and {(s, c) for _, s, c in starts} == {
        ("2", next(c for _, _, c in starts))}, out
    assert next(c for _, _, c in starts).startswith("epoch=0-step=2.ckpt/")



@pytest.mark.slow
def test_a_ddp_fit_that_resumes_nothing_over_a_run_stops_on_every_rank(local_backend):
    """Rank 0 decides, every rank raises the same RunExistsError before its first step: none is left waiting at a
    collective for one that stopped alone (the run would hang until its timeout)."""
    root = local_backend.root
    run(root, 2)
    before = read_pointer(local_backend)
    proc = procs.run([sys.executable, str(CHILD), root, "4", "{}"], capture_output=True, text=True, timeout=240,
                     start_new_session=True, env={**os.environ, "FRESH": "1"})
    assert proc.returncode != 0
    assert proc.stderr.count("RunExistsError: this fit loads no checkpoint") == 2, proc.stderr[-3000:]
    assert "START" not in proc.stdout and "SAVE" not in proc.stdout  # before the first step, nothing saved
    assert read_pointer(local_backend) == before
