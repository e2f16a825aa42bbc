"""What a ModelCheckpoint reports is never deleted by retention or gc (``io/reported.py``, issue #38 point 3).

``AtomicCheckpointIO(keep_last=N)`` beside a top-k ``ModelCheckpoint`` in one folder: between a new top-k save and
Lightning's removal of the checkpoint it displaces, the folder briefly holds one state more, and ``keep_last`` used to
retire the oldest one, which is the best when the metric peaked early: ``best_model_path`` then named a deleted
checkpoint. Now no name a ModelCheckpoint of the run reports is ever dropped (by ``keep_last``, ``gc --keep-last`` or
``gc --abandoned``): ``keep_last`` keeps its newest states as before, and the reported ones older than those besides.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_resilient
from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint, repair_pointer
from lightning_resilient.io.pointer import POINTER_NAME
from lightning_resilient.io.reported import kept_by, reported_in, reported_names

from ..cli.test_root_commands import run
from ..models import TinyModel, tiny_loader
from .helpers import make_checkpoint, read_pointer

# val_acc per epoch: the best (epoch 0) is the oldest checkpoint for the whole run, and the top two change.
ACCURACY = [0.9, 0.5, 0.4, 0.6, 0.3, 0.7, 0.2, 0.8, 0.1, 0.85]


class Graded(TinyModel):
    """TinyModel with a validation metric that follows ``ACCURACY`` by epoch."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_acc", ACCURACY[self.current_epoch])


class Checking(AtomicCheckpointIO):
    """After each save, every checkpoint a ModelCheckpoint of the fit reports loads (each commit loaded once)."""

    def __init__(self, backend: Any, **kwargs: Any) -> None:
        super().__init__(storage_options=backend.storage_options, retry_base_delay=0.01, **kwargs)
        self.backend = backend
        self.trainer: Trainer | None = None
        self.loaded: set[str] = set()
        self.saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saves += 1
        assert self.trainer is not None
        catalog = read_pointer(self.backend).checkpoints
        for reported_path in reported(self.trainer):
            name = os.path.basename(reported_path)
            assert name in catalog, f"{name}, which a ModelCheckpoint reports, was dropped at save {self.saves}"
            if catalog[name].commit not in self.loaded:
                loads(reported_path, self.storage_options)
                self.loaded.add(catalog[name].commit)


def reported(trainer: Trainer) -> set[str]:
    """Every path the ModelCheckpoints of ``trainer`` report now."""
    paths: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        assert isinstance(callback, ModelCheckpoint)
        paths.update([callback.best_model_path, callback.kth_best_model_path, callback.last_model_path,
                      *callback.best_k_models])
    return {p for p in paths if p}


def loads(path: str, options: dict[str, Any]) -> None:
    """``path`` loads, and holds the step its name says (or, for last.ckpt, a step)."""
    checkpoint = lightning_resilient.load_checkpoint(path, storage_options=options)
    name = os.path.basename(path)
    if "step=" in name:
        assert checkpoint["global_step"] == int(name.split("step=")[1].split(".")[0]), name


def unreported_states(pointer: Any, names: set[str]) -> set[tuple[int, int]]:
    """The training states the catalog holds that no reported name holds: keep_last bounds them."""
    held = {(e.writer_epoch, e.step) for n, e in pointer.checkpoints.items() if n in names}
    return {(e.writer_epoch, e.step) for e in pointer.checkpoints.values()} - held


def callbacks(root: str, every: bool, **top_k: Any) -> list[ModelCheckpoint]:
    """One top-k ModelCheckpoint (with last.ckpt) and, with ``every``, one that saves every epoch, both in ``root``."""
    return [ModelCheckpoint(dirpath=root, monitor="val_acc", mode="max", save_top_k=2, save_last=True,
                            filename="best-{epoch}-{step}", **top_k),
            *([ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, filename="every-{epoch}-{step}")]
              if every else [])]


