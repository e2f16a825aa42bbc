"""What ``AtomicCheckpointIO`` reads of the Trainer that calls it: Lightning hands a CheckpointIO no Trainer.

The Trainer loading a checkpoint is found up the call stack (:func:`trainer_loading`), and its facts decide what a
load means: why it loads (:func:`fn_of`: ``"fit"`` resumes, anything else only reads), which folders its fit writes
(:func:`fit_roots`), whether its ``ckpt_path`` names one of its ModelCheckpoints' ``last.ckpt`` (:func:`names_last`),
how its ranks decide together (:func:`together`) and which is this process (:func:`global_rank`).
:func:`mark_resumed_step_saved` tells its ModelCheckpoints that the step a fit resumes from is saved already.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_resilient._namespaces import trainer_on_stack
from lightning_resilient.io.catalog import Together
from lightning_resilient.io.collectives import named

__all__ = ["fit_roots", "fn_of", "global_rank", "mark_resumed_step_saved", "names_last", "together",
           "trainer_loading"]


def fit_roots(trainer: Any) -> list[str]:
    """The checkpoint folders a ``fit`` of ``trainer`` writes: every ``ModelCheckpoint`` dirpath and a
    ``PreemptionCheckpoint``'s own ``dirpath`` (each once, in the order of the callbacks). Lightning resolves a
    ModelCheckpoint's dirpath in its ``setup``, before a resume loads."""
    from lightning_resilient.preemption import PreemptionCheckpoint

    found: list[str] = []
    for callback in getattr(trainer, "callbacks", []):
        dirpath = getattr(callback, "dirpath", None)
        writes = callback in getattr(trainer, "checkpoint_callbacks", []) or isinstance(callback, PreemptionCheckpoint)
        if writes and isinstance(dirpath, (str, os.PathLike)) and str(dirpath) and str(dirpath) not in found:
            found.append(str(dirpath))
    return found


def trainer_loading() -> Any:
    """The Trainer whose checkpoint connector is loading (up the call stack), or None outside a Trainer.

    The CheckpointIO is handed neither why it loads (to resume a fit, or to validate, test or predict) nor whether
    every rank of the job is loading too; both are facts of that Trainer."""
    return trainer_on_stack("_CheckpointConnector")


def fn_of(trainer: Any) -> Any:
    """What ``trainer`` runs (its ``state.fn``: ``"fit"``, ``"validate"``, ...), or None."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return getattr(fn, "value", fn)


def together(trainer: Any) -> Together | None:
    """How the ranks of ``trainer``'s job decide together, when there are several (Lightning's resume loads on every
    rank); None for a single process, or a load outside a Trainer (which may run on one rank alone)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or getattr(trainer, "world_size", 1) <= 1 or not (
            torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    rank = int(strategy.global_rank)
    bound = "each wait bounded by the job's process-group timeout (the strategy's timeout=)"

    def broadcast(obj: Any) -> Any:
        with named("the resume decision (the checkpoint every rank loads)", rank, bound):
            return strategy.broadcast(obj, src=0)

    def reduce(flag: bool, *, all: bool) -> bool:
        with named("the resume decision (whether every rank loaded it)", rank, bound):
            return bool(strategy.reduce_boolean_decision(flag, all=all))

    return Together(rank=rank, broadcast=broadcast, all_true=lambda flag: reduce(flag, all=True),
                    any_true=lambda flag: reduce(flag, all=False))


def global_rank() -> int:
    """This process's rank in the job: the process group's, else Lightning's ``rank_zero_only.rank`` (0 alone)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def names_last(callback: Any, name: str) -> bool:
    """Whether ``name`` is one of ``callback``'s ``save_last`` names (``last.ckpt``, ``last-v1.ckpt``, ...)."""
    last = getattr(callback, "CHECKPOINT_NAME_LAST", None)
    if not isinstance(last, str):
        return False
    join = re.escape(str(getattr(callback, "CHECKPOINT_JOIN_CHAR", "-")))
    extension = re.escape(str(getattr(callback, "FILE_EXTENSION", ".ckpt")))
    return re.fullmatch(f"{re.escape(last)}({join}v\\d+)?{extension}", name) is not None


def mark_resumed_step_saved(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """The step a fit resumes from is saved already: no ModelCheckpoint saves it again.

    ModelCheckpoint skips a save only when its ``_last_global_step_saved`` equals the global step, and that counter is
    not part of its state, so after a resume it is 0. Under gradient accumulation the first batches after the resume
    end at the resumed step (no optimizer step yet), and ``every_n_train_steps`` would save that step once more."""
    step = checkpoint.get("global_step")
    if not isinstance(step, int) or step <= 0:
        return
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if hasattr(callback, "_last_global_step_saved"):
            callback._last_global_step_saved = step
