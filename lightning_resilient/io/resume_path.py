"""One checkpoint for the whole job, whatever ``ckpt_path`` each of its processes was given.

Lightning loads a checkpoint on every rank from the ``ckpt_path`` that rank's ``fit`` (``validate``, ``test``,
``predict``) was given, and skips the load on a rank given None. The ranks of one job can be given different values:
the idiom of a job on several nodes calls ``find_latest_checkpoint(root, local_tier=...)`` on every node, and a node
whose local tier is empty (a replaced node) or behind gets an older commit, or None. A rank that loads then waits in
the load's collectives for ranks that never come: no progress and no error until the job is killed.

So before any load, every rank gives the path it was given, and global rank 0 makes the decision every rank loads:

- every rank was given the same (the usual case, None included): that;
- different paths in one checkpoint root (its commits, names, the root itself; None on some ranks): the root, whose
  newest committed checkpoint of the run the load resolves once for the job, across every node's local tier (a
  warning names what each rank was given);
- paths in different roots, or a plain file beside a root: every rank raises the same
  :class:`~lightning_resilient.ResumeMismatchError`, naming what each was given and the fix.

The fit-start check (``io/fit_check.py``) installs :class:`AgreedRestore` on the Trainer's checkpoint connector for
the stage: Lightning calls ``_restore_modules_and_callbacks(ckpt_path)`` on every rank, with the path that rank was
given, before it loads anything (also when that path is None), so every rank reaches the decision. The exchange is a
collective of Lightning's own process group, bounded by the strategy's timeout, and named in a failure
(``io/collectives.py``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from lightning_resilient.errors import ResumeMismatchError
from lightning_resilient.io.catalog import normalize, resolve
from lightning_resilient.io.collectives import named
from lightning_resilient.io.tier_view import split_tiered

__all__ = ["AgreedRestore", "agree", "decide"]

log = logging.getLogger(__name__)

_EXCHANGE = "the exchange of the ckpt_path each rank was given (the job's one resume decision)"


def _as_text(path: Any) -> str | None:
    if path is None:
        return None
    return os.fspath(path) if isinstance(path, os.PathLike) else str(path)


def decide(given: list[str | None], root_of: Any) -> str | None:
    """The one path every rank loads, from what each rank was ``given`` (by global rank); ``root_of(url)`` names
    the checkpoint root a URL is in (None for a plain file). Raises :class:`~lightning_resilient.ResumeMismatchError`
    when no single decision covers them."""
    distinct = {normalize(p) if p else None for p in given}
    if len(distinct) == 1:
        return given[0]
    roots: dict[str, str | None] = {}
    for path in {p for p in given if p}:
        try:
            roots[path] = root_of(normalize(path))
        except FileNotFoundError:
            roots[path] = None  # (named below: not a checkpoint of any root)
    found = set(roots.values())
    if None in found or len(found) != 1:
        where = ", ".join(f"{path} -> {root or 'no checkpoint root'}" for path, root in sorted(roots.items()))
        raise ResumeMismatchError(
            f"the processes of this job were given different checkpoints to resume ({_listing(given)}), and they are"
            f" not all in one checkpoint root ({where}):"
            " no single checkpoint resumes them all. Give every process the same ckpt_path: the root itself"
            " (ckpt_path=<ModelCheckpoint dirpath> resumes its newest checkpoint, found across every node's local"
            " tier), or the same find_latest_checkpoint(root, ...) on every process.")
    (root,) = found
    assert root is not None
    log.warning("the processes of this job were given different checkpoints to resume (%s): every one resumes the"
                " newest committed checkpoint of the run in %s, found across every node's local tier (one decision"
                " for the job)", _listing(given), root)
    return root


def _listing(given: list[str | None]) -> str:
    return "; ".join(f"rank {rank}: {path if path else 'None'}" for rank, path in enumerate(given))


def agree(plugin: Any, given: Any) -> Any:
    """Every rank calls this with the ``ckpt_path`` it was given; each returns the one global rank 0 decided
    (:func:`decide`), or raises the same error. A single process returns ``given`` as it is."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return given
    world = torch.distributed.get_world_size()
    if world <= 1:
        return given
    rank = torch.distributed.get_rank()
    bound = "each wait bounded by the job's process-group timeout (the strategy's timeout=)"
    texts: list[Any] = [None] * world
    with named(_EXCHANGE, rank, bound):
        torch.distributed.all_gather_object(texts, _as_text(given))
    if len({normalize(t) if t else None for t in texts}) == 1:
        return given  # the usual case: no decision to make, no store read
    verdict: list[Any] = [None]
    if rank == 0:
        try:
            verdict = [{"path": decide(texts, lambda url: _root_of(plugin, url))}]
        except Exception as exc:  # every rank raises what rank 0 found
            verdict = [{"error": exc}]
    with named(_EXCHANGE, rank, bound):
        torch.distributed.broadcast_object_list(verdict, src=0)
    if "error" in verdict[0]:
        raise verdict[0]["error"]
    return verdict[0]["path"]


def _root_of(plugin: Any, url: str) -> str | None:
    """The checkpoint root (as the plugin names it) that ``url`` is in or names; None for a plain file."""
    if plugin.local_tier is not None:
        durable, _ = split_tiered(url, plugin.local_tier, plugin.root)
        if durable is not None:
            return str(plugin.root(durable).url)
    found = resolve(url, plugin.root)
    if found is None:
        return None
    return str(found.root.url)


class AgreedRestore:
    """Stands in for a Trainer's ``_checkpoint_connector._restore_modules_and_callbacks`` for one call: makes the
    job's one decision (:func:`agree`), then restores it as Lightning would. A plain object (not a closure), removed
    after its call (or by the fit-start check's teardown), so the Trainer stays picklable."""

    def __init__(self, connector: Any, plugin: Any) -> None:
        self.connector = connector
        self.plugin = plugin

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.connector.__dict__.get("_restore_modules_and_callbacks") is self:
            del self.connector.__dict__["_restore_modules_and_callbacks"]
        if args:
            args = (agree(self.plugin, args[0]), *args[1:])
        else:
            kwargs["checkpoint_path"] = agree(self.plugin, kwargs.get("checkpoint_path"))
        return self.connector._restore_modules_and_callbacks(*args, **kwargs)

    @classmethod
    def install(cls, trainer: Any, plugin: Any) -> None:
        """Before ``trainer`` restores (every stage, on every rank) when several processes run the job."""
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None or not hasattr(connector, "_restore_modules_and_callbacks"):
            return  # (a Lightning without that step: its loads are what each rank was given, as before)
        if int(getattr(trainer, "world_size", 1)) > 1:
            connector._restore_modules_and_callbacks = cls(connector, plugin)

    @classmethod
    def remove(cls, trainer: Any) -> None:
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is not None and isinstance(connector.__dict__.get("_restore_modules_and_callbacks"), cls):
            del connector.__dict__["_restore_modules_and_callbacks"]