def fit(io: Checking, root: str, epochs: int, ckpt_path: str | None = None, extra: list[Callback] | None = None,
        every: bool = True, **top_k: Any) -> Trainer:
    trainer = Trainer(max_epochs=epochs, plugins=[io], callbacks=[*callbacks(root, every, **top_k), *(extra or [])],
                      accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    io.trainer = trainer
    trainer.fit(Graded(), tiny_loader(16), tiny_loader(8), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(params=["local", "memory", "s3"])
def lbackend(request, monkeypatch):
    backend = request.getfixturevalue(f"{request.param}_backend")
    if backend.endpoint:
        # ModelCheckpoint lists its dirpath with its own fsspec client and no storage options.
        monkeypatch.setenv("AWS_ENDPOINT_URL", backend.endpoint)
    return backend


def retention_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "is smaller than what the ModelCheckpoint(s)" in str(w.message)]


def test_keep_last_and_gc_never_delete_what_a_model_checkpoint_reports(lbackend, plugins):
    root, options = lbackend.root, lbackend.storage_options
    io = plugins.track(Checking(lbackend, keep_last=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = fit(io, root, 6)
    # Once, at fit start: top-2 + last + the every-epoch callback's newest = 4 reported, keep_last 2.
    [warning] = retention_warnings(caught)
    assert "keep_last=2" in warning and "up to 2 + 4 checkpoints" in warning and "lower save_top_k" in warning
    # Every epoch, plus a top-k save and last.ckpt (saved with each top-k save) at epochs 0, 1, 3 and 5.
    assert io.saves == 6 + 4 * 2
    top_k = first.checkpoint_callbacks[0]
    assert isinstance(top_k, ModelCheckpoint)
    assert os.path.basename(top_k.best_model_path) == "best-epoch=0-step=2.ckpt"  # oldest of all, kept

    # The restart: a new job resumes the latest. Before its first save, a gc from another process (keep-last 1,
    # abandoned branches too) keeps what the resumed ModelCheckpoints report; so does every save after.
    names_before = {os.path.basename(p) for p in reported(first)}
    latest = read_pointer(lbackend).latest
    resumed = {(latest.writer_epoch, latest.step)}  # kept besides: what the new job resumed from

    class GcBeforeFirstSave(Callback):
        def on_train_start(self, trainer, pl_module):
            assert set(read_pointer(lbackend).reported) == names_before
            for dry in (["--dry-run"], []):
                assert run(lbackend, "gc", root, "--keep-last", "1", "--abandoned", *dry) == 0
            for path in reported(trainer):
                loads(path, options)

    io2 = plugins.track(Checking(lbackend, keep_last=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = fit(io2, root, 10, ckpt_path=find_latest_checkpoint(root, options), extra=[GcBeforeFirstSave()])
    assert len(retention_warnings(caught)) == 1
    assert io2.saves == 4 + 2 * 2  # top-k saves (and last.ckpt) at epochs 7 and 9

    pointer = read_pointer(lbackend)
    names = {os.path.basename(p) for p in reported(second)}
    assert set(pointer.reported) == names
    assert os.path.basename(second.checkpoint_callbacks[0].best_model_path) == "best-epoch=0-step=2.ckpt"
    assert len(unreported_states(pointer, names) - resumed) <= 2  # keep_last counts the rest
    for path in reported(second):
        loads(path, options)
        checkpoint = io2.load_checkpoint(path)  # and through the plugin
        assert checkpoint["global_step"] > 0

    # An operator's gc beside the finished run: dry run, then for real, then a lost pointer rebuilt and gc again.
    for dry in (["--dry-run"], []):
        assert run(lbackend, "gc", root, "--keep-last", "1", "--abandoned", *dry) == 0
    pointer = read_pointer(lbackend)
    assert len(unreported_states(pointer, names) - resumed) <= 1
    lbackend.fs().rm_file(lbackend.path(POINTER_NAME))
    repair_pointer(root, options)
    assert set(read_pointer(lbackend).reported) == names
    assert run(lbackend, "gc", root, "--keep-last", "1", "--abandoned") == 0
    for path in reported(second):
        loads(path, options)


def test_a_weights_only_top_k_is_kept_too(local_backend, plugins):
    """save_weights_only=True: the checkpoint carries no callback state; the plugin reads the Trainer's callbacks."""
    root = local_backend.root
    io = plugins.track(Checking(local_backend, keep_last=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = fit(io, root, 6, every=False, save_weights_only=True)
    pointer = read_pointer(local_backend)
    names = {os.path.basename(p) for p in reported(trainer)}
    assert "best-epoch=0-step=2.ckpt" in names and set(pointer.reported) == names
    assert len(unreported_states(pointer, names)) <= 1
    for path in reported(trainer):
        loads(path, {})


def test_keep_last_not_smaller_than_what_they_keep_says_nothing(local_backend, plugins):
    io = plugins.track(Checking(local_backend, keep_last=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(io, local_backend.root, 1)
    assert retention_warnings(caught) == []


def test_reported_names_come_from_every_model_checkpoint_state_of_that_folder(tmp_path):
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    os.makedirs(here)
    os.symlink(here, tmp_path / "link")
    states = {
        "ModelCheckpoint{'monitor': 'val_acc'}": {
            "best_model_path": f"{here}/a.ckpt", "kth_best_model_path": f"{here}/b.ckpt", "last_model_path": "",
            "best_k_models": {f"{here}/a.ckpt": 1.0, f"{here}/b.ckpt": 0.5}, "dirpath": here},
        # another callback in the same folder (named through a symlink), one in another folder
        "ModelCheckpoint{'every_n_epochs': 1}": {"best_model_path": f"{tmp_path}/link/c.ckpt", "best_k_models": {},
                                                 "last_model_path": f"{here}/last.ckpt"},
        "ModelCheckpoint{'other'}": {"best_model_path": f"{there}/d.ckpt", "best_k_models": {}},
        "SomethingElse": {"best_model_path": f"{here}/e.ckpt"},  # not a ModelCheckpoint's state
    }
    assert reported_in({"callbacks": states}, here) == ["a.ckpt", "b.ckpt", "c.ckpt", "last.ckpt"]
    assert reported_in({"callbacks": states}, there) == ["d.ckpt"]
    assert reported_in({"callbacks": states}, str(tmp_path / "elsewhere")) == []
    assert reported_in({"state_dict": {}}, here) is None  # a weights-only save says nothing
    assert reported_in({"callbacks": {"SomethingElse": {}}}, here) is None
    s3 = {"best_model_path": "s3://b/run/ckpt/a.ckpt", "best_k_models": {"s3://b/run/ckpt/a.ckpt": 1}}
    assert reported_names([s3], "s3://b/run/ckpt/") == ["a.ckpt"] and reported_names([s3], "s3://b/run") == []


def test_what_a_model_checkpoint_keeps():
    assert kept_by(ModelCheckpoint(monitor="val_acc", save_top_k=2, save_last=True)) == 3
    assert kept_by(ModelCheckpoint(monitor="val_acc", save_top_k=-1)) == math.inf
    assert kept_by(ModelCheckpoint(save_top_k=-1)) == 1  # best_model_path: its newest save; the rest unreported
    assert kept_by(ModelCheckpoint(save_top_k=0, save_last=True)) == 1


@pytest.fixture(params=["local", "memory"])
def pbackend(request):
    return request.getfixturevalue(f"{request.param}_backend")


def save_reporting(io: AtomicCheckpointIO, b: Any, name: str, step: int, best_k: list[str], last: str = "") -> None:
    """Save ``name`` at ``step`` as a monitoring ModelCheckpoint would: its state reports ``best_k`` (best last)
    and ``last``."""
    checkpoint = make_checkpoint(step)
    checkpoint["callbacks"] = {"ModelCheckpoint{'monitor': 'val_acc'}": {
        "best_model_path": b.url(best_k[-1]), "kth_best_model_path": b.url(best_k[0]),
        "best_k_models": {b.url(n): float(i) for i, n in enumerate(best_k)},
        "last_model_path": b.url(last) if last else "", "dirpath": b.root}}
    io.save_checkpoint(checkpoint, b.url(name))


def test_keep_last_keeps_its_newest_states_and_older_reported_ones_besides(pbackend, make_io):
    b = pbackend
    io = make_io(b, keep_last=2)
    for step in range(1, 6):  # what the newest save reports takes its place among the newest, as before
        save_reporting(io, b, f"s{step}.ckpt", step, [f"s{step}.ckpt"])
    assert sorted(read_pointer(b).checkpoints) == ["s4.ckpt", "s5.ckpt"]
    for step in range(6, 10):  # the best stays s6: kept besides the two newest
        save_reporting(io, b, f"s{step}.ckpt", step, [f"s{step}.ckpt", "s6.ckpt"])
    assert sorted(read_pointer(b).checkpoints) == ["s6.ckpt", "s8.ckpt", "s9.ckpt"]


def test_a_claim_takes_what_its_resumed_save_reported_and_gc_abandoned_keeps_it(pbackend, make_io):
    """A rollback's ModelCheckpoints report what they reported at the save it resumed, which the claim records at
    once (a gc before the job's first save sees it); a name of the abandoned branch among them survives ``gc
    --abandoned``. A fresh start reports nothing of the old run."""
    b = pbackend
    io = make_io(b, keep_last=1)

    def save(name: str, step: int, best_k: list[str], last: str) -> None:
        save_reporting(io, b, name, step, best_k, last)

    save("s1.ckpt", 1, ["s1.ckpt"], "")
    save("last.ckpt", 1, ["s1.ckpt"], "last.ckpt")
    save("s2.ckpt", 2, ["s1.ckpt", "s2.ckpt"], "last.ckpt")  # reports last.ckpt: the step-1 one, then
    save("last.ckpt", 2, ["s1.ckpt", "s2.ckpt"], "last.ckpt")
    save("s3.ckpt", 3, ["s2.ckpt", "s3.ckpt"], "last.ckpt")
    io.remove_checkpoint(b.url("s1.ckpt"))  # as Lightning removes what left the top k
    save("last.ckpt", 3, ["s2.ckpt", "s3.ckpt"], "last.ckpt")
    pointer = read_pointer(b)
    assert pointer.reported == ["last.ckpt", "s2.ckpt", "s3.ckpt"]
    assert sorted(pointer.checkpoints) == ["last.ckpt", "s2.ckpt", "s3.ckpt"]

    # A rollback to step 2: what its save reported (s1 is gone since; last.ckpt now names step 3's, abandoned).
    make_io(b).root(b.root).claim(resumed_from=pointer.checkpoints["s2.ckpt"])
    assert read_pointer(b).reported == ["last.ckpt", "s1.ckpt", "s2.ckpt"]
    assert run(b, "gc", b.root, "--abandoned") == 0
    pointer = read_pointer(b)
    assert "s3.ckpt" not in pointer.checkpoints  # the abandoned branch goes, but for what the rollback reports
    assert pointer.checkpoints["last.ckpt"].step == 3
    assert lightning_resilient.load_checkpoint(b.url("last.ckpt"), storage_options=b.storage_options)[
        "global_step"] == 3

    with pytest.warns(RuntimeWarning, match="started from scratch"):  # a new run in the folder
        make_io(b, new_run=True).root(b.root).claim()
    assert read_pointer(b).reported == []  # its ModelCheckpoints start empty


def test_with_a_local_tier_both_tiers_keep_what_is_reported_and_the_end_of_the_fit_persists_it(local_backend, make_io,
                                                                                                 tmp_path):
    """The local tier's commits carry what the durable folder's ModelCheckpoints report. With persist_every=2 the best
    checkpoint (an early one) may never be persisted by the saves: the local tier keeps it beyond local_keep (its
    only copy), and the end of the fit persists it, so every path the callback reports loads from the durable root
    alone. The local tier otherwise stays bounded by local_keep."""
    io = make_io(local_backend, keep_last=1, local_tier=str(tmp_path / "tier"), local_keep=1, persist_every=2)
    trainer = Trainer(max_epochs=6, plugins=[io], callbacks=callbacks(local_backend.root, every=False),
                      accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Graded(), tiny_loader(16), tiny_loader(8))
    names = {os.path.basename(p) for p in reported(trainer)}
    assert "best-epoch=0-step=2.ckpt" in names
    pointer = read_pointer(local_backend)
    assert set(pointer.reported) == names and names <= set(pointer.checkpoints)
    for path in reported(trainer):
        loads(path, {})  # from the durable root, without the local tier
    from lightning_resilient.io.local_tier import local_tier_url

    local = io.root(local_tier_url(io.local_tier, io.root(local_backend.root).url)).read_pointer()[0]
    assert local is not None and names <= set(local.checkpoints)
    reported_states = {(e.writer_epoch, e.step) for n, e in local.checkpoints.items() if n in names}
    others = {(e.writer_epoch, e.step) for e in local.checkpoints.values()} - reported_states
    assert len(others) <= 1  # local_keep
