"""Two-tier checkpoint cadence: how often to save to node-local disk, and every how many saves to persist.

``AtomicCheckpointIO(local_tier=DIR, persist_every=N)`` commits every save to node-local disk and copies every
``N``-th one to the durable store in the background. Two kinds of failure then cost differently:

- a **process-level failure** (a crash, a GPU fault, an in-place restart; mean time between them ``M_p``) leaves
  the node and its local disk: training restarts in ``R_l`` seconds from the newest *local* checkpoint;
- a **node loss** (preemption without notice, hardware loss; ``M_n``) takes the local tier with it: training
  restarts in ``R_d`` seconds (the download included) from the newest *durable* checkpoint.

Every save blocks the loop ``C_l`` seconds; a persist costs the loop ``B`` more (0 when it runs fully in the
background) and takes ``C_d`` seconds, the time one checkpoint takes to write to the durable store, before the
checkpoint survives a node loss. :func:`tiered_waste` is the expected fraction of wall time lost at a local
interval ``tau`` and a ``persist_every`` of ``N``; :func:`plan_tiers` finds the pair that loses least and
compares it with the single-tier plan (every save written straight to the durable store, blocking ``C_d``, at
Daly's interval for the combined MTBF, every failure restarting from the store in ``R_d``).

To first order, and with ``N`` free, the optimum is one Young interval per tier, each from the cost of its
own save and the failures it alone protects against::

    tau_l     ~ sqrt(2 C_l M_p)        local interval (compute seconds between saves)
    N * tau_l ~ sqrt(2 B M_n)          durable interval, so N ~ sqrt(B M_n / (C_l M_p))

With a free persist (``B = 0``) there is no reason to persist less often than one upload allows
(``N (tau_l + C_l) >= C_d``), and with ``N = 1`` every failure rolls back at most one local interval:
``tau_l ~ sqrt(2 C_l M)`` with the combined ``M = 1 / (1/M_p + 1/M_n)``. :func:`plan_tiers` does not rely on these
approximations: it minimises :func:`tiered_waste` over ``tau`` for each ``N`` and over integer ``N``.

Example: 2 s local saves, 40 s to S3, a process failure every 6 h and a node loss every 48 h, restarts of 1 min
from local disk and 5 min from S3::

    >>> costs = TierCosts(local_save_seconds=2, durable_save_seconds=40, process_mtbf_seconds=6 * 3600,
    ...                   node_mtbf_seconds=48 * 3600, local_restart_seconds=60, durable_restart_seconds=300)
    >>> plan = plan_tiers(costs)
    >>> round(plan.local_interval_seconds), plan.persist_every, f"{plan.waste:.2%}"
    (276, 1, '1.90%')
    >>> round(plan.single_tier_interval_seconds), f"{plan.single_tier_waste:.2%}"
    (1213, '7.77%')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lightning_resilient._checks import check_non_negative, check_positive, check_positive_int
from lightning_resilient.planning.cadence import daly_interval, expected_waste

__all__ = ["TierCosts", "TieredPlan", "plan_tiers", "tiered_waste"]

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_MAX_PERSIST_EVERY = 2**40  # beyond any real run: only reached when node losses (nearly) never happen


@dataclass(frozen=True)
class TierCosts:
    """What each tier's saves and restarts cost, and how often each kind of failure strikes the job.

    Times in seconds, MTBFs of the whole job (for ``n`` nodes that each lose their disk every ``H`` hours on
    average, the node MTBF is ``H / n``).

    Attributes:
        local_save_seconds: ``C_l``, seconds every save blocks training to commit to the node-local tier.
        durable_save_seconds: ``C_d``, seconds one checkpoint takes to write to the durable store: what every save
            blocks in the single-tier plan, and how long a background persist takes before its checkpoint survives
            a node loss (the lag) in the tiered plan.
        process_mtbf_seconds: ``M_p``, mean time between failures that leave the node and its local disk intact
            (process crash, GPU fault, NCCL timeout, in-place restart).
        node_mtbf_seconds: ``M_n``, mean time between losses of a node with its local disk (preemption without
            notice, hardware failure). A preemption *with* notice costs one save, not a rollback: leave it out.
        local_restart_seconds: ``R_l``, seconds from a process failure to training again from the local tier.
        durable_restart_seconds: ``R_d``, seconds from a node loss to training again from the durable store
            (a new node, the download included).
        persist_blocking_seconds: ``B``, the training time one persist costs (0 for a persist that runs fully in
            the background; the time it slows the loop down when it competes for the network, disk or CPU).

    Example::

        >>> costs = TierCosts(local_save_seconds=2, durable_save_seconds=40, process_mtbf_seconds=6 * 3600,
        ...                   node_mtbf_seconds=48 * 3600)
        >>> costs.mtbf_seconds  # one failure of either kind every 5.3 h
        19200.0
        >>> TierCosts(2, 40, 6 * 3600, 0)
        Traceback (most recent call last):
        ...
        ValueError: node_mtbf_seconds must be > 0, got 0

    Raises:
        TypeError: a field is not a number.
        ValueError: a save time or MTBF is not > 0, a restart or blocking time is negative, or a value is NaN or
            infinite; the message names the field.
    """

    local_save_seconds: float
    durable_save_seconds: float
    process_mtbf_seconds: float
    node_mtbf_seconds: float
    local_restart_seconds: float = 0.0
    durable_restart_seconds: float = 0.0
    persist_blocking_seconds: float = 0.0

    def __post_init__(self) -> None:
        # Stored as floats, so that a plan computed from ints or numpy scalars prints the same.
        for name in ("local_save_seconds", "durable_save_seconds", "process_mtbf_seconds", "node_mtbf_seconds"):
            object.__setattr__(self, name, check_positive(name, getattr(self, name)))
        for name in ("local_restart_seconds", "durable_restart_seconds", "persist_blocking_seconds"):
            object.__setattr__(self, name, check_non_negative(name, getattr(self, name)))

    @property
    def mtbf_seconds(self) -> float:
        """The job's mean time between failures of either kind: ``1 / (1/M_p + 1/M_n)``."""
        return 1.0 / (1.0 / self.process_mtbf_seconds + 1.0 / self.node_mtbf_seconds)

    def min_local_interval(self, persist_every: int) -> float:
        """The shortest local interval at which one persist is done before the next is due, >= 0.

        ``persist_every * (tau + C_l) + B >= C_d``: persists any closer together would queue behind each other.
        """
        n = check_positive_int("persist_every", persist_every)
        return max(0.0, (self.durable_save_seconds - self.persist_blocking_seconds) / n - self.local_save_seconds)


