"""A job killed mid-epoch resumes on another number of processes (gloo on CPU, real SIGKILLs): every sample of the
epoch is trained exactly once across the attempts, checked from the sample ids each rank logged per batch; with
``keep_global_batch`` the optimizer steps read the same samples as an uninterrupted job at the original size and the
losses agree to float reduction order; the resume line and the resume audit say what happened.

Each process of a job starts its own interpreter (``nodes`` launchers of one process, as on separate machines,
``NODE_RANK`` and ``MASTER_ADDR``/``MASTER_PORT`` on loopback): that is also the 2-node case. One killed job is
resumed two ways from copies of its root. 64 samples, 4 per batch; the killed jobs save at step 3 and die at step 5
(mid-epoch 0), so a resume replays steps 3 and 4 and the audit compares them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import procs

CHILD = Path(__file__).with_name("elastic_child.py")
SAMPLES = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(root: Path, out: Path, options: dict[str, Any]) -> str:
    """Run a job of ``options["nodes"]`` one-process launchers (or one launcher of ``devices`` processes) to its end,
    or, with ``kill_at``, until every rank killed itself. Returns rank 0's log."""
    nodes = options.get("nodes", 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get(
        "PYTHONPATH", "")])}
    port = str(free_port())
    children = []
    for node in range(nodes):
        node_env = dict(env)
        if nodes > 1:
            tmp = root.parent / f"{root.name}-node{node}"  # a node-local disk of its own (the node cache)
            tmp.mkdir(exist_ok=True)
            node_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node), LOCAL_RANK="0",
                            TMPDIR=str(tmp))
        children.append(procs.popen([sys.executable, str(CHILD), str(root), str(out), json.dumps(options)],
                                    env=node_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True))
    logs = [proc.communicate(timeout=240)[1] for proc in children]
    expected = -signal.SIGKILL if options.get("kill_at") is not None else 0
    for proc, log in zip(children, logs, strict=True):
        assert proc.returncode == expected, log[-4000:]
    return logs[0]


def batches(out: Path) -> list[dict[str, Any]]:
    """Every rank's logged batches, each with its ``rank``."""
    found = []
    for path in sorted(out.parent.glob(f"{out.name}.r*.jsonl")):
        rank = int(path.name.rsplit(".r", 1)[1].split(".")[0])
        found += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines()]
    return found


