"""Tiered checkpoints (``local_tier=``, ``persist_every=``): what is persisted, what a resume picks, fencing across
tiers. The real-process kill test (SIGKILL during saves and during a persist, restarts on the same node, a new node
and over a damaged local copy, bit-identical to an uninterrupted run) is ``test_tiered_crash.py``."""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient import (
    AtomicCheckpointIO,
    CheckpointCorruptedError,
    PersistFailedError,
    RunExistsError,
    StaleWriterError,
    find_latest_checkpoint,
)
from lightning_resilient.cli import main
from lightning_resilient.io.catalog import reader
from lightning_resilient.io.local_tier import local_tier_url
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.tier_view import TierView, resolve_tiered

from ..conftest import Plugins
from .helpers import assert_same, make_checkpoint


@pytest.fixture
def plugin(plugins: Plugins) -> Callable[..., AtomicCheckpointIO]:
    """``plugin(local, backend, **kwargs)``: a plugin with the local tier ``local`` and the durable root on
    ``backend``'s store, released after the test whatever its outcome. A ``teardown()`` left in a test body is not
    that release: with a local tier it is the end of the job's fit (its last persist), which the test then checks."""

    def build(local: Path, backend: Any, **kwargs: Any) -> AtomicCheckpointIO:
        return plugins.track(AtomicCheckpointIO(storage_options=backend.storage_options, local_tier=str(local),
                                                **kwargs))

    return build


def save_steps(io: AtomicCheckpointIO, backend: Any, steps: range, *, last: bool = True) -> None:
    """Save ``steps`` (and last.ckpt at each), each step's persist done before the next step is saved: a persist
    that has not started when a newer one is queued is skipped by design (test_a_slow_store_never_builds_a_backlog),
    which would make the exact durable steps depend on the machine's speed."""
    for step in steps:
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
        if last:
            io.save_checkpoint(make_checkpoint(step), backend.url("last.ckpt"))
        io.wait()


def durable_steps(backend: Any) -> list[int]:
    pointer, _ = reader(backend.root, backend.storage_options).read_pointer()
    return sorted(e.step for e in pointer.entries()) if pointer is not None else []


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


def test_every_nth_step_and_the_last_are_persisted_and_the_local_tier_keeps_local_keep(durable, tmp_path, plugin):
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


def test_a_resume_takes_the_newest_copy_local_first_then_durable_then_older(local_backend, tmp_path, plugin, plugins):
    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=4)
    plugins.abandoned(io)  # its node's local tier is deleted below: the job never ends there
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


def test_a_damaged_local_copy_of_a_durable_step_loads_the_durable_copy_of_that_step(local_backend, tmp_path, plugin):
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


def test_a_damaged_local_copy_is_never_persisted(local_backend, tmp_path, plugin, plugins):
    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=100)
    save_steps(io, local_backend, range(1, 3), last=False)
    lroot = local_root(nvme, local_backend)
    pointer, _ = reader(lroot).read_pointer()
    assert pointer is not None and pointer.latest is not None
    damage(lroot, pointer.latest.commit)
    with pytest.raises(Exception, match="does not match its manifest"):
        io.teardown()
    plugins.asserted(io, CheckpointCorruptedError)  # the release retries that persist: the same refusal
    pointer, _ = reader(local_backend.root).read_pointer()
    assert pointer is not None and pointer.latest is None and not pointer.checkpoints  # claimed, nothing persisted
    assert not list(Path(local_backend.root, "step=2.ckpt").glob(f"*/{MANIFEST_NAME}"))


def test_a_fenced_job_keeps_its_local_tier_but_never_moves_the_durable_pointer(s3_backend, tmp_path, plugin, plugins):
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
    plugins.asserted(old, StaleWriterError)  # the release retries its persist: refused the same way
    assert pointer_steps(s3_backend.root, s3_backend.storage_options) == {"step=2.ckpt": 2, "step=4.ckpt": 4}
    # A job restarted on the old job's node does not take the old job's local checkpoints past the fork (step 4).
    url = find_latest_checkpoint(s3_backend.root, s3_backend.storage_options, local_tier=str(node_a))
    loaded = plugin(node_a, s3_backend, claim_on_load=False).load_checkpoint(url)
    assert loaded["global_step"] == 4
    # The new job's own local saves continue the lineage.
    save_steps(new, s3_backend, range(5, 7), last=False)
    new.teardown()
    assert pointer_steps(s3_backend.root, s3_backend.storage_options)["step=6.ckpt"] == 6


