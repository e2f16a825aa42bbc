"""AtomicCheckpointIO inside a real Trainer: the calls Lightning makes, top-k, save_last, resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient import AtomicCheckpointIO, StaleWriterError, find_latest_checkpoint

from ..models import TinyModel, tiny_loader
from .helpers import read_pointer


class CountingIO(AtomicCheckpointIO):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: dict[str, list[Any]] = {"save": [], "load": [], "remove": [], "teardown": []}

    def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
        self.calls["save"].append(str(path))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location=None, weights_only=None):  # type: ignore[no-untyped-def]
        self.calls["load"].append(str(path))
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path):  # type: ignore[no-untyped-def]
        self.calls["remove"].append(str(path))
        super().remove_checkpoint(path)

    def teardown(self):  # type: ignore[no-untyped-def]
        self.calls["teardown"].append(True)
        super().teardown()


def trainer(io: AtomicCheckpointIO, root: str, max_steps: int, **ckpt: Any) -> Trainer:
    ckpt.setdefault("every_n_train_steps", 2)
    return Trainer(
        max_steps=max_steps, plugins=[io], callbacks=[ModelCheckpoint(dirpath=root, **ckpt)],
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
    )


@pytest.fixture(params=["local", "memory", "s3"])
def lbackend(request, monkeypatch):
    backend = request.getfixturevalue(f"{request.param}_backend")
    if backend.endpoint:
        # ModelCheckpoint lists its dirpath with its own fsspec client and no storage options, so the
        # endpoint must reach it through the environment, as it would for a user of stock Lightning.
        monkeypatch.setenv("AWS_ENDPOINT_URL", backend.endpoint)
    return backend


def test_trainer_saves_rotates_and_resumes(lbackend):
    root = lbackend.root
    io = CountingIO(storage_options=lbackend.storage_options)
    t = trainer(io, root, 6, save_top_k=2, monitor="step", mode="max", save_last=True)
    t.fit(TinyModel(), tiny_loader())
    # Saves at steps 2, 4, 6: a top-k save plus last.ckpt each time; top-k rotated out step 2.
    assert len(io.calls["save"]) == 6
    assert [p.rsplit("/", 1)[-1] for p in io.calls["remove"]] == ["epoch=0-step=2.ckpt"]
    assert io.calls["teardown"]
    pointer = read_pointer(lbackend)
    assert sorted(pointer.checkpoints) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert pointer.latest.name == "last.ckpt" and pointer.latest.step == 6
    # save_last uploaded no tensor bytes of its own: it shares the top-k save's shards.
    last = pointer.checkpoints["last.ckpt"]
    assert pointer.checkpoints["epoch=0-step=6.ckpt"].commit in last.folders

    latest = find_latest_checkpoint(root, lbackend.storage_options)
    io2 = CountingIO(storage_options=lbackend.storage_options)
    model = TinyModel()
    t2 = trainer(io2, root, 10, save_top_k=2, monitor="step", mode="max", save_last=True)
    t2.fit(model, tiny_loader(), ckpt_path=latest)
    assert io2.calls["load"] == [latest]
    assert t2.global_step == 10 and len(model.losses) == 4  # steps 7..10 only: it resumed at step 6
    after = read_pointer(lbackend)
    assert after.latest.step == 10 and after.writer_epoch == 2
    # The checkpoint this run resumed from survived top-k rotation and last.ckpt replacement.
    assert latest.split(root.rstrip("/") + "/", 1)[1] in after.protected
    reader = AtomicCheckpointIO(storage_options=lbackend.storage_options, claim_on_load=False)
    assert reader.load_checkpoint(latest)["global_step"] == 6


def test_trainer_save_checkpoint_storage_options_are_checked(memory_backend):
    io = AtomicCheckpointIO()
    t = trainer(io, memory_backend.root, 2)
    t.fit(TinyModel(), tiny_loader())
    with pytest.raises(TypeError, match=r"storage_options=...\) must be a dict"):
        t.save_checkpoint(memory_backend.url("manual.ckpt"), storage_options="nope")
    t.save_checkpoint(memory_backend.url("manual.ckpt"), storage_options={})
    assert "manual.ckpt" in read_pointer(memory_backend).checkpoints


def test_weights_only_load_of_a_trainer_checkpoint(local_backend):
    io = AtomicCheckpointIO()
    trainer(io, local_backend.root, 2).fit(TinyModel(width=4), tiny_loader())
    loaded = AtomicCheckpointIO(claim_on_load=False).load_checkpoint(local_backend.root, weights_only=True)
    assert loaded["global_step"] == 2 and loaded["hyper_parameters"]["width"] == 4


def test_stock_lightning_checkpoint_file_still_loads(local_backend, tmp_path):
    """Migrating from TorchCheckpointIO: an existing .ckpt file resumes through the plugin."""
    stock = trainer_stock = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                                    enable_model_summary=False, default_root_dir=tmp_path,
                                    callbacks=[ModelCheckpoint(dirpath=tmp_path / "stock")])
    stock.fit(TinyModel(), tiny_loader())
    path = str(tmp_path / "stock" / "epoch=0-step=2.ckpt")
    io = AtomicCheckpointIO()
    t = trainer(io, local_backend.root, 4)
    model = TinyModel()
    t.fit(model, tiny_loader(), ckpt_path=path)
    assert len(model.losses) == 2 and trainer_stock.global_step == 2
    assert read_pointer(local_backend).latest.step == 4


def test_resume_restores_weights_exactly(memory_backend):
    io = AtomicCheckpointIO()
    model = TinyModel()
    trainer(io, memory_backend.root, 4).fit(model, tiny_loader())
    restored = AtomicCheckpointIO(claim_on_load=False).load_checkpoint(memory_backend.root)
    for k, v in model.state_dict().items():
        assert torch.equal(restored["state_dict"][k], v)


class EvaluatedModel(TinyModel):
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_loading_to_evaluate_never_fences_the_job_training_into_the_root(lbackend):
    """``trainer.test(ckpt_path=...)``, a notebook's load, ``find_latest_checkpoint``: reads only. The job that
    trains into the root keeps saving; only a process that saves (or opts in with claim_on_load) claims it."""
    root = lbackend.root
    job = AtomicCheckpointIO(storage_options=lbackend.storage_options)
    training = trainer(job, root, 2)
    training.fit(TinyModel(), tiny_loader())
    epoch = read_pointer(lbackend).writer_epoch
    evaluation = trainer(AtomicCheckpointIO(storage_options=lbackend.storage_options), root, 2)
    evaluation.test(EvaluatedModel(), tiny_loader(), ckpt_path=find_latest_checkpoint(root, lbackend.storage_options),
                    verbose=False)
    AtomicCheckpointIO(storage_options=lbackend.storage_options).load_checkpoint(root)
    training.save_checkpoint(f"{root.rstrip('/')}/after-evaluation.ckpt")  # the job is not fenced
    pointer = read_pointer(lbackend)
    assert pointer.writer_epoch == epoch and pointer.latest.name == "after-evaluation.ckpt"
    # Opting in: a process that will train claims at once when it loads, and the old job is stopped.
    AtomicCheckpointIO(storage_options=lbackend.storage_options, claim_on_load=True).load_checkpoint(root)
    with pytest.raises(StaleWriterError):
        training.save_checkpoint(f"{root.rstrip('/')}/stale.ckpt")


class MyCheckpoint(ModelCheckpoint):
    """A user's subclass: Lightning keys its state by this name."""


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("callback", [ModelCheckpoint, MyCheckpoint])
def test_a_filename_with_folders_is_refused_when_fit_starts(local_backend, callback, weights_only):
    """Also for weights-only checkpoints, which carry no callback state to read the dirpath from."""
    steps: list[int] = []

    class Steps(Callback):
        def on_train_batch_start(self, trainer, *args):
            steps.append(trainer.global_step)

    t = Trainer(max_steps=2, plugins=[AtomicCheckpointIO()], accelerator="cpu", logger=False,
                enable_progress_bar=False, enable_model_summary=False,
                callbacks=[Steps(), callback(dirpath=local_backend.root, filename="{epoch}/{step}",
                                             every_n_train_steps=2, save_weights_only=weights_only)])
    with pytest.raises(ValueError, match=r"filename='\{epoch\}/\{step\}'\) would save .* filename without '/'"):
        t.fit(TinyModel(), tiny_loader())
    assert steps == []  # refused before the first step
    assert not any(local_backend.fs().find(local_backend.path()))  # nothing was written


