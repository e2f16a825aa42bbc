"""Which cluster to train on: wall-clock hours and money per option, optionally counting the value of time.

Each :class:`ClusterOption` knows its wall-clock hours, given directly or derived as work / throughput, and its
cost ``gpus x price_per_gpu_hour x hours``. :func:`compare` picks the option with the lowest total cost
(``cost + value_per_hour x hours``); on equal cost the faster one wins. :func:`load_scaling` turns the output
of ``benchmarks/scaling.py`` into options.

Units, everywhere: throughput in **samples per second** (of the whole cluster), work in samples (or optimizer
steps x global batch), time in hours, money in any one currency per GPU-hour.

Worked example::

    >>> c = compare([ClusterOption("256 GPUs", 256, 2.0, hours=48), ClusterOption("64 GPUs", 64, 2.0, hours=192)])
    >>> [row.cost for row in c.rows]
    [24576.0, 24576.0]
    >>> c.winner.name, c.reason
    ('256 GPUs', 'equal cost ($24,576.00 each), so the faster one: 256 GPUs takes 48.0 h instead of 192.0 h')
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

import fsspec

from lightning_resilient._checks import (
    check_bool,
    check_fraction,
    check_non_negative,
    check_positive,
    check_positive_int,
)
from lightning_resilient._units import (
    format_hours,
    format_hours_pair,
    format_money,
    format_money_pair,
    plural,
)

__all__ = ["ClusterOption", "Comparison", "OptionCost", "SCALING_SCHEMA", "compare", "load_scaling"]

SCALING_SCHEMA = "lightning_resilient.scaling/1"
# Every result of benchmarks/scaling.py carries exactly these fields (more are tolerated, none may be missing).
_RESULT_FIELDS = ("world_size", "global_batch", "throughput_samples_per_s", "scaling_efficiency", "step_seconds",
                  "save_seconds", "load_seconds", "checkpoint_overhead_fraction")
_REL_TOL = 1e-9  # costs this close are equal: the worked example's two products are exact, sums of floats not


@dataclass(frozen=True)
class ClusterOption:
    """One way to run the training job: how many GPUs, at what price, for how long.

    The hours come from exactly one of:

    - ``hours``: wall-clock hours, known directly;
    - work / throughput: the work is ``samples_to_target``, or ``steps_to_target x global_batch``; the throughput is
      ``throughput`` (samples/s of the whole cluster), or ``base_throughput x gpus x scaling_efficiency`` (the
      single-GPU samples/s and the measured scaling efficiency).

    ``overhead_fraction`` is the share of wall time spent outside the measured throughput (e.g. checkpointing):
    the hours become ``hours / (1 - overhead_fraction)``.

    Example::

        ClusterOption("64 x H100", 64, 2.0, base_throughput=410.0, scaling_efficiency=0.92,
                      steps_to_target=120_000, global_batch=1024, value_per_hour=50.0)

    Attributes:
        name: a label for tables and the verdict.
        gpus: how many GPUs are billed.
        price_per_gpu_hour: the price of one GPU for one hour (>= 0).
        hours: wall-clock hours, instead of work / throughput.
        throughput: samples per second of the whole cluster.
        base_throughput: samples per second of one GPU alone (with ``scaling_efficiency``).
        scaling_efficiency: throughput / (gpus x base_throughput), > 0 (usually <= 1).
        samples_to_target: samples to train to reach the target.
        steps_to_target: optimizer steps to reach the target at this option's ``global_batch``.
        global_batch: samples per optimizer step (with ``steps_to_target``).
        overhead_fraction: share of wall time lost outside the throughput, in [0, 1).
        value_per_hour: what one hour of waiting for the result is worth (same currency), >= 0.
    """

    name: str
    gpus: int
    price_per_gpu_hour: float
    _: KW_ONLY
    hours: float | None = None
    throughput: float | None = None
    base_throughput: float | None = None
    scaling_efficiency: float | None = None
    samples_to_target: float | None = None
    steps_to_target: float | None = None
    global_batch: int | None = None
    overhead_fraction: float = 0.0
    value_per_hour: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        where = f"option {self.name!r}: "
        try:
            self._validate()
        except (TypeError, ValueError) as err:
            raise type(err)(where + str(err)) from None

    def _validate(self) -> None:
        check_positive_int("gpus", self.gpus)
        check_non_negative("price_per_gpu_hour", self.price_per_gpu_hour)
        check_fraction("overhead_fraction", self.overhead_fraction)
        check_non_negative("value_per_hour", self.value_per_hour)
        for name in ("hours", "throughput", "base_throughput", "scaling_efficiency", "samples_to_target",
                     "steps_to_target"):
            value = getattr(self, name)
            if value is not None:
                check_positive(name, value)
        if self.global_batch is not None:
            check_positive_int("global_batch", self.global_batch)

        work = [n for n in ("samples_to_target", "steps_to_target") if getattr(self, n) is not None]
        rate = [n for n in ("throughput", "base_throughput") if getattr(self, n) is not None]
        if self.hours is not None:
            extra = work + rate + [n for n in ("scaling_efficiency", "global_batch") if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"give hours or work/throughput, not both: hours={self.hours!r} with {extra[0]}")
            return
        if len(work) != 1:
            raise ValueError("needs hours=..., or the work as exactly one of samples_to_target=... or"
                             f" steps_to_target=... (with global_batch=...), got {work or 'neither'}")
        if (self.steps_to_target is None) != (self.global_batch is None):
            raise ValueError("steps_to_target and global_batch go together (samples = steps x global batch);"
                             f" got steps_to_target={self.steps_to_target!r}, global_batch={self.global_batch!r}")
        if len(rate) != 1:
            raise ValueError("needs exactly one of throughput=... (samples/s of the cluster) or base_throughput=..."
                             f" (samples/s of one GPU, with scaling_efficiency=...), got {rate or 'neither'}")
        if (self.base_throughput is None) != (self.scaling_efficiency is None):
            raise ValueError("base_throughput and scaling_efficiency go together (throughput = base_throughput x"
                             f" gpus x scaling_efficiency); got base_throughput={self.base_throughput!r},"
                             f" scaling_efficiency={self.scaling_efficiency!r}")

    @property
    def samples_per_second(self) -> float | None:
        """Throughput of the whole cluster in samples/s, or None when the option gives hours directly."""
        if self.throughput is not None:
            return float(self.throughput)
        if self.base_throughput is not None and self.scaling_efficiency is not None:
            return self.base_throughput * self.gpus * self.scaling_efficiency
        return None

    @property
    def wall_hours(self) -> float:
        """Wall-clock hours to the target, overhead included."""
        if self.hours is not None:
            base = float(self.hours)
        else:
            samples = (self.samples_to_target if self.samples_to_target is not None
                       else float(self.steps_to_target or 0) * float(self.global_batch or 0))
            rate = self.samples_per_second
            assert rate is not None  # guaranteed by validation
            base = float(samples) / rate / 3600.0
        return base / (1.0 - self.overhead_fraction)


@dataclass(frozen=True)
class OptionCost:
    """One option's figures in a :class:`Comparison`."""

    option: ClusterOption
    hours: float
    cost: float  # gpus x price_per_gpu_hour x hours
    time_value: float  # value_per_hour x hours
    total_cost: float  # cost + time_value

    @property
    def name(self) -> str:
        return self.option.name


