"""Young's and Daly's intervals and the expected waste, against values computed by hand."""

from __future__ import annotations

import math

import pytest

from lightning_resilient.planning import daly_interval, expected_waste, steps_for_interval, young_interval

HOUR = 3600.0


def test_young_matches_the_worked_example():
    # sqrt(2 * 6 s * 10080 s) = sqrt(120960) = 347.79 s
    assert young_interval(6.0, 2.8 * HOUR) == pytest.approx(347.793, abs=1e-3)
    assert round(young_interval(6, 2.8 * HOUR), 1) == 347.8


def test_daly_by_hand():
    # C = 50, M = 100: C/2M = 1/4, sqrt(2CM) = 100, so tau = 100 * (1 + (1/2)/3 + (1/4)/9) - 50
    # = 100 * 43/36 - 50 = 1075/9 - 450/9 = 625/9.
    assert daly_interval(50.0, 100.0) == pytest.approx(625 / 9, rel=1e-12)
    # The worked example: 347.793 * (1 + 0.0172516/3 + 0.000297619/9) - 6 = 343.80 s, a little under Young.
    assert daly_interval(6.0, 2.8 * HOUR) == pytest.approx(343.80, abs=0.01)


@pytest.mark.parametrize(("save", "mtbf"), [(2.0, 1.0), (30.0, 10.0), (1e6, 3.0)])
def test_daly_returns_the_mtbf_once_a_save_lasts_two_mtbfs(save, mtbf):
    assert daly_interval(save, mtbf) == mtbf


def test_waste_by_hand():
    # tau = 100, C = 10, M = 1000: 1 - 100 / (1000 * (e^0.11 - 1)) = 1 - 100 / 116.2781 = 0.139993
    assert expected_waste(100, 10, 1000) == pytest.approx(0.139993, abs=1e-6)
    # ... and a 50 s restart multiplies the expected segment time by e^0.05: 1 - 100 / 122.2399 = 0.181936
    assert expected_waste(100, 10, 1000, restart_seconds=50) == pytest.approx(0.181936, abs=1e-6)


def test_waste_without_failures_is_the_write_cost_alone():
    assert expected_waste(100.0, 10.0, 1e15) == pytest.approx(10 / 110, rel=1e-6)


def test_waste_saturates_instead_of_overflowing():
    assert expected_waste(1e6, 1.0, 1.0) == 1.0
    assert expected_waste(10.0, 1.0, 1.0, restart_seconds=1e6) == 1.0


@pytest.mark.parametrize(("save", "mtbf"), [(6.0, 2.8 * HOUR), (60.0, HOUR), (1.0, 100.0), (300.0, HOUR),
                                            (0.05, 60.0), (50.0, 100.0)])
@pytest.mark.parametrize("restart", [0.0, 30.0])
def test_waste_is_lowest_near_the_daly_interval(save, mtbf, restart):
    best = daly_interval(save, mtbf)

    def waste(tau: float) -> float:
        return expected_waste(tau, save, mtbf, restart)

    assert waste(best) <= waste(0.5 * best)
    assert waste(best) <= waste(2.0 * best)
    assert waste(best) <= waste(young_interval(save, mtbf))  # the higher-order estimate is the better one


def test_steps_for_interval_rounds_to_the_nearest_step_and_never_below_one():
    assert steps_for_interval(343.8, 0.5) == 688  # 687.6
    assert steps_for_interval(10.0, 4.0) == 3  # 2.5 rounds up
    assert steps_for_interval(0.1, 1.0) == 1


BAD_NUMBERS = [
    (0, ValueError, "must be > 0"),
    (-1.0, ValueError, "must be > 0"),
    (math.nan, ValueError, "finite"),
    (math.inf, ValueError, "finite"),
    ("6", TypeError, "must be a number"),
    (None, TypeError, "must be a number"),
    (True, TypeError, "must be a number"),
]


@pytest.mark.parametrize(("value", "error", "message"), BAD_NUMBERS)
@pytest.mark.parametrize("position", [0, 1])
def test_interval_formulas_name_the_bad_argument(value, error, message, position):
    names = ("save_seconds", "mtbf_seconds")
    args = [6.0, 3600.0]
    args[position] = value
    for formula in (young_interval, daly_interval):
        with pytest.raises(error, match=f"{names[position]} {message}|{names[position]} must be a finite"):
            formula(*args)


@pytest.mark.parametrize(("value", "error", "message"), BAD_NUMBERS)
@pytest.mark.parametrize("position", [0, 1, 2])
def test_waste_names_the_bad_argument(value, error, message, position):
    names = ("interval_seconds", "save_seconds", "mtbf_seconds")
    args = [300.0, 6.0, 3600.0]
    args[position] = value
    with pytest.raises(error, match=names[position]):
        expected_waste(*args)


def test_restart_may_be_zero_but_not_negative_or_nan():
    assert expected_waste(300.0, 6.0, 3600.0, restart_seconds=0) < expected_waste(300.0, 6.0, 3600.0, 60.0)
    with pytest.raises(ValueError, match="restart_seconds must be >= 0, got -1"):
        expected_waste(300.0, 6.0, 3600.0, restart_seconds=-1)
    with pytest.raises(ValueError, match="restart_seconds must be a finite number"):
        expected_waste(300.0, 6.0, 3600.0, restart_seconds=math.nan)


def test_steps_for_interval_rejects_a_bad_step_time():
    with pytest.raises(ValueError, match="step_seconds must be > 0"):
        steps_for_interval(300.0, 0.0)
