"""Killed and resumed training equals uninterrupted training, bit for bit (CPU, real SIGKILL).

Each case runs the same command three ways: uninterrupted; killed right after a given save (or a few steps after
it); and the same command again, which resumes. The final weights must be ``torch.equal`` and the per-step losses
after the resume point identical. The same scenario without ResumeStateCallback must differ. Where the job is
killed a few steps after its save, the resumed job's ``resume audit:`` line must say the replayed steps were
identical, and the killed job's record of them must have survived the kill.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.state.attempts import list_attempts, read_record

CHILD = Path(__file__).with_name("exact_child.py")


def launch(root: Path | str, out: Path, options: dict[str, Any], kill_after_save: int | None,
           kill_at_step: int | None = None, env: dict[str, str] | None = None) -> str:
    """Run the child; kill it at the line ``SAVED kill_after_save`` (then, with ``kill_at_step``, at ``STEP
    kill_at_step``). Returns what a run that was not killed wrote to stderr (its log)."""
    proc = subprocess.Popen([sys.executable, str(CHILD), str(root), str(out), json.dumps(options)],
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


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_is_bit_exact(tmp_path, workers):
    assert_identical(*scenario(tmp_path, opts(workers=workers), kills=[3]))  # step 3 = batch 3 of 10


def killed_a_few_steps_after_a_save(tmp_path: Path, options: dict[str, Any], save: int, step: int,
                                    resume: dict[str, Any] | None = None) -> tuple[dict, dict, list, list, str]:
    """Uninterrupted; killed at ``STEP step`` after ``SAVED save``; resumed (with ``resume`` options, if given).
    Returns both weights, both loss sequences and the resumed job's log."""
    full = tmp_path / "full"
    launch(tmp_path / "root-full", full, options, None)
    part = tmp_path / "part"
    launch(tmp_path / "root-part", part, options, save, step)
    log = launch(tmp_path / "root-part", part, resume or options, None)
    return (torch.load(full.with_suffix(".weights")), torch.load(part.with_suffix(".weights")),
            segments(full)[0], segments(part)[-1], log)


def local_store(root: Path) -> Any:
    return open_store(str(root), {}, RetryPolicy())


@pytest.mark.slow
def test_worker_augmentation_resumes_bit_exact_with_no_wrapper_and_the_audit_says_so(tmp_path, capsys):
    """Random augmentation drawn from Python's, NumPy's and torch's global RNGs in 2 worker processes, with only
    ResumeStateCallback added: killed two steps after its save at step 3 and resumed, bit for bit. The killed job's
    record of those two steps survived the SIGKILL (local disk: written every step), the resumed job's audit
    compared them, and ``ls`` shows both attempts."""
    options = opts(workers=2, augment="raw", epochs=2, step_sleep=0.05)
    w_full, w_part, full, resumed, log = killed_a_few_steps_after_a_save(tmp_path, options, 3, 5)
    assert_identical(w_full, w_part, full, resumed)
    (audit,) = audit_lines(log)
    assert audit.startswith("resume audit: the ") and "were identical on the only rank" in audit, audit
    assert "restored the data position: epoch 0, after 3 of 10 batches" in log and "continues exactly" in log
    store = local_store(tmp_path / "root-part")
    killed, finished = (read_record(store, a, 0) for a in list_attempts(store))
    assert killed.ended is None and max(s.step for s in killed.steps) >= 4  # STEP 5 printed: its batch recorded
    assert finished.audit is not None and finished.audit.outcome == "identical" and finished.audit.compared >= 2
    from lightning_resilient.cli import main

    assert main(["ls", str(tmp_path / "root-part")]) == 0
    out = capsys.readouterr().out
    assert "| fresh start |" in out and "| killed (or running) | - |" in out
    assert "| step 3 |" in out and "| finished | identical: " in out


@pytest.mark.slow
def test_worker_augmentation_without_per_sample_seeding_differs_and_the_audit_says_so(tmp_path):
    options = opts(workers=2, augment="raw", epochs=2, step_sleep=0.05, callback_args={"per_sample_seeding": False})
    w_full, w_part, _, _, log = killed_a_few_steps_after_a_save(tmp_path, options, 3, 5)
    assert not all(torch.equal(w_full[k], w_part[k]) for k in w_full)
    (audit,) = audit_lines(log)
    assert "DIFFER" in audit and "first at global step 3 (epoch 0, batch 3) on rank 0: data (input bytes)" in audit
    assert "continues exactly" not in log and "per-sample seeding is off" in log


@pytest.mark.slow
def test_epoch_boundary_resume_is_bit_exact(tmp_path):
    assert_identical(*scenario(tmp_path, opts(ckpt={"every_n_epochs": 1}), kills=[10]))


@pytest.mark.slow
def test_resume_with_accumulation_a_schedule_and_twice(tmp_path):
    # The schedule reads estimated_stepping_batches in configure_optimizers (Lightning then builds the loader
    # early); the LR, and so the weights, would differ if the resume were off by a step.
    options = opts(accumulate=2, schedule=True, ckpt={"every_n_train_steps": 2})
    assert_identical(*scenario(tmp_path, options, kills=[2, 6]))


