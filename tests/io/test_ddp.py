"""Under DDP a save is committed once, by global rank 0, and every rank resumes from the same checkpoint.

Lightning calls the CheckpointIO on global rank 0 only (DDP state is replicated, so rank 0's dump is the
whole checkpoint) and holds every rank at a barrier until that call, the pointer swap included, returns.
The job runs in subprocesses: DDP must never run inside pytest.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import read_pointer

CHILD = Path(__file__).with_name("ddp_child.py")


def run(root: str, max_steps: int) -> str:
    proc = subprocess.run([sys.executable, str(CHILD), root, str(max_steps)], capture_output=True, text=True,
                          timeout=240, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_ddp_commits_once_on_rank_zero_and_resumes_every_rank(local_backend):
    root = local_backend.root
    out = run(root, 4)
    saves = re.findall(r"SAVE rank=(\d) pid=(\d+) step=(\d+)", out)
    assert [(r, s) for r, _, s in saves] == [("0", "2"), ("0", "4")], out
    pointer = read_pointer(local_backend)
    assert pointer.writer_epoch == 1 and f":{saves[0][1]}:" in pointer.writer  # rank 0 claimed, once
    assert sorted(e.step for e in pointer.checkpoints.values()) == [2, 4]

    out = run(root, 8)
    starts = dict(re.findall(r"START rank=(\d) pid=\d+ step=(\d+)", out))
    assert starts == {"0": "4", "1": "4"}, out  # both ranks resumed from the committed step 4
    ends = re.findall(r"END rank=(\d) step=(\d+) weight_sum=(\S+)", out)
    assert {s for _, s, _ in ends} == {"8"} and len({w for _, _, w in ends}) == 1  # ranks in sync
    saves = re.findall(r"SAVE rank=(\d) pid=(\d+) step=(\d+)", out)
    assert [(r, s) for r, _, s in saves] == [("0", "6"), ("0", "8")]
    pointer = read_pointer(local_backend)
    assert pointer.writer_epoch == 2, "each job claims once, not once per rank"
    assert pointer.latest.step == 8 and len(pointer.checkpoints) == 4