def test_a_resume_from_a_local_only_checkpoint_records_it_as_the_origin(local_backend, tmp_path, plugin, plugins):
    nvme = tmp_path / "nvme"
    first = plugin(nvme, local_backend, persist_every=4)
    plugins.abandoned(first)  # it dies here: the second job resumes its local-only step and fences it off
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


def test_a_job_killed_after_resuming_a_local_only_checkpoint_before_saving_resumes_it_again(local_backend, tmp_path,
                                                                                              plugin, plugins):
    """Nothing was ever persisted (the durable root holds only the first job's claim); the second job resumes the
    local-only step 4, claims the durable root with it as origin, and is killed before its first save. The third
    must resume step 4 again: the claim once pruned the first job's epoch from the durable pointer's origins, after
    which no local checkpoint counted as the lineage's and the restart failed ("has a pointer but no committed
    checkpoint of its current run yet")."""
    nvme = tmp_path / "nvme"
    first = plugin(nvme, local_backend, persist_every=100)
    plugins.abandoned(first)  # killed: nothing persisted
    save_steps(first, local_backend, range(1, 5), last=False)
    assert durable_steps(local_backend) == []
    for _ in range(2):  # the second job, killed right after its resume (and its claim); then the third
        job = plugin(nvme, local_backend, persist_every=100, claim_on_load=True)
        plugins.abandoned(job)
        assert job.load_checkpoint(local_backend.root)["global_step"] == 4
    pointer, _ = reader(local_backend.root).read_pointer()
    assert pointer is not None and pointer.writer_epoch == 3 and 1 in pointer.origins


def test_a_chain_of_resumes_of_local_only_checkpoints_keeps_every_older_one_as_a_fallback(local_backend, tmp_path,
                                                                                          plugin, plugins):
    """Nothing is ever persisted: job 1 saves steps 1-4, job 2 resumes 4 and saves 5-6, job 3 resumes 6 and saves 7;
    each is killed. The durable pointer's pruning keeps only the newest epochs' origins, but every local step stays
    a candidate of the lineage (newest first), and gc of the local tier deletes none of them."""
    nvme = tmp_path / "nvme"
    for steps in (range(1, 5), range(5, 7), range(7, 8)):
        job = plugin(nvme, local_backend, persist_every=100, local_keep=10, claim_on_load=True)
        plugins.abandoned(job)
        if steps.start > 1:
            assert job.load_checkpoint(local_backend.root)["global_step"] == steps.start - 1
        save_steps(job, local_backend, steps, last=False)
    pointer, _ = reader(local_backend.root).read_pointer()
    assert pointer is not None and 1 not in pointer.origins  # (pruned: the case this test is about)
    found = resolve_tiered(local_backend.root, str(nvme), lambda url: reader(url))
    assert found is not None
    assert [found.entry.step, *(e.step for e in found.fallbacks)] == [7, 6, 5, 4, 3, 2, 1]
    lroot = Path(local_root(nvme, local_backend))
    folders = sorted(p.name for p in lroot.iterdir() if p.name.startswith("step="))
    assert main(["gc", local_backend.root, "--local-tier", str(nvme), "--grace", "0"]) == 0
    assert sorted(p.name for p in lroot.iterdir() if p.name.startswith("step=")) == folders


def test_a_top_k_save_and_last_at_one_step_share_their_bytes_in_both_tiers(local_backend, tmp_path, plugin):
    io = plugin(tmp_path / "nvme", local_backend, persist_every=1)
    save_steps(io, local_backend, range(1, 3))  # persist_every=1: both steps are durable once it returns
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


def test_the_plugin_with_a_local_tier_pickles(tmp_path, plugins):
    import pickle

    io = plugins.track(AtomicCheckpointIO(local_tier=str(tmp_path / "nvme"), persist_every=3))
    io.save_checkpoint(make_checkpoint(1), str(tmp_path / "ckpt" / "a.ckpt"))
    clone = pickle.loads(pickle.dumps(io))
    assert clone.local_tier == io.local_tier and clone.persist_every == 3 and clone._tiers == {}
    io.teardown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(AtomicCheckpointIO().load_checkpoint(str(tmp_path / "ckpt" / "a.ckpt"))["state_dict"]
                           ["layer.weight"], make_checkpoint(1)["state_dict"]["layer.weight"])


