"""Transient store errors are retried with bounded backoff; client errors are not."""

from __future__ import annotations

import errno

import pytest
import torch

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.io.retry import RetryPolicy, is_transient
from lightning_resilient.testing import StoreProxy

from .helpers import assert_same, make_checkpoint


class FakeClientError(Exception):
    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.mark.parametrize("exc, transient", [
    (OSError(errno.EBUSY, "SlowDown"), True),
    (ConnectionResetError("reset"), True),
    (TimeoutError("read timeout"), True),
    (FakeClientError(503, "ServiceUnavailable"), True),
    (FakeClientError(500, "InternalError"), True),
    (FakeClientError(429, "TooManyRequests"), True),
    (FileNotFoundError("no such bucket"), False),
    (PermissionError("403"), False),
    (FakeClientError(403, "AccessDenied"), False),
    (FakeClientError(412, "PreconditionFailed"), False),
    (ValueError("bad argument"), False),
])
def test_classification(exc, transient):
    assert is_transient(exc) is transient


def test_wrapped_cause_is_classified():
    outer = OSError(errno.EINVAL, "wrapped")
    outer.__cause__ = FakeClientError(503, "SlowDown")
    assert is_transient(outer)


def test_bounded_backoff_without_sleeping():
    waits: list[float] = []
    policy = RetryPolicy(attempts=4, base_delay=1.0, max_delay=3.0, sleep=waits.append)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError("reset")
        return "ok"

    assert policy.call("op", flaky) == "ok"
    assert len(calls) == 4 and len(waits) == 3
    assert all(0 <= w <= cap for w, cap in zip(waits, [1.0, 2.0, 3.0], strict=True))

    calls.clear()
    with pytest.raises(ConnectionResetError):
        RetryPolicy(attempts=2, sleep=waits.append).call("op", lambda: flaky())
    assert len(calls) == 2, "gave up after the attempts it was allowed"


def test_client_errors_are_not_retried():
    calls = []

    def denied() -> None:
        calls.append(1)
        raise PermissionError("403 AccessDenied")

    with pytest.raises(PermissionError):
        RetryPolicy(attempts=5, sleep=lambda s: None).call("op", denied)
    assert len(calls) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_policy_validates_attempts(bad):
    with pytest.raises(ValueError, match="attempts must be an int >= 1"):
        RetryPolicy(attempts=bad)


# The client's own retries are switched off, so any success through the proxy is this package's doing.
NO_CLIENT_RETRIES = {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
                     "skip_instance_cache": True}


def without_s3fs_retries(io: AtomicCheckpointIO, root: str) -> AtomicCheckpointIO:
    io.root(root).store.fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
    return io


def _options(proxy: StoreProxy) -> dict:
    return {"client_kwargs": {"endpoint_url": proxy.url}, **NO_CLIENT_RETRIES}


def test_saves_and_loads_survive_a_failing_proxy(s3_backend, caplog):
    caplog.set_level("WARNING", logger="lightning_resilient.io.retry")
    with StoreProxy(s3_backend.endpoint, fail_rate=0.3, seed=1) as proxy:
        io = without_s3fs_retries(AtomicCheckpointIO(storage_options=_options(proxy), shard_size=4096,
                                                     retry_attempts=12, retry_base_delay=0.0, retry_max_delay=0.0),
                                  s3_backend.root)
        saved = {}
        for step in range(1, 5):
            saved[step] = make_checkpoint(step, size=512)
            io.save_checkpoint(saved[step], s3_backend.url(f"step={step}.ckpt"))
        latest = find_latest_checkpoint(s3_backend.root, _options(proxy))
        loaded = io.load_checkpoint(latest)
    assert proxy.counts["503"] > 3 and proxy.counts["reset"] > 3, proxy.counts
    assert sum("retry" in r.getMessage() for r in caplog.records) >= 5  # our backoff did the recovering
    assert_same(loaded, saved[4])
    # Nothing lost: every committed checkpoint reads back directly from the server, bit for bit.
    direct = AtomicCheckpointIO(storage_options=s3_backend.storage_options, claim_on_load=False)
    for step, ckpt in saved.items():
        assert_same(direct.load_checkpoint(s3_backend.url(f"step={step}.ckpt")), ckpt)


def test_without_retries_the_same_faults_fail(s3_backend):
    """The mechanism matters: with one attempt per request the faulty proxy breaks the save."""
    with StoreProxy(s3_backend.endpoint, fail_rate=0.3, seed=1) as proxy:
        io = without_s3fs_retries(AtomicCheckpointIO(storage_options=_options(proxy), shard_size=4096,
                                                     retry_attempts=1), s3_backend.root)
        with pytest.raises(Exception) as info:
            for step in range(1, 5):
                io.save_checkpoint(make_checkpoint(step, size=512), s3_backend.url(f"step={step}.ckpt"))
    assert is_transient(info.value)


def test_missing_bucket_is_a_clear_error_not_retried(s3_backend):
    options = {"client_kwargs": {"endpoint_url": s3_backend.endpoint}}
    io = AtomicCheckpointIO(storage_options=options, retry_attempts=5, retry_base_delay=5.0)
    with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket-x' does not exist"):
        io.save_checkpoint(make_checkpoint(1), "s3://no-such-bucket-x/run/ckpt/a.ckpt")
    with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket-x' does not exist"):
        find_latest_checkpoint("s3://no-such-bucket-x/run/ckpt", options)


def test_missing_credentials_is_a_clear_error(s3_backend, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"client_kwargs": {"endpoint_url": s3_backend.endpoint}, "skip_instance_cache": True}
    io = AtomicCheckpointIO(storage_options=options, retry_attempts=1)
    with pytest.raises(PermissionError, match=r"no credentials.*AWS_ACCESS_KEY_ID"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, s3_backend.url("a.ckpt"))
