"""Two "nodes" x two processes on this machine (Lightning's ``num_nodes=2``, ``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``):
a kill mid-save, then the same job again. Every rank resumes the one commit rank 0 chose (even when the second
node's processes were handed an older one), each node reads it from the store once (counted through a loopback
proxy per node), and the run ends bit-identical to an uninterrupted one.

What this proves on one machine: the protocol, the per-job decision and the node-local cache across two node
ranks and four processes, over real TCP (gloo) and a real S3 server. What it cannot: separate kernels and disks,
network partitions between nodes, NCCL, and a store that is slower for one node than another.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.testing import StoreProxy
from tests import procs

from .helpers import read_pointer
from .test_crash import _env

CHILD = Path(__file__).with_name("multinode_child.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node's launcher process (it starts the node's second process); its output, read as it comes."""

    def __init__(self, rank: int, root: str, out: Path, options: dict, env: dict[str, str]) -> None:
        self.proc = procs.popen([sys.executable, str(CHILD), root, str(out), json.dumps(options)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        self.lines: list[str] = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


def launch(root: str, out: Path, options: dict, node_env: list[dict[str, str]]) -> list[Node]:
    port = str(free_port())
    return [Node(rank, root, out, {**options, **node_env[rank].pop("_options", {})},
                 {**_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank)), **node_env[rank]})
            for rank in range(2)]


def finish(nodes: list[Node], timeout: float = 300) -> list[str]:
    for node in nodes:
        node.proc.wait(timeout=timeout)
        assert node.proc.returncode == 0, node.err[-4000:]
    time.sleep(0.2)  # the reader threads drain the last lines
    return [line for node in nodes for line in node.lines]


@pytest.mark.slow
def test_two_nodes_resume_one_commit_reading_the_store_once_per_node(s3_backend, tmp_path):
    options = {"max_steps": 12, "every": 4}
    with StoreProxy(s3_backend.endpoint) as node0, StoreProxy(s3_backend.endpoint, latency=0.05) as node1:
        def node_env(ckpt: str) -> list[dict]:
            return [{"TMPDIR": str(tmp_path / f"node{rank}"), "AWS_ENDPOINT_URL": proxy.url,
                     "_options": {"ckpt": ckpt, "storage_options": {"client_kwargs": {"endpoint_url": proxy.url}}}}
                    for rank, proxy in enumerate((node0, node1))]

        for rank in range(2):
            (tmp_path / f"node{rank}").mkdir()
        full_root = s3_backend.url("uninterrupted")
        finish(launch(full_root, tmp_path / "full.pt", options, node_env("none")))

        root = s3_backend.url("run")
        node0.latency = 0.1  # rank 0's saves go through node 0's endpoint: slow, so the kill lands inside one
        nodes = launch(root, tmp_path / "part.pt", options, node_env("none"))
        deadline = time.monotonic() + 240
        while "BEGIN 12" not in nodes[0].lines and time.monotonic() < deadline:  # rank 0 is saving step 12
            time.sleep(0.01)
        assert "END 8" in nodes[0].lines, nodes[0].lines
        for node in nodes:
            node.kill()
        node0.latency = 0.0
        assert read_pointer(s3_backend_at(s3_backend, "run")).latest.step == 8  # 12 never committed

        node0.requests.clear()
        node1.requests.clear()
        # The second node's processes are handed the oldest checkpoint (they looked it up before the old job's
        # last commit): every rank still loads the commit rank 0 chose.
        lines = finish(launch(root, tmp_path / "part.pt", options, node_env("stale")))

    starts = dict(re.findall(r"START rank=(\d) step=\d+ commit=(\S+)", " ".join(lines)))
    oldest = read_pointer(s3_backend_at(s3_backend, "run")).candidates()[-1]
    assert oldest.step == 4  # what the second node's processes were handed
    assert set(starts) == {"0", "1", "2", "3"}, lines
    assert len(set(starts.values())) == 1, starts  # one commit for the whole job
    commit = next(iter(starts.values()))
    assert commit.startswith("epoch=") and "-step=8.ckpt/" in commit, starts
    manifest = json.loads(s3_backend.fs().cat_file(s3_backend.path(f"run/{commit}/{MANIFEST_NAME}")))["body"]
    chunks = sum(len(o["chunks"]) for o in manifest["objects"])
    for proxy in (node0, node1):  # the data of the resumed commit: once per node, not once per rank
        paths = [unquote(p.split("?")[0]) for m, p in proxy.requests if m == "GET"]
        assert sum(1 for p in paths if f"/{commit}/" in p and not p.endswith(MANIFEST_NAME)) == chunks
    full, part = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "part.pt")
    assert full.keys() == part.keys() and all(torch.equal(full[k], part[k]) for k in full), "not bit-identical"


def s3_backend_at(backend, sub: str):
    """The same bucket, another root under it."""
    from ..conftest import Backend

    return Backend(backend.kind, backend.url(sub), backend.storage_options, backend.endpoint)