def test_ls_shows_both_tiers_and_gc_cleans_both(local_backend, tmp_path, capsys, plugin, plugins):
    nvme = tmp_path / "nvme"
    lroot = Path(local_root(nvme, local_backend))
    crashed = lroot / "step=9.ckpt" / "c0000000000001-e0-00000000"  # a crashed save of an older writer
    crashed.mkdir(parents=True)
    (crashed / "shard-00000.bin").write_bytes(b"x")
    io = plugin(nvme, local_backend, persist_every=4)  # (its own collection leaves it for an hour)
    plugins.abandoned(io)  # the job never ends in this story: its newest local copy is damaged below
    save_steps(io, local_backend, range(1, 7), last=False)  # durable: 4; local: 5, 6
    io.wait()
    assert main(["ls", local_backend.root, "--local-tier", str(nvme)]) == 0
    out = capsys.readouterr().out
    assert f"local tier: {lroot}" in out
    assert "| step=6.ckpt | 6 | 1 |" in out and "| local only |" in out
    assert "a resume on this node tries step=6.ckpt (step 6) first, from the local tier" in out
    assert main(["gc", local_backend.root, "--local-tier", str(nvme), "--grace", "0"]) == 0
    assert str(crashed) in capsys.readouterr().out and not crashed.exists()
    damage(str(lroot), reader(str(lroot)).read_pointer()[0].latest.commit)
    assert main(["ls", local_backend.root, "--local-tier", str(nvme)]) == 1


# -- regressions of the adversarial review (each failed before its fix) ----------------------------------------------
def test_a_durable_root_deleted_and_written_again_never_resumes_the_old_local_tier(local_backend, tmp_path, plugin):
    nvme = tmp_path / "nvme"
    for job in range(3):  # three jobs of the old run: writer epochs 1..3, in both tiers
        io = plugin(nvme, local_backend, persist_every=2, claim_on_load=True)
        url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
        if url:
            io.load_checkpoint(url)
        save_steps(io, local_backend, range(job * 3 + 1, job * 3 + 4), last=False)
        io.teardown()
    shutil.rmtree(local_backend.root)  # the experiment is restarted from scratch under the same URL
    assert find_latest_checkpoint(local_backend.root, local_tier=str(nvme)) is None
    io = plugin(nvme, local_backend, persist_every=2)
    with pytest.warns(RuntimeWarning, match="earlier incarnation"):
        save_steps(io, local_backend, range(1, 2), last=False)  # the old local tier is set aside, kept
    assert list(nvme.glob("*.set-aside-*"))
    url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
    assert plugin(nvme, local_backend, claim_on_load=False).load_checkpoint(url)["global_step"] == 1


def test_a_durable_pointer_lost_and_rebuilt_keeps_the_local_tier(local_backend, tmp_path, plugin, plugins):
    """Only the durable pointer is lost (not the root): its rebuild keeps the root's incarnation, which the origin
    records carry, so the node's local tier still belongs to it: the next job on the node resumes the local-only
    newest step and writes on, nothing set aside."""
    from lightning_resilient import repair_pointer
    from lightning_resilient.io.pointer import POINTER_NAME

    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=4)
    plugins.abandoned(io)  # it dies: its local-only steps 5 and 6 are never persisted
    save_steps(io, local_backend, range(1, 7))  # durable: 4; local: 5, 6
    root_id = reader(local_backend.root).read_pointer()[0].root_id
    os.remove(os.path.join(local_backend.root, POINTER_NAME))
    repair_pointer(local_backend.root)
    assert reader(local_backend.root).read_pointer()[0].root_id == root_id
    # Step 4 was committed in the local tier (whose own pointer has another root_id) and persisted: its manifest
    # names the durable root's incarnation, so the rebuild, which ignores commits of other incarnations, keeps it.
    assert 4 in durable_steps(local_backend)
    durable = reader(local_backend.root)
    assert {durable.read_manifest(e.commit).root_id for e in durable.read_pointer()[0].entries()} == {root_id}
    url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
    again = plugin(nvme, local_backend, persist_every=4, claim_on_load=True)
    assert again.load_checkpoint(url)["global_step"] == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing set aside
        save_steps(again, local_backend, range(7, 8))
    assert not list(nvme.glob("*.set-aside-*"))
    url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
    assert plugin(nvme, local_backend, claim_on_load=False).load_checkpoint(url)["global_step"] == 7


