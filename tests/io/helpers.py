"""Small builders shared by the io tests (plugins come from the ``make_io`` fixture, which releases them)."""

from __future__ import annotations

import json
from typing import Any

import torch

from lightning_resilient.io.pointer import POINTER_NAME, Pointer


def make_checkpoint(step: int, *, seed: int = 0, size: int = 64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return {
        "epoch": step // 10,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"layer.weight": torch.randn(size, 8, generator=g), "layer.bias": torch.randn(8, generator=g),
                       "steps": torch.tensor(step)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(size, 8, generator=g), "step": torch.tensor(1.0)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": step // 10}}}},
        "callbacks": {"ModelCheckpoint{}": {"best_model_path": f"step={step}"}},
    }


def assert_same(a: Any, b: Any) -> None:
    """Bit-level equality of two nested checkpoint structures."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def read_pointer(backend: Any) -> Pointer:
    return Pointer.from_bytes(backend.fs().cat_file(backend.path(POINTER_NAME)), where="test")


def pointer_json(backend: Any) -> dict[str, Any]:
    return json.loads(backend.fs().cat_file(backend.path(POINTER_NAME)))


def put(backend: Any, rel: str, data: bytes) -> None:
    """Write a raw object under the backend's root, behind the plugin's back."""
    fs = backend.fs()
    path = backend.path(rel)
    if backend.kind == "local":
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)
