"""Lightning Fabric with ``AtomicCheckpointIO``: ``fabric.load`` then ``fabric.save`` in one process continues the run.

Fabric hands the plugin no Trainer, so a load there claims nothing; the plugin's first save into a root then claims it
with that load as the origin of its lineage, as a Trainer's resume does at once: ``fabric.load(find_latest_checkpoint(
root), state)`` followed by ``fabric.save(...)`` continues the run (never "started from scratch"), a load of an older
checkpoint is a rollback, a save into another root is a fork, and a process that only loads never fences anyone.
Real Fabric objects on one CPU process (``fabric.save``/``fabric.load`` reach the plugin as they do on DDP's rank 0),
and one 2-process Fabric DDP job (``fabric_child.py``) for the claim per job.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.io.lineage import Origin
from lightning_resilient.io.pointer import POINTER_NAME, Entry, Pointer
from lightning_resilient.io.root import open_root

from .. import procs

CHILD = Path(__file__).with_name("fabric_child.py")


def _fabric(io: AtomicCheckpointIO) -> Any:
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=1, plugins=[io])


def _state(fabric: Any, seed: int = 0) -> dict[str, Any]:
    """A model and optimizer set up by ``fabric``, and the step counter a Fabric loop keeps (``global_step``, the key
    the plugin reads the step from, as the Trainer writes it)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    return {"model": model, "optimizer": optimizer, "global_step": 0}


def _train(fabric: Any, state: dict[str, Any], root: str, steps: int, prefix: str = "step") -> None:
    """``steps`` optimizer steps, each saved as ``<root>/<prefix>=<step>.ckpt`` with ``fabric.save``."""
    for _ in range(steps):
        loss = state["model"](torch.full((3, 4), float(state["global_step"] + 1))).square().sum()
        fabric.backward(loss)
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["global_step"] += 1
        fabric.save(f"{root}/{prefix}={state['global_step']}.ckpt", state)


def _weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in state["model"].state_dict().items()}


def _pointer(root: str, options: dict[str, Any]) -> Pointer:
    pointer, _ = open_root(root, options).read_pointer()
    assert pointer is not None
    return pointer


def _named(pointer: Pointer, name: str) -> Entry:
    return pointer.checkpoints[name]


@contextmanager
def _no_fresh_start_warning() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    assert not [str(w.message) for w in seen if "started from scratch" in str(w.message)
                or "abandoned branch" in str(w.message)]


def test_a_fabric_load_then_save_continues_the_run(backend, make_io, plugins):
    """Job 1 saves steps 1-3 and is gone; job 2 does ``fabric.load(find_latest_checkpoint(root), state)`` and saves
    steps 4 and 5: its claim's origin is step 3, so steps 1-3 stay in the lineage (none abandoned, nothing for
    ``gc --abandoned``), ``keep_last`` counts them (step 3, resumed from, stays) and a restart resumes step 5."""
    root, options = backend.root, backend.storage_options
    first = make_io(backend)
    plugins.abandoned(first)  # (job 1 is gone: killed, its plugin never torn down)
    fabric = _fabric(first)
    state = _state(fabric)
    _train(fabric, state, root, 3)
    at_3 = _weights(state)

    second = make_io(backend, keep_last=2)
    fabric = _fabric(second)
    state = _state(fabric, seed=1)
    with _no_fresh_start_warning():
        fabric.load(find_latest_checkpoint(root, options), state)
        assert state["global_step"] == 3
        for name, tensor in _weights(state).items():
            assert torch.equal(tensor, at_3[name]), name
        _train(fabric, state, root, 2)

    pointer = _pointer(root, options)
    step3 = _named(pointer, "step=3.ckpt")
    assert pointer.writer_epoch == step3.writer_epoch + 1
    assert pointer.origins[pointer.writer_epoch] == Origin(step3.commit, step3.writer_epoch, 3)
    assert pointer.abandoned() == []
    # keep_last=2 counted the run's lineage: steps 1 and 2 went, step 3 stays as what this job resumed from.
    assert [e.step for e in pointer.candidates()] == [5, 4, 3]
    latest = find_latest_checkpoint(root, options)
    assert latest is not None and latest.endswith(pointer.latest.commit) and pointer.latest.step == 5
    collectable = second.root(root).collect_garbage(abandoned=True, dry_run=True)
    assert [url for url, why in collectable if "abandoned" in why] == []