def test_a_fresh_fit_with_a_reused_plugin_is_a_new_job(tmp_path, plugins):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import TinyModel, tiny_loader

    root, nvme = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    io = plugins.track(AtomicCheckpointIO(local_tier=nvme, persist_every=4, local_keep=2))

    def fit(steps: int, prefix: str) -> None:
        Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                enable_model_summary=False, plugins=[io],
                callbacks=[ModelCheckpoint(dirpath=root, filename=prefix + "-{step}", every_n_train_steps=1,
                                           save_top_k=-1)]).fit(TinyModel(), tiny_loader())

    fit(6, "a")
    with pytest.raises(RunExistsError, match="holds a committed run"):
        fit(3, "b")  # resumes nothing over the run: refused at its start, unless said to be a new run
    io.new_run = True
    with pytest.warns(RuntimeWarning, match="started from scratch"):
        fit(3, "b")  # a new model from step 0, same plugin and folder: a new lineage, not epoch 1 continued
    latest = find_latest_checkpoint(root, local_tier=nvme)
    assert latest is not None and "/b-step=3.ckpt/" in latest
    local = reader(local_tier_url(nvme, root)).read_pointer()[0]
    assert local is not None and {e.name for e in local.entries()} == {"b-step=2.ckpt", "b-step=3.ckpt"}
    durable = reader(root).read_pointer()[0]
    assert durable is not None and durable.latest.name == "b-step=3.ckpt"  # the last save of the fit persisted


def test_a_checkpoint_folder_inside_the_local_tier_is_refused(tmp_path, plugins):
    io = plugins.track(AtomicCheckpointIO(local_tier=str(tmp_path)))
    with pytest.raises(ValueError, match="is inside local_tier"):
        io.save_checkpoint(make_checkpoint(1), str(tmp_path / "run" / "ckpt" / "a.ckpt"))


def test_saves_without_a_step_are_states_of_their_own(local_backend, tmp_path, plugin):
    io = plugin(tmp_path / "nvme", local_backend, persist_every=2)
    for i in range(1, 9):
        state = make_checkpoint(1)
        state["global_step"] = 0
        io.save_checkpoint(state, local_backend.url(f"ckpt-{i}.pt"))
        io.wait()  # (each persist done before the next save: none is skipped for a newer one)
    io.teardown()
    assert sorted(pointer_steps(local_backend.root)) == ["ckpt-2.pt", "ckpt-4.pt", "ckpt-6.pt", "ckpt-8.pt"]


def test_a_failed_persist_never_costs_a_local_save_and_is_retried(local_backend, tmp_path, plugin):
    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=4)
    save_steps(io, local_backend, range(1, 7), last=False)  # durable: 4; local: 5, 6
    io.wait()
    store = io.tiers(local_backend.root).durable.store
    real = store.write_pieces

    def down(path: str, pieces: Any) -> None:
        raise ConnectionError("store unreachable (simulated)")

    store.write_pieces = down
    with pytest.raises(ConnectionError):
        io.persist_latest()
    with pytest.raises(ConnectionError):  # an emergency save: committed locally first, then the error is raised
        save_steps(io, local_backend, range(7, 8), last=False)
        io.persist_latest()
    assert "step=7.ckpt" in pointer_steps(local_root(nvme, local_backend))
    store.write_pieces = real  # the store is back: the newest state is persisted, not reported done without it
    io.teardown()
    assert pointer_steps(local_backend.root)["step=7.ckpt"] == 7


def test_teardown_persists_every_root_even_when_one_fails(local_backend, tmp_path, plugin, plugins):
    other = str(tmp_path / "periodic")
    io = plugin(tmp_path / "nvme", local_backend, persist_every=100)
    for step in range(1, 4):
        io.save_checkpoint(make_checkpoint(step), local_backend.url(f"step={step}.ckpt"))
        io.save_checkpoint(make_checkpoint(step), os.path.join(other, f"step={step}.ckpt"))
    io.wait()

    def down(path: str, pieces: Any) -> None:
        raise ConnectionError("first root unreachable (simulated)")

    io.tiers(local_backend.root).durable.store.write_pieces = down
    # The end of the fit says the newest state is not durable, naming where it is (the cause: the store's error).
    with pytest.raises(PersistFailedError, match=r"does not answer.*holds the newest checkpoints") as raised:
        io.teardown()
    assert isinstance(raised.value.__cause__, ConnectionError)
    plugins.asserted(io, PersistFailedError)  # the release retries the first root's persist: still unreachable
    assert pointer_steps(other) == {"step=3.ckpt": 3}


