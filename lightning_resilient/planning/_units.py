"""Human-readable durations, money and fractions for log lines and tables."""

from __future__ import annotations

__all__ = ["format_duration", "format_money", "format_percent"]


def format_duration(seconds: float) -> str:
    """``0.0031`` -> ``"3.1 ms"``, ``347.8`` -> ``"347.8 s (5.8 min)"``, ``10080`` -> ``"10080 s (2.8 h)"``."""
    if seconds < 1.0:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120.0:
        return f"{seconds:.3g} s"
    if seconds < 7200.0:
        return f"{seconds:.1f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"


def format_money(amount: float) -> str:
    """``24576`` -> ``"$24,576.00"``."""
    return f"${amount:,.2f}"


def format_percent(fraction: float) -> str:
    """``0.03408`` -> ``"3.41%"``."""
    return f"{fraction * 100:.2f}%"
