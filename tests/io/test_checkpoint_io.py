"""Construction-time validation and the public surface."""

from __future__ import annotations

import pytest
import torch

import lightning_resilient
from lightning_resilient import AtomicCheckpointIO


@pytest.mark.parametrize("kwargs, message", [
    ({"keep_last": 0}, "keep_last must be an int >= 1 or None, got 0"),
    ({"keep_last": 2.5}, "keep_last must be an int >= 1 or None, got 2.5"),
    ({"keep_last": True}, "keep_last must be an int >= 1 or None, got True"),
    ({"shard_size": 0}, "shard_size must be a number of bytes from 1 to 5 GiB (S3's single-PUT limit), got 0"),
    ({"shard_size": 6 * 2**30}, "shard_size must be a number of bytes from 1 to 5 GiB"),
    ({"chunk_size": 0}, "chunk_size must be a positive number of bytes, got 0"),
    ({"max_concurrency": 0}, "max_concurrency must be an int >= 1, got 0"),
    ({"orphan_grace_seconds": -1}, "orphan_grace_seconds must be a number >= 0, got -1"),
    ({"retry_attempts": 0}, "retry_attempts must be an int >= 1, got 0"),
    ({"retry_base_delay": -1.0}, "retry delays must be >= 0"),
])
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AtomicCheckpointIO(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"storage_options": "anon"}, "storage_options must be a dict of fsspec options"),
    ({"storage_options": {1: 2}}, "storage_options must be a dict of fsspec options"),
    ({"fallback_on_corruption": "yes"}, "fallback_on_corruption must be True or False"),
    ({"claim_on_load": 1}, "claim_on_load must be None \\(a resuming fit claims\\), True or False"),
    ({"async_save": "no"}, "async_save must be True or False"),
    ({"pin_memory": 1}, "pin_memory must be True, False or None"),
])
def test_bad_types_fail_at_construction(kwargs, message):
    with pytest.raises(TypeError, match=message):
        AtomicCheckpointIO(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_pin_memory_true_without_cuda_fails_at_construction():
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
        AtomicCheckpointIO(pin_memory=True)
    assert AtomicCheckpointIO(pin_memory=None).pin_memory is False


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        AtomicCheckpointIO({"anon": True})  # type: ignore[misc]


def test_bad_save_calls(memory_backend):
    io = AtomicCheckpointIO()
    with pytest.raises(TypeError, match="checkpoint must be a dict"):
        io.save_checkpoint([1, 2], memory_backend.url("a.ckpt"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"checkpoint path must be a str or os\.PathLike"):
        io.save_checkpoint({}, 42)


def test_public_names():
    assert lightning_resilient.__all__ == sorted(lightning_resilient.__all__)
    for name in lightning_resilient.__all__:
        assert getattr(lightning_resilient, name) is not None
    from lightning_resilient import (  # noqa: F401 - the names the README promises
        AtomicCheckpointIO,
        CheckpointCorruptedError,
        StaleWriterError,
        find_latest_checkpoint,
    )
    assert issubclass(lightning_resilient.StaleWriterError, lightning_resilient.CheckpointError)
    assert set(lightning_resilient.__all__) == set(lightning_resilient._WHERE) | {"__version__"}
    names = dir(lightning_resilient)
    assert sorted(names) == names and "AtomicCheckpointIO" in names


def test_the_storage_protocol_imports_without_lightning():
    """The package's public names import on first use: a tool that needs only the protocol (the randomized test's
    writers, an operator's script) does not pay for importing Lightning."""
    import subprocess
    import sys

    code = ("import sys, lightning_resilient.io.root, lightning_resilient.io.catalog;"
            " assert 'lightning' not in sys.modules, sorted(m for m in sys.modules if m.startswith('lightning'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_constructor_argument_is_typed_for_the_cli():
    import inspect

    sig = inspect.signature(AtomicCheckpointIO.__init__)
    untyped = [n for n, p in sig.parameters.items() if n != "self" and p.annotation is inspect.Parameter.empty]
    assert not untyped