@dataclass(frozen=True)
class TieredPlan:
    """A local interval and ``persist_every``, the waste they cost, and the single-tier plan beside them.

    Attributes:
        costs: the inputs.
        local_interval_seconds: ``tau_l``, compute seconds between two saves to the local tier.
        persist_every: ``N``: every ``N``-th save is persisted (``AtomicCheckpointIO(persist_every=N)``).
        waste: the expected fraction of wall time lost by this plan (:func:`tiered_waste`).
        single_tier_interval_seconds: Daly's interval for saving every checkpoint straight to the durable store.
        single_tier_waste: the expected waste of that plan (:func:`~lightning_resilient.planning.expected_waste`
            with ``C_d``, the combined MTBF and ``R_d``: without a local tier every failure restarts from the store).

    Example::

        >>> plan = plan_tiers(TierCosts(2, 40, 6 * 3600, 48 * 3600, persist_blocking_seconds=4))
        >>> plan.persist_every, round(plan.durable_interval_seconds), round(10 * plan.persists_per_hour, 1)
        (4, 1166, 30.5)
    """

    costs: TierCosts
    local_interval_seconds: float
    persist_every: int
    waste: float
    single_tier_interval_seconds: float
    single_tier_waste: float

    @property
    def durable_interval_seconds(self) -> float:
        """Compute seconds between two persisted checkpoints: ``persist_every * local_interval_seconds``."""
        return self.persist_every * self.local_interval_seconds

    @property
    def local_saves_per_hour(self) -> float:
        """Saves to the local tier per hour of failure-free training."""
        return 3600.0 / self._cycle_seconds() * self.persist_every

    @property
    def persists_per_hour(self) -> float:
        """Checkpoints written to the durable store per hour of failure-free training (tiered plan)."""
        return 3600.0 / self._cycle_seconds()

    @property
    def single_tier_saves_per_hour(self) -> float:
        """Checkpoints written to the durable store per hour of failure-free training (single-tier plan)."""
        return 3600.0 / (self.single_tier_interval_seconds + self.costs.durable_save_seconds)

    @property
    def pays(self) -> bool:
        """Whether the tiered plan wastes less than the single-tier one."""
        return self.waste < self.single_tier_waste

    def _cycle_seconds(self) -> float:
        c = self.costs
        return self.persist_every * (self.local_interval_seconds + c.local_save_seconds) + c.persist_blocking_seconds


