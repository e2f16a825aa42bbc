"""Killed and resumed training equals uninterrupted training, bit for bit (CPU, real SIGKILL).

Each case runs the same command three ways: uninterrupted; killed right after a given save; and the same
command again, which resumes. The final weights must be ``torch.equal`` and the per-step losses after the
resume point identical. The same scenario without ResumeStateCallback must differ.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

CHILD = Path(__file__).with_name("exact_child.py")


def launch(root: Path, out: Path, options: dict[str, Any], kill_after_save: int | None) -> None:
    proc = subprocess.Popen([sys.executable, str(CHILD), str(root), str(out), json.dumps(options)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with open(out.with_suffix(".losses"), "a") as f:
        f.write("START\n")
    assert proc.stdout is not None
    if kill_after_save is not None:
        for line in proc.stdout:
            if line.strip() == f"SAVED {kill_after_save}":
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL, "the job ended before the save it should be killed after"
        return
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]


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


@pytest.mark.slow
def test_worker_side_augmentation_with_per_sample_seeding_is_bit_exact(tmp_path):
    # Jitter drawn inside 2 worker processes: with PerSampleSeeded it depends on the sample, not the worker.
    assert_identical(*scenario(tmp_path, opts(workers=2, augment="seeded", epochs=2), kills=[3]))


@pytest.mark.slow
def test_worker_side_augmentation_without_per_sample_seeding_differs(tmp_path):
    w_full, w_part, _, _ = scenario(tmp_path, opts(workers=2, augment="raw", epochs=2), kills=[3])
    assert not all(torch.equal(w_full[k], w_part[k]) for k in w_full)


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
