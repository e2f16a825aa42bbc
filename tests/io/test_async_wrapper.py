"""AtomicCheckpointIO behind Lightning's ``AsyncCheckpointIO``: saves on the wrapper's worker thread, removals on the
Trainer's, ordered; one claim per job; the plugin's teardown (which the wrapper never calls) and its errors."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_resilient import AtomicCheckpointIO, StaleWriterError, load_checkpoint
from lightning_resilient.io.pointer import POINTER_NAME, Pointer

from ..models import TinyModel, tiny_loader
from .helpers import make_checkpoint, read_pointer

WAIT = 60.0  # seconds a held save or the Trainer's thread may take to reach its next point (a hang fails the test)


class ScoredModel(TinyModel):
    """Logs a ``score`` whose top 2 (mode max) make every odd step from 3 on replace the checkpoint of the step just
    before it: 3, 2, 5, 4, 7, 6, ... for steps 1, 2, 3, 4, 5, 6, ..."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step + 1  # the step this batch completes
        self.log("score", float(step + 2 if step % 2 else step))
        return super().training_step(batch, batch_idx)


class HeldIO(AtomicCheckpointIO):
    """Holds the save of step k, on the wrapper's worker thread and before the plugin does anything with it, until the
    Trainer's thread has handed the wrapper every save and removal of step k + 1 (:class:`Pace`). Each removal that
    ModelCheckpoint asks for so comes while the save it follows has not even started: the interleaving a 1-in-5 race
    produced, every time."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cond = threading.Condition()
        self.open_to = 0  # saves of steps up to this one may run
        self.handed: Counter[int] = Counter()  # saves the Trainer's thread handed the wrapper, per step
        self.done: Counter[int] = Counter()  # saves that returned on the worker, per step

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        step = int(checkpoint["global_step"])
        with self.cond:
            if not self.cond.wait_for(lambda: step <= self.open_to, timeout=WAIT):
                raise TimeoutError(f"the save of step {step} was never let through")
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
        finally:
            with self.cond:
                self.done[step] += 1
                self.cond.notify_all()

    def let_through(self, step: int, *, wait: bool = True) -> None:
        """Let the saves of steps up to ``step`` run; with ``wait``, until those of ``step`` returned."""
        with self.cond:
            self.open_to = max(self.open_to, step)
            self.cond.notify_all()
            if wait and not self.cond.wait_for(lambda: self.done[step] >= self.handed[step], timeout=WAIT):
                raise TimeoutError(f"the saves of step {step} did not return")


class RecordingAsync(AsyncCheckpointIO):
    """Lightning's wrapper, recording on the Trainer's thread the order it is handed saves and removals in."""

    def __init__(self, io: HeldIO) -> None:
        super().__init__(io)
        self.io = io
        self.handed: list[tuple[str, str]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        with self.io.cond:
            self.io.handed[int(checkpoint["global_step"])] += 1
        self.handed.append(("save", os.path.basename(str(path))))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.handed.append(("remove", os.path.basename(str(path))))
        super().remove_checkpoint(path)


class Pace(Callback):
    """Lets the worker's saves of step k run once the Trainer's thread has finished step k + 1's checkpointing."""

    def __init__(self, io: HeldIO) -> None:
        self.io = io

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step >= 1:
            self.io.let_through(trainer.global_step - 1)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.io.let_through(trainer.global_step + 1, wait=False)  # the rest: the wrapper's teardown waits for them

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self.io.let_through(trainer.global_step + 1, wait=False)


def pointer_writes(io: AtomicCheckpointIO, root: str) -> list[set[str]]:
    """The names each pointer write of ``io`` to ``root`` cataloged, in order (observed at the store)."""
    store = io.root(root).store
    writes: list[set[str]] = []
    write_versioned = store.write_versioned

    def observed(rel: str, data: bytes, expected: str | None) -> str | None:
        done: str | None = write_versioned(rel, data, expected)
        if done is not None and rel == POINTER_NAME:
            writes.append(set(Pointer.from_bytes(data, where="test").checkpoints))
        return done

    store.write_versioned = observed  # type: ignore[method-assign]
    return writes


