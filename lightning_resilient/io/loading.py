"""Reading a committed checkpoint outside a Trainer: a plain dict, a LightningModule, or one stock ``.ckpt`` file.

A committed checkpoint is a folder of objects (tensor shards, a skeleton, a manifest), so the stock routes that open
one file (``torch.load(path)``, ``LightningModule.load_from_checkpoint(path)``) cannot read it. These are their
replacements. Each takes what ``trainer.fit(ckpt_path=...)`` takes (a commit folder, a name such as
``<root>/last.ckpt``, the root itself for its latest, or a stock file), verifies every byte, and is read-only: it never
claims the root, so it never fences the job that is training into it.
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Any, TypeVar

import torch

from lightning_resilient.io import paths

__all__ = ["export_checkpoint", "load_checkpoint", "load_from_checkpoint"]

T = TypeVar("T")


def load_checkpoint(checkpoint_path: str | os.PathLike[str], map_location: Any = None, *,
                    storage_options: dict[str, Any] | None = None, weights_only: bool | None = None) -> dict[str, Any]:
    """The checkpoint dict Lightning saved, verified (what ``torch.load(path)`` gives for a stock ``.ckpt``).

    Args:
        checkpoint_path: a commit folder, a checkpoint name (``<root>/last.ckpt``, ``best_model_path``), a root (its
            latest), or a stock Lightning file.
        map_location: as for ``torch.load``.
        storage_options: fsspec options for the store (credentials, endpoint).
        weights_only: as for ``torch.load``, for the non-tensor part (tensors are raw bytes, never unpickled).
    """
    from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO

    plugin = AtomicCheckpointIO(storage_options=storage_options, claim_on_load=False, node_cache=False)
    return plugin.load_checkpoint(checkpoint_path, map_location=map_location, weights_only=weights_only)


def load_from_checkpoint(cls: type[T], checkpoint_path: str | os.PathLike[str], map_location: Any = None,
                         hparams_file: str | os.PathLike[str] | None = None, strict: bool | None = None, *,
                         storage_options: dict[str, Any] | None = None, weights_only: bool | None = None,
                         **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a committed checkpoint (a LightningModule or a
    LightningDataModule), e.g. ``load_from_checkpoint(MyModel, trainer.checkpoint_callback.best_model_path)``.

    The checkpoint is read and verified as :func:`load_checkpoint` does, then handed to ``cls.load_from_checkpoint``
    itself as an in-memory file: Lightning's own code runs (legacy migrations, ``hparams_file``, keyword overrides,
    ``on_load_checkpoint``, ``strict``, the device move, and any override of ``load_from_checkpoint`` in ``cls``),
    so the result is what the stock call gives for a stock file. The price is one serialized copy of the checkpoint in
    host memory while it loads; for a model too large for that, use :func:`load_checkpoint` and
    ``model.load_state_dict(checkpoint["state_dict"])``.
    """
    checkpoint = load_checkpoint(checkpoint_path, map_location=map_location, storage_options=storage_options,
                                 weights_only=weights_only)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    loader = getattr(cls, "load_from_checkpoint", None)
    if loader is None:
        raise TypeError(f"{getattr(cls, '__name__', cls)!r} has no load_from_checkpoint: pass a LightningModule or"
                        " LightningDataModule class, or use lightning_resilient.load_checkpoint for the dict")
    if weights_only is not None:  # Lightning < 2.5 has no such argument (it would become a hyperparameter)
        kwargs["weights_only"] = weights_only
    loaded: T = loader(buffer, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs)
    return loaded


def export_checkpoint(checkpoint_path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      storage_options: dict[str, Any] | None = None,
                      out_storage_options: dict[str, Any] | None = None) -> str:
    """Write a committed checkpoint as one stock Lightning ``.ckpt`` file (``torch.load``-able, loadable by stock
    Lightning without this package), for tools that need a file. Returns the URL written.

    The checkpoint is verified before anything is written; a local ``out`` appears whole or not at all (a temporary
    file in the same folder, then a rename).
    """
    from fsspec.core import url_to_fs

    from lightning_resilient.io.store import check_url

    target = os.fspath(out)
    check_url(target)  # before the checkpoint is read: "s3:/bucket/x.ckpt" would be written to a local folder
    checkpoint = load_checkpoint(checkpoint_path, map_location="cpu", storage_options=storage_options)
    fs: Any
    path: str
    fs, path = url_to_fs(target, **(out_storage_options or {}))
    if fs.isdir(path):
        raise IsADirectoryError(f"export target {target} is a folder: name the .ckpt file to write")
    protocol = paths.split_protocol(target)[0]
    if protocol in (None, "file", "local"):
        folder = os.path.dirname(os.path.abspath(path)) or "."
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return os.path.abspath(path)
    # fsspec commits a remote file on close, also when the write failed: write a temporary key, then move it.
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "wb") as f:
            torch.save(checkpoint, f)
        fs.mv(tmp, path)
    finally:
        if fs.exists(tmp):
            fs.rm_file(tmp)
    return target
