"""URL helpers: remote paths stay strings and are joined with posixpath, never ``pathlib.Path``.

``Path("s3://b/k")`` becomes ``s3:/b/k``; everything here keeps the protocol intact. Public: the packages above
``io/`` that name a folder of a root (``state/``'s attempt records) use these too.
"""

from __future__ import annotations

import posixpath

__all__ = ["basename", "check_relative", "dirname", "join", "split_protocol", "strip_trailing"]


def split_protocol(url: str) -> tuple[str | None, str]:
    """``"s3://b/k"`` -> ``("s3", "b/k")``; a plain path has no protocol."""
    if "://" in url:
        protocol, rest = url.split("://", 1)
        return protocol, rest
    return None, url


def _join_protocol(protocol: str | None, path: str) -> str:
    return f"{protocol}://{path}" if protocol else path


def strip_trailing(url: str) -> str:
    protocol, path = split_protocol(url)
    stripped = path.rstrip("/")
    return _join_protocol(protocol, stripped or ("/" if path.startswith("/") else ""))


def join(base: str, *parts: str) -> str:
    protocol, path = split_protocol(base)
    return _join_protocol(protocol, posixpath.join(path, *parts))


def dirname(url: str) -> str:
    protocol, path = split_protocol(strip_trailing(url))
    return _join_protocol(protocol, posixpath.dirname(path))


def basename(url: str) -> str:
    return posixpath.basename(split_protocol(strip_trailing(url))[1])


def check_relative(entry: object, *, where: str) -> str:
    """Validate a root-relative object path read from a manifest or pointer.

    Stored paths must stay inside the checkpoint root: a hostile or corrupted manifest must not be able to
    make a load (or a deletion) touch anything else.
    """
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"{where}: expected a non-empty relative path string, got {entry!r}")
    if "://" in entry or entry.startswith(("/", "~")) or "\\" in entry or "\x00" in entry:
        raise ValueError(f"{where}: {entry!r} is not a path relative to the checkpoint root")
    parts = entry.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{where}: {entry!r} escapes or does not name an object inside the checkpoint root")
    return entry