def test_last_ckpt_after_a_rollback_is_the_lineage_newest_never_the_abandoned_branch(local_backend, tmp_path, plugin):
    nvme = tmp_path / "nvme"
    first = plugin(nvme, local_backend, persist_every=4, local_keep=3)
    save_steps(first, local_backend, range(1, 11))
    first.teardown()  # durable: 4, 8, 10 (last.ckpt at 10)
    four = next(e for e in reader(local_backend.root).read_pointer()[0].entries() if e.step == 4)
    rollback = plugin(nvme, local_backend, persist_every=4, claim_on_load=True)
    rollback.load_checkpoint(local_backend.url(four.commit))  # claims, then dies before saving
    for node in (nvme, tmp_path / "other-node"):
        loaded = plugin(node, local_backend, claim_on_load=False).load_checkpoint(local_backend.url("last.ckpt"))
        assert loaded["global_step"] == 4


def test_a_symlinked_checkpoint_folder_finds_its_local_tier(tmp_path, plugins):
    real, link, nvme = tmp_path / "lustre" / "run", tmp_path / "scratch", str(tmp_path / "nvme")
    real.mkdir(parents=True)
    link.symlink_to(real.parent)
    io = plugins.track(AtomicCheckpointIO(local_tier=nvme, persist_every=4))
    for step in range(1, 7):
        io.save_checkpoint(make_checkpoint(step), str(link / "run" / f"step={step}.ckpt"))
    io.wait()
    for root in (str(link / "run"), str(real)):
        loader = plugins.track(AtomicCheckpointIO(local_tier=nvme, claim_on_load=False))
        assert loader.load_checkpoint(root)["global_step"] == 6 and loader.last_load.tier == "local"


def test_a_stock_last_ckpt_in_the_checkpoint_folder_is_replaced_by_the_first_persist(tmp_path, plugins):
    root, nvme = tmp_path / "ckpt", str(tmp_path / "nvme")
    root.mkdir()
    torch.save(make_checkpoint(3), root / "last.ckpt")  # a run from before the plugin
    io = plugins.track(AtomicCheckpointIO(local_tier=nvme, persist_every=2, claim_on_load=True))
    assert io.load_checkpoint(find_latest_checkpoint(str(root), local_tier=nvme))["global_step"] == 3
    for step in range(4, 8):
        io.save_checkpoint(make_checkpoint(step), str(root / f"step={step}.ckpt"))
        io.save_checkpoint(make_checkpoint(step), str(root / "last.ckpt"))
    io.teardown()
    assert pointer_steps(str(root))["last.ckpt"] == 7 and not (root / "last.ckpt").is_file()


def test_a_damaged_local_pointer_resumes_from_the_durable_tier_and_is_set_aside(local_backend, tmp_path, plugin):
    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=1)
    save_steps(io, local_backend, range(1, 4), last=False)
    io.teardown()
    pointer_file = Path(local_root(nvme, local_backend), ".lightning_resilient", "latest.json")
    pointer_file.write_bytes(b"\xdf" + pointer_file.read_bytes()[1:])
    with pytest.warns(RuntimeWarning, match="is unreadable"):
        url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
    nxt = plugin(nvme, local_backend, persist_every=1, claim_on_load=True)
    with pytest.warns(RuntimeWarning):
        assert nxt.load_checkpoint(url)["global_step"] == 3
    with pytest.warns(RuntimeWarning, match="was moved to"):
        save_steps(nxt, local_backend, range(4, 5), last=False)
    nxt.teardown()
    assert pointer_steps(local_root(nvme, local_backend)) == {"step=4.ckpt": 4}


def test_a_fenced_jobs_local_checkpoints_stay_out_after_the_durable_root_pruned_its_origins(tmp_path, plugins):
    root, node1, node2 = str(tmp_path / "ckpt"), str(tmp_path / "node1"), str(tmp_path / "node2")
    fenced = plugins.track(AtomicCheckpointIO(local_tier=node1, persist_every=4, local_keep=2))
    plugins.abandoned(fenced)  # fenced off by the jobs below: its end-of-fit persist would be refused
    for step in range(1, 12):
        fenced.save_checkpoint(make_checkpoint(step), os.path.join(root, f"step={step}.ckpt"))
    fenced.wait()  # durable: 4, 8; node1: 10, 11 (past the fork at 8 below)
    for first, last in ((9, 14), (15, 16), (17, 18), (19, 20)):  # four more jobs on node2: origins get pruned
        io = plugins.track(AtomicCheckpointIO(local_tier=node2, persist_every=1, keep_last=1, claim_on_load=True))
        io.load_checkpoint(find_latest_checkpoint(root, local_tier=node2))
        for step in range(first, last + 1):
            io.save_checkpoint(make_checkpoint(step), os.path.join(root, f"step={step}.ckpt"))
        io.teardown()
    durable = reader(root)
    view = TierView.read(durable, reader(local_tier_url(node1, durable.url)))
    assert [e.step for e in view.candidates()] == [20, 18]
    assert main(["gc", root, "--local-tier", node1, "--grace", "0"]) == 0  # and gc deletes them
    assert reader(local_tier_url(node1, durable.url)).read_pointer()[0].entries() == []


