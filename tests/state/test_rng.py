"""RNG capture and restore: every generator, stored so that weights_only loading accepts it."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from lightning_resilient import ResumeStateCallback
from lightning_resilient.state import capture_rng, restore_rng


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist()


def test_restore_replays_every_generator():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leave a cached Gaussian in NumPy's state
    state = capture_rng()
    first = draws()
    draws()
    restore_rng(state)
    assert draws() == first


def test_state_loads_with_weights_only():
    buf = io.BytesIO()
    torch.save({"rng": capture_rng()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["rng"]
    first = draws()
    restore_rng(state)
    assert draws() == first


def test_a_changed_batch_size_warns_and_restarts_the_epoch(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_resilient import AtomicCheckpointIO

    from ..models import TinyModel, tiny_loader

    root = str(tmp_path / "ckpt")

    def fit(batch_size: int, steps: int, resume: bool) -> TinyModel:
        model = TinyModel()
        Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                callbacks=[ResumeStateCallback(), ModelCheckpoint(dirpath=root, every_n_train_steps=3)],
                ).fit(model, tiny_loader(batch_size=batch_size), ckpt_path=root if resume else None)
        return model

    fit(8, 3, resume=False)  # 8 batches of 8; saved after 3
    with pytest.warns(RuntimeWarning, match=r"training loader changed .* \(8 batches of 8 then, 4 of 16 now\)"):
        model = fit(16, 5, resume=True)
    assert len(model.losses) == 2


class FakeCuda:
    """The CUDA facts restore_rng reads, injected: a node with ``count`` devices, recording what is set."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.set: dict[int, torch.Tensor] = {}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: self.set.__setitem__(device, state))


@pytest.mark.parametrize(("saved", "now"), [(4, 2), (2, 4)])
def test_a_restart_on_another_number_of_cuda_devices_restores_those_that_match_and_warns(monkeypatch, saved, now):
    state = capture_rng()
    state["cuda"] = [torch.full((8,), d, dtype=torch.uint8) for d in range(saved)]
    cuda = FakeCuda(monkeypatch, now)
    with pytest.warns(RuntimeWarning, match=f"RNG states of {saved} CUDA device\\(s\\) but this process sees {now}:"
                                            f" restored devices 0-{min(saved, now) - 1}"):
        restore_rng(state)
    assert sorted(cuda.set) == list(range(min(saved, now)))
    assert all(torch.equal(cuda.set[d], state["cuda"][d]) for d in cuda.set)


def test_the_same_number_of_cuda_devices_restores_all_without_a_word(monkeypatch):
    import warnings

    state = capture_rng()
    state["cuda"] = [torch.full((8,), d, dtype=torch.uint8) for d in range(2)]
    cuda = FakeCuda(monkeypatch, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_rng(state)
    assert sorted(cuda.set) == [0, 1]