def test_a_fabric_load_of_an_older_checkpoint_then_save_is_a_rollback(local_backend, make_io, plugins):
    """Loading step 2 of a run that reached step 4, then saving, abandons steps 3 and 4 (as a Trainer's rollback):
    the lineage is the new saves, then steps 2 and 1; ``gc --abandoned`` takes steps 3 and 4 only."""
    root = local_backend.root
    first = make_io(local_backend)
    plugins.abandoned(first)
    fabric = _fabric(first)
    state = _state(fabric)
    _train(fabric, state, root, 4)

    second = make_io(local_backend)
    fabric = _fabric(second)
    state = _state(fabric, seed=1)
    with _no_fresh_start_warning():
        fabric.load(f"{root}/step=2.ckpt", state)  # a name, as a user passes one
        assert state["global_step"] == 2
        _train(fabric, state, root, 2, prefix="again")

    pointer = _pointer(root, {})
    step2 = _named(pointer, "step=2.ckpt")
    assert pointer.origins[pointer.writer_epoch] == Origin(step2.commit, step2.writer_epoch, 2)
    assert [(e.name, e.step) for e in pointer.candidates()] == [("again=4.ckpt", 4), ("again=3.ckpt", 3),
                                                                ("step=2.ckpt", 2), ("step=1.ckpt", 1)]
    assert sorted(e.name for e in pointer.abandoned()) == ["step=3.ckpt", "step=4.ckpt"]
    gone = second.collect_garbage(root, abandoned=True)
    assert sorted(url.split("/")[-2] for url in gone if "/step=" in url) == ["step=3.ckpt", "step=4.ckpt"]
    assert find_latest_checkpoint(root).endswith(_pointer(root, {}).latest.commit)


def test_a_process_that_only_loads_never_fences_the_training_job(local_backend, make_io):
    """An evaluation script with Fabric loads the training root's latest and an older checkpoint, and saves nothing:
    it claims nothing, and the training job (Fabric too) keeps saving, as the root's only writer."""
    root = local_backend.root
    training = _fabric(make_io(local_backend))
    state = _state(training)
    _train(training, state, root, 2)
    epoch = _pointer(root, {}).writer_epoch

    evaluation = _fabric(make_io(local_backend))
    model = _state(evaluation, seed=1)
    evaluation.load(find_latest_checkpoint(root), model)
    evaluation.load(f"{root}/step=1.ckpt", {"model": model["model"]}, strict=False)
    evaluation.load(f"{root}/step=2.ckpt", weights_only=True)

    _train(training, state, root, 2)  # no StaleWriterError: nobody claimed the root meanwhile
    pointer = _pointer(root, {})
    assert pointer.writer_epoch == epoch and pointer.abandoned() == []
    assert [e.step for e in pointer.candidates()] == [4, 3, 2, 1]


def test_a_fabric_load_then_save_into_another_root_is_a_fork(local_backend, make_io):
    """Loading root A's latest and saving into root B: B's lineage starts as a fork of A's checkpoint, and A (whose
    job is still training) is not touched: its pointer keeps every byte, its job keeps saving."""
    a, b = local_backend.url("a"), local_backend.url("b")
    a_job = _fabric(make_io(local_backend))
    a_state = _state(a_job)
    _train(a_job, a_state, a, 2)
    before = open_root(a).store.read_versioned(POINTER_NAME)

    fork = _fabric(make_io(local_backend))
    state = _state(fork, seed=1)
    with _no_fresh_start_warning():
        fork.load(find_latest_checkpoint(a), state)
        _train(fork, state, b, 1)

    assert open_root(a).store.read_versioned(POINTER_NAME) == before
    step2 = _named(_pointer(a, {}), "step=2.ckpt")
    pointer_b = _pointer(b, {})
    assert pointer_b.origins[pointer_b.writer_epoch] == Origin(step2.commit, step2.writer_epoch, 2, root=a)
    assert [e.step for e in pointer_b.candidates()] == [3]
    _train(a_job, a_state, a, 1)  # A's job is not fenced
    assert _pointer(a, {}).latest.step == 3


