"""Argument checks shared by the planning tools: one message shape, naming the argument and what it got."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_fraction", "check_non_negative", "check_positive", "check_positive_int"]


def _real(name: str, value: Any) -> float:
    # bool is an int subclass: True seconds or True GPUs is a bug at the call site, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


def check_positive(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number > 0; else TypeError/ValueError naming ``name``."""
    number = _real(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def check_non_negative(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number >= 0; else TypeError/ValueError naming ``name``."""
    number = _real(name, value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float if it is in [0, 1); else TypeError/ValueError naming ``name``."""
    number = _real(name, value)
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return number


def check_positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (not a bool, not a float); else TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)
