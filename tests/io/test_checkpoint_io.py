"""Construction-time validation, the public surface, and the checks that run when a fit starts."""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

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
    ({"collective_timeout": 0}, "collective_timeout must be > 0 (seconds a collective between the job's processes"),
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
    ({"new_run": "yes"}, "new_run must be True or False, got 'yes'"),
    ({"collective_timeout": "30"}, "collective_timeout must be a number"),
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


# -- what the fit-start check refuses in a checkpoint folder --------------------------------------------------------
def as_unprivileged(call: Callable[[], Any]) -> Any:
    """``call()`` as a user without privileges, returning what it returned or raising what it raised: root ignores
    folder permissions, so as root it runs in a forked child that has dropped to the user "nobody" (uid 65534)."""
    if os.geteuid() != 0:
        return call()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only the call and its outcome down the pipe
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                outcome: Any = ("ok", call())
            except BaseException as exc:
                outcome = ("raised", exc)
            os.write(write, pickle.dumps(outcome))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise value
    return value


def test_a_read_only_local_folder_is_refused_when_the_fit_starts_about_its_permissions():
    """The probe object the fit-start check writes and deletes in the protocol folder finds it before the first save;
    the message is about the folder's permissions, not about AWS credentials."""
    base = tempfile.mkdtemp()  # under /tmp, which every user may traverse
    try:
        os.chmod(base, 0o755)
        readonly = os.path.join(base, "ckpt")
        os.mkdir(readonly, 0o755)
        if os.geteuid() != 0:
            os.chmod(readonly, 0o555)
        with pytest.raises(lightning_resilient.StorePermissionError) as info:
            as_unprivileged(lambda: AtomicCheckpointIO().check_root(readonly))
        message = str(info.value)
        assert f"permission denied to write {readonly}/.lightning_resilient/" in message
        assert "Fix its permissions or ownership" in message and "AWS" not in message
        assert isinstance(info.value, PermissionError)
        assert os.listdir(readonly) == []
        if os.geteuid() == 0:
            AtomicCheckpointIO().check_root(readonly)  # its owner may write it: the same check passes
    finally:
        os.chmod(base, 0o755)
        for folder, _, files in os.walk(base, topdown=False):
            os.chmod(folder, 0o755)
            for name in files:
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)


def test_a_writable_root_keeps_no_probe(local_backend, s3_backend):
    for backend in (local_backend, s3_backend):
        AtomicCheckpointIO(storage_options=backend.storage_options).check_root(backend.root)
        fs = backend.fs()
        fs.invalidate_cache()
        probes = [p for p in fs.find(backend.path()) if "probe" in p]
        assert probes == [], probes


def test_a_root_that_is_a_file_is_named_as_given(tmp_path, monkeypatch, capsys):
    from lightning_resilient.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.ckpt").write_bytes(b"a file, not a folder")
    with pytest.raises(NotADirectoryError) as info:
        lightning_resilient.find_latest_checkpoint("model.ckpt")
    assert str(info.value).startswith("'model.ckpt' is a file, not a checkpoint root")
    assert ".lightning_resilient" not in str(info.value) and str(tmp_path) not in str(info.value)
    with pytest.raises(NotADirectoryError, match=r"'model\.ckpt' is a file"):
        AtomicCheckpointIO().check_root("model.ckpt")
    for command in ("ls", "gc", "verify"):
        assert main([command, "model.ckpt"]) == 2
        err = capsys.readouterr().err
        assert err == f"lightning-resilient {command}: {info.value}\n"
