"""Bounded exponential backoff with jitter for transient object-store errors.

Transient: server errors (5xx), throttling, timeouts, dropped or refused connections. Never retried: client
errors (403, 404, bad credentials, a failed precondition): repeating them cannot succeed and only delays the
clear error the user needs.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from lightning_resilient._checks import check_int, check_number

__all__ = ["RetryPolicy", "is_transient"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.EPIPE, errno.EAGAIN, getattr(errno, "EREMOTEIO", errno.EIO)}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable",
                    "InternalError", "RequestTimeTooSkewed", "503", "500", "502", "504", "429"}
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                    "ResponseStreamingError", "IncompleteReadError", "ClientConnectionError",
                    "ClientOSError", "ServerDisconnectedError", "ClientPayloadError", "ServerTimeoutError",
                    "HttpError", "HTTPClientError", "RemoteDisconnected", "ProtocolError", "TransferEncodingError"}


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status else None
    code = getattr(exc, "code", None)  # gcsfs HttpError
    return code if isinstance(code, int) else None


def is_transient(exc: BaseException) -> bool:
    """Whether repeating the failed request may succeed. Walks the cause chain (s3fs wraps boto errors)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                                NotADirectoryError)):
            return False
        status = _http_status(current)
        if status is not None:
            return status >= 500 or status == 429
        response = getattr(current, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in _TRANSIENT_CODES:
            return True
        if isinstance(current, (TimeoutError, ConnectionError)):
            return True
        if type(current).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried.

    Args:
        attempts: total tries per operation (1 disables retrying).
        base_delay: seconds before the first retry; doubles per retry, with full jitter.
        max_delay: cap of a single wait, in seconds.
        sleep: the sleeping function (tests pass a no-op).
    """

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Named as the setting users give (AtomicCheckpointIO(retry_attempts=...)), which is checked here only.
        object.__setattr__(self, "attempts", check_int("retry_attempts", self.attempts, minimum=1, typed=False))
        object.__setattr__(self, "base_delay", check_number("retry_base_delay", self.base_delay, finite=False))
        object.__setattr__(self, "max_delay", check_number("retry_max_delay", self.max_delay, finite=False))
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(f"retry delays must be >= 0, got base_delay={self.base_delay}, max_delay={self.max_delay}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): full jitter over a doubling cap."""
        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; retry transient failures; re-raise the last one (or a permanent one at once)."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if attempt == self.attempts or not is_transient(exc):
                    raise
                delay = self.backoff(attempt)
                log.warning("%s failed (%s: %s); retry %d/%d in %.2fs", what, type(exc).__name__, exc,
                            attempt, self.attempts - 1, delay)
                self.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover
