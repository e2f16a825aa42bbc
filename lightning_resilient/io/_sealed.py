"""JSON documents that carry their own SHA-256, so a flipped bit that still parses is caught too."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from lightning_resilient.errors import CheckpointCorruptedError

__all__ = ["seal", "unseal"]


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(body: dict[str, Any]) -> bytes:
    digest = hashlib.sha256(_canonical(body)).hexdigest()
    return json.dumps({"body": body, "sha256": digest}, sort_keys=True, indent=1).encode()


def unseal(data: bytes, *, what: str, where: str, hint: str = "") -> dict[str, Any]:
    """The body of a sealed document; CheckpointCorruptedError when it does not parse or fails its digest."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptedError(f"{what} {where} is not valid JSON ({exc}): it was truncated or"
                                       f" overwritten.{hint}", object=where) from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("body"), dict) or not isinstance(raw.get("sha256"), str):
        raise CheckpointCorruptedError(f"{where} is not a lightning_resilient {what}.{hint}", object=where)
    if hashlib.sha256(_canonical(raw["body"])).hexdigest() != raw["sha256"]:
        raise CheckpointCorruptedError(f"{what} {where} fails its SHA-256 check: its bytes were altered.{hint}",
                                       object=where)
    body: dict[str, Any] = raw["body"]
    return body
