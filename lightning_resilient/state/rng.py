"""Every random number generator a training process uses, as state that loads with ``weights_only=True``.

Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA device's generator (and
MPS where present). NumPy's state holds an ndarray, which ``weights_only`` refuses: it is stored as a tensor.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)), int(pos),
                  int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        state["mps"] = mps.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            raise ValueError(f"the checkpoint holds {len(cuda_states)} CUDA generator states but this process sees"
                             f" {torch.cuda.device_count()} devices")
        torch.cuda.set_rng_state_all(cuda_states)
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
