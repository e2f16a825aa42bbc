"""Argument checks for every public constructor and function: one message shape, naming the argument and what it got.

Settings are checked where they are given (at construction), so a typo fails before any training or I/O. Each
check returns the value in its checked type, so a caller can write ``self.keep = check_int("keep", keep, minimum=1)``.

A value of the wrong type raises :class:`SettingTypeError`, which is both a ``TypeError`` and a ``ValueError``:
earlier releases raised one or the other for different settings, and callers that catch either keep working.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any, TypeVar

from lightning_resilient.errors import SettingTypeError

__all__ = ["SettingTypeError", "check_bool", "check_choice", "check_fraction", "check_int", "check_non_negative",
           "check_number", "check_optional_bool", "check_optional_int", "check_positive", "check_positive_int"]

T = TypeVar("T")


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""


def check_bool(name: str, value: Any, *, hint: str = "") -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0/1, not a string); else :class:`SettingTypeError`."""
    if not isinstance(value, bool):
        raise SettingTypeError(f"{name} must be True or False{_hint(hint)}, got {value!r}")
    return value


def check_optional_bool(name: str, value: Any, *, none_means: str, none_first: bool = False) -> bool | None:
    """``value`` if it is ``True``, ``False`` or ``None``; ``none_means`` says what ``None`` does, in the message
    (which lists None first with ``none_first``: where None is the default, as it usually is)."""
    if value is not None and not isinstance(value, bool):
        rule = (f"None ({none_means}), True or False" if none_first
                else f"True, False or None ({none_means})")
        raise SettingTypeError(f"{name} must be {rule}, got {value!r}")
    return value


def _int_rule(minimum: int | None, maximum: int | None, what: str = "an int") -> str:
    if minimum is not None and maximum is not None:
        return f"{what} from {minimum} to {maximum}"
    if minimum is not None:
        return f"{what} >= {minimum}"
    if maximum is not None:
        return f"{what} <= {maximum}"
    return what


def _checked_int(name: str, value: Any, minimum: int | None, maximum: int | None, rule: str, typed: bool) -> int:
    # bool is an int subclass: True steps or True bytes is a bug at the call site, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        shown = f"{type(value).__name__} {value!r}" if typed else repr(value)
        raise SettingTypeError(f"{name} must be {rule}, got {shown}")
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return number


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              hint: str = "", what: str = "an int", rule: str | None = None, typed: bool = True) -> int:
    """``value`` if it is an int (not a bool, not a float) within ``[minimum, maximum]``; else an error naming
    ``name``: :class:`SettingTypeError` for another type, ``ValueError`` for an int out of range.

    ``what`` names the kind of int in the message: ``check_int("exit_code", 300, minimum=0, maximum=255,
    what="an exit status")`` says "exit_code must be an exit status from 0 to 255, got 300". ``rule`` replaces the
    whole rule in the caller's words ("a number of bytes from 1 to 5 GiB"); ``typed=False`` leaves the wrong value's
    type name out ("got 2.5", not "got float 2.5").
    """
    return _checked_int(name, value, minimum, maximum, f"{rule or _int_rule(minimum, maximum, what)}{_hint(hint)}",
                        typed)


def check_optional_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
                       none_means: str = "", typed: bool = True) -> int | None:
    """``None``, or ``value`` checked as :func:`check_int`; ``none_means`` says what ``None`` does, in the message
    (``"keep must be an int >= 1 or None (None: keep all), got 0"``)."""
    if value is None:
        return None
    return _checked_int(name, value, minimum, maximum,
                        f"{_int_rule(minimum, maximum)} or None{_hint(f'None: {none_means}' if none_means else '')}",
                        typed)


def check_number(name: str, value: Any, *, minimum: float | None = None, above: float | None = None,
                 below: float | None = None, hint: str = "", rule: str | None = None, finite: bool = True) -> float:
    """``value`` as a float if it is a finite real number (not a bool) with ``value >= minimum``, ``value > above``
    and ``value < below`` (each bound when given); else an error naming ``name`` (``rule`` replaces the ">= minimum"
    of its message). ``finite=False`` also accepts infinity ("never", "no limit"); NaN is refused either way."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SettingTypeError(f"{name} must be a number{_hint(hint)}, got {type(value).__name__} {value!r}")
    number = float(value)
    if math.isnan(number) or (finite and math.isinf(number)):
        raise ValueError(f"{name} must be a finite number{_hint(hint)}, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be {rule or f'>= {minimum:g}'}{_hint(hint)}, got {value!r}")
    if above is not None and number <= above:
        raise ValueError(f"{name} must be > {above:g}{_hint(hint)}, got {value!r}")
    if below is not None and number >= below:
        raise ValueError(f"{name} must be < {below:g}{_hint(hint)}, got {value!r}")
    return number


def check_positive(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number > 0; else an error naming ``name``."""
    return check_number(name, value, above=0)


def check_non_negative(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number >= 0; else an error naming ``name``."""
    return check_number(name, value, minimum=0)


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float if it is in [0, 1); else an error naming ``name``."""
    number = check_number(name, value)
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return number


def check_positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (not a bool, not a float); else an error naming ``name``."""
    return check_int(name, value, minimum=1)


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """``value`` if it is one of ``choices``; else ``ValueError`` listing them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value
