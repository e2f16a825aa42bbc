"""``AtomicModelParallelStrategy``: Lightning's ModelParallelStrategy (FSDP2, tensor parallelism) with sharded
checkpoints that are atomic, verified and fenced on any fsspec store.

Stock Lightning saves distributed checkpoints outside CheckpointIO: ``Path(filepath)`` (so ``s3://`` breaks),
``torch.distributed.checkpoint`` into a folder that is overwritten in place, and a ``meta.pt`` beside it; a crash
mid-save leaves a half-written checkpoint at the path of the previous one. Here every rank writes its shards into
a new commit folder of the checkpoint root, and the pointer moves only after all ranks finished (see
:mod:`lightning_resilient.io.sharded`). Resuming verifies every chunk it reads, falls back to the previous
committed checkpoint if one is damaged, and reshards when the number of processes changed.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_resilient.errors import CheckpointCorruptedError, ShardedCheckpointError
from lightning_resilient.io.checkpoint_io import AtomicCheckpointIO, _normalize, _resolve
from lightning_resilient.io.sharded import load_sharded, root_and_name, save_sharded

__all__ = ["AtomicModelParallelStrategy"]

log = logging.getLogger(__name__)


class AtomicModelParallelStrategy(ModelParallelStrategy):
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ValueError("AtomicModelParallelStrategy saves sharded checkpoints only: drop"
                             " save_distributed_checkpoint=False, or use ModelParallelStrategy for full-state saves")
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]
    def checkpoint_io(self) -> AtomicCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        assert isinstance(self._checkpoint_io, AtomicCheckpointIO)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None and not isinstance(io, AtomicCheckpointIO):
            raise TypeError(f"AtomicModelParallelStrategy writes through lightning_resilient.AtomicCheckpointIO, got"
                            f" {type(io).__name__}: pass AtomicCheckpointIO(...) in Trainer(plugins=[...]) or none")
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicModelParallelStrategy.save_checkpoint(storage_options=...) is not supported: set"
                            " storage_options on AtomicCheckpointIO")
        path = self.broadcast(str(filepath))
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        root, name = root_and_name(self.checkpoint_io, path)
        # Every rank uploads its shards; the coordinator (rank 0) commits once all have finished.
        save_sharded(state, root, name, rest=checkpoint if self.global_rank == 0 else None)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        io = self.checkpoint_io
        found = _resolve(_normalize(path), io.root)
        if found is None:
            return super().load_checkpoint(path, weights_only=weights_only)  # a stock Lightning checkpoint
        root, entry, fallbacks = found
        candidates = [entry, *(fallbacks if io.settings.fallback_on_corruption else [])]
        for i, candidate in enumerate(candidates):
            try:
                rest = self._load_sharded(root, candidate.commit, weights_only)
            except CheckpointCorruptedError as corrupted:
                if i + 1 == len(candidates):
                    raise
                message = (f"checkpoint {root.store.url(candidate.commit)} is corrupted and was NOT loaded: {corrupted};"
                           f" loading the previous committed one, {root.store.url(candidates[i + 1].commit)}")
                log.error(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                continue
            if io.claim_on_load and self.global_rank == 0 and root.epoch is None:
                root.claim(resumed_from=candidate)  # fence off the job this one replaces
            return rest
        raise AssertionError("unreachable")

    def _load_sharded(self, root: Any, commit: str, weights_only: bool | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        manifest = root.read_manifest(commit)
        if manifest.sharded is None:
            raise ShardedCheckpointError(f"{root.store.url(commit)} is a full (not sharded) checkpoint:"
                                         " AtomicModelParallelStrategy resumes sharded checkpoints only")
        assert self.model is not None and self.lightning_module is not None
        module_state = {"state_dict": get_model_state_dict(self.model)}
        load_sharded(module_state, root, commit)
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load_sharded(optim_state, root, commit)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return root.load(commit, map_location=None, weights_only=weights_only, sharded_rest=True).checkpoint
