"""Every random number generator a training process uses, as state that loads with ``weights_only=True``.

Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA device's generator (and
MPS where present). NumPy's state holds an ndarray, which ``weights_only`` refuses: it is stored as a tensor.
"""

from __future__ import annotations

import random
from typing import Any, TypeAlias

import numpy as np
import torch

from lightning_resilient._warnings import warn

__all__ = ["RngState", "capture_rng", "restore_rng"]

# What capture_rng() returns: "python", "numpy", "torch", and "cuda"/"mps" where present.
RngState: TypeAlias = dict[str, Any]


def capture_rng() -> RngState:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: RngState = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)), int(pos),
                  int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    # Only where CUDA is initialized: capturing would initialize it in a process that never used it. (torch leaves
    # is_initialized unannotated.)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        state["mps"] = mps.get_rng_state()
    return state


def restore_rng(state: RngState) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        count = torch.cuda.device_count()
        for device, device_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(device_state, device)
        if len(cuda_states) != count:
            # A restart on a node of another shape: the devices both runs have get their state back; the rest
            # cannot (their random numbers, e.g. dropout on those devices, differ from the uninterrupted run).
            warn(f"the checkpoint holds the RNG states of {len(cuda_states)} CUDA device(s) but this process sees"
                 f" {count}: restored devices 0-{min(count, len(cuda_states)) - 1}"
                 + (f", devices {len(cuda_states)}-{count - 1} keep fresh states" if count > len(cuda_states) else
                 f", the saved states of devices {count}-{len(cuda_states) - 1} are not used")
                 + "; random numbers drawn on the others differ from the uninterrupted run", RuntimeWarning)
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
