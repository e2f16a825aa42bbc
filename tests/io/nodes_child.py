"""One "node" of a job with a local tier on every node, on loopback (gloo, CPU), for tests/io/test_replicas.py:
``python nodes_child.py ROOT OUT OPTIONS``.

Run it once per node with ``NODE_RANK``, the same ``MASTER_ADDR``/``MASTER_PORT`` and this node's own ``LOCAL_TIER``
folder; with ``devices`` > 1 Lightning starts the node's other processes itself. OPTIONS (JSON): ``strategy``
("ddp", "model_parallel" for FSDP2, "fsdp" for FSDP1), ``nodes``, ``devices``, ``max_steps``, ``every`` (save
interval), ``persist_every``, ``replicas``, ``resume`` ("each": every node passes its own
``find_latest_checkpoint(root, local_tier=...)``, printing ``GIVEN rank=<node> <path>``), ``hold``
(``"receive:<step>"``: a node receiving that step's commit from another stops after writing its first object, printing
``RECEIVING <step>``; ``"persist:<step>"``: global rank 0 stops between that step's persist's copy and its manifest,
printing ``COPIED <step>``; ``"restored:<step>"``: a node that restored that step's commit from a peer for its resume
stops after writing the first object of its copy behind training, printing ``RESTORED <step>``; ``"after:<step>"``:
the training thread stops once that step's save returned (DDP), so that no later save lands while the other windows
open; comma-separated: windows for the parent's SIGKILL), ``tier`` (false: no local tier, for a reference run),
``dedup`` (incremental saves) and ``frozen`` (a frozen first layer and a frozen table, as in
tests/io/sharded_child.py).

The job resumes from the root whenever any tier of any node may hold a checkpoint (``ckpt_path=ROOT``: the job's
newest, one decision for every node), else starts fresh. It prints ``START rank=<r> step=<s> commit=<c> tier=<t>``,
``SAVED <step>`` after each save and ``PERSISTED <step>`` once one is durable (global rank 0), and ``DONE`` at the
end; global rank 0 writes the final full weights to ``OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import (
    AtomicCheckpointIO,
    AtomicFSDPStrategy,
    AtomicModelParallelStrategy,
    ResumeStateCallback,
    find_latest_checkpoint,
)
from lightning_resilient.io import replicas, tiered


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Net(LightningModule):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                       torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.table: torch.nn.Embedding | None = None
        if frozen:  # as tests/io/sharded_child.py's: a frozen first layer and a frozen 2 MiB table
            self.net[0].requires_grad_(False)
            self.table = torch.nn.Embedding(4096, 128).requires_grad_(False)

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, AtomicFSDPStrategy):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            cpu = torch.device("cpu")  # FSDP1 on CPU: wrapped here (see tests/io/sharded_child.py)
            for i, layer in enumerate(self.net):
                if isinstance(layer, torch.nn.Linear):
                    self.net[i] = FSDP(layer, device_id=cpu, use_orig_params=True)
            self.net = FSDP(self.net, device_id=cpu, use_orig_params=True)
        elif isinstance(strategy, AtomicModelParallelStrategy):
            from torch.distributed._composable.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
            if self.table is not None:
                fully_shard(self.table, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x + 0.01 * torch.randn_like(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Report(Callback):
    def __init__(self, io: AtomicCheckpointIO, out: str) -> None:
        self.io, self.out = io, out

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        last = self.io.last_load
        say(f"START rank={trainer.global_rank} step={trainer.global_step}"
            f" commit={last.commit if last is not None else None} tier={last.tier if last is not None else None}")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.step = checkpoint["global_step"]


#: Steps after whose save the training thread stops (``hold`` "after:<step>"): no later save can land before the
#: parent's SIGKILL, however long the background windows it waits for take to open on a busy machine.
_STOP_AFTER: set[int] = set()


class Announcing(AtomicCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        say(f"SAVED {checkpoint['global_step']}")
        if checkpoint["global_step"] in _STOP_AFTER:
            time.sleep(60)


def _announce_sharded(cls: type) -> type:
    class Announced(cls):  # type: ignore[valid-type,misc]
        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            step = checkpoint["global_step"]
            super().save_checkpoint(checkpoint, filepath, storage_options)
            if self.global_rank == 0:
                say(f"SAVED {step}")

    return Announced


def _hold_after_write(step: int, thread: str, label: str, held: list[int]) -> None:
    """Once a thread named ``thread...`` has written the first object of ``step``'s commit into a local tier: print
    ``<label> <step>`` and stop there (the window of the parent's SIGKILL)."""
    write = replicas._write

    def write_then_hold(local: Any, manifest: Any, index: int, data: Any) -> None:
        write(local, manifest, index, data)
        if manifest.step == step and threading.current_thread().name.startswith(thread) and not held:
            held.append(step)
            say(f"{label} {manifest.step}")
            time.sleep(60)

    replicas._write = write_then_hold


def hold(where: str) -> None:
    """Stop at the instants a test kills the job in (see the module docstring): ``receive:<step>``,
    ``persist:<step>``, ``restored:<step>``, comma-separated."""
    for what in where.split(","):
        kind, step = what.split(":")
        held: list[int] = []  # each window once (a copy writes several objects)
        if kind == "after":
            _STOP_AFTER.add(int(step))
        elif kind in ("receive", "restored"):
            # receive: a replica arrives in the background rounds' thread (the training thread writes the common
            # objects of a sharded save the same way); restored: the copy a resume restored, written behind training
            # (CheckpointRoot.finish_later's thread).
            thread, label = {"receive": ("lightning_resilient-replicas", "RECEIVING"),
                             "restored": ("lightning_resilient-the-copy", "RESTORED")}[kind]
            _hold_after_write(int(step), thread, label, held)
        elif kind == "persist":
            copy = tiered.TieredRoot._copy

            def copy_then_hold(self: Any, manifest: Any, step: int = int(step), copy: Any = copy,
                               held: list[int] = held) -> Any:
                out = copy(self, manifest)
                if manifest.step == step and not held:
                    held.append(step)
                    say(f"COPIED {manifest.step}")
                    time.sleep(60)
                return out

            tiered.TieredRoot._copy = copy_then_hold  # type: ignore[method-assign]


def announce_persists() -> None:
    persist = tiered.TieredRoot._persist

    def announced(self: Any, entry: Any, **kwargs: Any) -> None:
        persist(self, entry, **kwargs)
        if entry.commit in self._persisted:
            say(f"PERSISTED {entry.step}")

    tiered.TieredRoot._persist = announced  # type: ignore[method-assign]


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    model = trainer.strategy.model
    if isinstance(trainer.strategy, AtomicFSDPStrategy):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False)):
            return model.state_dict()
    if isinstance(trainer.strategy, AtomicModelParallelStrategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return trainer.lightning_module.state_dict()


def main(root: str, out: str, options: dict[str, Any]) -> None:
    torch.manual_seed(7)
    x = torch.randn(64, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    announce_persists()
    if options.get("hold"):
        hold(options["hold"])
    nodes, devices = options["nodes"], options["devices"]
    kind = options.get("strategy", "ddp")
    if kind == "model_parallel":
        strategy: Any = _announce_sharded(AtomicModelParallelStrategy)(data_parallel_size=nodes * devices,
                                                                       tensor_parallel_size=1)
    elif kind == "fsdp":
        strategy = _announce_sharded(AtomicFSDPStrategy)()
    else:
        # find_unused_parameters=True keeps DDP's buckets as built: bit-exact resumes (see docs/multi-node.md).
        strategy = DDPStrategy(find_unused_parameters=True)
    local_tier = os.environ.get("LOCAL_TIER") if options.get("tier", True) else None
    io_class = Announcing if kind == "ddp" else AtomicCheckpointIO
    dedup = bool(options.get("dedup"))
    io = io_class(local_tier=local_tier, persist_every=options.get("persist_every", 1),
                  replicas=options.get("replicas"), local_keep=2, dedup=dedup) if local_tier else io_class(dedup=dedup)
    report = Report(io, out)
    trainer = Trainer(accelerator="cpu", num_nodes=nodes, devices=devices, strategy=strategy,
                      max_steps=options["max_steps"], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[io],
                      callbacks=[ResumeStateCallback(), report,
                                 ModelCheckpoint(dirpath=root, every_n_train_steps=options["every"], save_top_k=-1)])
    # The job's newest across every node's tier: rank 0 decides for all. A first run has nothing anywhere (the first
    # save claims the durable root: a local commit never exists without it). Every node sees the same root here.
    resume = Path(root, ".lightning_resilient").exists()
    ckpt_path = root if resume else None
    if options.get("resume") == "each":
        # The idiom as README shows it: every node asks its own view (its local tier, the durable root); a replaced
        # node's empty tier answers with an older commit, or None. The plugin makes one decision for the job.
        ckpt_path = find_latest_checkpoint(root, local_tier=local_tier)
        say(f"GIVEN rank={os.environ.get('NODE_RANK')} {ckpt_path}")
    trainer.fit(Net(frozen=bool(options.get("frozen"))), loader, ckpt_path=ckpt_path)
    weights = full_weights(trainer)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in weights.items()}, out)
    say("DONE")
    sys.stdout.flush()
    os._exit(0)  # gloo (and FSDP) teardown at interpreter exit can abort on CPU (see tests/io/sharded_child.py)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
