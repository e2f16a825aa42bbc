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


def test_a_changed_world_size_warns_and_resumes_without_rng():
    callback = ResumeStateCallback()
    saved = {"format": 1, "world_size": 2, "ranks": [{"consumed": 1}, {"consumed": 1}]}
    with pytest.warns(RuntimeWarning, match="written by 2 process\\(es\\) but this run has 1"):
        callback.load_state_dict(saved)
    assert callback._pending is None
