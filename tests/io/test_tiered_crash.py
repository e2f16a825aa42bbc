"""SIGKILL a real training process with a local tier (``persist_every=4``) on moto S3, and restart it the three ways
a node comes back: on the same node (local tier kept), on a new node (local tier wiped), and over a damaged local
copy. Each restart resumes the newest intact checkpoint of the run's lineage, a kill during a background persist
leaves the durable pointer on the previous durable checkpoint, and the run that finally completes is bit-identical
(``torch.equal``) to an uninterrupted one."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything

from lightning_resilient.io.catalog import reader
from lightning_resilient.io.local_tier import local_tier_url
from lightning_resilient.io.tier_view import TierView
from tests import procs

from . import tiered_child
from .test_crash import Job, _env

CHILD = Path(__file__).with_name("tiered_child.py")
MAX_STEPS = 36


def start(backend, local: Path, out: Path, *extra: str) -> Job:
    # test_crash's child and its lines, around this test's own child script
    return Job(procs.popen([sys.executable, str(CHILD), backend.root, json.dumps(backend.storage_options),
                            str(local), str(out), "--max-steps", str(MAX_STEPS), *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env=_env(AWS_ENDPOINT_URL=backend.endpoint or ""), start_new_session=True))


def started_at(job: Job) -> int:
    return int(job.wait_for(lambda line: line.startswith("START"))[1].split()[1])


def view(backend, local: Path) -> TierView:
    durable = reader(backend.root, backend.storage_options)
    return TierView.read(durable, reader(local_tier_url(str(local), durable.url)))


def durable_latest(backend) -> int | None:
    pointer, _ = reader(backend.root, backend.storage_options).read_pointer()
    return pointer.latest.step if pointer is not None and pointer.latest is not None else None


def uninterrupted(tmp_path: Path) -> dict[str, torch.Tensor]:
    seed_everything(0)
    model = tiered_child.Noisy()
    tiered_child.trainer(str(tmp_path / "reference"), None, MAX_STEPS, []).fit(model, tiered_child.loader())
    return model.state_dict()


@pytest.mark.slow
def test_kills_and_restarts_on_the_same_node_a_new_node_and_over_a_damaged_local_copy(s3_backend, tmp_path):
    rng = random.Random(20261203)
    local, out = tmp_path / "nvme", tmp_path / "final.pt"

    # 1. Killed during a persist, between its copy and its manifest: the durable pointer stays on the previous one.
    job = start(s3_backend, local, out, "--persist-delay", "1.0")
    assert started_at(job) == 0
    job.wait_for(lambda line: line == "PERSIST-END 4 durable=True")
    copied = int(job.wait_for(lambda line: line.startswith("COPIED") and line != "COPIED 4")[1].split()[1])
    lines = job.kill()
    assert not any(line.startswith(f"PERSIST-END {copied}") for line in lines)
    persisted = [int(line.split()[1]) for line in lines if line.startswith("PERSIST-END") and "durable=True" in line]
    assert durable_latest(s3_backend) == max(persisted) < copied
    saved = max(int(line.split()[1]) for line in lines if line.startswith("SAVED"))

    # 2. Same node: the newest local checkpoint (the last save that returned, or the one committed as it was killed).
    newest = view(s3_backend, local).candidates()[0].step
    assert newest in (saved, saved + 1)
    job = start(s3_backend, local, out)
    assert started_at(job) == newest
    job.wait_for_nth("SAVED", rng.randint(3, 8))
    job.kill()

    # 3. A new node: the local tier is gone; the newest durable checkpoint.
    expected = durable_latest(s3_backend)
    assert expected is not None
    shutil.rmtree(local)
    job = start(s3_backend, local, out)
    assert started_at(job) == expected
    job.wait_for_nth("SAVED", rng.randint(5, 9))
    job.kill()

    # 4. The newest local copy is damaged: the durable copy of the same step if there is one, else the next older.
    tiers = view(s3_backend, local)
    first, *rest = tiers.candidates()
    manifest = tiers.local.read_manifest(first.commit)
    damaged = Path(tiers.local.store.path(manifest.objects[manifest.stream[0]].path))
    damaged.write_bytes(bytes(b ^ 0xFF for b in damaged.read_bytes()))
    expected = first.step if tiers.durable.store.exists(f"{first.commit}/manifest.json") else rest[0].step
    job = start(s3_backend, local, out)
    assert started_at(job) == expected
    job.wait_for(lambda line: line == "DONE", timeout=180)
    job.proc.wait(timeout=60)

    # Three kills and three kinds of restart later, the run ends where an uninterrupted one does, bit for bit.
    final = torch.load(out, weights_only=True)
    reference = uninterrupted(tmp_path)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    assert durable_latest(s3_backend) == MAX_STEPS  # the last save of the fit is persisted