def tiered_waste(costs: TierCosts, local_interval_seconds: float, persist_every: int) -> float:
    """The expected fraction of wall time lost with a local save every ``tau`` seconds and a persist every ``N``.

    Daly's (2006) model of :func:`~lightning_resilient.planning.expected_waste`, with two failure classes. Both
    arrive as Poisson processes (rates ``1/M_p`` and ``1/M_n``) at any moment, saves and restarts included. A cycle
    is ``N`` segments of ``tau`` seconds of compute plus a local save (``C_l``), then the persist's blocking
    ``B``. A process failure costs ``R_l`` and the work since the newest local checkpoint; a node loss costs
    ``R_d`` and the work since the newest durable one (the cycle's start); a failure during a restart starts that
    restart over (a node loss during a local restart turns it into a durable one). The expected wall time of a
    cycle, ``E``, solves these renewal equations exactly (closed form over the ``N`` segments).

    The persist's lag is modelled to first order: a node loss in the ``C_d`` seconds a persist takes rolls back
    to the previous durable checkpoint, one more cycle, so the wall time per cycle is ``E * (1 + p)`` with
    ``p = 1 - exp(-C_d / M_n)``, and the waste is ``1 - N tau / (E (1 + p))``. It assumes one persist is done
    before the next starts (``N (tau + C_l) + B >= C_d``, see :meth:`TierCosts.min_local_interval`).

    Limits: with node losses vanishingly rare it is :func:`expected_waste` ``(tau, C_l, M_p, R_l)`` for every
    ``N``; with ``N = 1``, ``B = 0`` and process failures vanishingly rare it is ``expected_waste(tau, C_l, M_n,
    R_d)`` plus the lag.

    Example::

        >>> costs = TierCosts(local_save_seconds=2, durable_save_seconds=40, process_mtbf_seconds=6 * 3600,
        ...                   node_mtbf_seconds=48 * 3600, local_restart_seconds=60, durable_restart_seconds=300)
        >>> f"{tiered_waste(costs, 300, 1):.2%}", f"{tiered_waste(costs, 300, 12):.2%}"
        ('1.91%', '2.86%')

    Args:
        costs: the two tiers' costs and the failure rates.
        local_interval_seconds: ``tau``, compute seconds between two local saves.
        persist_every: ``N``, every how many local saves one is persisted, >= 1.

    Returns:
        A fraction in ``(0, 1]``; 1.0 when the cycle is so long that it essentially never completes.

    Raises:
        TypeError: ``costs`` is not a :class:`TierCosts`, or an argument has the wrong type.
        ValueError: ``local_interval_seconds`` is not a finite number > 0, or ``persist_every`` < 1.
    """
    if not isinstance(costs, TierCosts):
        raise TypeError(f"costs must be a TierCosts, got {type(costs).__name__} {costs!r}")
    tau = check_positive("local_interval_seconds", local_interval_seconds)
    n = check_positive_int("persist_every", persist_every)
    return _waste(costs, tau, n)


