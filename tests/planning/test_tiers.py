"""Two-tier cadence: the waste model against its limits and a simulation, the search, and the input checks."""

from __future__ import annotations

import ast
import itertools
import math
import random
from pathlib import Path

import pytest

from lightning_resilient import planning
from lightning_resilient.planning import TierCosts, daly_interval, expected_waste, plan_tiers, tiered_waste

HOUR = 3600.0
# The worked example of docs/tiered-cadence.md: 2 s to local NVMe, 40 s to S3, a process failure every 6 h, a node
# loss every 48 h, 1 min to restart from local disk, 5 min from S3.
EXAMPLE = {"local_save_seconds": 2.0, "durable_save_seconds": 40.0, "process_mtbf_seconds": 6 * HOUR,
           "node_mtbf_seconds": 48 * HOUR, "local_restart_seconds": 60.0, "durable_restart_seconds": 300.0}
NEVER = 1e12 * HOUR  # an MTBF long enough to mean "never"; TierCosts takes finite numbers only


def costs(**changes: float) -> TierCosts:
    return TierCosts(**{**EXAMPLE, **changes})


# A spread of realistic and less realistic jobs: (C_l, C_d, M_p, M_n, R_l, R_d, B).
GRID = [
    (2.0, 40.0, 6 * HOUR, 48 * HOUR, 60.0, 300.0, 0.0),
    (2.0, 40.0, 6 * HOUR, 48 * HOUR, 60.0, 300.0, 4.0),
    (2.0, 40.0, 6 * HOUR, 48 * HOUR, 60.0, 300.0, 40.0),
    (0.5, 120.0, 2 * HOUR, 24 * HOUR, 30.0, 600.0, 2.0),
    (10.0, 60.0, 4 * HOUR, 4 * HOUR, 120.0, 120.0, 10.0),  # equal rates, equal restarts
    (5.0, 600.0, 12 * HOUR, 200 * HOUR, 60.0, 900.0, 30.0),  # a slow upload: persists limited by its length
    (1.0, 20.0, 0.5 * HOUR, 3 * HOUR, 10.0, 200.0, 1.0),  # failure-prone
]


def grid_costs(entry: tuple[float, ...]) -> TierCosts:
    c_l, c_d, m_p, m_n, r_l, r_d, b = entry
    return TierCosts(local_save_seconds=c_l, durable_save_seconds=c_d, process_mtbf_seconds=m_p,
                     node_mtbf_seconds=m_n, local_restart_seconds=r_l, durable_restart_seconds=r_d,
                     persist_blocking_seconds=b)


# -- the waste model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tau", [30.0, 300.0, 3000.0])
@pytest.mark.parametrize("n", [1, 3, 50])
def test_without_node_losses_it_is_dalys_waste_of_the_local_tier(tau, n):
    # Every failure restarts from the newest local checkpoint, so N does not matter.
    c = costs(node_mtbf_seconds=NEVER)
    assert tiered_waste(c, tau, n) == pytest.approx(expected_waste(tau, 2.0, 6 * HOUR, 60.0), rel=1e-8)


@pytest.mark.parametrize("tau", [30.0, 300.0, 3000.0])
def test_persisting_every_save_without_process_failures_is_dalys_waste_plus_the_lag(tau):
    c = costs(process_mtbf_seconds=NEVER)
    daly = expected_waste(tau, 2.0, 48 * HOUR, 300.0)
    lag = -math.expm1(-40.0 / (48 * HOUR))  # a node loss during the 40 s upload redoes one more cycle
    assert tiered_waste(c, tau, 1) == pytest.approx(1 - (1 - daly) / (1 + lag), rel=1e-8)


