"""``ResumeStateCallback``'s link to the resume audit and the goodput ledger, and to the checkpoint root they use.

:class:`AuditLink` owns, for one attempt: the :class:`~lightning_resilient.state.audit.ResumeAudit` (opened when
training starts, in the checkpoint root's ``.lightning_resilient/attempts/``, fed one
:class:`~lightning_resilient.state.attempts.StepDigest` per training batch, reported in one ``resume audit:`` line,
closed with how the fit ended) and the ledger's :class:`~lightning_resilient.state.ledger.AttemptTimer` (the fit's
start, each batch, each save's stall and the straggler check, validations paused). It finds what they need from the
Trainer: the checkpoint root (:func:`checkpoint_root`), the root's store with the plugin's options, the node's spool
of the records, the root's incarnation, and what the plugin last loaded. The audit and the ledger never stop
training: what they cannot reach is logged and left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import LightningModule, Trainer

from lightning_resilient.io.store import Store
from lightning_resilient.state._loader import sized
from lightning_resilient.state._seed_control import SeedingControl
from lightning_resilient.state._stream import DataStream
from lightning_resilient.state.attempts import StepDigest
from lightning_resilient.state.audit import ResumeAudit, StateSampler, digest_batch, digest_indices, digest_sample_set
from lightning_resilient.state.ledger import AttemptTimer, end_of

__all__ = ["AuditLink", "checkpoint_root"]

# The callback's log lines keep the logger they always had (a user may filter on it).
log = logging.getLogger("lightning_resilient.state.callback")

Gather = Callable[[Any], list[Any]]


class AuditLink:
    """This attempt's resume audit and ledger timer, fed from the callback's hooks."""

    def __init__(self) -> None:
        self._audit: ResumeAudit | None = None
        self._saved_since_start = False  # a save happened in this fit (the root is claimed: its incarnation known)
        self._sampler: StateSampler | None = None  # a sample of the parameters after each step, for the audit
        self.step_at_start = 0  # the global step at the current batch's start
        self._failure: str | None = None  # how the fit failed, for the record
        # The goodput ledger: this rank's timings of the attempt, how the fit ended, and the plugin's load before it.
        self.timer: AttemptTimer | None = None
        self._end = "finished"
        self._load_before: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy carries no audit, timer or load of a fit in progress.
        return {**self.__dict__, "_audit": None, "timer": None, "_load_before": None}

    def start_fit(self, trainer: Trainer, *, ledger: bool) -> None:
        self._failure = None
        self._end = "finished"
        self.timer = AttemptTimer(rank=trainer.global_rank) if ledger else None
        if self.timer is not None:
            self.timer.fit_started()  # before Lightning loads the checkpoint: a restore is timed from here
            self._load_before = _last_load(trainer)

    def failed(self, exception: BaseException) -> None:
        self._failure = f"{type(exception).__name__}: {exception}"[:300]
        self._end = end_of(exception)

    def timed_save(self, save: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   trainer: Trainer | None, straggler_factor: float | None, gather: Gather) -> Any:
        """``trainer.save_checkpoint``, timed for the ledger (how long it blocks the loop), then the straggler check
        (every rank saves together, so every rank reaches its collective)."""
        timer = self.timer
        if timer is None or trainer is None:
            return save(*args, **kwargs)
        started = timer.save_started()
        try:
            result = save(*args, **kwargs)
        finally:
            timer.save_ended(trainer.global_step, started)
        if straggler_factor is not None and trainer.world_size > 1:
            timer.check_stragglers(gather, step=trainer.global_step, factor=straggler_factor)
        return result

    def start(self, trainer: Trainer, stream: DataStream, seeding: SeedingControl, *, rank: int, world: int,
              gather: Gather, compare: bool, flush_seconds: float, flush_steps: int | None) -> None:
        """Open this attempt's record beside the checkpoints and, on a resume, get ready to compare the steps it
        replays (``compare``; collectives: every rank runs this)."""
        url = checkpoint_root(trainer)
        if url is None:  # no ModelCheckpoint and no resume: nowhere to record (the same on every rank)
            return
        store = _open_store(trainer, url)
        self._saved_since_start = False
        audit = ResumeAudit(rank=rank, world=world, gather=gather, flush_seconds=flush_seconds,
                            flush_steps=flush_steps, compare=compare)
        resumed = trainer.ckpt_path is not None
        result = audit.start(store, facts=_facts(stream, seeding, trainer, world),
                             resumed_step=trainer.global_step if resumed else None,
                             resumed_from=str(trainer.ckpt_path) if resumed else None,
                             spool=_spool(trainer, store),
                             root_id=_root_id(trainer, url, read=True) if rank == 0 else None)
        self._audit = audit
        if self.timer is not None:
            last = _last_load(trainer)
            loaded = last is not None and last is not self._load_before and resumed
            self.timer.attach(audit.log, loaded=(last.commit, last.tier or None, last.seconds) if loaded else None)
        if result is not None:
            rank_zero_info(result.line)

    def batch_started(self, step: int) -> None:
        self.step_at_start = step
        if self.timer is not None:
            self.timer.batch_started(step)

    def before_backward(self) -> None:
        if self.timer is not None:
            self.timer.before_backward()

    def batch_ended(self, step: int) -> None:
        if self.timer is not None:
            self.timer.batch_ended(step)

    def record_step(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, *,
                    indices: Any, data: str | None) -> None:
        """Give the audit this training batch's digests (``indices``: its sample indices where known; ``data``: the
        digest of what the loader fetched for it) and the parameters after it; report once it has compared every
        step the interrupted attempt ran past the checkpoint."""
        audit = self._audit
        if audit is None:
            return
        if audit.root_id is None and trainer.global_rank == 0 and self._saved_since_start:
            root_id = _root_id(trainer, checkpoint_root(trainer), read=False)  # (in memory once this job claimed)
            if root_id:
                audit.learned_root_id(root_id)
        step = StepDigest(trainer.current_epoch, batch_idx, self.step_at_start,
                          None if indices is None else digest_indices(indices),
                          data if data is not None else digest_batch(batch), None,
                          None if indices is None else (len(indices), digest_sample_set(indices)))
        # The parameters after the step: a change after the loss (to the gradients, the update) shows there.
        if self._sampler is None or self._sampler.module is not pl_module:
            self._sampler = StateSampler(pl_module)
        if audit.step(step, _loss_of(outputs), self._sampler()):
            self._report(audit)

    def train_ended(self) -> None:
        if self._audit is not None and not self._audit.reported:
            self._report(self._audit)  # the run ended before replaying every step the interrupted attempt ran

    @staticmethod
    def _report(audit: ResumeAudit) -> None:
        result = audit.report()  # a collective: every rank reaches it at the same step
        if result is not None:
            rank_zero_info(result.line)

    def saved(self) -> None:
        if self._audit is not None:
            self._audit.saved()
            self._saved_since_start = True

    def paused(self) -> None:
        if self.timer is not None:
            self.timer.paused()  # a validation's time is neither a training step's nor a fetch's

    def resumed(self) -> None:
        if self.timer is not None:
            self.timer.resumed()

    def close(self) -> None:
        """After the fit (or its failure): the record's last write, with how the attempt ended."""
        timer, self.timer = self.timer, None
        if self._audit is not None:
            audit, self._audit = self._audit, None
            ledger = {"end": self._end, "timings": timer.timings()} if timer is not None else {}
            audit.close("finished" if self._failure is None else f"stopped by {self._failure}", **ledger)


