"""A 2-process Lightning Fabric DDP job (gloo, CPU) for the Fabric test: python fabric_child.py ROOT STEPS.

Every rank resumes ``find_latest_checkpoint(ROOT)`` (rank 0 resolves it and broadcasts it: one decision for the job)
with ``fabric.load`` when there is one, then trains STEPS steps and saves each with ``fabric.save`` (which reaches the
plugin on rank 0 only). Each rank prints what it loaded and the writer epoch its plugin holds of ROOT at the end.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.fabric import Fabric

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint


def main(root: str, steps: int) -> None:
    io = AtomicCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "global_step": 0}
    path = fabric.broadcast(find_latest_checkpoint(root) if fabric.global_rank == 0 else None)
    if path is not None:
        fabric.load(path, state)
    print(f"LOADED rank={fabric.global_rank} step={state['global_step']}\n", end="", flush=True)
    for _ in range(steps):
        fabric.backward(model(torch.full((3, 4), float(fabric.global_rank + 1))).square().sum())
        optimizer.step()
        optimizer.zero_grad()
        state["global_step"] += 1
        fabric.save(f"{root}/step={state['global_step']}.ckpt", state)
    fabric.barrier()
    print(f"END rank={fabric.global_rank} writer_epoch={io.root(root).writer_epoch}\n", end="", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    # The run is over: skip the interpreter's teardown, where gloo's threads can abort a rank on CPU (see
    # tests/restart_child.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
