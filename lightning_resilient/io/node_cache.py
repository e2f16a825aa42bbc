"""One read of a checkpoint per node: the other processes of the node load a verified local copy.

Under DDP every rank loads the checkpoint it resumes from, so a node with 8 GPUs would read it 8 times from the
object store. Here the first process of the node to ask takes an exclusive file lock on that checkpoint's copy,
loads from the store as usual and writes every verified byte it read into a node-local folder as it goes; the
node's other processes take a shared lock and load that copy, from local disk. No collective is involved, so a
process that loads alone (evaluation, a single rank calling ``load_checkpoint``) never waits for others.

What the cache cannot be turned into, by another job or another user of the node:

- a private place: everything lives under ``<node_cache_dir or the temp folder>/lightning_resilient-<uid>``, created
  mode 0700, refused when it is a symlink, owned by someone else, or open to others; inside it, one folder per job
  (its root URL and launch: ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID`` or ``MASTER_ADDR:MASTER_PORT``), so two
  jobs never share or delete each other's copies; files are opened with ``O_NOFOLLOW``, and a symlink found where
  a copy or its lock goes is neither followed nor deleted: that load reads the store, with a warning;
- a source of trust: a copy is verified against the *store's* manifest (read from the store by every process),
  never against the copy's own; a copy that fails is dropped and refilled from the store;
- a race: a copy is read under a shared lock held for the whole read, and refilled or deleted under the exclusive
  one, so it never changes under a reader. A job deletes only its own older copies, once their readers are done.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from typing import Any

from lightning_resilient._warnings import warn
from lightning_resilient.errors import CheckpointCorruptedError
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest
from lightning_resilient.io.root import CheckpointRoot, Loaded
from lightning_resilient.io.store import file_lock

__all__ = ["NodeCache", "default_base", "job_identity"]

log = logging.getLogger(__name__)
_COMPLETE = ".complete"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def default_base() -> str:
    """Where node-local copies go unless ``node_cache_dir`` says otherwise: the system's temp folder."""
    return tempfile.gettempdir()