def _facts(stream: DataStream, seeding: SeedingControl, trainer: Trainer, world: int) -> dict[str, Any]:
    """What a DIFFERS line names when it changed between attempts."""
    dataset = getattr(stream.loader, "dataset", None)
    size = len(dataset) if dataset is not None and sized(dataset) else None
    applied = seeding.applied
    return {"world_size": world, "batch_size": stream.batch_size, "num_workers": stream.num_workers,
            "loader": str(stream.kind) if stream.kind is not None else None,
            "dataset": None if dataset is None else type(dataset).__name__ + ("" if size is None else f"[{size}]"),
            "per_sample_seeding": applied is not None,
            "sample_seed": applied.seed if applied is not None else None,
            "accumulate_grad_batches": trainer.accumulate_grad_batches}


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss ``training_step`` returned (as Lightning hands it to ``on_train_batch_end``), detached."""
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs.detach()
    return None


def checkpoint_root(trainer: Trainer) -> str | None:
    """Where the attempt records go: the first ModelCheckpoint's folder (the checkpoint root), else the folder of
    the checkpoint resumed from."""
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    if dirpath:
        return str(dirpath)
    path = trainer.ckpt_path
    if path is None:
        return None
    from lightning_resilient.io import paths

    return paths.dirname(str(path)) or None


def _plugin_of(trainer: Trainer) -> Any:
    """The Trainer's AtomicCheckpointIO (under any wrapper), or None."""
    from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO

    plugin = trainer.strategy.checkpoint_io
    while not isinstance(plugin, AtomicCheckpointIO) and hasattr(plugin, "checkpoint_io"):  # AsyncCheckpointIO
        plugin = plugin.checkpoint_io
    return plugin if isinstance(plugin, AtomicCheckpointIO) else None