@dataclass(frozen=True)
class Comparison:
    """The figures for every option, and the verdict.

    Attributes:
        rows: one :class:`OptionCost` per option, in the order given.
        cheaper: the lowest total cost (cost + value of time); on equal cost the faster of them.
        faster: the fewest wall-clock hours; on equal hours the cheaper of them.
        winner: the one to pick: total cost decides, and on equal cost the faster one.
        reason: one line saying why the winner won.
    """

    rows: tuple[OptionCost, ...]
    cheaper: OptionCost
    faster: OptionCost
    winner: OptionCost
    reason: str

    def to_markdown(self) -> str:
        """The comparison as a markdown table followed by the verdict line."""
        lines = ["| option | GPUs | $/GPU-h | time | cost | cost incl. time value |",
                 "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {row.name} | {row.option.gpus} | {row.option.price_per_gpu_hour:,.2f} |"
                  f" {format_hours(row.hours)} | {format_money(row.cost)} | {format_money(row.total_cost)} |"
                  for row in self.rows]
        lines.append("")
        lines.append(f"winner: {self.winner.name} ({self.reason})")
        return "\n".join(lines)


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=1e-9)


def compare(options: Iterable[ClusterOption]) -> Comparison:
    """Wall-clock hours and cost of each option, and which to pick.

    The pick is the lowest total cost, ``gpus x price x hours + value_per_hour x hours``; on equal cost (to a
    relative 1e-9) the faster option wins, since the result comes sooner for the same money.

    Example::

        >>> slow = ClusterOption("64 GPUs", 64, 2.0, hours=100)
        >>> fast = ClusterOption("256 GPUs", 256, 2.0, hours=30)
        >>> compare([slow, fast]).winner.name
        '64 GPUs'
        >>> from dataclasses import replace
        >>> compare([replace(slow, value_per_hour=100.0), replace(fast, value_per_hour=100.0)]).winner.name
        '256 GPUs'

    Raises:
        TypeError: an item is not a :class:`ClusterOption`.
        ValueError: no options, or two with the same name.
    """
    items = list(options)
    if not items:
        raise ValueError("compare needs at least one ClusterOption, got none")
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, ClusterOption):
            raise TypeError(f"options[{i}] must be a ClusterOption, got {type(item).__name__}")
        if item.name in seen:
            raise ValueError(f"two options are named {item.name!r}: give each a distinct name")
        seen.add(item.name)

    rows = []
    for item in items:
        hours = item.wall_hours
        cost = item.gpus * item.price_per_gpu_hour * hours
        time_value = item.value_per_hour * hours
        rows.append(OptionCost(option=item, hours=hours, cost=cost, time_value=time_value,
                               total_cost=cost + time_value))

    lowest = min(r.total_cost for r in rows)
    cheaper = min((r for r in rows if _same(r.total_cost, lowest)), key=lambda r: r.hours)
    fewest = min(r.hours for r in rows)
    faster = min((r for r in rows if _same(r.hours, fewest)), key=lambda r: r.total_cost)
    winner = cheaper
    return Comparison(rows=tuple(rows), cheaper=cheaper, faster=faster, winner=winner,
                      reason=_reason(rows, winner))