@pytest.mark.slow
def test_without_the_callback_the_resumed_run_differs(tmp_path):
    w_full, w_part, full, resumed = scenario(tmp_path, opts(callback=False), kills=[3])
    assert not all(torch.equal(w_full[k], w_part[k]) for k in w_full)
    assert full[-len(resumed):] != resumed


@pytest.mark.slow
def test_ddp_two_processes_resume_is_bit_exact(tmp_path):
    ddp = opts(epochs=2, ckpt={"every_n_train_steps": 2}, trainer={"strategy": "ddp", "devices": 2})
    assert_identical(*scenario(tmp_path, ddp, kills=[2]))  # 5 batches per rank per epoch: step 2 is mid-epoch


@pytest.mark.slow
def test_ddp_worker_augmentation_resumes_bit_exact_audited_on_every_rank_and_on_one_process_elastically(tmp_path):
    """2 processes, each reading with 2 workers that draw augmentation from the global RNGs, no wrapper: killed one
    step after the save at step 2 (5 batches per rank per epoch) and resumed, bit for bit, the audit identical on
    both ranks. The same killed job resumed by 1 process instead continues the epoch's order (elastic resume,
    tests/state/test_elastic_resume.py): the audit compares the samples trained after the checkpoint across the
    change of world size."""
    ddp = opts(epochs=2, workers=2, augment="raw", ckpt={"every_n_train_steps": 2}, step_sleep=0.1,
               trainer={"strategy": "ddp", "devices": 2})
    full = tmp_path / "full"
    launch(tmp_path / "root-full", full, ddp, None)
    part = tmp_path / "part"
    launch(tmp_path / "root-part", part, ddp, 2, 3)
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
def test_the_audit_record_survives_a_sigkill_on_s3_up_to_its_flush_interval(tmp_path, s3_endpoint):
    """On an object store the record is rewritten by a background thread every audit_flush_steps=2 steps: a SIGKILL
    at STEP 6 (the batch of step 5 just recorded, its flush just started) loses at most that flush interval, so the
    record holds at least up to step 3 (each step lasts 0.2 s: the flush before had time to finish), and the resumed
    job's audit compares the steps it holds."""
    from tests.conftest import make_bucket

    root = f"s3://{make_bucket(s3_endpoint)}/run/ckpt"
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_endpoint}
    options = opts(epochs=1, step_sleep=0.2, callback_args={"audit_flush_steps": 2})
    part = tmp_path / "part"
    launch(root, part, options, 3, 6, env=env)
    store = open_store(root, {"client_kwargs": {"endpoint_url": s3_endpoint}}, RetryPolicy())
    (attempt,) = list_attempts(store)
    killed = read_record(store, attempt, 0)
    assert killed.ended is None and max(s.step for s in killed.steps) >= 5 - 2
    log = launch(root, part, options, None, env=env)
    (audit,) = audit_lines(log)
    assert "were identical on the only rank" in audit, audit


# -- torchdata StatefulDataLoader ---------------------------------------------------------------------------------
# 10 batches per epoch, a save every 5 steps: step 10 is saved on the epoch's last batch (an epoch boundary: the
# loader's own RandomSampler generator must have advanced to epoch 1's permutation), step 15 mid-epoch 1.
STATEFUL = opts(loader="stateful", ckpt={"every_n_train_steps": 5})


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "schedule"), [(0, True), (2, False)], ids=["workers0-schedule", "workers2"])
def test_stateful_dataloader_resume_is_bit_exact(tmp_path, workers, schedule):
    # With schedule=True configure_optimizers reads estimated_stepping_batches (Lightning #20550). Killed at the
    # boundary and again mid-epoch: a position off by one batch, applied twice, or a generator not advanced
    # would change the data and so the weights.
    options = {**STATEFUL, "workers": workers, "schedule": schedule}
    assert_identical(*scenario(tmp_path, options, kills=[10, 15]))


@pytest.mark.slow
def test_stateful_dataloader_without_the_callback_differs(tmp_path):
    """Stock Lightning restores a StatefulDataLoader's position itself, but not here: configure_optimizers reads
    estimated_stepping_batches, which builds the loader before the loops' state is loaded, so the saved position
    is dropped (Lightning #20550) and the resumed epoch starts over; and no RNG is restored (dropout differs)."""
    options = {**STATEFUL, "schedule": True, "callback": False}
    w_full, w_part, full, resumed = scenario(tmp_path, options, kills=[15])
    assert not all(torch.equal(w_full[k], w_part[k]) for k in w_full)
    assert full[-len(resumed):] != resumed


@pytest.mark.slow
def test_ddp_stateful_dataloader_with_workers_resumed_in_a_later_epoch_is_bit_exact(tmp_path):
    # Each rank saves and restores its own loader state. Lightning re-instantiates the loader with torchdata's
    # RandomSampler inside a DistributedSamplerWrapper: torchdata's batch sampler iterates it as soon as the
    # iterator is created, before Lightning sets the sampler epoch (#21938), and the wrapper re-draws the inner
    # order (advancing its generator) on every iteration. Resumed in epoch 1 (5 batches per rank per epoch, step 6).
    ddp = {**STATEFUL, "workers": 2, "epochs": 2, "ckpt": {"every_n_train_steps": 2},
           "trainer": {"strategy": "ddp", "devices": 2}}
    assert_identical(*scenario(tmp_path, ddp, kills=[6]))
