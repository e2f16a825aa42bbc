"""AtomicModelParallelStrategy and AtomicFSDPStrategy: what is checked when they are built, given plugins, and asked
to resume a checkpoint they cannot.

Training through them needs a process group; that runs in subprocesses in tests/io/test_sharded.py.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_resilient import (
    AtomicCheckpointIO,
    AtomicFSDPStrategy,
    AtomicModelParallelStrategy,
    ShardedCheckpointError,
)
from lightning_resilient.io.sharded import save_sharded

STRATEGIES = [AtomicModelParallelStrategy, AtomicFSDPStrategy]


@pytest.mark.parametrize("cls", STRATEGIES)
def test_the_default_checkpoint_io_is_atomic_and_a_given_one_is_kept(cls):
    assert isinstance(cls().checkpoint_io, AtomicCheckpointIO)
    io = AtomicCheckpointIO(keep_last=2)
    strategy = cls()
    strategy.checkpoint_io = io
    assert strategy.checkpoint_io is io


@pytest.mark.parametrize("cls", STRATEGIES)
def test_another_checkpoint_io_is_refused_with_what_to_pass_instead(cls):
    strategy = cls()
    with pytest.raises(TypeError, match=rf"{cls.__name__} writes through lightning_resilient.AtomicCheckpointIO,"
                                        r" got TorchCheckpointIO: pass AtomicCheckpointIO"):
        strategy.checkpoint_io = TorchCheckpointIO()


@pytest.mark.parametrize("cls", STRATEGIES)
def test_a_local_tier_is_taken(cls, tmp_path):
    # Sharded saves commit each rank's shards to its node's local tier (tests/io/test_replicas.py runs them).
    strategy = cls()
    strategy.checkpoint_io = AtomicCheckpointIO(local_tier=str(tmp_path), persist_every=2)
    assert strategy.checkpoint_io.local_tier == str(tmp_path.resolve()) and strategy.checkpoint_io.persist_every == 2


def test_full_state_saves_are_refused_at_construction():
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        AtomicModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="state_dict_type='sharded'"):
        AtomicFSDPStrategy(state_dict_type="full")
    assert AtomicFSDPStrategy()._state_dict_type == "sharded"


@pytest.mark.parametrize(("writer_key", "cls", "names"), [("model", AtomicModelParallelStrategy, "AtomicFSDPStrategy"),
                                                          ("state_dict", AtomicFSDPStrategy,
                                                           "AtomicModelParallelStrategy")])
def test_a_checkpoint_of_the_other_sharded_strategy_is_refused_before_any_shard_is_read(tmp_path, writer_key, cls,
                                                                                        names):
    root_url = str(tmp_path / "root")
    io = AtomicCheckpointIO()
    save_sharded({writer_key: {"w": torch.ones(3)}}, io.root(root_url), "epoch=0-step=1.ckpt",
                 rest={"global_step": 1}, no_dist=True)
    strategy = cls()
    strategy.checkpoint_io = AtomicCheckpointIO(claim_on_load=False)
    with pytest.raises(ShardedCheckpointError, match=rf"holds no weights under .*written by another strategy; resume"
                                                      rf" it with {names}"):
        strategy.load_checkpoint(root_url)
