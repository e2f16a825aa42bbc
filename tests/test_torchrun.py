"""torchrun's in-job restart: a restarted attempt creates its process group under keys of its own in the agent's store,
so it never connects to a peer of the attempt before it. The whole restart under torchrun (a rank SIGKILLed, the
group resuming bit-identical) is ``tests/test_restarts.py``; here the race it used to lose on a loaded machine is made
on purpose, and which Trainers get the prefix."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_resilient import AtomicCheckpointIO
from lightning_resilient.torchrun import attempt_prefix
from tests import procs

CHILD = Path(__file__).parent / "torchrun_child.py"
ONE_AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"}


@pytest.mark.parametrize(("change", "expected"), [
    ({}, "lightning_resilient/attempt-2"),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, None),  # the workers' rank 0 hosts a new store every attempt
    ({"TORCHELASTIC_USE_AGENT_STORE": None}, None),  # not under torchrun
    ({"GROUP_WORLD_SIZE": "2"}, None),  # two agents may count restarts differently
    ({"TORCHELASTIC_RESTART_COUNT": None}, None),
])
def test_the_prefix_names_the_attempt_only_where_every_rank_names_it_alike(change, expected):
    environ = {k: v for k, v in {**ONE_AGENT, **change}.items() if v is not None}
    assert attempt_prefix(environ) == expected


def _trainer(plugins: list[object]) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=plugins)


def test_a_trainer_with_the_plugin_creates_its_process_group_under_the_attempts_prefix(monkeypatch):
    for name, value in ONE_AGENT.items():
        monkeypatch.setenv(name, value)
    original = dist.init_process_group
    trainer = _trainer([AtomicCheckpointIO()])
    strategy = trainer.strategy
    copy = pickle.loads(pickle.dumps(strategy))  # the strategy stays picklable (ddp_spawn, deepcopy) and scoped
    assert vars(copy)["setup_environment"].strategy is copy
    seen = []
    # The strategy's own setup_environment sets the device up, where DDP then creates the group: what would it call?
    monkeypatch.setattr(strategy.accelerator, "setup_device", lambda device: seen.append(dist.init_process_group))
    strategy.setup_environment()
    assert len(seen) == 1 and seen[0] is not original and seen[0].__qualname__.startswith("attempt_scoped_init")
    # Once: the strategy has its class's method again, and torch its own function.
    assert "setup_environment" not in vars(strategy) and dist.init_process_group is original
    strategy.setup_environment()
    assert seen[1] is original

    # Without the plugin, or with two agents, nothing changes.
    assert "setup_environment" not in vars(_trainer([]).strategy)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert "setup_environment" not in vars(_trainer([AtomicCheckpointIO()]).strategy)


@pytest.mark.slow
def test_a_restarted_rank_waits_for_its_peers_of_the_same_attempt_not_the_killed_ones():
    """Three attempts of a 2-rank gloo group through one store that outlives them, as torchrun's agent store does;
    in the restarts one rank reaches the group well after the other (first rank 1, then rank 0). Before the prefix,
    the early rank read the late one's address of the previous attempt and failed ("connectFullMesh failed ...
    Connection refused") or waited for a connection that never came, unless the ports happened to make the late rank
    the one that connects (about one restart in four)."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    base = {**os.environ, "PYTHONPATH": str(CHILD.parents[1]), "OMP_NUM_THREADS": "1", **ONE_AGENT,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "WORLD_SIZE": "2"}
    for attempt, late in ((0, None), (1, 1), (2, 0)):
        env = {**base, "TORCHELASTIC_RESTART_COUNT": str(attempt)}
        ranks = [procs.popen([sys.executable, str(CHILD), str(rank), "late" if rank == late else "early"],
                             env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True) for rank in (0, 1)]
        try:
            outputs = [rank.communicate(timeout=120) for rank in ranks]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        for rank, (out, err) in zip(ranks, outputs, strict=True):
            assert rank.returncode == 0 and out.splitlines() == ["SUM 3"], f"attempt {attempt}: {err[-3000:]}"
