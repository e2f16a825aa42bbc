"""What the fit-start check says about a checkpoint folder that holds files: one line of ours naming the commit a
resume continues, in place of Lightning's "Checkpoint directory ... exists and is not empty"; Lightning's warning for
a folder the fit does not resume. Which Trainers get the check at all: ``tests/test_lightning_compat.py``."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.io import paths

from ..conftest import Backend
from ..models import TinyModel, tiny_loader

NOT_EMPTY = "exists and is not empty"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    if backend.endpoint is not None:
        # ModelCheckpoint lists its dirpath with its own client
        monkeypatch.setenv("AWS_ENDPOINT_URL", backend.endpoint)
    return backend


def fit(store: Backend, make_io: Callable[..., AtomicCheckpointIO], steps: int,
        ckpt_path: str | None = None) -> tuple[Trainer, list[warnings.WarningMessage]]:
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[make_io(store)],
                      callbacks=[ModelCheckpoint(dirpath=store.root, every_n_train_steps=2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(), tiny_loader(), ckpt_path=ckpt_path)
    return trainer, caught


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("AtomicCheckpointIO: resuming")]


def test_a_resume_says_once_which_commit_it_continues_instead_of_lightnings_not_empty_warning(store, make_io, caplog):
    fit(store, make_io, 2)
    latest = find_latest_checkpoint(store.root, store.storage_options)
    assert latest is not None
    caplog.set_level("INFO")
    trainer, caught = fit(store, make_io, 4, ckpt_path=latest)
    assert trainer.global_step == 4
    assert not [w for w in caught if NOT_EMPTY in str(w.message)]  # Lightning said it on every resume
    commit = paths.basename(latest)
    assert said(caplog) == [(f"AtomicCheckpointIO: resuming the run in {store.root} from its checkpoint"
                             f" epoch=0-step=2.ckpt (commit {commit})")]
    (saver,) = trainer.checkpoint_callbacks
    assert "setup" not in vars(saver)  # the callback is as it was: its own setup, picklable
    pickle.loads(pickle.dumps(saver))


def test_a_fit_that_resumes_nothing_in_a_folder_that_holds_files_keeps_lightnings_warning(store, make_io, caplog):
    # Not a run of ours (the fit-start check refuses a fit that would abandon one): files the user left there.
    fs = store.fs()
    fs.makedirs(store.path(), exist_ok=True)
    fs.pipe(store.path("notes.txt"), b"not a checkpoint")
    caplog.set_level("INFO")
    trainer, caught = fit(store, make_io, 2)
    assert trainer.global_step == 2
    kept = [w for w in caught if NOT_EMPTY in str(w.message)]
    assert len(kept) == 1 and str(kept[0].message).startswith("Checkpoint directory ")
    assert kept[0].filename.endswith("model_checkpoint.py")  # shown as Lightning raised it
    assert said(caplog) == []


def test_a_resume_from_another_folder_keeps_lightnings_warning_for_the_folder_it_writes(tmp_path, make_io, caplog):
    # A fork: the fit resumes a checkpoint of one folder and writes another, which already holds files.
    source = Backend("local", str(tmp_path / "source"))
    fit(source, make_io, 2)
    target = Backend("local", str(tmp_path / "target"))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "notes.txt").write_text("not a checkpoint")
    caplog.set_level("INFO")
    _, caught = fit(target, make_io, 4, ckpt_path=find_latest_checkpoint(source.root))
    assert len([w for w in caught if NOT_EMPTY in str(w.message)]) == 1
    assert said(caplog) == []


class Failing(ModelCheckpoint):
    def setup(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a setup that fails")


def test_a_fit_that_fails_before_modelcheckpoint_setup_leaves_the_callback_as_it_was(tmp_path, make_io):
    first = ModelCheckpoint(dirpath=str(tmp_path / "a"))  # held before the failing one runs
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[make_io(Backend("local", str(tmp_path)))],
                      callbacks=[Failing(dirpath=str(tmp_path / "b")), first])
    with pytest.raises(RuntimeError, match="a setup that fails"):
        trainer.fit(TinyModel(), tiny_loader())
    assert not [c for c in trainer.checkpoint_callbacks if "setup" in vars(c)]
    pickle.loads(pickle.dumps(trainer.checkpoint_callbacks))


def test_a_save_cut_off_before_its_manifest_is_no_checkpoint_of_its_name_for_lightnings_version_counter(store,
                                                                                                        make_io):
    """ModelCheckpoint asks at every save whether its name exists (its "-v1" counter). A save cut off before its
    manifest (killed, or in a store outage) left objects under the name: Lightning's own client counts them as a file,
    and the next run's save of that step was named "epoch=0-step=2-v1.ckpt". The plugin answers from its catalog."""
    trainer, _ = fit(store, make_io, 2)
    fs = store.fs()
    leftover = store.path("epoch=0-step=4.ckpt/c1796526551869-e1-a9ebdd84/shard-00000.bin")
    fs.makedirs(paths.dirname(leftover), exist_ok=True)
    fs.pipe_file(leftover, b"half an upload")  # (no manifest: never committed)
    fs.invalidate_cache()
    resumed, _ = fit(store, make_io, 4, ckpt_path=find_latest_checkpoint(store.root, store.storage_options))
    names = {paths.basename(p) for p in resumed.checkpoint_callback.best_k_models} | {
        paths.basename(resumed.checkpoint_callback.best_model_path)}
    assert "epoch=0-step=4.ckpt" in names and not any("-v1" in n for n in names), names
    assert "file_exists" not in vars(trainer.checkpoint_callback)  # (the callback is itself again after the fit)


class _Asking:
    """What ``_CatalogExists`` needs of a plugin and a one-process Trainer: ``knows_checkpoint`` raising ``error``."""

    is_global_zero = True

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.strategy = self

    def knows_checkpoint(self, filepath: Any) -> bool:
        raise self.error

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # (Lightning's signature)
        return decision


def test_a_catalog_that_cannot_be_read_answers_not_there_and_a_bug_still_propagates(caplog):
    from lightning_resilient.errors import CheckpointCorruptedError
    from lightning_resilient.io.fit_check import _CatalogExists

    for error in (CheckpointCorruptedError("pointer x is not valid JSON"), ConnectionError("store down")):
        asking = _Asking(error)
        assert _CatalogExists(asking)("s3://b/run/step=2.ckpt", asking) is False  # the save that follows says why
    assert "could not tell whether s3://b/run/step=2.ckpt is a committed checkpoint (store down)" in caplog.text
    asking = _Asking(KeyError("a bug"))
    with pytest.raises(KeyError):
        _CatalogExists(asking)("s3://b/run/step=2.ckpt", asking)