def _reason(rows: list[OptionCost], winner: OptionCost) -> str:
    others = [r for r in rows if r is not winner]
    if not others:
        return f"the only option: {winner.name}"
    timed = any(r.option.value_per_hour > 0 for r in rows)
    what = "total cost incl. time value" if timed else "cost"
    tied = [r for r in others if _same(r.total_cost, winner.total_cost)]
    if tied:
        other = min(tied, key=lambda r: r.hours)
        if _same(other.hours, winner.hours):
            return (f"equal {what} ({format_money(winner.total_cost)}) and equal time ({format_hours(winner.hours)}):"
                    f" {winner.name} and {other.name} are interchangeable")
        mine, theirs = format_hours_pair(winner.hours, other.hours)
        return (f"equal {what} ({format_money(winner.total_cost)} each), so the faster one: {winner.name} takes"
                f" {mine} instead of {theirs}")
    runner_up = min(others, key=lambda r: (r.total_cost, r.hours))
    ours, other_money = format_money_pair(winner.total_cost, runner_up.total_cost)
    money = f"{ours} vs {other_money} for {runner_up.name}"
    prefix = "counting the value of time, " if timed else ""
    mine, theirs = format_hours_pair(winner.hours, runner_up.hours)
    if winner.hours < runner_up.hours and not _same(winner.hours, runner_up.hours):
        return f"{prefix}{winner.name} is both cheaper ({money}) and faster ({mine} vs {theirs})"
    if _same(winner.hours, runner_up.hours):
        return f"{prefix}{winner.name} costs less ({money}) in the same time ({format_hours(winner.hours)})"
    return f"{prefix}{winner.name} costs less ({money}) although it takes longer ({mine} vs {theirs})"


# -- the scaling benchmark's output ------------------------------------------------------------------------------
def _read_json(path: str) -> Any:
    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such scaling file (write it with benchmarks/scaling.py)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None


def _field(path: str, where: str, record: Mapping[str, Any], name: str, check: Any) -> Any:
    if name not in record:
        raise ValueError(f"{path}: {where} has no {name!r} field (schema {SCALING_SCHEMA})")
    try:
        return check(name, record[name])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {where}.{err}") from None


def _check_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {value!r}")
    return value


