"""One read of a checkpoint per node: the other processes of the node load a verified local copy.

Under DDP every rank loads the checkpoint it resumes from, so a node with 8 GPUs reads it 8 times from the
object store. Here the first process of the node to ask takes a file lock, loads from the store as usual, and
writes every verified byte it read into a node-local folder as it goes; the node's other processes wait for
the lock, then load that copy (verified again, from local disk). No collective is involved, so a process that
loads alone (evaluation, a single rank calling ``load_checkpoint``) can never hang waiting for the others.

The copy stays until a load of another checkpoint replaces it (one copy per node, in ``directory``).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.root import CheckpointRoot, Loaded

__all__ = ["NodeCache"]

log = logging.getLogger(__name__)
_COMPLETE = ".complete"


class NodeCache:
    """Node-local copies of loaded checkpoints, one at a time, under ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(os.path.join(self.directory, f"{key}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def load(self, root: CheckpointRoot, commit: str, local_root: Callable[[str], CheckpointRoot],
             **load_kwargs: Any) -> Loaded:
        """Load ``commit`` of ``root``: from this node's copy when there is one, else from the store (keeping one).

        ``local_root(path)`` opens a checkpoint root on local disk (with the caller's settings).
        """
        key = hashlib.sha256(root.store.url(commit).encode()).hexdigest()[:24]
        folder = os.path.join(self.directory, key)
        with self._locked(key):
            if not os.path.exists(os.path.join(folder, _COMPLETE)):
                return self._fill(root, commit, folder, key, **load_kwargs)
        log.info("loading %s from this node's copy in %s", root.store.url(commit), folder)
        return local_root(folder).load(commit, **load_kwargs)

    def _fill(self, root: CheckpointRoot, commit: str, folder: str, key: str, **load_kwargs: Any) -> Loaded:
        # Only one copy per node: a copy of another checkpoint (an earlier resume) goes first.
        for entry in os.listdir(self.directory):
            if entry != key and not entry.endswith(".lock"):
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)

        def tee(path: str, offset: int, piece: memoryview) -> None:
            target = os.path.join(folder, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, piece, offset)
            finally:
                os.close(fd)

        loaded = root.load(commit, tee=tee, **load_kwargs)
        if not loaded.manifest.chunk_size:
            return loaded  # a format-1 checkpoint: the node's other processes read it from the store themselves
        # The manifest is written after the data and the marker last: a copy interrupted half-way is never used.
        manifest = os.path.join(folder, commit, MANIFEST_NAME)
        os.makedirs(os.path.dirname(manifest), exist_ok=True)
        with open(manifest, "wb") as f:
            f.write(loaded.manifest.to_bytes())
        with open(os.path.join(folder, _COMPLETE), "w") as f:
            f.write(root.store.url(commit))
        return loaded
