"""Check, when ``fit`` starts, that every checkpoint folder the Trainer will write through ``AtomicCheckpointIO``
can hold checkpoints: a URL no store reads as meant, a missing bucket, credentials that cannot see it or a folder this
process may not write stop the run before its first step, not at its first save a training interval later. So does a
fit that loads no checkpoint into a folder that holds a committed run (``AtomicCheckpointIO.check_new_run``). It also
tells the plugin that a fit starts (a fit that resumed nothing is a new job: see ``AtomicCheckpointIO.begin_fit``).

A ``CheckpointIO`` gets no call from Lightning before it saves (and the folder is a ``ModelCheckpoint`` setting the
plugin never sees), so the check is a callback. Lightning adds callbacks that packages register under the entry
point groups ``lightning.pytorch.callbacks_factory`` and ``pytorch_lightning.callbacks_factory`` to every Trainer it
builds (see ``pyproject.toml``); this one does nothing unless the Trainer's checkpoint plugin is ours, and it keeps
no state, so checkpoints carry nothing of it. ``ResumeStateCallback`` adds one to a Trainer that lacks it (the
package run from a source tree without installed entry points).

The check runs in ``on_fit_start``: after every ``setup`` (``ModelCheckpoint.setup`` resolves a ``dirpath`` left
``None`` to ``<default_root_dir>/.../checkpoints``), before the sanity check and the first step. Every rank checks:
one that raised alone would leave the others waiting for it at the next collective. A ``default_root_dir`` that a
ModelCheckpoint without a dirpath will use is checked earlier, in ``setup``, before ``ModelCheckpoint.setup`` opens
its own client on it. Whether the fit resumed a checkpoint is
known once the checkpoint is loaded: in ``on_fit_start``, except under strategies that restore after setup (FSDP,
model parallel), whose check runs in ``on_train_start``, still before the first step.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["add_fit_start_check", "lightning_pytorch_callbacks", "pytorch_lightning_callbacks"]


class _Check:
    """The check itself, shared by the two namespaces' callback classes (each Trainer wants its own ``Callback``)."""

    @property
    def state_key(self) -> str:
        return "lightning_resilient.FitStartCheck"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Before ModelCheckpoint.setup (Lightning runs checkpoint callbacks last), which lists its dirpath with its
        # own client: without credentials in the environment that fails with botocore's bare NoCredentialsError.
        if stage != "fit" or _plugin(trainer) is None:
            return
        from lightning_resilient.io.store import check_default_client, check_url

        if any(not getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks):
            # ModelCheckpoint.setup puts such a callback's folder under default_root_dir and opens it with its own
            # client, which fails on "S3://" in fsspec's words. (Every dirpath set is checked in on_fit_start.)
            check_url(str(trainer.default_root_dir))
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if isinstance(dirpath, (str, os.PathLike)) and str(dirpath):
                check_default_client(str(dirpath))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is None:
            return
        from lightning_resilient.io.checkpoint_io import check_filenames, fit_roots

        check_filenames(trainer)
        # A fit that resumed nothing is a new job, also with a plugin an earlier fit of this process used, unless it
        # continues that fit from its state in memory.
        plugin.begin_fit(resumed=getattr(trainer, "ckpt_path", None) is not None, trainer=trainer, pl_module=pl_module)
        for dirpath in fit_roots(trainer):
            plugin.check_root(dirpath)
        if not _restores_after_setup(trainer):
            plugin.check_new_run(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is not None and _restores_after_setup(trainer):
            plugin.check_new_run(trainer)  # the checkpoint (if any) is loaded only after on_fit_start there

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is not None:
            plugin.end_fit(trainer, pl_module)


def _restores_after_setup(trainer: Any) -> bool:
    """Whether the Trainer's strategy loads the checkpoint after ``on_fit_start`` (FSDP, model parallel)."""
    return bool(getattr(trainer.strategy, "restore_checkpoint_after_setup", False))


def _plugin(trainer: Any) -> Any:
    """The Trainer's checkpoint plugin when it is ours (also behind Lightning's ``AsyncCheckpointIO`` wrapper)."""
    from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO

    io = getattr(trainer.strategy, "checkpoint_io", None)
    for _ in range(4):  # wrappers hold the plugin they wrap as ``checkpoint_io``
        if isinstance(io, AtomicCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def _callback_class(namespace: str) -> type:
    """``FitStartCheck`` for ``lightning.pytorch`` or ``pytorch_lightning``, built on first use so that loading the
    entry point imports nothing the Trainer has not imported already."""
    cached = _CLASSES.get(namespace)
    if cached is None:
        base: type
        if namespace == "lightning.pytorch":
            from lightning.pytorch import Callback

            base = Callback
        else:
            base = sys.modules["pytorch_lightning"].Callback  # the Trainer asking for it has imported it
        cached = _CLASSES[namespace] = type("FitStartCheck", (_Check, base), {
            "__module__": __name__,
            "__doc__": "Checks the checkpoint folders of ``AtomicCheckpointIO`` when ``fit`` starts (see module).",
            "__reduce__": lambda self: (_rebuild, (namespace,)),
        })
    return cached


def _rebuild(namespace: str) -> Any:
    return _callback_class(namespace)()


_CLASSES: dict[str, type] = {}


def lightning_pytorch_callbacks() -> list[Any]:
    """Entry point ``lightning.pytorch.callbacks_factory``: the callbacks every ``lightning.pytorch`` Trainer gets."""
    return [_callback_class("lightning.pytorch")()]


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point ``pytorch_lightning.callbacks_factory``: the same for ``pytorch_lightning`` Trainers."""
    return [_callback_class("pytorch_lightning")()]


def add_fit_start_check(trainer: Any) -> None:
    """Give ``trainer`` the check when its entry point did not (a source tree run without installing the package)."""
    if not any(isinstance(c, _Check) for c in trainer.callbacks):
        trainer.callbacks = [*trainer.callbacks, _callback_class("lightning.pytorch")()]


def __getattr__(name: str) -> Any:
    if name == "FitStartCheck":  # the lightning.pytorch class, built on first use
        return _callback_class("lightning.pytorch")
    raise AttributeError(name)