def test_a_slow_store_never_builds_a_backlog(local_backend, tmp_path, plugin):
    import time

    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=1, local_keep=2)
    store = io.tiers(local_backend.root).durable.store
    real = store.write_pieces

    def slow(path: str, pieces: Any) -> None:
        time.sleep(0.2)
        real(path, pieces)

    store.write_pieces = slow
    for step in range(1, 13):  # far faster than one persist each
        io.save_checkpoint(make_checkpoint(step), local_backend.url(f"step={step}.ckpt"))
    io.teardown()
    durable = pointer_steps(local_backend.root)
    assert durable["step=12.ckpt"] == 12 and len(durable) < 12  # the newest, with older ones skipped
    local = reader(local_root(nvme, local_backend)).read_pointer()[0]
    assert local is not None and not local.protected  # every hold released
    assert sorted(e.step for e in local.entries()) == [11, 12]  # local_keep held once the persists ended


def test_gc_and_readers_between_a_persists_copy_and_its_manifest_lose_nothing(local_backend, tmp_path, capsys, plugin):
    """The worst instant of a persist: its objects are in the durable root, its manifest is not. An operator's
    ``gc --grace 0`` on both tiers and readers of both run right then; the persist still commits, and every
    checkpoint of both tiers verifies."""
    from lightning_resilient.io import tiered

    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=2, local_keep=2)
    save_steps(io, local_backend, range(1, 3), last=False)  # durable: 2
    seen: list[int | None] = []
    copy = tiered.TieredRoot._copy

    def copy_then_interfere(self: Any, manifest: Any) -> Any:
        out = copy(self, manifest)
        assert main(["gc", local_backend.root, "--local-tier", str(nvme), "--grace", "0"]) == 0
        url = find_latest_checkpoint(local_backend.root, local_tier=str(nvme))
        seen.append(plugin(nvme, local_backend, claim_on_load=False).load_checkpoint(url)["global_step"])
        seen.append(AtomicCheckpointIO(claim_on_load=False).load_checkpoint(local_backend.root)["global_step"])
        return out

    tiered.TieredRoot._copy = copy_then_interfere  # type: ignore[method-assign]
    try:
        save_steps(io, local_backend, range(3, 5), last=False)  # step 4's persist meets the gc and the readers
    finally:
        tiered.TieredRoot._copy = copy  # type: ignore[method-assign]
    io.teardown()
    assert seen == [4, 2]  # the newest from the local tier; the durable root alone still at its previous one
    assert pointer_steps(local_backend.root) == {"step=2.ckpt": 2, "step=4.ckpt": 4}
    capsys.readouterr()
    assert main(["verify", local_backend.root, "--all", "--no-progress"]) == 0
    assert main(["ls", local_backend.root, "--local-tier", str(nvme)]) == 0  # exit 1 if any local copy failed


# -- a store outage (issue 30, point 5) ------------------------------------------------------------------------------
def _store_down(io: AtomicCheckpointIO, backend: Any) -> Callable[[], None]:
    """Make every write to the durable store fail (as an outage does, after the store's own retries); returns the
    function that brings it back."""
    store = io.tiers(backend.root).durable.store
    real = store.write_pieces

    def down(path: str, pieces: Any) -> None:
        raise ConnectionError("store unreachable (simulated)")

    store.write_pieces = down

    def back() -> None:
        store.write_pieces = real

    return back


def save_each(io: AtomicCheckpointIO, backend: Any, steps: range) -> None:
    """Save ``steps``, each one's persist over before the next save (without raising its failure, as a save does)."""
    for step in steps:
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
        io.tiers(backend.root).wait()


