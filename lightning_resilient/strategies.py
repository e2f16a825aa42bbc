"""``AtomicModelParallelStrategy`` and ``AtomicFSDPStrategy``: Lightning's ModelParallelStrategy (FSDP2, tensor
parallelism) and FSDPStrategy (FSDP1, ``state_dict_type="sharded"``) with sharded checkpoints that are atomic,
verified and fenced on any fsspec store.

Stock Lightning saves distributed checkpoints outside CheckpointIO: ``Path(filepath)`` (so ``s3://`` breaks),
``torch.distributed.checkpoint`` into a folder that is overwritten in place, and a ``meta.pt`` beside it; a crash
mid-save leaves a half-written checkpoint at the path of the previous one. Here every rank writes its shards into
a new commit folder of the checkpoint root, and the pointer moves only after all ranks finished (see
:mod:`lightning_resilient.io.sharded`). Resuming verifies every chunk it reads, falls back to the previous
committed checkpoint if one is damaged, and reshards when the number of processes changed.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_resilient.errors import ShardedCheckpointError
from lightning_resilient.io.calling_trainer import mark_resumed_step_saved
from lightning_resilient.io.catalog import Together, load_resolved, normalize
from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO
from lightning_resilient.io.root import CheckpointRoot, Loaded
from lightning_resilient.io.sharded import AtomicStorageReader, load_sharded, own_errors, root_and_name, save_sharded

__all__ = ["AtomicFSDPStrategy", "AtomicModelParallelStrategy"]

log = logging.getLogger(__name__)


class _AtomicSharded:
    """What both strategies share: the CheckpointIO is an AtomicCheckpointIO; a save splits Lightning's checkpoint
    into the sharded state and the rest; a resume resolves the path, checks the layout, loads the shards, falls back
    to the previous committed checkpoint if one is damaged, and claims the root. Each strategy loads its shards."""

    _checkpoint_io: CheckpointIO | None
    #: The key the weights are sharded under (Lightning's own conventions: FSDP1 "model", FSDP2 "state_dict").
    _weights_key: str
    _other: str  # the strategy that writes the other layout, for the error message

    @property
    def checkpoint_io(self) -> AtomicCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        assert isinstance(self._checkpoint_io, AtomicCheckpointIO)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None and not isinstance(io, AtomicCheckpointIO):
            raise TypeError(f"{type(self).__name__} writes through lightning_resilient.AtomicCheckpointIO, got"
                            f" {type(io).__name__}: pass AtomicCheckpointIO(...) in Trainer(plugins=[...]) or none")
        self._checkpoint_io = io

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]  # a mixin: the strategy's
        # Lightning's FSDPStrategy and ModelParallelStrategy end without the CheckpointIO's teardown, which waits for
        # the last save's persist (a local tier) and ends the copies between nodes.
        self.checkpoint_io.teardown()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: set"
                            " storage_options on AtomicCheckpointIO")
        # The sharded keys are Lightning's own (weights under _weights_key, "optimizer_<i>"); the rest of the
        # checkpoint (loops, callbacks, RNG) goes into the commit's skeleton, from the coordinator.
        state = {self._weights_key: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        path = self.broadcast(str(filepath))  # type: ignore[attr-defined]
        # Every rank uploads its shards; the coordinator (rank 0) commits once all have finished.
        rest = checkpoint if self.global_rank == 0 else None  # type: ignore[attr-defined]
        if self.checkpoint_io.local_tier is not None:
            # Each rank's shards into its node's local tier; every node commits its part (io/replicas.py).
            self.checkpoint_io.save_sharded_tiered(state, path, rest, self)
            return
        root, name = root_and_name(self.checkpoint_io, path)
        save_sharded(state, root, name, rest=rest)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        io = self.checkpoint_io
        rank = self.global_rank  # type: ignore[attr-defined]
        # One decision per job: rank 0 resolves the path, every rank loads that commit's shards (DCP is collective),
        # and a candidate damaged on any rank makes them all fall back to the same older one.
        together = Together(rank=rank, broadcast=lambda obj: self.broadcast(obj, src=0),  # type: ignore[attr-defined]
                            all_true=lambda flag: self.reduce_boolean_decision(flag, all=True),  # type: ignore[attr-defined]
                            any_true=lambda flag: self.reduce_boolean_decision(flag, all=False))  # type: ignore[attr-defined]

        def load_for(root: CheckpointRoot) -> Any:
            def load(commit: str, **_: Any) -> Loaded:
                # One manifest read and one metadata read per candidate, shared by every step below.
                manifest = root.read_manifest(commit)
                if manifest.sharded is None:
                    raise ShardedCheckpointError(f"{root.store.url(commit)} is a full (not sharded) checkpoint:"
                                                 f" {type(self).__name__} resumes sharded checkpoints only")
                reader = AtomicStorageReader(root, commit, manifest=manifest, weights_only=weights_only)
                self._check_layout(reader)
                self._load_shards(reader)
                return root.load(commit, map_location=None, weights_only=weights_only, sharded_rest=True,
                                 manifest=manifest)

            return load

        # In a fit, ckpt_path="last" (<dirpath>/last.ckpt) means the newest committed checkpoint of that root's run.
        module = self.lightning_module  # type: ignore[attr-defined]
        url = io.resolve_last(normalize(str(checkpoint_path)), module.trainer if module is not None else None)
        if io.local_tier is not None:
            def load_shards(reader: AtomicStorageReader) -> None:
                if reader.manifest is not None and reader.manifest.sharded is None:
                    raise ShardedCheckpointError(f"{reader.root.store.url(reader.commit)} is a full (not sharded)"
                                                 f" checkpoint: {type(self).__name__} resumes sharded checkpoints only")
                self._check_layout(reader)
                self._load_shards(reader)

            tiered = io.load_sharded_tiered(url, self, load_shards, shown=str(checkpoint_path),
                                            weights_only=weights_only)
            if tiered is not None:
                return tiered
        done = load_resolved(url, io.root, fallback=io.settings.fallback_on_corruption, load_for=load_for,
                             together=together, shown=str(checkpoint_path))
        if done is None:  # a stock Lightning checkpoint: the Lightning strategy loads it
            stock: dict[str, Any] = super().load_checkpoint(  # type: ignore[misc]  # a mixin: the strategy's
                self.broadcast(str(checkpoint_path)), weights_only=weights_only)  # type: ignore[attr-defined]
            return stock
        found, loaded = done
        # A resuming fit claims the root with this checkpoint as its lineage's origin (on the coordinator, at once
        # unless claim_on_load=False); validate/test/predict loads are read-only (see AtomicCheckpointIO).
        fit = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # type: ignore[attr-defined]
        if fit or io.claim_on_load:
            found.root.resumed(found.entry)
            claim_now = io.claim_on_load if io.claim_on_load is not None else fit
            if claim_now and rank == 0 and found.root.writer_epoch is None:
                found.root.claim()
        if fit:
            mark_resumed_step_saved(self.lightning_module.trainer, loaded.checkpoint)  # type: ignore[attr-defined]
            if io.dedup:  # every rank's first save references what it finds unchanged by digest (a frozen base)
                found.root.remember_loaded(loaded)
        return loaded.checkpoint

    def _check_layout(self, reader: AtomicStorageReader) -> None:
        # Checked before any shard is read: otherwise DCP fails deep in its planner with a missing-key error.
        keys = reader.read_metadata().state_dict_metadata
        if not any(key.startswith(f"{self._weights_key}.") for key in keys):
            found = sorted({key.split(".", 1)[0] for key in keys})
            raise ShardedCheckpointError(
                f"{reader.root.store.url(reader.commit)} holds no weights under {self._weights_key!r} (its top-level"
                f" keys: {found}): it was written by another strategy; resume it with {self._other}, or consolidate"
                " it with lightning_resilient.io.sharded.load_full(url)")

    def _load_shards(self, reader: AtomicStorageReader) -> None:
        raise NotImplementedError


# The mixin narrows Strategy.checkpoint_io to AtomicCheckpointIO (its setter refuses any other), which mypy reports.
class AtomicModelParallelStrategy(_AtomicSharded, ModelParallelStrategy):  # type: ignore[misc]
    """``ModelParallelStrategy`` whose sharded checkpoints go through :class:`~lightning_resilient.AtomicCheckpointIO`.

    One line in place of Lightning's strategy; the checkpoint root is the ``ModelCheckpoint`` dirpath, local or
    ``s3://`` / ``gs://``, and ``AtomicCheckpointIO`` options (credentials, retention, ...) come from ``plugins``::

        trainer = Trainer(strategy=AtomicModelParallelStrategy(data_parallel_size=8),
                          plugins=[AtomicCheckpointIO(storage_options={...}, keep_last=3)],
                          callbacks=[ModelCheckpoint(dirpath="s3://bucket/run/ckpt", every_n_train_steps=500)])
        trainer.fit(model, ckpt_path=find_latest_checkpoint("s3://bucket/run/ckpt"))

    Takes ``ModelParallelStrategy``'s arguments. Limits: distributed (sharded) checkpoints only
    (``save_distributed_checkpoint=True``); async saves are not applied to sharded saves (each rank uploads
    its shards synchronously, in parallel).
    """

    _weights_key = "state_dict"
    _other = "AtomicFSDPStrategy (FSDP1)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ValueError("AtomicModelParallelStrategy saves sharded checkpoints only: drop"
                             " save_distributed_checkpoint=False, or use ModelParallelStrategy for full-state saves")
        super().__init__(*args, **kwargs)

    def _load_shards(self, reader: AtomicStorageReader) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        module_state = {"state_dict": get_model_state_dict(self.model)}
        load_sharded(module_state, reader.root, reader.commit, reader=reader)
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load_sharded(optim_state, reader.root, reader.commit, reader=reader)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True))


class AtomicFSDPStrategy(_AtomicSharded, FSDPStrategy):  # type: ignore[misc]  # checkpoint_io narrowed, as above
    """``FSDPStrategy(state_dict_type="sharded")`` whose checkpoints go through
    :class:`~lightning_resilient.AtomicCheckpointIO`, as :class:`AtomicModelParallelStrategy` does for FSDP2.

    Example::

        Trainer(accelerator="cuda", devices=8,
                strategy=AtomicFSDPStrategy(auto_wrap_policy={nn.TransformerEncoderLayer}),
                plugins=[AtomicCheckpointIO(storage_options={...})],
                callbacks=[ModelCheckpoint(dirpath="s3://bucket/run/ckpt", every_n_train_steps=500)])

    Takes ``FSDPStrategy``'s arguments; ``state_dict_type`` must be ``"sharded"`` (the default here).
    """

    _weights_key = "model"
    _other = "AtomicModelParallelStrategy (FSDP2)"

    def __init__(self, *args: Any, state_dict_type: Literal["full", "sharded"] = "sharded", **kwargs: Any) -> None:
        if state_dict_type != "sharded":
            raise ValueError("AtomicFSDPStrategy saves sharded checkpoints only: use state_dict_type='sharded' (the"
                             " default), or FSDPStrategy with AtomicCheckpointIO for full-state saves")
        super().__init__(*args, **{**kwargs, "state_dict_type": state_dict_type})

    def _load_shards(self, reader: AtomicStorageReader) -> None:
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert self.model is not None and self.lightning_module is not None
        # Lightning annotates this @contextmanager as the generator it wraps.
        with _get_sharded_state_dict_context(self.model):  # type: ignore[attr-defined]
            module_state = {"model": self.model.state_dict()}
            load_sharded(module_state, reader.root, reader.commit, reader=reader)
            self.model.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)
            if self.lightning_module.trainer.state.fn != TrainerFn.FITTING or not self.optimizers:
                return
            for idx, optimizer in enumerate(self.optimizers):
                key = f"optimizer_{idx}"
                with own_errors():
                    optim_state = load_sharded_optimizer_state_dict(model_state_dict=module_state["model"],
                                                                    optimizer_key=key, storage_reader=reader)
                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(optim_state_dict=optim_state[key],
                                                                        model=self.model, optim=optimizer))