def wrapped_trainer(wrapper: AsyncCheckpointIO, root: str, *callbacks: Callback, **fit: Any) -> Trainer:
    return Trainer(max_epochs=3, plugins=[wrapper], accelerator="cpu", logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[*callbacks, ModelCheckpoint(
                       dirpath=root, monitor="score", mode="max", save_top_k=2, every_n_train_steps=1,
                       save_last=True)], **fit)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync-plugin", "async-plugin"])
def test_removals_run_after_the_saves_they_follow_behind_lightnings_async_wrapper(local_backend, plugins,
                                                                                   async_save):
    root = local_backend.root
    io = plugins.track(HeldIO(async_save=async_save))
    writes = pointer_writes(io, root)
    wrapper = RecordingAsync(io)
    t = wrapped_trainer(wrapper, root, Pace(io))
    t.fit(ScoredModel(), tiny_loader())  # 3 epochs of 8 steps, a top-k save and last.ckpt at each step

    checkpoint = t.checkpoint_callback
    assert isinstance(checkpoint, ModelCheckpoint)
    pointer = read_pointer(local_backend)
    assert pointer.writer_epoch == 1  # one claim, by whichever of the first save and removal came first
    kept = {os.path.basename(p) for p in checkpoint.best_k_models}
    assert len(kept) == 2 and os.path.basename(checkpoint.best_model_path) in kept
    assert set(pointer.checkpoints) == kept | {"last.ckpt"}  # nothing ModelCheckpoint removed is still there
    assert os.path.basename(checkpoint.last_model_path) == "last.ckpt" and pointer.latest.step == t.global_step == 24
    for path in [*checkpoint.best_k_models, checkpoint.best_model_path, checkpoint.last_model_path]:
        name = os.path.basename(path)
        step = t.global_step if name == "last.ckpt" else int(name.split("step=")[1].split(".")[0])
        assert load_checkpoint(path)["global_step"] == step  # each loads, verified

    # Every removal went after the save handed to the wrapper just before it had committed: a removal run before that
    # save found the name uncommitted, did nothing, and the save then committed a checkpoint top-k had dropped.
    removals = [(kind, name) for kind, name in wrapper.handed if kind == "remove"]
    assert len(removals) == 22  # steps 3 to 24 each replace one
    for i, (kind, name) in enumerate(wrapper.handed):
        if kind != "remove":
            continue
        follows = next(n for k, n in reversed(wrapper.handed[:i]) if k == "save")
        committed = next(w for w, names in enumerate(writes) if follows in names)
        added = next(w for w, names in enumerate(writes) if name in names)
        removed = next((w for w, names in enumerate(writes) if w > added and name not in names), None)
        assert removed is not None, f"{name} was never removed"
        assert committed < removed, f"{name} was removed before {follows}, the save it follows, committed"


class FailingStore(Callback):
    """Makes the plugin's store refuse the data of every save of ``step``."""

    def __init__(self, io: AtomicCheckpointIO, root: str, step: int) -> None:
        self.store = io.root(root).store
        write_pieces = self.store.write_pieces

        def refused(rel: str, pieces: Any) -> None:
            if f"step={step}" in rel.split("/", 1)[0]:
                raise PermissionError(f"refused by the test: {rel}")
            write_pieces(rel, pieces)

        self.store.write_pieces = refused  # type: ignore[method-assign]


def test_the_plugins_teardown_runs_behind_the_wrapper_and_its_error_surfaces(local_backend, plugins):
    """Lightning's AsyncCheckpointIO.teardown never calls the teardown of the plugin it wraps: with the plugin's own
    ``async_save``, its last background commit was never waited for (its error lost, its thread left running), and
    what the fit retired never deleted. The fit-start check's teardown calls it."""
    root = local_backend.root
    io = plugins.track(AtomicCheckpointIO(async_save=True))
    FailingStore(io, root, step=6)
    t = Trainer(max_steps=6, plugins=[AsyncCheckpointIO(io)], accelerator="cpu", logger=False,
                enable_progress_bar=False, enable_model_summary=False,
                callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=1, monitor="step",
                                           mode="max")])
    plugins.asserted(io, PermissionError)
    with pytest.raises(PermissionError, match="refused by the test"):
        t.fit(TinyModel(), tiny_loader())  # the last save's commit fails in the plugin's background thread
    assert not [th.name for th in threading.enumerate() if th.name.startswith("lightning_resilient")]
    pointer = read_pointer(local_backend)
    assert pointer.latest.step == 4 and set(pointer.checkpoints) == {"epoch=0-step=4.ckpt"}