def _spool(trainer: Trainer, store: Store | None) -> str | None:
    """This node's spool of the attempt records of ``store`` (an object store; None on local disk), under the plugin's
    local tier when it has one (see ``attempts.spool_folder``). None when it cannot be made (warned: the records
    then reach the store at its flushes only)."""
    from lightning_resilient.io.store import LocalStore
    from lightning_resilient.state.attempts import spool_folder

    if store is None or isinstance(store, LocalStore):
        return None
    plugin = _plugin_of(trainer)
    try:
        return spool_folder(store.url(), getattr(plugin, "local_tier", None), store.endpoint())
    except OSError as exc:
        log.warning("the resume audit cannot keep its records on this node (%s): a kill loses the steps since the"
                    " record's last flush to %s", exc, store.url())
        return None


def _root_id(trainer: Trainer, url: str | None, *, read: bool) -> str | None:
    """The incarnation of the checkpoint root ``url`` (its pointer's ``root_id``): as the plugin's root holds it once
    this job claimed, else (``read``) from the pointer; None when not known (a fresh root, another plugin)."""
    plugin = _plugin_of(trainer)
    if plugin is None or url is None:
        return None
    try:
        root = plugin.root(url)
        known = root.fence.root_id
        if known or not read:
            return str(known) if known else None
        pointer, _ = root.read_pointer()
        return pointer.root_id if pointer is not None and pointer.root_id else None
    except Exception as exc:  # the audit never stops training
        log.debug("could not read the root id of %s: %s", url, exc)
        return None


def _open_store(trainer: Trainer, url: str) -> Store | None:
    """The root's store, with the plugin's storage options and retries where it is ours; None (warned) on failure."""
    from lightning_resilient.io.catalog import normalize
    from lightning_resilient.io.retry import RetryPolicy
    from lightning_resilient.io.store import open_store

    plugin = _plugin_of(trainer)
    options, retry = (plugin.storage_options, plugin.retry) if plugin is not None else ({}, RetryPolicy())
    try:
        return open_store(normalize(url), options, retry)
    except Exception as exc:  # the audit never stops training
        log.warning("the resume audit cannot open %s (%s); this attempt is not recorded", url, exc)
        return None


def _last_load(trainer: Trainer) -> Any:
    """What ``AtomicCheckpointIO`` (the Trainer's, under any wrapper) last loaded (``LoadStats``), or None."""
    plugin = trainer.strategy.checkpoint_io
    while not hasattr(plugin, "last_load") and hasattr(plugin, "checkpoint_io"):  # AsyncCheckpointIO
        plugin = plugin.checkpoint_io
    return getattr(plugin, "last_load", None)
