"""Human-readable durations, money and fractions for log lines and tables."""

from __future__ import annotations

__all__ = ["format_duration", "format_hours", "format_hours_pair", "format_money", "format_money_pair",
           "format_percent", "plural"]


def format_duration(seconds: float) -> str:
    """``0.0031`` -> ``"3.1 ms"``, ``347.8`` -> ``"347.8 s (5.8 min)"``, ``10080`` -> ``"10080 s (2.8 h)"``."""
    if seconds < 1.0:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120.0:
        return f"{seconds:.3g} s"
    if seconds < 7200.0:
        return f"{seconds:.1f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"


def format_money(amount: float, digits: int = 2) -> str:
    """``24576`` -> ``"$24,576.00"``."""
    return f"${amount:,.{digits}f}"


def format_money_pair(a: float, b: float) -> tuple[str, str]:
    """Two amounts for a comparison: more digits until they read differently (``0.2``, ``0.2001`` ->
    ``"$0.2000"``, ``"$0.2001"``)."""
    for digits in range(2, 7):
        pair = format_money(a, digits), format_money(b, digits)
        if pair[0] != pair[1]:
            return pair
    return pair


def format_percent(fraction: float) -> str:
    """``0.03408`` -> ``"3.41%"``."""
    return f"{fraction * 100:.2f}%"


def format_hours(hours: float, digits: int = 1) -> str:
    """A wall-clock time given in hours, in the unit that reads best: ``48`` -> ``"48.0 h"``, ``0.1`` ->
    ``"6.0 min"``, ``0.004`` -> ``"14.4 s"`` (``digits`` after the point)."""
    if hours >= 1.0:
        return f"{hours:,.{digits}f} h"
    if hours * 60.0 >= 1.0:
        return f"{hours * 60.0:.{digits}f} min"
    return f"{hours * 3600.0:.{digits}f} s"


def format_hours_pair(a: float, b: float) -> tuple[str, str]:
    """Two times for a comparison ("x vs y"): more digits until they read differently, so that two different
    times never print alike (``0.1``, ``0.10005`` h -> ``"6.000 min"``, ``"6.003 min"``)."""
    for digits in range(1, 5):
        pair = format_hours(a, digits), format_hours(b, digits)
        if pair[0] != pair[1]:
            return pair
    return pair


def plural(n: int, singular: str, plural: str | None = None) -> str:
    """``plural(1, "GPU")`` -> ``"1 GPU"``, ``plural(2, "GPU")`` -> ``"2 GPUs"``, ``plural(3, "batch", "batches")``."""
    return f"{n} {singular if n == 1 else (plural or singular + 's')}"