def test_a_store_outage_never_stops_training_until_the_bound_and_ls_says_so(local_backend, tmp_path, plugin, plugins,
                                                                            capsys):
    from lightning_resilient import PersistFailedError

    nvme = tmp_path / "nvme"
    io = plugin(nvme, local_backend, persist_every=1, max_persist_failures=3, retry_max_delay=0.001)
    save_each(io, local_backend, range(1, 3))  # durable: 1, 2
    back = _store_down(io, local_backend)
    with pytest.warns(RuntimeWarning, match=r"failed \(1 in a row\).*Training goes on from the local tier"):
        save_each(io, local_backend, range(3, 5))  # two failed persists: the saves go on
    assert io.tiers(local_backend.root).failures == 2
    assert main(["ls", local_backend.root, "--local-tier", str(nvme)]) == 0
    out = capsys.readouterr().out
    assert "persist: FAILING (2 failed in a row, since" in out and "store unreachable (simulated)" in out
    save_each(io, local_backend, range(5, 6))  # the third: the bound is reached
    with pytest.raises(PersistFailedError, match=r"3 persists in a row failed \(max_persist_failures=3\)") as info:
        io.save_checkpoint(make_checkpoint(6), local_backend.url("step=6.ckpt"))
    assert isinstance(info.value.__cause__, ConnectionError)
    io.tiers(local_backend.root).wait()  # (step 6's persist, queued by that save, fails too)
    assert pointer_steps(local_root(nvme, local_backend))["step=6.ckpt"] == 6  # committed locally all the same
    assert pointer_steps(local_backend.root) == {"step=1.ckpt": 1, "step=2.ckpt": 2}
    back()
    io.teardown()  # the store is back: the newest state is persisted
    assert pointer_steps(local_backend.root)["step=6.ckpt"] == 6
    assert main(["ls", local_backend.root, "--local-tier", str(nvme)]) == 0
    assert "persist: ok, step 6 durable" in capsys.readouterr().out


@pytest.mark.parametrize("delay", [0.001, 1000.0])
def test_a_failed_persist_is_retried_at_the_next_save_once_its_backoff_passed(local_backend, tmp_path, plugin, delay):
    io = plugin(tmp_path / "nvme", local_backend, persist_every=4, retry_max_delay=delay)
    save_each(io, local_backend, range(1, 4))
    back = _store_down(io, local_backend)
    with pytest.warns(RuntimeWarning, match="failed"):
        save_each(io, local_backend, range(4, 5))  # step 4's persist fails
    back()
    time.sleep(0.01)  # past the short backoff, far from the long one
    save_each(io, local_backend, range(5, 6))  # not a 4th step: persisted as the retry, if its backoff has passed
    durable = pointer_steps(local_backend.root)
    assert ("step=5.ckpt" in durable) == (delay < 1), durable
    assert "step=4.ckpt" not in durable  # the newest state is retried, never an older one


def test_a_persist_failing_for_longer_than_the_time_bound_stops_the_next_save(local_backend, tmp_path, plugin,
                                                                              plugins):
    import time

    from lightning_resilient import PersistFailedError

    io = plugin(tmp_path / "nvme", local_backend, persist_every=1, max_persist_failures=None,
                max_seconds_without_durable=0.05)
    plugins.abandoned(io)  # its store never comes back in this story: its release's wait says so, as asserted
    plugins.asserted(io, ConnectionError, PersistFailedError)
    _store_down(io, local_backend)
    with pytest.warns(RuntimeWarning, match="failed"):
        save_each(io, local_backend, range(1, 2))
    time.sleep(0.1)
    with pytest.raises(PersistFailedError, match=r"max_seconds_without_durable=0.05"):
        save_each(io, local_backend, range(2, 3))


def test_the_outage_and_replica_settings_are_checked_at_construction(tmp_path):
    with pytest.raises(ValueError, match="replicas=2 needs local_tier"):
        AtomicCheckpointIO(replicas=2)
    with pytest.raises(ValueError, match="replicas must be an int >= 1 or None"):
        AtomicCheckpointIO(local_tier=str(tmp_path), replicas=0)
    with pytest.raises(ValueError, match="max_persist_failures must be an int >= 1 or None"):
        AtomicCheckpointIO(local_tier=str(tmp_path), max_persist_failures=0)
    with pytest.raises(ValueError, match="max_seconds_without_durable must be > 0"):
        AtomicCheckpointIO(local_tier=str(tmp_path), max_seconds_without_durable=-1)
    with pytest.raises(TypeError, match="max_seconds_without_durable must be a number"):
        AtomicCheckpointIO(local_tier=str(tmp_path), max_seconds_without_durable="1h")


def _end_of_fit(io: AtomicCheckpointIO) -> tuple[threading.Thread, list[BaseException]]:
    """``io.persist_latest()`` (what the end of a fit does) started in a thread; the list gets what it raises."""
    errors: list[BaseException] = []

    def end() -> None:
        try:
            io.persist_latest()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=end)
    thread.start()
    return thread, errors