def test_a_save_into_a_sub_folder_of_a_fit_root_is_refused_without_callback_state(local_backend, plugins):
    """A weights-only save (no callback state) by hand, into a sub-folder of the fit's ModelCheckpoint dirpath."""
    io = plugins.track(AtomicCheckpointIO())
    t = trainer(io, local_backend.root, 2)
    t.fit(TinyModel(), tiny_loader())
    with pytest.raises(ValueError, match="sub-folder of the ModelCheckpoint dirpath"):
        t.save_checkpoint(f"{local_backend.root}/nested/x.ckpt", weights_only=True)
    assert not local_backend.fs().exists(local_backend.path("nested"))


def test_a_resuming_fit_fences_the_job_it_replaces_as_soon_as_it_loads(local_backend):
    """So that the old job, if still running, cannot retire the checkpoint the new one resumed from."""
    root = local_backend.root
    old_io = AtomicCheckpointIO(keep_last=1)
    old = trainer(old_io, root, 2)
    old.fit(TinyModel(), tiny_loader())
    seen: list[str] = []

    class TryTheOldJob(Callback):
        def on_train_start(self, trainer, pl_module):  # after the resume's load, before any save of the new job
            try:
                old.save_checkpoint(f"{root}/old-again.ckpt")
            except StaleWriterError:
                seen.append("fenced")

    new = Trainer(max_steps=4, plugins=[AtomicCheckpointIO()], callbacks=[TryTheOldJob(), ModelCheckpoint(
        dirpath=root, every_n_train_steps=2)], accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False)
    latest = find_latest_checkpoint(root)
    new.fit(TinyModel(), tiny_loader(), ckpt_path=latest)
    pointer = read_pointer(local_backend)
    assert seen == ["fenced"] and pointer.origins[pointer.writer_epoch].commit == latest.split(root + "/", 1)[1]