def plan_tiers(costs: TierCosts, *, persist_every: int | None = None,
               max_persists_per_hour: float | None = None) -> TieredPlan:
    """The local interval and ``persist_every`` with the least :func:`tiered_waste`, and the single-tier plan.

    For each ``N`` the local interval minimises the waste (a golden-section search around the first-order
    optimum, no shorter than :meth:`TierCosts.min_local_interval`); ``N`` minimises that over the integers
    (exactly: its neighbours waste more). Pass ``persist_every`` to fix ``N`` and get the best interval for it,
    e.g. to price a persist less often than the optimum, or ``max_persists_per_hour`` to cap the traffic to the
    durable store (per hour of failure-free training): the least waste among the ``N`` within the cap.

    Example::

        >>> costs = TierCosts(local_save_seconds=2, durable_save_seconds=40, process_mtbf_seconds=6 * 3600,
        ...                   node_mtbf_seconds=48 * 3600, persist_blocking_seconds=4)
        >>> plan = plan_tiers(costs)
        >>> round(plan.local_interval_seconds), plan.persist_every, round(plan.durable_interval_seconds)
        (292, 4, 1166)
        >>> plan_tiers(costs, persist_every=8).waste > plan.waste
        True

    Raises:
        TypeError: ``costs`` is not a :class:`TierCosts`, ``persist_every`` is not an int or
            ``max_persists_per_hour`` not a number.
        ValueError: ``persist_every`` < 1, ``max_persists_per_hour`` not a finite number > 0, or both given.
    """
    if not isinstance(costs, TierCosts):
        raise TypeError(f"costs must be a TierCosts, got {type(costs).__name__} {costs!r}")
    if persist_every is not None and max_persists_per_hour is not None:
        raise ValueError(f"give persist_every or max_persists_per_hour, not both: got persist_every={persist_every!r},"
                         f" max_persists_per_hour={max_persists_per_hour!r}")
    if persist_every is not None:
        n = check_positive_int("persist_every", persist_every)
        tau, waste = _best_interval(costs, n)
    else:
        n, tau, waste = _best_persist_every(costs)
        if max_persists_per_hour is not None:
            cap = check_positive("max_persists_per_hour", max_persists_per_hour)
            n, tau, waste = _within_cap(costs, n, tau, waste, cap)
    single = daly_interval(costs.durable_save_seconds, costs.mtbf_seconds)
    single_waste = expected_waste(single, costs.durable_save_seconds, costs.mtbf_seconds,
                                  costs.durable_restart_seconds)
    return TieredPlan(costs=costs, local_interval_seconds=tau, persist_every=n, waste=waste,
                      single_tier_interval_seconds=single, single_tier_waste=single_waste)


# -- the model ---------------------------------------------------------------------------------------------------
def _waste(c: TierCosts, tau: float, n: int) -> float:
    lam_p, lam_n = 1.0 / c.process_mtbf_seconds, 1.0 / c.node_mtbf_seconds
    lam = lam_p + lam_n
    pp, pn = lam_p / lam, lam_n / lam
    try:
        r = math.exp(-lam * c.local_restart_seconds)
        m_rl = -math.expm1(-lam * c.local_restart_seconds) / lam  # expected time spent in one restart attempt
        den_a = pn + pp * r  # 1 - P(a local restart ends in a process failure)
        # One phase of x seconds, from a checkpoint: E_start = a + (1 - v) E_next + v Z, where Z is the expected
        # time to finish the cycle from a node loss and v the chance the phase ends in one (through its own
        # failures or those of the local restarts a process failure sends it through).
        seg_a, seg_v = _phase(tau + c.local_save_seconds, lam, pp, pn, m_rl, den_a)
        blk_a, blk_v = _phase(c.persist_blocking_seconds, lam, pp, pn, m_rl, den_a)
        # N identical segments, then the blocking phase: E_0 = a S + b^N E_B + (1 - b^N) Z, with b = 1 - v and
        # S = (1 - b^N) / v (= N when node losses never happen: the segments are then independent).
        if seg_v >= 1.0:
            return 1.0  # a segment so long that a node loss always comes first
        log_bn = n * math.log1p(-seg_v)
        bn = math.exp(log_bn)
        s = -math.expm1(log_bn) / seg_v if seg_v > 0 else float(n)
        alpha = seg_a * s + bn * blk_a
        # Z = K + E_0 (a durable restart of R_d, retried on any failure, then the cycle from its start), so
        # E_0 = (alpha + (1 - b^N b_B) K) / (b^N b_B), with no difference of nearly equal numbers.
        k = math.expm1(lam * c.durable_restart_seconds) / lam
        survive = bn * (1.0 - blk_v)
        cycle = (alpha + (1.0 - survive) * k) / survive
        lag = -math.expm1(-lam_n * c.durable_save_seconds)
        wall = cycle * (1.0 + lag)
    except (OverflowError, ZeroDivisionError):
        return 1.0  # a cycle that essentially never completes
    if not math.isfinite(wall) or wall <= 0:
        return 1.0
    return min(1.0, max(0.0, 1.0 - n * tau / wall))