def test_the_end_of_a_fit_persists_a_state_whose_queued_persist_is_deciding_to_wait_for_the_backoff(
        local_backend, tmp_path, plugin):
    """During the backoff after a failed persist, the persist a save queued decides to wait (it would fail too). The
    end of the fit asks for that very state at that instant: the store is back, so it is persisted. (Before, the
    request found the persist still queued and queued nothing; the persist then waited, and the fit ended raising the
    old failure: the composition job that trains through an outage on a tier, red in CI.)"""
    io = plugin(tmp_path / "nvme", local_backend, persist_every=1, retry_max_delay=1000.0)
    save_each(io, local_backend, range(1, 2))
    back = _store_down(io, local_backend)
    with pytest.warns(RuntimeWarning, match="failed"):
        save_each(io, local_backend, range(2, 3))  # fails: backing off for 1000 s
    back()
    tiers = io.tiers(local_backend.root)
    deciding, go = threading.Event(), threading.Event()
    backing_off = tiers.health.backing_off

    def held() -> bool:
        deciding.set()
        go.wait(timeout=10)
        return backing_off()

    tiers.health.backing_off = held  # type: ignore[method-assign]
    io.save_checkpoint(make_checkpoint(3), local_backend.url("step=3.ckpt"))  # its persist stops at the decision
    assert deciding.wait(timeout=10)
    ender, errors = _end_of_fit(io)
    ender.join(timeout=0.3)  # (it reaches the queue meanwhile, or waits for the decision: either way not lost)
    go.set()
    ender.join(timeout=30)
    assert not ender.is_alive() and errors == []
    assert pointer_steps(local_backend.root)["step=3.ckpt"] == 3


def test_the_end_of_a_fit_tries_again_a_persist_begun_before_it_asked_that_fails_after(
        local_backend, tmp_path, plugin):
    """A persist queued by a save began in an outage and fails only after the store is back (the store's own retries
    outlast the outage) and after the end of the fit asked for that state: that failure is not the end of the fit's
    attempt. The state is persisted, and the fit ends without an error. (Before, that stale failure made the asked
    persists wait for the backoff and the fit end raising it: the composition job that trains through an outage on a
    tier, red in CI.)"""
    io = plugin(tmp_path / "nvme", local_backend, persist_every=1, retry_max_delay=1000.0)
    save_each(io, local_backend, range(1, 2))
    store = io.tiers(local_backend.root).durable.store
    real = store.write_pieces
    entered, go = threading.Event(), threading.Event()

    def failing(path: str, pieces: Any) -> None:
        entered.set()
        go.wait(timeout=10)
        raise ConnectionError("store unreachable (simulated)")

    store.write_pieces = failing
    with pytest.warns(RuntimeWarning, match="failed"):
        io.save_checkpoint(make_checkpoint(2), local_backend.url("step=2.ckpt"))  # its persist begins in the outage
        assert entered.wait(timeout=10)
        ender, errors = _end_of_fit(io)
        ender.join(timeout=0.3)  # (it asks for step 2, still being persisted, and waits for the queue)
        store.write_pieces = real  # the store is back
        go.set()  # the attempt begun in the outage fails now
        ender.join(timeout=30)
    assert not ender.is_alive() and errors == []
    assert pointer_steps(local_backend.root)["step=2.ckpt"] == 2


def test_the_end_of_a_fit_that_gave_up_on_a_hung_store_makes_no_attempt_after(local_backend, tmp_path, plugin):
    """A persist its save queued hangs in a store that stopped answering; the end of the fit asks for that state,
    gives up after its stall bound (``PersistFailedError`` naming the local tier) and abandons the queue. When the
    hung request finally fails, no attempt is made again for it: the process exits after that request, not after
    another full attempt against the dead store."""
    io = plugin(tmp_path / "nvme", local_backend, persist_every=1)
    save_each(io, local_backend, range(1, 2))
    tiers = io.tiers(local_backend.root)
    calls: list[str] = []
    release = threading.Event()

    def hung(path: str, pieces: Any) -> None:
        calls.append(path)
        release.wait(timeout=10)
        raise ConnectionError("timed out (simulated)")

    store = tiers.durable.store
    real = store.write_pieces
    store.write_pieces = hung
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        io.save_checkpoint(make_checkpoint(2), local_backend.url("step=2.ckpt"))  # its persist hangs
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PersistFailedError, match="local tier"):
            tiers.persist_latest(stall=0.3)
        release.set()
        assert tiers.wait()
    assert calls and len(calls) == len(set(calls)), calls  # each object tried once: no attempt after the give-up
    store.write_pieces = real