def before_the_checkpoint(killed: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """The batches of a killed attempt that the checkpoint of ``step`` holds (those after it were lost)."""
    return [b for b in killed if b["step"] < step]


def assert_each_sample_once(epoch_batches: list[dict[str, Any]]) -> None:
    counts = Counter(i for b in epoch_batches for i in b["ids"])
    assert sorted(counts) == list(range(SAMPLES)), f"never trained: {sorted(set(range(SAMPLES)) - set(counts))}"
    assert set(counts.values()) == {1}, f"trained twice: {sorted(i for i, c in counts.items() if c > 1)}"


def assert_equal_steps_per_rank(resumed: list[dict[str, Any]], world: int) -> None:
    per_rank = Counter((b["epoch"], b["rank"]) for b in resumed)
    for epoch in {e for e, _ in per_rank}:
        assert len({per_rank[epoch, r] for r in range(world)}) == 1, per_rank  # DDP needs equal batch counts


def global_steps(lines: list[dict[str, Any]]) -> dict[int, tuple[list[int], float]]:
    """Per optimizer step: its samples (all ranks, all micro-batches) and the mean of its micro-batch losses (the
    loss of the global batch, the micro-batches being of equal size)."""
    steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for b in lines:
        steps[b["step"]].append(b)
    return {s: (sorted(i for b in bs for i in b["ids"]), sum(b["loss"] for b in bs) / len(bs))
            for s, bs in steps.items()}


def line_of(log: str, start: str) -> str:
    (line,) = [line[line.index(start):] for line in log.splitlines() if start in line]
    return line


@pytest.mark.slow
def test_two_nodes_killed_mid_epoch_resume_on_one_process_with_the_same_global_batch_and_on_four(tmp_path):
    """2 nodes x 1 process, killed at step 5 after the save at step 3, then resumed from copies of its root: on 1
    process with keep_global_batch (accumulate_grad_batches 1 -> 2, 2 workers), and on 4 processes (global batch
    8 -> 16). Each: every sample of epoch 0 once; the 1-process resume trains the same samples per optimizer step as
    an uninterrupted 2-process job through epoch 1, with losses equal to float reduction order."""
    job = {"nodes": 2, "epochs": 2, "every": 3}
    run(tmp_path / "root-full", tmp_path / "full", {**job, "attempt": 0, "every": 1000})
    run(tmp_path / "root", tmp_path / "part", {**job, "attempt": 1, "kill_at": 5})
    shutil.copytree(tmp_path / "root", tmp_path / "root-four")
    kept = before_the_checkpoint(batches(tmp_path / "part"), 3)
    assert len(kept) == 2 * 3  # 3 batches on each of 2 ranks: 24 samples

    # -- on 1 process, keeping the global batch -------------------------------------------------------------------
    log = run(tmp_path / "root", tmp_path / "part", {"epochs": 2, "attempt": 2, "keep": True, "workers": 2})
    resumed = [b for b in batches(tmp_path / "part") if b["attempt"] == 2]
    assert_each_sample_once(kept + [b for b in resumed if b["epoch"] == 0])
    assert_each_sample_once([b for b in resumed if b["epoch"] == 1])
    assert {b["accumulate"] for b in resumed} == {2}
    full, part = global_steps(batches(tmp_path / "full")), global_steps(resumed)
    assert sorted(part) == list(range(3, 16)), sorted(part)  # the uninterrupted job's steps 3-15, no step more
    for step, (ids, loss) in part.items():
        assert ids == full[step][0], f"step {step} read other samples"
        assert loss == pytest.approx(full[step][1], rel=1e-5, abs=1e-7), f"step {step}: loss {loss} vs {full[step][1]}"
    w_full, w_part = torch.load(tmp_path / "full.weights"), torch.load(tmp_path / "part.weights")
    assert all(torch.allclose(w_full[k], w_part[k], rtol=1e-4, atol=1e-6) for k in w_full)
    line = line_of(log, "ResumeStateCallback: resumed")
    assert ("resumed on 1 process(es) a checkpoint written by 2 in epoch 0: 24 of its 64 samples were trained before"
            " the checkpoint (the epoch's global order: DistributedSampler's permutation, seed 0), and the other 40"
            " are split among this run's 1 process(es), 10 batch(es) each, so every sample of the epoch is trained"
            " once") in line, line
    assert "8 samples per optimizer step, as before (keep_global_batch: accumulate_grad_batches 1 -> 2)" in line
    assert "those of its rank 1 end (they cannot be remapped)" in line
    audit = line_of(log, "resume audit:")
    assert audit.startswith("resume audit: the 16 samples this run trained after the checkpoint of step 3") and (
        "are the same samples, stretch by stretch of the epoch's order, as those the interrupted attempt") in audit

    # -- the 1-process job's own mid-epoch save (it was reading the rest), resumed on 1 process: bit for bit -------
    shutil.copytree(tmp_path / "root", tmp_path / "root-again")
    log = run(tmp_path / "root-again", tmp_path / "again", {"epochs": 2, "attempt": 3, "keep": True, "from_step": 6})
    again = [{**b, "attempt": 2} for b in batches(tmp_path / "again")]
    assert [b for b in resumed if b["step"] >= 6] == again  # the same batches, samples and losses, bit for bit
    w_again = torch.load(tmp_path / "again.weights")
    assert all(torch.equal(w_part[k], w_again[k]) for k in w_part)
    assert "resumed on 1 process(es) a checkpoint written by 1 in epoch 0: 48 of its 64 samples" in log, log[-3000:]

    # -- on 4 processes, the global batch changing ----------------------------------------------------------------
    log = run(tmp_path / "root-four", tmp_path / "four", {"nodes": 4, "epochs": 1, "attempt": 2})
    four = batches(tmp_path / "four")
    assert_each_sample_once(kept + four)
    assert_equal_steps_per_rank(four, 4)
    line = line_of(log, "ResumeStateCallback: resumed")
    assert "the other 40 are split among this run's 4 process(es), 3 batch(es) each" in line, line
    assert "8 samples per optimizer step then, 16 now" in line and "ranks 2-3 start new streams" in line
    assert "were the same" not in (audit := line_of(log, "resume audit:")) and "are the same samples" in audit, audit


@pytest.mark.slow
def test_one_process_with_accumulation_killed_mid_epoch_resumes_on_two_with_a_stateful_loader(tmp_path):
    """torchdata's StatefulDataLoader with 2 persistent workers, accumulate_grad_batches 2: 1 process killed at step 5
    after the save at step 3 (6 batches: 24 samples), resumed on 2 processes. Epoch 0's rest is split from the
    order the single process drew (its RandomSampler's, drawn again from the generator state it was drawn from), and
    epoch 1 is read by Lightning's distributed sampler: every sample once in each."""
    job = {"loader": "stateful", "workers": 2, "accumulate": 2, "epochs": 2, "every": 3}
    run(tmp_path / "root", tmp_path / "part", {**job, "attempt": 1, "kill_at": 5})
    kept = before_the_checkpoint(batches(tmp_path / "part"), 3)
    assert len(kept) == 6
    log = run(tmp_path / "root", tmp_path / "part", {**job, "attempt": 2, "devices": 2})
    resumed = [b for b in batches(tmp_path / "part") if b["attempt"] == 2]
    assert_each_sample_once(kept + [b for b in resumed if b["epoch"] == 0])
    assert_each_sample_once([b for b in resumed if b["epoch"] == 1])
    assert_equal_steps_per_rank(resumed, 2)
    line = line_of(log, "ResumeStateCallback: resumed")
    assert ("24 of its 64 samples were trained before the checkpoint (the epoch's global order: the RandomSampler's,"
            " drawn again from its saved state), and the other 40 are split among this run's 2 process(es), 5"
            " batch(es) each") in line, line
    assert "8 samples per optimizer step then, 16 now" in line
    audit = line_of(log, "resume audit:")
    assert audit.startswith("resume audit: nothing to compare") and "did not say its sample indices" in audit, audit


@pytest.mark.slow
def test_two_then_one_then_two_processes_the_audit_says_which_samples_it_compared(tmp_path):
    """Issue 39: 2 nodes killed at step 5 (saved at 3), resumed on 1 process, which saved at 6 and 9 and was killed at
    step 12 (3 batches, 12 samples, after its save at 9), resumed on 2 nodes again, which train the last 16 samples of
    the epoch in 2 stretches of 8. Every sample of the epoch once; the audit compares the first 8 samples (the only
    count where a stretch ends in both) and says that the interrupted attempt's other 4 were not compared, never that
    this run stopped before training them."""
    root, out = tmp_path / "root", tmp_path / "part"
    run(root, out, {"nodes": 2, "epochs": 1, "every": 3, "attempt": 1, "kill_at": 5})
    run(root, out, {"epochs": 1, "every": 3, "attempt": 2, "kill_at": 12})
    log = run(root, out, {"nodes": 2, "epochs": 1, "every": 3, "attempt": 3})
    done = batches(out)
    kept = (before_the_checkpoint([b for b in done if b["attempt"] == 1], 3)
            + before_the_checkpoint([b for b in done if b["attempt"] == 2], 9))
    last = [b for b in done if b["attempt"] == 3]
    assert_each_sample_once(kept + last)
    assert len(last) == 2 * 2  # 2 batches on each of 2 ranks: the rest of the epoch
    audit = line_of(log, "resume audit:")
    assert audit.startswith("resume audit: the first 8 of the 16 samples this run trained after the checkpoint of step"
                            " 9 (global steps 9 to 10 on 2 rank(s)) are the same samples"), audit
    assert "as the first 8 of the 12 the interrupted attempt" in audit and "its other 4 samples were not compared" in (
        audit) and "stopped" not in audit, audit
