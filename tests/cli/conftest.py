"""The io tests' plugin builder (``make_io``, tests/io/conftest.py), for the commands' tests that fill a root first."""

from __future__ import annotations

from ..io.conftest import make_io

__all__ = ["make_io"]
