"""Collectives between a job's processes are bounded and named (io/collectives.py): a rank whose peer never joins
fails within the group's timeout with a :class:`~lightning_resilient.CollectiveError` naming the rank and the
operation, instead of torch's bare ``RuntimeError`` or a hang. Two real gloo processes, no Lightning."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from lightning_resilient.errors import CollectiveError
    from lightning_resilient.io.replicas import Nodes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    nodes = Nodes.join(rank, 0, timeout=2.0)
    if rank == 1:
        time.sleep(8)  # took another path: never joins the broadcast below
        os._exit(0)  # (gloo's teardown at interpreter exit can abort with work pending: see tests/io/sharded_child.py)
    started = time.monotonic()
    try:
        nodes.broadcast({"plan": 1}, "the test's resume plan")
        result = {"raised": None}
    except CollectiveError as exc:
        result = {"raised": str(exc), "seconds": time.monotonic() - started}
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # the timed-out broadcast is still pending in gloo: its teardown at exit aborts (SIGABRT, once in CI)


@pytest.mark.slow
def test_a_collective_whose_peer_never_joins_fails_within_the_timeout_naming_the_rank_and_the_operation(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.json"
    mp.start_processes(_rank, args=(_free_port(), str(out)), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    message = result["raised"]
    assert message is not None, "rank 0 waited for its peer and never raised"
    assert message.startswith("rank 0: the test's resume plan timed out")
    assert "collective_timeout=2" in message and "took another path" in message
