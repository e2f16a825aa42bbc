"""Killed and resumed training equals uninterrupted training, bit for bit (CPU, real SIGKILL).

Each case runs the same command: uninterrupted; killed right after a given save (or a few steps after it), as many
times as the case needs; and once more, to its end. The final weights must be ``torch.equal`` and the per-step
losses after the last resume identical. The same scenario without ResumeStateCallback must differ. Where the job is
killed a few steps after its save, the resumed job's ``resume audit:`` line must say the replayed steps were
identical, and the killed job's record of them must have survived the kill.

Every process costs seconds (Lightning's import alone), so each case kills one job at several kinds of instants
(mid-epoch, on an epoch's last batch, under accumulation) instead of one case per instant; the in-process resume
matrix (``test_resume_matrix.py``) covers the many configurations, the same mechanism without a process boundary.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.state.attempts import list_attempts, read_record
from tests import procs

CHILD = Path(__file__).with_name("exact_child.py")


def launch(root: Path | str, out: Path, options: dict[str, Any], kill_after_save: int | None,
           kill_at_step: int | None = None, env: dict[str, str] | None = None) -> str:
    """Run the child; kill it at the line ``SAVED kill_after_save`` (then, with ``kill_at_step``, at ``STEP
    kill_at_step``). Returns what a run that was not killed wrote to stderr (its log)."""
    proc = procs.popen([sys.executable, str(CHILD), str(root), str(out), json.dumps(options)],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if kill_after_save else subprocess.PIPE,
                       text=True, start_new_session=True, env=env)
    with open(out.with_suffix(".losses"), "a") as f:
        f.write("START\n")
    assert proc.stdout is not None
    if kill_after_save is not None:
        saved = False
        for line in proc.stdout:
            saved = saved or line.strip() == f"SAVED {kill_after_save}"
            if saved and (kill_at_step is None or line.strip() == f"STEP {kill_at_step}"):
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL, "the job ended before the point it should be killed at"
        return ""
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return err


def audit_lines(log: str) -> list[str]:
    return [line[line.index("resume audit:"):] for line in log.splitlines() if "resume audit:" in line]


def segments(out: Path) -> list[list[str]]:
    runs: list[list[str]] = []
    for line in out.with_suffix(".losses").read_text().splitlines():
        if line == "START":
            runs.append([])
        else:
            runs[-1].append(line)
    return runs


def scenario(tmp_path: Path, options: dict[str, Any], kills: list[int]) -> tuple[dict, dict, list, list]:
    full = tmp_path / "full"
    launch(tmp_path / "root-full", full, options, None)
    part = tmp_path / "part"
    for step in kills:
        launch(tmp_path / "root-part", part, options, step)
    launch(tmp_path / "root-part", part, options, None)
    return (torch.load(full.with_suffix(".weights")), torch.load(part.with_suffix(".weights")),
            segments(full)[0], segments(part)[-1])


def assert_identical(w_full: dict, w_part: dict, full: list[str], resumed: list[str]) -> None:
    assert w_full.keys() == w_part.keys()
    for k in w_full:
        assert torch.equal(w_full[k], w_part[k]), f"{k} differs after resume"
    assert resumed and full[-len(resumed):] == resumed, "per-step losses after the resume point differ"


BASE = {"workers": 0, "accumulate": 1, "epochs": 3, "callback": True, "ckpt": {"every_n_train_steps": 3}}


def opts(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


def local_store(root: Path) -> Any:
    return open_store(str(root), {}, RetryPolicy())


@pytest.mark.slow
def test_a_job_killed_mid_epoch_and_on_an_epochs_last_batch_resumes_bit_exact_and_audited(tmp_path, capsys):
    """Random augmentation drawn from Python's, NumPy's and torch's global RNGs in 2 worker processes with only
    ResumeStateCallback added, gradient accumulation 2 and an LR schedule that reads estimated_stepping_batches in
    configure_optimizers (Lightning then builds the loader early). 10 batches, so 5 optimizer steps, per epoch; a save
    every 2 steps. Killed a step after its mid-epoch save at step 2, resumed; killed again right after the save at
    step 10, on epoch 1's last batch; resumed to the end: bit for bit. The first killed job's record of the step it
    ran past its save survived the SIGKILL (local disk: written every step), the resumed job's audit compared it,
    and ``ls`` shows the three attempts."""
    options = opts(workers=2, augment="raw", accumulate=2, schedule=True, epochs=3, step_sleep=0.05,
                   ckpt={"every_n_train_steps": 2})
    full, part = tmp_path / "full", tmp_path / "part"
    launch(tmp_path / "root-full", full, options, None)
    launch(tmp_path / "root-part", part, options, 2, 3)
    store = local_store(tmp_path / "root-part")
    (first,) = list_attempts(store)
    killed = read_record(store, first, 0)
    # The micro-batches it trained past its save (STEP 3 printed: they were recorded before the kill).
    assert killed.ended is None and [s.step for s in killed.steps][4:] == [2, 2]
    launch(tmp_path / "root-part", part, options, 10)
    log = launch(tmp_path / "root-part", part, options, None)
    assert_identical(torch.load(full.with_suffix(".weights")), torch.load(part.with_suffix(".weights")),
                     segments(full)[0], segments(part)[-1])
    assert segments(part)[-1][0].split()[:2] == ["10", "0"]  # the last resume began epoch 2's first batch
    # Killed right at its save: nothing past it to compare, which the audit says (never "identical").
    (audit,) = audit_lines(log)
    assert audit.startswith("resume audit: nothing to compare") and "after step 10" in audit, audit
    attempts = list_attempts(store)
    assert len(attempts) == 3
    second = read_record(store, attempts[1], 0)
    assert second.audit is not None and second.audit.outcome == "identical" and second.audit.compared >= 1
    from lightning_resilient.cli import main

    assert main(["ls", str(tmp_path / "root-part")]) == 0
    out = capsys.readouterr().out
    assert "| fresh start |" in out and "| killed (or running) | - |" in out
    assert "| step 2 |" in out and "| step 10 |" in out and "identical: " in out


@pytest.mark.slow
def test_ddp_worker_augmentation_resumes_bit_exact_audited_on_every_rank_and_on_one_process_elastically(tmp_path):
    """2 processes, each reading with 2 workers that draw augmentation from the global RNGs, no wrapper: killed two
    steps after the save at step 2 (5 batches per rank per epoch) and resumed, bit for bit, the audit identical on
    both ranks. The same killed job resumed by 1 process instead continues the epoch's order (elastic resume,
    tests/state/test_elastic_resume.py): the audit compares the samples trained after the checkpoint across the
    change of world size."""
    ddp = opts(epochs=2, workers=2, augment="raw", ckpt={"every_n_train_steps": 2}, step_sleep=0.1,
               trainer={"strategy": "ddp", "devices": 2})
    full = tmp_path / "full"
    launch(tmp_path / "root-full", full, ddp, None)
    part = tmp_path / "part"
    # Killed when rank 0 printed STEP 4: step 3's gradient all-reduce waited for rank 1, which had by then recorded
    # its step-2 batch, so every rank's record holds a step past the save (at STEP 3 rank 1 may not have: the
    # elastic audit below needs every rank's).
    launch(tmp_path / "root-part", part, ddp, 2, 4)
    shutil.copytree(tmp_path / "root-part", tmp_path / "root-one")
    log = launch(tmp_path / "root-part", part, ddp, None)
    assert_identical(torch.load(full.with_suffix(".weights")), torch.load(part.with_suffix(".weights")),
                     segments(full)[0], segments(part)[-1])
    (audit,) = audit_lines(log)
    assert "were identical on every rank (2 ranks)" in audit, audit
    one = {**ddp, "trainer": {"strategy": "auto", "devices": 1}}
    (audit,) = audit_lines(launch(tmp_path / "root-one", tmp_path / "one", one, None))
    assert "samples this run trained after the checkpoint of step 2 (global steps" in audit, audit
    assert "are the same samples, stretch by stretch of the epoch's order" in audit and "on 2 rank(s)" in audit


@pytest.mark.slow
def test_every_finished_step_survives_a_sigkill_on_s3_and_the_ledger_counts_every_lost_step(tmp_path, s3_endpoint):
    """On an object store the record reaches the store every 30 s (the default flush), but every step is appended to
    the node's spool as it ends. Killed part-way through a step 1, 2 and 4 steps after a save (three attempts), each
    restart on this node compares every step the killed attempt finished after its checkpoint (identical), and the
    ledger (read from the store, where each restart shipped the killed attempt's spooled record) counts exactly the
    steps each attempt lost: the kill step minus the checkpoint step."""
    from lightning_resilient.state.goodput import measure
    from tests.conftest import make_bucket

    root = f"s3://{make_bucket(s3_endpoint)}/run/ckpt"
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_endpoint}
    options = opts(epochs=2, ckpt={"every_n_train_steps": 5})
    part = tmp_path / "part"
    kills = [(5, 6), (10, 12), (15, 19)]  # (the save, the step whose batch the kill lands in)
    audits = []
    for save, at in kills:
        audits += audit_lines(launch_until(root, part, {**options, "pause_at": [at]}, f"SAVED {save}", f"BEGIN {at}",
                                           env=env))
    audits += audit_lines(launch(root, part, options, None, env=env))
    assert len(audits) == 3, audits
    for (save, at), audit in zip(kills, audits, strict=True):
        steps = at - save
        assert f"the {steps} replayed training step(s)" in audit and "were identical on the only rank" in audit, audit
    ledger = measure(open_store(root, {"client_kwargs": {"endpoint_url": s3_endpoint}}, RetryPolicy()))
    assert [a.lost_steps for a in ledger.attempts] == [1, 2, 4, 0], ledger.table()
    assert ledger.lost_steps == 7


def launch_until(root: str, out: Path, options: dict[str, Any], first: str, then: str,
                 env: dict[str, str] | None = None) -> str:
    """Run the child; SIGKILL it at the line ``then`` printed after ``first``; returns its log (stderr)."""
    proc = procs.popen([sys.executable, str(CHILD), str(root), str(out), json.dumps(options)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    assert proc.stdout is not None
    seen = False
    for line in proc.stdout:
        seen = seen or line.strip() == first
        if seen and line.strip() == then:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "the job ended before the point it should be killed at"
    time.sleep(0.1)  # (the reader takes the last lines)
    return "".join(err)


# -- torchdata StatefulDataLoader ---------------------------------------------------------------------------------
# 10 batches per epoch, a save every 5 steps: step 10 is saved on the epoch's last batch (an epoch boundary: the
# loader's own RandomSampler generator must have advanced to epoch 1's permutation), step 15 mid-epoch 1.
STATEFUL = opts(loader="stateful", ckpt={"every_n_train_steps": 5})


@pytest.mark.slow
def test_stateful_dataloader_resume_is_bit_exact(tmp_path):
    # 2 workers (torchdata collects each worker's state); configure_optimizers reads estimated_stepping_batches
    # (Lightning #20550). Killed at the boundary and again mid-epoch: a position off by one batch, applied twice, or a
    # generator not advanced would change the data and so the weights. (0 workers: the in-process matrix.)
    options = {**STATEFUL, "workers": 2, "schedule": True}
    assert_identical(*scenario(tmp_path, options, kills=[10, 15]))


@pytest.mark.slow
def test_ddp_stateful_dataloader_with_workers_resumed_in_a_later_epoch_is_bit_exact(tmp_path):
    # Each rank saves and restores its own loader state. Lightning re-instantiates the loader with torchdata's
    # RandomSampler inside a DistributedSamplerWrapper: torchdata's batch sampler iterates it as soon as the
    # iterator is created, before Lightning sets the sampler epoch (#21938), and the wrapper re-draws the inner
    # order (advancing its generator) on every iteration. Resumed in epoch 1 (5 batches per rank per epoch, step 6).
    ddp = {**STATEFUL, "workers": 2, "epochs": 2, "ckpt": {"every_n_train_steps": 2},
           "trainer": {"strategy": "ddp", "devices": 2}}
    assert_identical(*scenario(tmp_path, ddp, kills=[6]))
