"""A sharded training job on CPU processes, for tests/io/test_sharded.py: FSDP2 through
AtomicModelParallelStrategy, or FSDP1 through AtomicFSDPStrategy (``"strategy": "fsdp"``; Lightning refuses its
own FSDPStrategy on CPU, but not a subclass, and torch's FSDP1 runs on CPU with gloo when wrapped with
``device_id=cpu``).

Run: python sharded_child.py ROOT OUT JSON_OPTIONS. Options: strategy, devices, max_steps, every (cadence),
storage_options, dedup (incremental saves), frozen (the first layer and a table are not trained), die (``[rank, step]``:
that rank SIGKILLs itself after storing its first object of that step's save). Resumes from ROOT when it holds a
checkpoint. Prints ``SAVED <step>`` after each save (rank 0) and ``DYING <rank>``; writes per-step losses
(``OUT.losses``), the final full weights (``OUT.weights``) and, per rank, one JSON line per training batch
(``OUT.ids.r<global rank>``: ``epoch``, ``step`` (the global step after the batch) and ``ids``, the batch's sample
indices).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import (
    AtomicCheckpointIO,
    AtomicFSDPStrategy,
    AtomicModelParallelStrategy,
    ResumeStateCallback,
    find_latest_checkpoint,
)


class Net(LightningModule):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                       torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.table: torch.nn.Embedding | None = None
        if frozen:  # a fine-tune's frozen base: the first layer, and a 2 MiB table (unused: only its bytes matter)
            self.net[0].requires_grad_(False)
            self.table = torch.nn.Embedding(4096, 128).requires_grad_(False)

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, AtomicFSDPStrategy):
            # FSDP1 wrapped here rather than by the strategy, which passes device_id=None on CPU and torch's FSDP1
            # then refuses to run without an accelerator; Lightning keeps a model the user already wrapped.
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            cpu = torch.device("cpu")
            for i, layer in enumerate(self.net):
                if isinstance(layer, torch.nn.Linear):
                    self.net[i] = FSDP(layer, device_id=cpu, use_orig_params=True)
            self.net = FSDP(self.net, device_id=cpu, use_orig_params=True)
            return
        from torch.distributed._composable.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        if self.table is not None:
            fully_shard(self.table, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.net(x + 0.01 * torch.randn_like(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Record(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        line = {"epoch": trainer.current_epoch, "step": trainer.global_step, "ids": batch[2].tolist()}
        with open(f"{self.out}.ids.r{trainer.global_rank}", "a") as f:
            f.write(json.dumps(line) + "\n")
        if trainer.global_rank == 0:
            with open(self.out + ".losses", "a") as f:
                f.write(f"{trainer.global_step} {outputs['loss'].item()!r}\n")


class _Announcing:
    die: list[int] | None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        step = checkpoint["global_step"]
        if self.die and self.global_rank == self.die[0] and step == self.die[1]:
            store = self.checkpoint_io.root(os.path.dirname(str(filepath))).store
            write = store.write_pieces

            def write_then_die(rel: str, pieces: Any) -> None:
                write(rel, pieces)
                print(f"DYING {self.global_rank}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            store.write_pieces = write_then_die  # type: ignore[method-assign]
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        if self.global_rank == 0:
            print(f"SAVED {step}", flush=True)


class AnnouncingModelParallel(_Announcing, AtomicModelParallelStrategy):
    def __init__(self, die: list[int] | None, devices: int) -> None:
        super().__init__(data_parallel_size=devices, tensor_parallel_size=1)
        self.die = die


class AnnouncingFSDP(_Announcing, AtomicFSDPStrategy):
    def __init__(self, die: list[int] | None, devices: int) -> None:
        super().__init__()
        self.die = die


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP) or any(isinstance(m, FSDP) for m in model.modules()):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False)):
            return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(root: str, out: str, options: dict[str, Any]) -> None:
    torch.manual_seed(7)
    x = torch.randn(64, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True), torch.arange(64)), batch_size=4, shuffle=True)
    storage_options = options.get("storage_options") or {}
    devices = options["devices"]
    trainer = Trainer(
        accelerator="cpu", devices=devices, max_steps=options["max_steps"], logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        strategy={"fsdp": AnnouncingFSDP, "model_parallel": AnnouncingModelParallel}[
            options.get("strategy", "model_parallel")](options.get("die"), devices),
        plugins=[AtomicCheckpointIO(storage_options=storage_options, dedup=bool(options.get("dedup")))],
        callbacks=[ResumeStateCallback(), Record(out),
                   ModelCheckpoint(dirpath=root, every_n_train_steps=options["every"], save_top_k=-1)])
    trainer.fit(Net(frozen=bool(options.get("frozen"))), loader,
                ckpt_path=find_latest_checkpoint(root, storage_options))
    full = full_weights(trainer.strategy.model)
    if trainer.global_rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, out + ".weights")
    # torch's FSDP over gloo on CPU sometimes aborts at interpreter exit ("terminate called without an active
    # exception"), after all work is done: FSDP1 about one run in five, in a plain torchrun script without Lightning
    # or this package too; FSDP2 more rarely. A plain gloo all_reduce script does not. Skip the interpreter
    # teardown so the exit status reports the run, not that.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
