"""Tiered checkpoints (``local_tier=``, ``persist_every=``): what is persisted, what a resume picks, fencing across
tiers. The real-process kill test (SIGKILL during saves and during a persist, restarts on the same node, a new node
and over a damaged local copy, bit-identical to an uninterrupted run) is ``test_tiered_crash.py``."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient import AtomicCheckpointIO, StaleWriterError, find_latest_checkpoint
from lightning_resilient.io.catalog import reader
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.tiered import local_tier_url

from .helpers import assert_same, make_checkpoint


def plugin(local: Path, backend: Any, **kwargs: Any) -> AtomicCheckpointIO:
    return AtomicCheckpointIO(storage_options=backend.storage_options, local_tier=str(local), **kwargs)


def save_steps(io: AtomicCheckpointIO, backend: Any, steps: range, *, last: bool = True) -> None:
    for step in steps:
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
        if last:
            io.save_checkpoint(make_checkpoint(step), backend.url("last.ckpt"))


def pointer_steps(root: str, options: dict[str, Any] | None = None) -> dict[str, int]:
    pointer, _ = reader(root, options).read_pointer()
    assert pointer is not None
    return {name: entry.step for name, entry in pointer.checkpoints.items()}


def damage(root: str, commit: str) -> None:
    """Overwrite the first tensor object of ``commit`` under the local root ``root`` (same size, other bytes)."""
    manifest = reader(root).read_manifest(commit)
    path = Path(root, manifest.objects[manifest.stream[0]].path)
    path.write_bytes(b"\0" * path.stat().st_size)


def local_root(local: Path, backend: Any) -> str:
    return local_tier_url(str(local), reader(backend.root, backend.storage_options).url)


@pytest.fixture(params=["local", "s3"])
def durable(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_backend")


def test_every_nth_step_and_the_last_are_persisted_and_the_local_tier_keeps_local_keep(durable, tmp_path):
    io = plugin(tmp_path / "nvme", durable, persist_every=4, local_keep=2)
    save_steps(io, durable, range(1, 11))
    io.wait()
    assert sorted(set(pointer_steps(durable.root, durable.storage_options).values())) == [4, 8]
    io.teardown()  # the end of fit: the newest step (both its names) goes to the durable root too
    durable_names = pointer_steps(durable.root, durable.storage_options)
    assert durable_names == {"step=4.ckpt": 4, "step=8.ckpt": 8, "step=10.ckpt": 10, "last.ckpt": 10}
    assert pointer_steps(local_root(tmp_path / "nvme", durable)) == {"step=9.ckpt": 9, "step=10.ckpt": 10,
                                                                   "last.ckpt": 10}
    # The durable copies are whole checkpoints of their own: every byte verifies there, without the local tier.
    shutil.rmtree(tmp_path / "nvme")
    found = find_latest_checkpoint(durable.root, durable.storage_options)
    loaded = AtomicCheckpointIO(storage_options=durable.storage_options).load_checkpoint(found)
    assert_same(loaded, make_checkpoint(10))


def test_a_resume_takes_the_newest_copy_local_first_then_durable_then_older(local_backend, tmp_path):
    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=4)
    save_steps(io, local_backend, range(1, 7))  # durable: 4; local: 5, 6
    io.wait()

    def resume() -> tuple[str | None, dict[str, Any]]:
        url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
        assert url is not None
        return url, plugin(nvme, local_backend, claim_on_load=False).load_checkpoint(url)

    # (a) same node: the newest, from the local tier, under the durable root's URL
    url, loaded = resume()
    assert loaded["global_step"] == 6 and url.startswith(str(Path(local_backend.root).resolve()))
    assert not os.path.exists(os.path.join(local_backend.root, url.split("/")[-2], url.split("/")[-1]))
    # (c) the local copy damaged: the previous one (local step 5), with a loud warning
    damage(local_root(nvme, local_backend), "/".join(url.split("/")[-2:]))
    with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):
        _, loaded = resume()
    assert loaded["global_step"] == 5
    # (b) a new node: nothing local, the durable tier's newest
    shutil.rmtree(nvme)
    _, loaded = resume()
    assert loaded["global_step"] == 4


def test_a_damaged_local_copy_of_a_durable_step_loads_the_durable_copy_of_that_step(local_backend, tmp_path):
    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=4)
    save_steps(io, local_backend, range(1, 9), last=False)  # durable: 4, 8; local: 7, 8
    io.wait()
    url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
    assert url is not None
    damage(local_root(nvme, local_backend), "/".join(url.split("/")[-2:]))
    with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):
        loaded = plugin(nvme, local_backend, claim_on_load=False).load_checkpoint(url)
    assert_same(loaded, make_checkpoint(8))


def test_a_damaged_local_copy_is_never_persisted(local_backend, tmp_path):
    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=100)
    save_steps(io, local_backend, range(1, 3), last=False)
    lroot = local_root(nvme, local_backend)
    pointer, _ = reader(lroot).read_pointer()
    assert pointer is not None and pointer.latest is not None
    damage(lroot, pointer.latest.commit)
    with pytest.raises(Exception, match="does not match its manifest"):
        io.teardown()
    pointer, _ = reader(local_backend.root).read_pointer()
    assert pointer is not None and pointer.latest is None and not pointer.checkpoints  # claimed, nothing persisted
    assert not list(Path(local_backend.root, "step=2.ckpt").glob(f"*/{MANIFEST_NAME}"))


def test_a_fenced_job_keeps_its_local_tier_but_never_moves_the_durable_pointer(s3_backend, tmp_path):
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    old = plugin(node_a, s3_backend, persist_every=2)
    save_steps(old, s3_backend, range(1, 5), last=False)  # durable: 2, 4
    old.wait()
    # A replacement job on another node resumes the durable root's newest (4) and claims it.
    new = plugin(node_b, s3_backend, persist_every=2, claim_on_load=True)
    new.load_checkpoint(find_latest_checkpoint(s3_backend.root, s3_backend.storage_options, local_tier=str(node_b)))
    # The old job goes on: its local saves may still happen, its persists are refused, and it is told.
    with pytest.raises(StaleWriterError):
        save_steps(old, s3_backend, range(5, 9), last=False)
        old.teardown()
    assert pointer_steps(s3_backend.root, s3_backend.storage_options) == {"step=2.ckpt": 2, "step=4.ckpt": 4}
    # A job restarted on the old job's node does not take the old job's local checkpoints past the fork (step 4).
    url = find_latest_checkpoint(s3_backend.root, s3_backend.storage_options, local_tier=str(node_a))
    loaded = plugin(node_a, s3_backend, claim_on_load=False).load_checkpoint(url)
    assert loaded["global_step"] == 4
    # The new job's own local saves continue the lineage.
    save_steps(new, s3_backend, range(5, 7), last=False)
    new.teardown()
    assert pointer_steps(s3_backend.root, s3_backend.storage_options)["step=6.ckpt"] == 6


def test_a_resume_from_a_local_only_checkpoint_records_it_as_the_origin(local_backend, tmp_path):
    nvme = tmp_path / "nvme"
    first = plugin(nvme, local_backend, persist_every=4)
    save_steps(first, local_backend, range(1, 7), last=False)  # durable: 4; local only: 5, 6
    first.wait()
    second = plugin(nvme, local_backend, persist_every=4, claim_on_load=True)
    loaded = second.load_checkpoint(find_latest_checkpoint(local_backend.root, local_tier=str(nvme)))
    assert loaded["global_step"] == 6
    save_steps(second, local_backend, range(7, 9), last=False)
    second.teardown()
    pointer, _ = reader(local_backend.root).read_pointer()
    assert pointer is not None
    assert pointer.origins[pointer.writer_epoch].step == 6  # the lineage goes through the local-only step 6
    # The first save after a resume from a local-only checkpoint is persisted (the durable tier was behind), the
    # last of the job too; the durable step 4 stays in the lineage (a fallback).
    assert [e.step for e in pointer.candidates()] == [8, 7, 4]


def test_a_top_k_save_and_last_at_one_step_share_their_bytes_in_both_tiers(local_backend, tmp_path):
    io = plugin(tmp_path / "nvme", local_backend, persist_every=1)
    save_steps(io, local_backend, range(1, 3))
    io.teardown()
    pointer, _ = reader(local_backend.root).read_pointer()
    assert pointer is not None
    last, top = pointer.checkpoints["last.ckpt"], pointer.checkpoints["step=2.ckpt"]
    assert top.commit in last.folders  # last.ckpt references step=2's shards in the durable root too
    manifest = reader(local_backend.root).read_manifest(last.commit)
    assert all(os.path.exists(os.path.join(local_backend.root, o.path)) for o in manifest.objects)


def test_settings_are_checked_at_construction(tmp_path):
    with pytest.raises(ValueError, match="persist_every=4 needs local_tier"):
        AtomicCheckpointIO(persist_every=4)
    with pytest.raises(ValueError, match="local_tier must be a node-local folder"):
        AtomicCheckpointIO(local_tier="s3://bucket/x")
    with pytest.raises(ValueError, match="persist_every must be an int >= 1"):
        AtomicCheckpointIO(local_tier=str(tmp_path), persist_every=0)
    with pytest.raises(ValueError, match="local_keep must be an int >= 1"):
        AtomicCheckpointIO(local_tier=str(tmp_path), local_keep=0)
    with pytest.raises(TypeError, match="local_tier must be a node-local folder path"):
        AtomicCheckpointIO(local_tier=3)  # type: ignore[arg-type]


def test_the_plugin_with_a_local_tier_pickles(tmp_path):
    import pickle

    io = AtomicCheckpointIO(local_tier=str(tmp_path / "nvme"), persist_every=3)
    io.save_checkpoint(make_checkpoint(1), str(tmp_path / "ckpt" / "a.ckpt"))
    clone = pickle.loads(pickle.dumps(io))
    assert clone.local_tier == io.local_tier and clone.persist_every == 3 and clone._tiers == {}
    io.teardown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(AtomicCheckpointIO().load_checkpoint(str(tmp_path / "ckpt" / "a.ckpt"))["state_dict"]
                           ["layer.weight"], make_checkpoint(1)["state_dict"]["layer.weight"])


def test_ls_shows_both_tiers_and_gc_cleans_both(local_backend, tmp_path, capsys):
    from lightning_resilient.cli import main

    nvme = tmp_path / "nvme"
    lroot = Path(local_root(nvme, local_backend))
    crashed = lroot / "step=9.ckpt" / "c0000000000001-e0-00000000"  # a crashed save of an older writer
    crashed.mkdir(parents=True)
    (crashed / "shard-00000.bin").write_bytes(b"x")
    io = plugin(nvme, local_backend, persist_every=4)  # (its own collection leaves it for an hour)
    save_steps(io, local_backend, range(1, 7), last=False)  # durable: 4; local: 5, 6
    io.wait()
    assert main(["ls", local_backend.root, "--local-tier", str(nvme)]) == 0
    out = capsys.readouterr().out
    assert f"local tier: {lroot}" in out
    assert "| step=6.ckpt | 6 | 1 |" in out and "| local only |" in out
    assert "a resume on this node loads step=6.ckpt (step 6) from the local tier" in out
    assert main(["gc", local_backend.root, "--local-tier", str(nvme), "--grace", "0"]) == 0
    assert str(crashed) in capsys.readouterr().out and not crashed.exists()
    damage(str(lroot), reader(str(lroot)).read_pointer()[0].latest.commit)
    assert main(["ls", local_backend.root, "--local-tier", str(nvme)]) == 1