def job_identity() -> str:
    """What every process of one job shares, and another job on the same node does not: the launcher's run id."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        value = os.environ.get(name)
        if value and value != "none":
            return f"{name}={value}"
    return f"master={os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


def _private_dir(path: str) -> str:
    """Create (mode 0700) or check ``path``: a real folder of this user that no one else can read or write."""
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"node cache folder {path} is a symlink or not a folder: refusing to use it (someone may"
                           " be redirecting it); remove it, or pass node_cache_dir=... to AtomicCheckpointIO")
    if info.st_uid != os.getuid():
        raise RuntimeError(f"node cache folder {path} belongs to another user (uid {info.st_uid}): refusing to use it;"
                           " remove it, or pass node_cache_dir=... to AtomicCheckpointIO")
    if info.st_mode & 0o077:
        raise RuntimeError(f"node cache folder {path} is open to other users (mode {oct(info.st_mode & 0o777)}):"
                           f" refusing to use it; run `chmod 700 {path}`, or pass node_cache_dir=...")
    return path


class NodeCache:
    """Node-local, verified copies of the checkpoints one job loads, under ``base``."""

    def __init__(self, base: str | None, root_url: str, job: str | None = None) -> None:
        base = base or default_base()
        os.makedirs(base, exist_ok=True)
        private = _private_dir(os.path.join(base, f"lightning_resilient-{os.getuid()}"))
        key = hashlib.sha256(f"{root_url}\n{job if job is not None else job_identity()}".encode()).hexdigest()[:20]
        self.directory = _private_dir(os.path.join(private, key))

    def _locked(self, key: str, mode: int) -> AbstractContextManager[None]:
        return file_lock(os.path.join(self.directory, f"{key}.lock"), mode, private=True)

    def load(self, root: CheckpointRoot, commit: str, local_root: Callable[[str], CheckpointRoot],
             **load_kwargs: Any) -> Loaded:
        """Load ``commit`` of ``root``: from this node's copy when there is a good one, else from the store (keeping
        a copy). ``local_root(path)`` opens a checkpoint root on local disk (with the caller's settings)."""
        manifest = root.read_manifest(commit)  # the store's: what every copy is verified against
        key = hashlib.sha256(commit.encode()).hexdigest()[:24]
        folder = os.path.join(self.directory, key)
        planted = self._planted(key)
        if planted is not None:
            # The cache only saves reads; the store has the checkpoint. Reading it from there is always right, and
            # a link is neither followed (a fill would write where it points) nor deleted (it is not ours).
            message = (f"node cache: {planted} is a symlink, which lightning_resilient never makes there (it was"
                       f" planted in the private folder {self.directory}): not following it; {root.store.url(commit)}"
                       f" is read from the store instead of this node's copy. To use the cache again, remove it"
                       f" (rm {planted})")
            log.warning(message)
            warn(message, RuntimeWarning)
            return root.load(commit, manifest=manifest, **load_kwargs)
        with self._locked(key, fcntl.LOCK_SH):
            if self._complete(folder, root, commit):
                try:
                    loaded = local_root(folder).load(commit, manifest=manifest, **load_kwargs)
                except CheckpointCorruptedError as exc:
                    log.warning("this node's copy of %s is damaged (%s): reading it from the store again",
                                root.store.url(commit), exc)
                else:
                    log.info("loaded %s from this node's copy in %s", root.store.url(commit), folder)
                    return loaded
        with self._locked(key, fcntl.LOCK_EX):
            if self._complete(folder, root, commit):  # another process refilled it meanwhile
                try:
                    return local_root(folder).load(commit, manifest=manifest, **load_kwargs)
                except CheckpointCorruptedError:
                    pass
            self._drop_others(key)
            return self._fill(root, commit, manifest, folder, **load_kwargs)

    def _planted(self, key: str) -> str | None:
        """The path of a symlink where ``key``'s copy or its lock goes (None: none). Checked before each load: the
        lock is opened ``O_NOFOLLOW`` (a link there fails with ELOOP) and a fill makes the copy's folder anew (a link
        there fails with FileExistsError); only this user can write the private folder, so nothing replaces the
        entries between this check and their use but this user's own processes."""
        for name in (key, f"{key}.lock"):
            path = os.path.join(self.directory, name)
            if os.path.islink(path):
                return path
        return None

    def _complete(self, folder: str, root: CheckpointRoot, commit: str) -> bool:
        marker = os.path.join(folder, _COMPLETE)
        try:
            fd = os.open(marker, os.O_RDONLY | _NOFOLLOW)
        except OSError:
            return False
        with os.fdopen(fd) as f:
            return f.read() == root.store.url(commit)

    def _drop_others(self, keep: str) -> None:
        """Delete this job's copies of other checkpoints (one copy per job), each once its readers are done."""
        for entry in os.listdir(self.directory):
            if entry.endswith(".lock") or entry == keep or self._planted(entry) is not None:
                continue  # (a planted link is never followed, nor deleted: load warns about its own)
            with self._locked(entry, fcntl.LOCK_EX):
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)

    def _fill(self, root: CheckpointRoot, commit: str, manifest: Manifest, folder: str, **load_kwargs: Any) -> Loaded:
        shutil.rmtree(folder, ignore_errors=True)  # a partial or damaged copy of this checkpoint
        os.mkdir(folder, 0o700)

        def tee(path: str, offset: int, piece: memoryview) -> None:
            target = os.path.join(folder, path)
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o600)
            try:
                os.pwrite(fd, piece, offset)
            finally:
                os.close(fd)

        loaded = root.load(commit, tee=tee, manifest=manifest, **load_kwargs)
        # The manifest (for the copy's layout; verification uses the store's) and the marker go last: a copy
        # interrupted half-way is never used.
        path = os.path.join(folder, commit, MANIFEST_NAME)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        for target, data in ((path, manifest.to_bytes()), (os.path.join(folder, _COMPLETE),
                                                           root.store.url(commit).encode())):
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return loaded