def test_a_single_tier_is_the_special_case_of_a_local_tier_that_is_the_durable_one():
    # Local saves as dear as durable ones, every failure a node loss, a negligible lag: expected_waste itself.
    c = TierCosts(local_save_seconds=40.0, durable_save_seconds=1e-9, process_mtbf_seconds=NEVER,
                  node_mtbf_seconds=5 * HOUR, durable_restart_seconds=300.0)
    assert tiered_waste(c, 1200.0, 1) == pytest.approx(expected_waste(1200.0, 40.0, 5 * HOUR, 300.0), rel=1e-9)


def test_without_failures_the_waste_is_the_blocking_alone():
    c = costs(process_mtbf_seconds=NEVER, node_mtbf_seconds=NEVER, persist_blocking_seconds=6.0)
    # Per cycle of 4 saves: 4 x 100 s of compute, 4 x 2 s of local saves and 6 s of the persist.
    assert tiered_waste(c, 100.0, 4) == pytest.approx(14 / 414, rel=1e-6)


def test_the_waste_grows_with_each_cost():
    base = tiered_waste(costs(persist_blocking_seconds=4.0), 300.0, 4)
    for field, value in [("local_save_seconds", 3.0), ("durable_save_seconds", 400.0), ("process_mtbf_seconds", HOUR),
                         ("node_mtbf_seconds", 10 * HOUR), ("local_restart_seconds", 120.0),
                         ("durable_restart_seconds", 900.0), ("persist_blocking_seconds", 8.0)]:
        changed = costs(**{"persist_blocking_seconds": 4.0, field: value})
        assert tiered_waste(changed, 300.0, 4) > base, field


def test_the_waste_saturates_instead_of_overflowing():
    assert tiered_waste(costs(), 1e9, 1) == 1.0
    assert tiered_waste(costs(durable_restart_seconds=1e9), 300.0, 1) == 1.0
    # A local restart that never ends is cut short by the next node loss (48 h), then restarts from the store: each
    # process failure (every ~6 h of progress) costs about 48 h.
    assert tiered_waste(costs(local_restart_seconds=1e9), 300.0, 1) == pytest.approx(48 / (48 + 6), abs=0.01)
    assert tiered_waste(costs(), 300.0, 10**9) == pytest.approx(1.0)


def simulate(c: TierCosts, tau: float, n: int, cycles: int, seed: int) -> float:
    """An event-by-event run of the model's assumptions, the persist's lag simulated exactly."""
    rng = random.Random(seed)
    lam_p, lam_n = 1 / c.process_mtbf_seconds, 1 / c.node_mtbf_seconds
    length = {"segment": tau + c.local_save_seconds, "persist": c.persist_blocking_seconds,
              "local restart": c.local_restart_seconds, "durable restart": c.durable_restart_seconds}
    t, done, durable = 0.0, 0, 0  # wall time; local saves done; local saves in the newest durable checkpoint
    in_flight: tuple[int, float] | None = None  # (saves, time it lands)
    phase, resume = "segment", "segment"
    while not (phase == "segment" and done >= cycles * n):
        x = length[phase]
        to_process, to_node = rng.expovariate(lam_p), rng.expovariate(lam_n)  # memoryless: fresh clocks per phase
        if min(to_process, to_node) >= x:
            t += x
            if phase == "segment":
                done += 1
                if done % n == 0:
                    if in_flight is not None and in_flight[1] <= t:
                        durable = in_flight[0]
                    in_flight = (done, t + c.durable_save_seconds)
                    phase = "persist" if c.persist_blocking_seconds > 0 else "segment"
            elif phase == "local restart":
                phase = resume
            else:
                phase = "segment"
            continue
        t += min(to_process, to_node)
        if in_flight is not None and in_flight[1] <= t:
            durable, in_flight = in_flight[0], None
        if to_node < to_process:  # the node and its local tier are gone: back to the newest durable checkpoint
            done, in_flight, phase = durable, None, "durable restart"
        elif phase in ("segment", "persist"):  # back to the newest local checkpoint, then this phase again
            resume, phase = phase, "local restart"
    return 1.0 - done * tau / t