def test_the_plugins_teardown_behind_the_wrapper_deletes_what_the_fit_retired(local_backend, plugins):
    root = local_backend.root
    io = plugins.track(AtomicCheckpointIO(async_save=True))
    t = Trainer(max_steps=6, plugins=[AsyncCheckpointIO(io)], accelerator="cpu", logger=False,
                enable_progress_bar=False, enable_model_summary=False,
                callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=1, monitor="step",
                                           mode="max")])
    t.fit(TinyModel(), tiny_loader())
    assert not [th.name for th in threading.enumerate() if th.name.startswith("lightning_resilient")]
    pointer = read_pointer(local_backend)
    assert set(pointer.checkpoints) == {"epoch=0-step=6.ckpt"} and not pointer.retired
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["epoch=0-step=6.ckpt"]


def test_a_removal_that_fails_on_the_wrappers_worker_is_raised_by_the_plugins_teardown(local_backend, plugins):
    """The removal runs on the wrapper's worker, where nothing reads its future: its error is kept and raised by the
    plugin (here: fenced off by a newer job before the removal ran)."""
    root = local_backend.root
    io = plugins.track(AtomicCheckpointIO())
    wrapper = AsyncCheckpointIO(io)
    io.wrapped_by(wrapper)
    wrapper.save_checkpoint(make_checkpoint(1), f"{root}/a.ckpt")
    io.wait()  # (drains the wrapper's queue)
    AtomicCheckpointIO().root(root).claim(resumed_from=read_pointer(local_backend).latest)  # a newer job resumes
    wrapper.remove_checkpoint(f"{root}/a.ckpt")  # queued on the worker, returns at once
    with pytest.raises(StaleWriterError):
        io.teardown()  # waits for the queue, raises the removal's error
    wrapper.teardown()
    assert "a.ckpt" in read_pointer(local_backend).checkpoints


class FrozenBaseModel(TinyModel):
    """TinyModel behind a frozen 1 MiB base (a LoRA-like fine-tune): only the small head trains."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(512, 512)
        self.base.requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=0.1)


class Snapshots(Callback):
    """The module's state at every step end, before ModelCheckpoint (which runs after the other callbacks) saves."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self.states[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_dedup_behind_lightnings_async_wrapper_references_the_frozen_base_and_every_commit_loads(local_backend,
                                                                                                 plugins):
    """The wrapper clones every tensor before its worker saves (identities are lost at each save), so unchanged
    objects are found by digest: after the first save each commit stores about the trained head only, and every kept
    commit loads, alone, exactly the state of its step."""
    root = local_backend.root
    io = plugins.track(AtomicCheckpointIO(dedup=True))
    snapshots = Snapshots()
    trainer = Trainer(max_steps=6, plugins=[AsyncCheckpointIO(io)], accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[snapshots, ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1,
                                                            filename="{step}")])
    trainer.fit(FrozenBaseModel(), tiny_loader())
    pointer = read_pointer(local_backend)
    base_bytes = 512 * 513 * 4
    for step in range(1, 7):
        entry = pointer.checkpoints[f"step={step}.ckpt"]
        loaded = load_checkpoint(local_backend.url(f"step={step}.ckpt"))["state_dict"]
        assert loaded.keys() == snapshots.states[step].keys()
        for key, value in snapshots.states[step].items():
            assert torch.equal(loaded[key], value), (step, key)
        manifest = io.root(root).read_manifest(entry.commit)
        stored = sum(o.size for o in manifest.objects if o.path.rsplit("/", 1)[0] == entry.commit)
        if step == 1:
            assert stored >= base_bytes
        elif step >= 3:  # (the second save rewrites the small frozen bias once, in a pack of its own)
            assert stored < base_bytes / 8, (step, stored)
