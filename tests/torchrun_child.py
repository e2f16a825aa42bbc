"""One rank of a 2-process gloo group created as a torchrun attempt creates it: ``python torchrun_child.py RANK ROLE``
(ROLE ``early`` or ``late``), with torchrun's variables set by the test and ``MASTER_ADDR``/``MASTER_PORT`` naming a
TCPStore the test holds for the agent's (it outlives every attempt, as torchrun's does).

The group is created with ``env://`` (as Lightning does) inside ``attempt_scoped_init(attempt_prefix())``, or plainly
where ``attempt_prefix()`` is None; then rank + 1 is all-reduced, ``SUM <value>`` printed, and the process ends at
once, as a killed one would. The early rank sets ``test/attempt-<n>/entering`` just before it creates the group; the
late one waits for that key and 2 s more: so the early rank reads its peer's address before the late one has
published it, the order a loaded machine makes by chance.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_resilient.torchrun import attempt_prefix, attempt_scoped_init


def main(rank: int, role: str) -> None:
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    attempt = f"test/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    entering, done = f"{attempt}/entering", f"{attempt}/done"
    if role == "late":
        agent.wait([entering])
        time.sleep(2)
    else:
        agent.set(entering, "1")
    prefix = attempt_prefix()
    with attempt_scoped_init(prefix) if prefix is not None else contextlib.nullcontext():
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    print(f"SUM {value.item():g}", flush=True)
    # Then end as a killed rank does, without destroying the group (its keys stay in the store; the interpreter's own
    # exit would abort in gloo's threads), once both ranks are past the all-reduce.
    agent.set(f"{done}/{rank}", "1")
    agent.wait([f"{done}/0", f"{done}/1"])
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
