"""How often to checkpoint: Young's and Daly's optimal intervals and the expected waste of any interval.

A checkpoint that takes ``C`` seconds to write, on a job whose mean time between failures is ``M`` seconds,
costs ``C`` every interval; a failure costs the work done since the last checkpoint (plus the restart). Saving
more often shrinks the rework and grows the write cost; the intervals below balance the two.

- Young (1974), "A first order approximation to the optimum checkpoint interval":
  ``tau = sqrt(2 C M)``.
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps":
  ``tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for ``C < 2M``, else ``tau = M``.

``tau`` is compute time between checkpoints (the save itself not included). Example: a 6 s save and a 2.8 h
MTBF give Young 347.8 s and Daly 343.8 s, each wasting about 3.4% of the wall time.
"""

from __future__ import annotations

import math

from lightning_resilient._checks import check_non_negative, check_positive

__all__ = ["daly_interval", "expected_waste", "steps_for_interval", "young_interval"]


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum checkpoint interval, ``sqrt(2 * C * MTBF)``, in seconds of compute.

    Example::

        >>> round(young_interval(6.0, 2.8 * 3600), 1)
        347.8

    Args:
        save_seconds: ``C``, the time one checkpoint blocks training.
        mtbf_seconds: the mean time between failures of the whole job (all its nodes together).

    Raises:
        TypeError: an argument is not a number.
        ValueError: an argument is zero, negative, NaN or infinite.
    """
    c = check_positive("save_seconds", save_seconds)
    m = check_positive("mtbf_seconds", mtbf_seconds)
    return math.sqrt(2.0 * c * m)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum checkpoint interval, in seconds of compute.

    ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` while ``C < 2M``; once a save takes two MTBFs or
    more, the best one can do is checkpoint every ``M`` (Daly 2006, eq. 37).

    Example::

        >>> round(daly_interval(6.0, 2.8 * 3600), 1)
        343.8
        >>> daly_interval(30.0, 10.0)  # the save outlasts 2 MTBFs: the MTBF itself
        10.0

    Raises:
        TypeError: an argument is not a number.
        ValueError: an argument is zero, negative, NaN or infinite.
    """
    c = check_positive("save_seconds", save_seconds)
    m = check_positive("mtbf_seconds", mtbf_seconds)
    if c >= 2.0 * m:
        return m
    ratio = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - c


def expected_waste(
    interval_seconds: float, save_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """The expected fraction of wall time lost to checkpoint writes, rework after failures, and restarts.

    Daly's (2006) model: failures arrive as a Poisson process with mean time ``M`` between them (exponential
    inter-arrival times, failures possible during saves and restarts too); the job computes ``tau`` seconds,
    then blocks ``C`` seconds to checkpoint; after a failure it pays ``R`` seconds to restart and redoes the work
    since the last checkpoint. For ``T_solve`` seconds of useful work the expected wall time is::

        T_wall = M * e^(R/M) * (e^((tau + C)/M) - 1) * T_solve / tau

    and the waste is ``1 - T_solve / T_wall``, independent of ``T_solve``. Without failures (``M`` -> inf) it
    tends to ``C / (tau + C)``, the cost of the writes alone. It is smallest near :func:`daly_interval`.

    Example::

        >>> round(expected_waste(343.8, 6.0, 2.8 * 3600), 4)
        0.0341

    Args:
        interval_seconds: ``tau``, compute seconds between checkpoints.
        save_seconds: ``C``, seconds one checkpoint blocks training.
        mtbf_seconds: ``M``, the job's mean time between failures.
        restart_seconds: ``R``, seconds from a failure to training again (rescheduling, loading), >= 0.

    Returns:
        A fraction in ``(0, 1]``; 1.0 when the interval is so long that the job essentially never finishes.

    Raises:
        TypeError: an argument is not a number.
        ValueError: an argument is zero (``restart_seconds`` may be 0), negative, NaN or infinite.
    """
    tau = check_positive("interval_seconds", interval_seconds)
    c = check_positive("save_seconds", save_seconds)
    m = check_positive("mtbf_seconds", mtbf_seconds)
    r = check_non_negative("restart_seconds", restart_seconds)
    try:
        # expm1 keeps the precision when (tau + C) << M, the usual case (minutes against hours).
        per_segment = m * math.exp(r / m) * math.expm1((tau + c) / m)
    except OverflowError:
        return 1.0  # intervals or restarts of hundreds of MTBFs: no segment ever completes
    if math.isinf(per_segment):
        return 1.0
    return 1.0 - tau / per_segment


def steps_for_interval(interval_seconds: float, step_seconds: float) -> int:
    """The interval as a whole number of optimizer steps (``ModelCheckpoint(every_n_train_steps=...)``), >= 1.

    Rounds to the nearest step: the waste is flat around the optimum, so half a step either way costs nothing.

    Example::

        >>> steps_for_interval(343.8, 0.5)
        688
    """
    tau = check_positive("interval_seconds", interval_seconds)
    step = check_positive("step_seconds", step_seconds)
    return max(1, math.floor(tau / step + 0.5))