def test_of_several_loads_a_roots_own_last_one_is_the_origin(local_backend, make_io, plugins):
    """Two loads of a root then a save: the last one is the origin. A load of another root in between (pretrained
    weights, a teacher) does not turn a resume of the root into a fork of the other one."""
    a, other = local_backend.url("a"), local_backend.url("other")
    first = make_io(local_backend)
    plugins.abandoned(first)
    fabric = _fabric(first)
    state = _state(fabric)
    _train(fabric, state, a, 3)
    _train(fabric, _state(fabric, seed=2), other, 1)

    second = make_io(local_backend)
    fabric = _fabric(second)
    state = _state(fabric, seed=1)
    fabric.load(f"{a}/step=1.ckpt", state)
    fabric.load(f"{a}/step=3.ckpt", state)  # the last load of A wins
    fabric.load(f"{other}/step=1.ckpt", {"model": _state(fabric, seed=3)["model"]}, strict=False)
    with _no_fresh_start_warning():
        _train(fabric, state, a, 1)
    pointer = _pointer(a, {})
    step3 = _named(pointer, "step=3.ckpt")
    assert pointer.origins[pointer.writer_epoch] == Origin(step3.commit, step3.writer_epoch, 3)
    assert pointer.abandoned() == [] and [e.step for e in pointer.candidates()] == [4, 3, 2, 1]


def test_a_trainer_fit_that_resumes_nothing_forgets_the_loads_made_outside_it(local_backend, make_io, plugins):
    """A load outside a Trainer is the origin of this plugin's later saves outside a fit only: a ``Trainer.fit`` of
    the same plugin that resumes nothing (``new_run=True``) starts a new run, as it would without that load."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..models import TinyModel, tiny_loader

    root = local_backend.root
    first = make_io(local_backend)
    plugins.abandoned(first)
    fabric = _fabric(first)
    _train(fabric, _state(fabric), root, 2)

    io = make_io(local_backend, new_run=True)
    fabric = _fabric(io)
    fabric.load(find_latest_checkpoint(root), _state(fabric, seed=1))
    trainer = Trainer(max_steps=2, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)])
    with pytest.warns(RuntimeWarning, match="started from scratch"):
        trainer.fit(TinyModel(), tiny_loader())
    pointer = _pointer(root, {})
    assert pointer.origins[pointer.writer_epoch] == Origin(None)


@pytest.mark.slow
def test_fabric_ddp_resumes_with_one_claim_per_job(local_backend):
    """Fabric under DDP (2 processes): ``fabric.load`` runs on every rank, ``fabric.save`` reaches the plugin on rank
    0 only. Job 2 resumes job 1's step 2 and saves steps 3 and 4: one claim per job (rank 0's, at its first save;
    rank 1 never claims), and job 2 continues job 1's lineage."""
    root = local_backend.root

    def job(steps: int) -> str:
        proc = procs.run([sys.executable, str(CHILD), root, str(steps)], capture_output=True, text=True, timeout=240,
                         start_new_session=True, env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    first = job(2)
    assert sorted(line for line in first.splitlines() if line.startswith("END")) == [
        "END rank=0 writer_epoch=1", "END rank=1 writer_epoch=None"]
    second = job(2)
    assert sorted(line for line in second.splitlines() if line.startswith(("LOADED", "END"))) == [
        "END rank=0 writer_epoch=2", "END rank=1 writer_epoch=None", "LOADED rank=0 step=2", "LOADED rank=1 step=2"]
    pointer = _pointer(root, {})
    step2 = _named(pointer, "step=2.ckpt")
    assert pointer.writer_epoch == 2 and step2.writer_epoch == 1
    assert pointer.origins[2] == Origin(step2.commit, 1, 2)
    assert pointer.abandoned() == [] and [e.step for e in pointer.candidates()] == [4, 3, 2, 1]