@pytest.mark.parametrize(("tau", "n", "blocking"), [(100.0, 1, 0.0), (100.0, 4, 0.0), (60.0, 10, 15.0)])
def test_the_model_agrees_with_a_simulation(tau, n, blocking):
    # Failure rates high enough for a few thousand failures in a fraction of a second.
    c = TierCosts(local_save_seconds=2.0, durable_save_seconds=30.0, process_mtbf_seconds=0.5 * HOUR,
                  node_mtbf_seconds=2 * HOUR, local_restart_seconds=60.0, durable_restart_seconds=300.0,
                  persist_blocking_seconds=blocking)
    simulated = [simulate(c, tau, n, cycles=40_000 // n, seed=seed) for seed in range(3)]
    assert sum(simulated) / len(simulated) == pytest.approx(tiered_waste(c, tau, n), rel=0.02)


# -- the plan ----------------------------------------------------------------------------------------------------
def test_the_worked_example():
    plan = plan_tiers(costs())
    # A free persist: every save is persisted, at an interval close to Young's for the combined MTBF (5.33 h).
    assert plan.persist_every == 1
    assert plan.local_interval_seconds == pytest.approx(275.8, abs=0.1)
    assert plan.local_interval_seconds == pytest.approx(math.sqrt(2 * 2.0 * 48 / 9 * HOUR), rel=0.01)
    assert plan.waste == pytest.approx(0.01904, abs=1e-5)
    assert plan.single_tier_interval_seconds == daly_interval(40.0, 48 / 9 * HOUR)
    assert plan.single_tier_waste == pytest.approx(0.07769, abs=1e-5)
    assert plan.pays
    assert plan.single_tier_saves_per_hour == pytest.approx(3600 / (1212.83 + 40), rel=1e-4)
    assert plan.persists_per_hour == plan.local_saves_per_hour == pytest.approx(3600 / 277.8, rel=1e-3)


def test_the_first_order_optimum_holds_when_failures_are_rare():
    # tau_l ~ sqrt(2 C_l M_p) and N tau_l ~ sqrt(2 B M_n) (both MTBFs >> both intervals).
    c = costs(process_mtbf_seconds=200 * HOUR, node_mtbf_seconds=5000 * HOUR, persist_blocking_seconds=2.0,
              local_restart_seconds=0.0, durable_restart_seconds=0.0, durable_save_seconds=2.0)
    plan = plan_tiers(c)
    assert plan.local_interval_seconds == pytest.approx(math.sqrt(2 * 2.0 * 200 * HOUR), rel=0.05)
    assert plan.durable_interval_seconds == pytest.approx(math.sqrt(2 * 2.0 * 5000 * HOUR), rel=0.05)
    assert plan.persist_every == 5  # sqrt(B M_n / (C_l M_p)) = sqrt(25)


@pytest.mark.parametrize("entry", GRID)
def test_the_plan_minimises_the_waste_among_its_neighbours(entry):
    c = grid_costs(entry)
    plan = plan_tiers(c)
    tau, n = plan.local_interval_seconds, plan.persist_every
    assert plan.waste == tiered_waste(c, tau, n)
    for scale in (0.99, 1.01):  # the interval, for this N
        assert plan.waste <= tiered_waste(c, max(tau * scale, c.min_local_interval(n) or tau * scale), n)
    for other in (n - 1, n + 1):  # N, each with its own best interval
        if other >= 1:
            assert plan.waste <= plan_tiers(c, persist_every=other).waste
    # One persist is done before the next one starts.
    assert n * (tau + c.local_save_seconds) + c.persist_blocking_seconds >= c.durable_save_seconds * (1 - 1e-9)


def test_a_slow_upload_spaces_the_persists():
    # A 10 min upload behind a 4.6 min local interval: persisting every save would queue uploads.
    plan = plan_tiers(costs(durable_save_seconds=600.0))
    assert plan.persist_every >= 2
    assert plan.persist_every * (plan.local_interval_seconds + 2.0) >= 600.0 * (1 - 1e-9)
    assert plan_tiers(costs(durable_save_seconds=600.0), persist_every=1).local_interval_seconds >= 598.0 * (1 - 1e-9)


def test_node_losses_that_never_happen_make_persisting_rare():
    plan = plan_tiers(costs(node_mtbf_seconds=1e9 * HOUR, persist_blocking_seconds=4.0))
    assert plan.persist_every > 10_000
    assert plan.local_interval_seconds == pytest.approx(math.sqrt(2 * 2.0 * 6 * HOUR), rel=0.05)


def test_equal_rates_and_equal_save_costs():
    # Process failures as frequent as node losses: N ~ sqrt(B / C_l).
    equal = plan_tiers(costs(process_mtbf_seconds=10 * HOUR, node_mtbf_seconds=10 * HOUR,
                             persist_blocking_seconds=18.0))
    assert equal.persist_every == 3
    # A durable save no dearer than a local one still needs N >= 1, and a free one is persisted every save.
    same = plan_tiers(costs(durable_save_seconds=2.0, persist_blocking_seconds=2.0))
    assert same.persist_every >= 1 and same.pays
    assert plan_tiers(costs(durable_save_seconds=2.0)).persist_every == 1


@pytest.mark.parametrize("entry", [e for e in GRID if e[6] <= e[0]] + [
    (c_l, c_l * k, m_p, m_n, r_l, r_d, b)
    for c_l, k, (m_p, m_n), (r_l, r_d), b in itertools.product(
        (0.5, 5.0), (1.5, 20.0), ((2 * HOUR, 20 * HOUR), (10 * HOUR, 10 * HOUR), (50 * HOUR, 5 * HOUR)),
        ((0.0, 0.0), (30.0, 300.0)), (0.0,))
])
def test_two_tiers_waste_no_more_than_one_when_local_saves_are_cheaper(entry):
    c = grid_costs(entry)
    assert c.local_save_seconds < c.durable_save_seconds
    plan = plan_tiers(c)
    assert plan.waste <= plan.single_tier_waste


def test_a_local_tier_that_does_not_pay_is_reported():
    # Local saves dearer than durable ones, a blocking persist and almost only node losses.
    plan = plan_tiers(TierCosts(local_save_seconds=30.0, durable_save_seconds=10.0, process_mtbf_seconds=1000 * HOUR,
                                node_mtbf_seconds=5 * HOUR, persist_blocking_seconds=10.0))
    assert not plan.pays and plan.waste > plan.single_tier_waste


def test_a_fixed_persist_every_gets_its_own_best_interval():
    c = costs(persist_blocking_seconds=4.0)
    best = plan_tiers(c)
    fixed = plan_tiers(c, persist_every=16)
    assert fixed.persist_every == 16 and fixed.waste > best.waste
    assert fixed.local_interval_seconds < best.local_interval_seconds  # rarer persists, denser local saves
    assert fixed.single_tier_waste == best.single_tier_waste


@pytest.mark.parametrize("cap", [100.0, 2.7, 1.0, 0.05])
def test_a_cap_on_persists_takes_the_smallest_persist_every_within_it(cap):
    c = costs()
    best = plan_tiers(c)
    capped = plan_tiers(c, max_persists_per_hour=cap)
    assert capped.persists_per_hour <= cap
    assert capped.waste >= best.waste
    if capped.persist_every > best.persist_every:
        assert plan_tiers(c, persist_every=capped.persist_every - 1).persists_per_hour > cap
    else:
        assert capped.persist_every == best.persist_every


# -- input checks ------------------------------------------------------------------------------------------------
BAD_NUMBERS = [
    (math.nan, ValueError, "must be a finite number"),
    (math.inf, ValueError, "must be a finite number"),
    ("6", TypeError, "must be a number, got str '6'"),
    (None, TypeError, "must be a number, got NoneType"),
    (True, TypeError, "must be a number, got bool"),
]
POSITIVE = ["local_save_seconds", "durable_save_seconds", "process_mtbf_seconds", "node_mtbf_seconds"]
NON_NEGATIVE = ["local_restart_seconds", "durable_restart_seconds", "persist_blocking_seconds"]


@pytest.mark.parametrize("field", POSITIVE + NON_NEGATIVE)
@pytest.mark.parametrize(("value", "error", "message"), BAD_NUMBERS)
def test_tier_costs_name_the_bad_field(field, value, error, message):
    with pytest.raises(error, match=f"^{field} {message}"):
        costs(**{field: value})


@pytest.mark.parametrize("field", POSITIVE)
@pytest.mark.parametrize("value", [0, -1.0])
def test_save_times_and_mtbfs_must_be_positive(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be > 0, got {value!r}"):
        costs(**{field: value})


@pytest.mark.parametrize("field", NON_NEGATIVE)
def test_restarts_and_blocking_may_be_zero_but_not_negative(field):
    assert getattr(costs(**{field: 0}), field) == 0.0
    with pytest.raises(ValueError, match=f"^{field} must be >= 0, got -1"):
        costs(**{field: -1})


def test_tier_costs_are_floats_and_the_job_mtbf_combines_both():
    c = TierCosts(2, 40, 6 * 3600, 48 * 3600)
    assert isinstance(c.local_save_seconds, float) and c.persist_blocking_seconds == 0.0
    assert c.mtbf_seconds == pytest.approx(48 / 9 * HOUR)


@pytest.mark.parametrize(("args", "error", "message"), [
    ((0.0, 1), ValueError, "local_interval_seconds must be > 0"),
    ((math.nan, 1), ValueError, "local_interval_seconds must be a finite number"),
    ((300.0, 0), ValueError, "persist_every must be an int >= 1, got 0"),
    ((300.0, 2.0), TypeError, "persist_every must be an int >= 1, got float 2.0"),
    ((300.0, True), TypeError, "persist_every must be an int >= 1, got bool True"),
])
def test_tiered_waste_names_the_bad_argument(args, error, message):
    with pytest.raises(error, match=message):
        tiered_waste(costs(), *args)


def test_the_costs_must_be_tier_costs():
    for call in (lambda: tiered_waste({"local_save_seconds": 2}, 300.0, 1), lambda: plan_tiers(None)):
        with pytest.raises(TypeError, match="costs must be a TierCosts, got"):
            call()


def test_plan_arguments_are_checked():
    with pytest.raises(ValueError, match="give persist_every or max_persists_per_hour, not both"):
        plan_tiers(costs(), persist_every=2, max_persists_per_hour=1.0)
    with pytest.raises(ValueError, match="persist_every must be an int >= 1, got 0"):
        plan_tiers(costs(), persist_every=0)
    with pytest.raises(ValueError, match="max_persists_per_hour must be > 0, got 0"):
        plan_tiers(costs(), max_persists_per_hour=0)
    with pytest.raises(ValueError, match="persist_every must be an int >= 1, got -1"):
        costs().min_local_interval(-1)


# -- imports -----------------------------------------------------------------------------------------------------
LIGHT = {"lightning_resilient._checks", "lightning_resilient._units",
         "lightning_resilient.planning.cadence", "lightning_resilient.planning.cost",
         "lightning_resilient.planning.tiers"}


@pytest.mark.parametrize("module", ["cli/planning_commands", "planning/tiers", "planning/cadence", "planning/cost"])
def test_the_cli_planning_modules_import_no_torch_or_lightning(module):
    # `lightning-resilient cadence --help` must not pay for torch: these modules (and what they import of ours) may
    # only import light things at module level.
    path = Path(planning.__file__).parents[1] / f"{module}.py"
    for node in ast.parse(path.read_text()).body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            root = name.split(".")[0]
            assert root not in ("torch", "lightning", "pytorch_lightning", "lightning_utilities"), (module, name)
            if root == "lightning_resilient":
                assert name in LIGHT, (module, name)
