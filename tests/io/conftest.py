"""Plugin builders for the io tests, each plugin released by the ``plugins`` fixture after the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_resilient import AtomicCheckpointIO

from ..conftest import Plugins


@pytest.fixture
def make_io(plugins: Plugins) -> Callable[..., AtomicCheckpointIO]:
    """``make_io(backend, **kwargs)``: a plugin on ``backend``'s store (retries without long sleeps), torn down
    after the test whatever its outcome."""

    def build(backend: Any, **kwargs: Any) -> AtomicCheckpointIO:
        kwargs.setdefault("retry_base_delay", 0.01)
        return plugins.track(AtomicCheckpointIO(storage_options=backend.storage_options, **kwargs))

    return build