def _phase(x: float, lam: float, pp: float, pn: float, m_rl: float, den_a: float) -> tuple[float, float]:
    """``(a, v)`` of ``E_start = a + (1 - v) E_next + v Z`` for a phase of ``x`` seconds (``(0, 0)`` for none)."""
    if x == 0:
        return 0.0, 0.0
    q = math.exp(-lam * x)  # the phase completes without a failure
    f = -math.expm1(-lam * x)
    h = q + f * pn / den_a
    a = (f / lam + f * pp * m_rl / den_a) / h
    # v = 1 - q / h, computed directly: it is ~x / M_n, far below 1's rounding error when failures are rare.
    return a, f * pn / (den_a * h)


# -- the search --------------------------------------------------------------------------------------------------
def _first_order_interval(c: TierCosts, n: int) -> float:
    # d/dtau of C_l/tau + B/(N tau) + (1/M_p + N/M_n) tau / 2 = 0.
    cost = c.local_save_seconds + c.persist_blocking_seconds / n
    rate = 1.0 / c.process_mtbf_seconds + n / c.node_mtbf_seconds
    return math.sqrt(2.0 * cost / rate)


def _best_interval(c: TierCosts, n: int) -> tuple[float, float]:
    """The local interval with the least waste for this ``N``, and that waste."""
    floor = c.min_local_interval(n)
    guess = max(_first_order_interval(c, n), floor)
    lo = max(guess / 64.0, floor, 1e-9 * guess)
    hi = guess * 64.0
    tau = math.exp(_golden_min(lambda x: _waste(c, math.exp(x), n), math.log(lo), math.log(hi)))
    return tau, _waste(c, tau, n)


def _golden_min(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-9) -> float:
    """The minimiser of a unimodal ``f`` on ``[lo, hi]``."""
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = f(x1), f(x2)
    while hi - lo > tol:
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - _GOLDEN * (hi - lo)
            f1 = f(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + _GOLDEN * (hi - lo)
            f2 = f(x2)
    return (lo + hi) / 2.0


def _best_persist_every(c: TierCosts) -> tuple[int, float, float]:
    """The ``N`` (and its interval and waste) with the least waste, by a search over the integers."""
    cache: dict[int, tuple[float, float]] = {}

    def waste(n: int) -> float:
        if n not in cache:
            cache[n] = _best_interval(c, n)
        return cache[n][1]

    # The first-order N is sqrt(B M_n / (C_l M_p)); bracket the minimum to the right of it, then narrow the bracket
    # (the waste is unimodal in N) and look at what is left.
    guess = math.sqrt(c.persist_blocking_seconds * c.node_mtbf_seconds
                      / (c.local_save_seconds * c.process_mtbf_seconds))
    lo, hi = 1, max(4, min(_MAX_PERSIST_EVERY, 2 * math.ceil(guess) + 2))
    while hi < _MAX_PERSIST_EVERY and waste(hi + 1) < waste(hi):
        lo, hi = hi, min(_MAX_PERSIST_EVERY, hi * 2)
    while hi - lo > 4:
        m1 = lo + (hi - lo) // 3
        m2 = hi - (hi - lo) // 3
        if waste(m1) <= waste(m2):
            hi = m2
        else:
            lo = m1
    best = min(range(lo, hi + 1), key=lambda n: (waste(n), n))
    tau, w = cache[best]
    return best, tau, w


def _within_cap(c: TierCosts, n: int, tau: float, waste: float, cap: float) -> tuple[int, float, float]:
    """The smallest ``N`` >= the optimal one whose persists per hour are within ``cap``: past the optimum the waste
    only grows with ``N``, and the durable interval grows too, so the first ``N`` within the cap is the best."""
    def per_hour(n: int, tau: float) -> float:
        return 3600.0 / (n * (tau + c.local_save_seconds) + c.persist_blocking_seconds)

    if per_hour(n, tau) <= cap:
        return n, tau, waste
    cache: dict[int, tuple[float, float]] = {}

    def fits(m: int) -> bool:
        if m not in cache:
            cache[m] = _best_interval(c, m)
        return per_hour(m, cache[m][0]) <= cap

    lo, hi = n, 2 * n  # lo does not fit, hi is tried
    while not fits(hi):
        if hi >= _MAX_PERSIST_EVERY:
            raise ValueError(f"max_persists_per_hour={cap!r} cannot be met with persist_every <= {_MAX_PERSIST_EVERY}")
        lo, hi = hi, min(_MAX_PERSIST_EVERY, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    fits(hi)
    return hi, cache[hi][0], cache[hi][1]
