"""Async saves: the loop waits only for the snapshot; one save in flight; the pointer moves after the upload;
errors surface on the next save and at teardown; a failed save never costs the checkpoint it replaces."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.testing import StoreProxy

from ..conftest import Plugins
from ..models import TinyModel, tiny_loader
from .helpers import assert_same, make_checkpoint, read_pointer

# Requests through the proxy are this package's only chance: the clients' own retries are off.
NO_CLIENT_RETRIES = {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
                     "skip_instance_cache": True}


@pytest.fixture
def proxied_io(plugins: Plugins) -> Callable[..., AtomicCheckpointIO]:
    """``proxied_io(proxy, root, **kwargs)``: an async plugin that reaches the store only through ``proxy``,
    released after the test whatever its outcome."""

    def build(proxy: StoreProxy, root: str, **kwargs: Any) -> AtomicCheckpointIO:
        io = AtomicCheckpointIO(storage_options={"client_kwargs": {"endpoint_url": proxy.url}, **NO_CLIENT_RETRIES},
                                async_save=True, retry_base_delay=0.0, **kwargs)
        io.root(root).store.fs.retries = 1  # s3fs's own retry loop
        return plugins.track(io)

    return build


def direct_latest(backend) -> str | None:  # backend: a conftest Backend
    return find_latest_checkpoint(backend.root, backend.storage_options)


def test_async_save_roundtrips_and_snapshots_the_state_it_was_given(backend, make_io):
    io = make_io(backend, async_save=True, shard_size=1024)
    ckpt = make_checkpoint(1)
    expected = {k: v.clone() for k, v in ckpt["state_dict"].items()}
    io.save_checkpoint(ckpt, backend.url("a.ckpt"))
    for t in ckpt["state_dict"].values():
        t.add_(1)  # the next optimizer step changes the weights in place while the upload runs
    io.teardown()  # the end of the job: waits for the upload (under test here, not only a release)
    loaded = make_io(backend, claim_on_load=False).load_checkpoint(backend.url("a.ckpt"))
    assert_same(loaded["state_dict"], expected)
    assert io.save_stats[-1].asynchronous and io.save_stats[-1].committed


def test_the_pointer_moves_only_when_the_upload_completes(s3_backend, make_io, proxied_io):
    with StoreProxy(s3_backend.endpoint) as proxy:
        io = proxied_io(proxy, s3_backend.root)
        io.save_checkpoint(make_checkpoint(1), s3_backend.url("a.ckpt"))
        io.wait()
        first = direct_latest(s3_backend)
        proxy.pause()  # the store stops answering: the upload of the next save hangs
        ckpt = make_checkpoint(2)
        expected = {k: v.clone() for k, v in ckpt["state_dict"].items()}
        io.save_checkpoint(ckpt, s3_backend.url("b.ckpt"))  # returns: only the snapshot was waited for
        for t in ckpt["state_dict"].values():
            t.mul_(-1)  # training changes the weights before a single byte was uploaded
        assert io.save_stats[-1].committed is False
        assert direct_latest(s3_backend) == first
        proxy.resume()
        io.wait()
        assert direct_latest(s3_backend).startswith(s3_backend.url("b.ckpt/"))
    loaded = make_io(s3_backend, claim_on_load=False).load_checkpoint(s3_backend.root)
    assert_same(loaded["state_dict"], expected)  # what was saved, not what training made of it since


def test_at_most_one_save_is_in_flight_and_the_wait_is_measured(s3_backend, proxied_io):
    with StoreProxy(s3_backend.endpoint) as proxy:
        io = proxied_io(proxy, s3_backend.root)
        proxy.pause()
        io.save_checkpoint(make_checkpoint(1), s3_backend.url("a.ckpt"))
        second = threading.Thread(target=io.save_checkpoint, args=(make_checkpoint(2), s3_backend.url("b.ckpt")))
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive(), "a second save must wait while the first is still uploading"
        proxy.resume()
        second.join(timeout=60)
        assert not second.is_alive()
        io.teardown()  # waits for the second upload: its stats are final only then
    first_stats, second_stats = list(io.save_stats)[-2:]
    assert first_stats.committed and second_stats.committed
    assert second_stats.waited >= 0.9 and second_stats.blocked >= second_stats.waited
    assert first_stats.waited < 0.5


def test_a_failed_upload_keeps_the_old_pointer_and_raises_on_the_next_save(s3_backend, make_io, proxied_io):
    with StoreProxy(s3_backend.endpoint, seed=3) as proxy:
        io = proxied_io(proxy, s3_backend.root, retry_attempts=1, shard_size=512)
        io.save_checkpoint(make_checkpoint(1), s3_backend.url("a.ckpt"))
        io.wait()
        before = read_pointer(s3_backend)
        proxy.pause()
        proxy.fail_rate = 0.5  # some of the next save's 64 objects land, some do not
        io.save_checkpoint(make_checkpoint(2, size=512), s3_backend.url("b.ckpt"))  # returns before the failure
        # Lightning rotates top-k right after starting a save: that removal waits for the save, and is dropped
        # when the save fails, so the checkpoint being replaced survives.
        io.remove_checkpoint(s3_backend.url("a.ckpt"))
        proxy.resume()
        io._async.wait()  # let the failure happen without consuming it
        proxy.fail_rate = 0.0
        with pytest.raises(Exception) as info:
            io.save_checkpoint(make_checkpoint(3), s3_backend.url("c.ckpt"))
        assert any("background" in note for note in getattr(info.value, "__notes__", []))
        io.teardown()  # the error was raised once; teardown after it is clean
    after = read_pointer(s3_backend)
    assert after.latest.commit == before.latest.commit
    assert "a.ckpt" in after.checkpoints and "b.ckpt" not in after.checkpoints
    landed = s3_backend.fs().find(s3_backend.path("b.ckpt"))
    # The failed save deletes what it uploaded (best effort: the store still fails half the requests then), and
    # what is left has no manifest: never committed, collected once its writer is fenced off.
    assert not any(p.endswith("manifest.json") for p in landed), "a partial upload, never committed"
    assert make_io(s3_backend, claim_on_load=False).load_checkpoint(s3_backend.root)["global_step"] == 1


def test_teardown_waits_for_the_last_save_and_raises_its_error(s3_backend, proxied_io):
    with StoreProxy(s3_backend.endpoint) as proxy:
        io = proxied_io(proxy, s3_backend.root, retry_attempts=1)
        proxy.fail_rate = 1.0
        io.save_checkpoint(make_checkpoint(1), s3_backend.url("a.ckpt"))
        with pytest.raises(Exception) as info:
            io.teardown()
        assert any("background" in note for note in getattr(info.value, "__notes__", []))
    assert direct_latest(s3_backend) is None


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_trainer_with_async_saves_rotates_and_resumes(request, monkeypatch, kind, plugins):
    backend = request.getfixturevalue(f"{kind}_backend")
    if backend.endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", backend.endpoint)  # ModelCheckpoint lists with its own client

    def run(max_steps: int, ckpt_path: str | None) -> Trainer:
        io = plugins.track(AtomicCheckpointIO(storage_options=backend.storage_options, async_save=True))
        trainer = Trainer(max_steps=max_steps, plugins=[io], accelerator="cpu", logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[ModelCheckpoint(dirpath=backend.root, every_n_train_steps=2, save_top_k=2,
                                                     monitor="step", mode="max", save_last=True)])
        torch.manual_seed(0)
        trainer.fit(TinyModel(), tiny_loader(), ckpt_path=ckpt_path)
        assert all(s.asynchronous and s.committed for s in io.save_stats)
        return trainer

    run(6, None)
    pointer = read_pointer(backend)
    assert pointer.latest.step == 6
    assert sorted(pointer.checkpoints) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    trainer = run(8, find_latest_checkpoint(backend.root, backend.storage_options))
    assert trainer.global_step == 8
    assert read_pointer(backend).latest.step == 8


def test_a_second_save_of_the_same_state_does_not_wait(s3_backend, make_io, proxied_io):
    """ModelCheckpoint(save_last=True) saves twice per step: the second shares the first's snapshot."""
    with StoreProxy(s3_backend.endpoint) as proxy:
        io = proxied_io(proxy, s3_backend.root, shard_size=1024)
        ckpt = make_checkpoint(7)
        ckpt["rng"] = torch.get_rng_state()
        proxy.pause()
        io.save_checkpoint(ckpt, s3_backend.url("epoch=0-step=7.ckpt"))
        ckpt["rng"] = torch.get_rng_state()  # each dump makes fresh small tensors, as ResumeStateCallback's RNGs
        io.save_checkpoint(ckpt, s3_backend.url("last.ckpt"))  # returns although the first is still held
        assert io.save_stats[-1].waited == 0.0
        # A small tensor changed since: it gets a copy of its own, the rest still comes from the snapshot.
        before = ckpt["state_dict"]["layer.weight"].clone()
        ckpt["state_dict"]["layer.weight"].add_(1.0)
        io.save_checkpoint(ckpt, s3_backend.url("changed.ckpt"))
        assert io.save_stats[-1].waited == 0.0
        # The next step (an optimizer step ran) overwrites the snapshot: it must wait for the uploads reading it.
        nxt = dict(ckpt, global_step=8)
        blocked = threading.Thread(target=io.save_checkpoint, args=(nxt, s3_backend.url("other.ckpt")))
        blocked.start()
        blocked.join(timeout=1.0)
        assert blocked.is_alive()
        proxy.resume()
        blocked.join(timeout=60)
        io.teardown()  # waits for the uploads still running, before the store is read
    pointer = read_pointer(s3_backend)
    last = pointer.checkpoints["last.ckpt"]
    assert pointer.checkpoints["epoch=0-step=7.ckpt"].commit in last.folders  # its shards were not uploaded again
    reader = make_io(s3_backend, claim_on_load=False)
    loaded = reader.load_checkpoint(s3_backend.url("last.ckpt"))
    assert torch.equal(loaded["rng"], ckpt["rng"])
    assert torch.equal(loaded["state_dict"]["layer.weight"], before)
    changed = reader.load_checkpoint(s3_backend.url("changed.ckpt"))
    assert_same(changed["state_dict"], ckpt["state_dict"])
    assert io.save_stats[-1].waited > 0.5