def load_scaling(
    path: str | os.PathLike[str],
    *,
    price_per_gpu_hour: float,
    steps_to_target: float | Mapping[int, float] | None = None,
    samples_to_target: float | None = None,
    value_per_hour: float = 0.0,
    include_checkpoint_overhead: bool = True,
) -> list[ClusterOption]:
    """Read ``benchmarks/scaling.py``'s JSON and make one :class:`ClusterOption` per measured world size.

    The file (schema ``lightning_resilient.scaling/1``)::

        {"schema": "lightning_resilient.scaling/1", "model": "...", "machine": "...",
         "results": [{"world_size": 1, "global_batch": 32, "throughput_samples_per_s": 1234.5,
                      "scaling_efficiency": 1.0, "step_seconds": 0.026, "save_seconds": 0.8,
                      "load_seconds": 0.5, "checkpoint_overhead_fraction": 0.01}, ...]}

    Each result becomes ``ClusterOption(name="<world_size> GPUs" ("1 GPU"), gpus=world_size, throughput=
    throughput_samples_per_s, ...)``. The throughput is taken to exclude checkpointing, whose measured share of
    wall time (``checkpoint_overhead_fraction``) is added back unless ``include_checkpoint_overhead=False``.

    Example::

        options = load_scaling("scaling.json", price_per_gpu_hour=2.0, steps_to_target={256: 90_000, 1024: 30_000})
        print(compare(options).to_markdown())

    Args:
        path: the JSON file (any fsspec URL).
        price_per_gpu_hour: the price of one GPU-hour, for every option.
        steps_to_target: optimizer steps to reach the target: one number for every global batch, or a mapping
            ``global_batch -> steps`` (a larger batch often needs fewer steps, but more samples).
        samples_to_target: the target as samples instead (give this or ``steps_to_target``).
        value_per_hour: the value of one hour of time, for every option.
        include_checkpoint_overhead: stretch the hours by ``1 / (1 - checkpoint_overhead_fraction)``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not JSON, another schema, a missing or malformed field, or no step count for a global batch.
    """
    path = os.fspath(path)
    check_non_negative("price_per_gpu_hour", price_per_gpu_hour)
    check_non_negative("value_per_hour", value_per_hour)
    check_bool("include_checkpoint_overhead", include_checkpoint_overhead)
    if (steps_to_target is None) == (samples_to_target is None):
        raise ValueError("give exactly one of steps_to_target=... (a number, or a mapping global_batch -> steps) or"
                         " samples_to_target=...")
    if samples_to_target is not None:
        check_positive("samples_to_target", samples_to_target)
    if isinstance(steps_to_target, Mapping):
        if not steps_to_target:
            raise ValueError("steps_to_target is an empty mapping: give steps for each global_batch in the file")
        for batch, steps in steps_to_target.items():
            check_positive_int("steps_to_target key (a global_batch)", batch)
            check_positive(f"steps_to_target[{batch}]", steps)
    elif steps_to_target is not None:
        check_positive("steps_to_target", steps_to_target)

    doc = _read_json(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object with schema {SCALING_SCHEMA!r}, got {type(doc).__name__}")
    if doc.get("schema") != SCALING_SCHEMA:
        raise ValueError(f"{path}: schema must be {SCALING_SCHEMA!r}, got {doc.get('schema')!r}")
    for name in ("model", "machine"):
        _field(path, "the file", doc, name, _check_str)
    results = doc.get("results")
    if not isinstance(results, list) or not results:
        raise ValueError(f"{path}: 'results' must be a non-empty list of measurements, got {results!r}")

    parsed = []
    for i, result in enumerate(results):
        where = f"results[{i}]"
        if not isinstance(result, dict):
            raise ValueError(f"{path}: {where} must be an object, got {result!r}")
        checks = {"world_size": check_positive_int, "global_batch": check_positive_int,
                  "throughput_samples_per_s": check_positive, "scaling_efficiency": check_positive,
                  "step_seconds": check_positive, "save_seconds": check_non_negative,
                  "load_seconds": check_non_negative, "checkpoint_overhead_fraction": check_fraction}
        parsed.append({name: _field(path, where, result, name, checks[name]) for name in _RESULT_FIELDS})

    sizes = [r["world_size"] for r in parsed]
    options = []
    for i, r in enumerate(parsed):
        # Two results at one world size (e.g. two global batches) need the batch in the name to stay distinct.
        name = plural(r["world_size"], "GPU") if sizes.count(r["world_size"]) == 1 else \
            f"{plural(r['world_size'], 'GPU')}, batch {r['global_batch']}"
        work: dict[str, Any]
        if samples_to_target is not None:
            work = {"samples_to_target": samples_to_target}
        elif isinstance(steps_to_target, Mapping):
            if r["global_batch"] not in steps_to_target:
                known = ", ".join(str(k) for k in sorted(steps_to_target))
                raise ValueError(f"{path}: results[{i}] has global_batch={r['global_batch']} but steps_to_target"
                                 f" gives steps only for global_batch {known}: add {r['global_batch']}")
            work = {"steps_to_target": steps_to_target[r["global_batch"]], "global_batch": r["global_batch"]}
        else:
            work = {"steps_to_target": steps_to_target, "global_batch": r["global_batch"]}
        overhead = r["checkpoint_overhead_fraction"] if include_checkpoint_overhead else 0.0
        options.append(ClusterOption(name, r["world_size"], price_per_gpu_hour,
                                     throughput=r["throughput_samples_per_s"], overhead_fraction=overhead,
                                     value_per_hour=value_per_hour, **work))
    return options
