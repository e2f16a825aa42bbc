"""A store outage inside a whole fit with a local tier: S3 (moto) behind a loopback proxy that closes its port and
every open connection (botocore's ``EndpointConnectionError``, as a store that is down), reached by this package's
client and by Lightning's own (``ModelCheckpoint`` asks the store whether a name exists at every save).

Training goes on through the outage from the local tier; the durable tier catches up when the store is back (the
newest state persisted, Lightning's removals done); the end of a fit in an outage is bounded and says where the
newest state is."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient import (
    AtomicCheckpointIO,
    PersistFailedError,
    ResumeStateCallback,
    StaleWriterError,
    find_latest_checkpoint,
)
from lightning_resilient.io import tiered
from lightning_resilient.io.catalog import reader
from lightning_resilient.state import attempts
from lightning_resilient.testing import StoreProxy

from ..conftest import Plugins
from ..models import TinyModel, tiny_loader


@pytest.fixture
def proxy(s3_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreProxy]:
    """The store behind a proxy that can go down, reached through it by this package's client (storage options)
    and by Lightning's own (the environment, as users set it). Clients of fsspec's instance cache made before the
    test (another endpoint) are dropped, and so are the test's, after it."""
    import s3fs

    with StoreProxy(s3_backend.endpoint) as running:
        monkeypatch.setenv("AWS_ENDPOINT_URL", running.url)
        s3fs.S3FileSystem.clear_instance_cache()
        yield running
        running.resume()
        running.come_back()
    s3fs.S3FileSystem.clear_instance_cache()


class Outage(Callback):
    """The store goes down before the batch of global step ``down`` and comes back before that of ``up``; with
    ``met``, only once ``met()`` says a persist met the outage (bounded: however slow the machine, a persist queued
    behind the training may otherwise start only after the store is back)."""

    def __init__(self, proxy: StoreProxy, down: int, up: int | None) -> None:
        self.proxy, self.down, self.up = proxy, down, up
        self.met: Callable[[], bool] | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.down:
            self.proxy.go_down()
        if trainer.global_step == self.up:
            deadline = time.monotonic() + 60
            while self.met is not None and not self.met() and time.monotonic() < deadline:
                time.sleep(0.02)
            self.proxy.come_back()


def build(plugins: Plugins, proxy: StoreProxy, root: str, nvme: Path, callbacks: list[Any], max_steps: int,
          **io_kwargs: Any) -> tuple[Trainer, AtomicCheckpointIO, ModelCheckpoint]:
    # One request per try (botocore's own retries off), few quick tries: a request to a store that is down fails in
    # milliseconds here, not the ~14 s of the client's defaults, and the test stays short.
    options = {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {"retries": {"max_attempts": 1}},
               "skip_instance_cache": True}
    io = plugins.track(AtomicCheckpointIO(storage_options=options, local_tier=str(nvme), persist_every=2,
                                          retry_attempts=2, retry_base_delay=0.01, retry_max_delay=0.05,
                                          max_persist_failures=None, **io_kwargs))
    checkpoint = ModelCheckpoint(dirpath=root, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2,
                                 save_last=True)
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", plugins=[io], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ResumeStateCallback(), *callbacks, checkpoint])
    return trainer, io, checkpoint


def durable_names(root: str, options: dict[str, Any]) -> dict[str, int]:
    pointer, _ = reader(root, options).read_pointer()
    assert pointer is not None
    return {name: entry.step for name, entry in pointer.checkpoints.items()}


def test_training_goes_on_through_a_store_outage_and_the_durable_tier_catches_up(s3_backend, proxy, tmp_path,
                                                                                plugins):
    root = s3_backend.root
    outage = Outage(proxy, 5, 13)
    trainer, io, checkpoint = build(plugins, proxy, root, tmp_path / "nvme", [outage], 20)
    outage.met = lambda: io.tiers(root).failures > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(), tiny_loader(n=160))  # no EndpointConnectionError from ModelCheckpoint's own client
    assert trainer.global_step == 20
    # Reported once per outage (the persist it met: step 4's if still uploading at step 5, else step 8's).
    failed = [w for w in caught if "to the durable tier" in str(w.message) and "failed (1 in a row)" in str(w.message)]
    assert len(failed) == 1, [str(w.message) for w in caught]
    # The store came back: the newest state is durable, and so is every removal top-k made meanwhile (the names
    # it removed in the outage, steps 6 to 12, waited for the first persist that succeeded).
    options = {"client_kwargs": {"endpoint_url": s3_backend.endpoint}}
    reported = {os.path.basename(p) for p in [*checkpoint.best_k_models, checkpoint.last_model_path]}
    assert reported == {"epoch=0-step=18.ckpt", "epoch=0-step=20.ckpt", "last.ckpt"}
    # (18, a save not due for a persist, was persisted at the end of the fit: it is reported.)
    assert durable_names(root, options) == {"epoch=0-step=18.ckpt": 18, "epoch=0-step=20.ckpt": 20, "last.ckpt": 20}
    assert find_latest_checkpoint(root, options).startswith(f"{root}/")
    for path in [*checkpoint.best_k_models, checkpoint.last_model_path]:
        assert io.load_checkpoint(path)["global_step"] in (18, 20)


def test_the_end_of_a_fit_in_an_outage_says_where_the_newest_state_is_and_a_restart_resumes_it(
        s3_backend, proxy, tmp_path, plugins):
    root, nvme = s3_backend.root, tmp_path / "nvme"
    trainer, io, _ = build(plugins, proxy, root, nvme, [Outage(proxy, 5, None)], 12)
    with pytest.raises(PersistFailedError, match=r"does not answer .* local tier .* holds the newest checkpoints"):
        trainer.fit(TinyModel(), tiny_loader(n=160))
    # (Its fit ended above, with the store down; the restart below fences it: what its release raises is that.)
    plugins.asserted(io, PersistFailedError, StaleWriterError)
    proxy.come_back()
    # The same command on the same node resumes the newest state, step 12, from the local tier (the durable tier
    # holds none of the steps saved in the outage).
    assert all(step < 6 for step in durable_names(root, {"client_kwargs": {"endpoint_url": s3_backend.endpoint}})
               .values())
    latest = find_latest_checkpoint(root, {"client_kwargs": {"endpoint_url": proxy.url}}, local_tier=str(nvme))
    started: list[int] = []

    class Start(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            started.append(trainer.global_step)

    trainer, io, _ = build(plugins, proxy, root, nvme, [Start()], 14)
    trainer.fit(TinyModel(), tiny_loader(n=160), ckpt_path=latest)
    assert started == [12] and io.last_load is not None and io.last_load.tier == "local"
    assert trainer.global_step == 14


def test_the_end_of_a_fit_waits_for_a_store_that_hangs_only_while_it_makes_no_progress_for_a_bound(
        s3_backend, proxy, tmp_path, plugins, monkeypatch):
    monkeypatch.setattr(tiered, "TEARDOWN_STALL_SECONDS", 1.0)
    monkeypatch.setattr(attempts, "CLOSE_SECONDS", 1.0)  # (the resume audit's record: its last write is bounded too)

    class Hang(Callback):  # the store stops answering (requests wait at its door) after the last save
        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            proxy.pause()

    trainer, io, _ = build(plugins, proxy, s3_backend.root, tmp_path / "nvme", [Hang()], 6)
    with pytest.raises(PersistFailedError, match=r"made no progress for 1 s .* holds the newest checkpoints"):
        trainer.fit(TinyModel(), tiny_loader(n=160))
    plugins.asserted(io, PersistFailedError)
    proxy.resume()  # (the abandoned request ends; nothing queued behind it runs)
