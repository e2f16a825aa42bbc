"""The planning subcommands of ``lightning-resilient``: ``cadence`` and ``cost``.

This module owns the two commands, their options, the format of the cost file (:data:`COST_DESCRIPTION`) and
reading it; the arithmetic is ``planning/``'s (``cadence.py``, ``tiers.py``, ``cost.py``), which imports none of
this. It imports neither torch nor Lightning, so ``--help`` answers at once.

``lightning-resilient cadence --save-seconds 6 --mtbf-hours 2.8 [--restart-seconds R] [--step-seconds T]``
prints Young's and Daly's checkpoint intervals, the waste at each and, with ``--step-seconds``, the matching
``every_n_train_steps``.

``lightning-resilient cadence --local-save-seconds 2 --durable-save-seconds 40 --process-mtbf-hours 6
--node-mtbf-hours 48 [--local-restart-seconds R] [--durable-restart-seconds R] [--persist-blocking-seconds B]``
plans a node-local tier in front of the durable store (:mod:`~lightning_resilient.planning.tiers`): the local
interval, ``persist_every``, their waste next to the single-tier plan's, and the lines to configure them.
``--state-gb`` adds the object-store traffic per hour, in either form.

``lightning-resilient cost OPTIONS.yaml`` prints a cost comparison and the verdict. The file's format is in
:data:`COST_DESCRIPTION`, which ``lightning-resilient cost --help`` prints. A file that cannot be read, is not YAML or
has a wrong field exits with status 2 and a message naming the file and the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any

import yaml

from lightning_resilient._checks import check_non_negative, check_positive
from lightning_resilient._units import format_duration, format_percent
from lightning_resilient.planning.cadence import daly_interval, expected_waste, steps_for_interval, young_interval
from lightning_resilient.planning.cost import ClusterOption, compare, load_scaling
from lightning_resilient.planning.tiers import TierCosts, plan_tiers

__all__ = ["COST_DESCRIPTION", "add_commands", "run_cadence", "run_cost"]

_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(ClusterOption))
_SCALING_FIELDS = ("path", "price_per_gpu_hour", "steps_to_target", "samples_to_target", "value_per_hour",
                   "include_checkpoint_overhead")
_TOP_FIELDS = ("options", "scaling", "price_per_gpu_hour", "value_per_hour", "steps_to_target",
               "samples_to_target", "include_checkpoint_overhead")
_SCALING_DEFAULTS = ("price_per_gpu_hour", "value_per_hour", "steps_to_target", "samples_to_target",
                     "include_checkpoint_overhead")


# `lightning-resilient cost --help`: what the command does and the whole file format.
COST_DESCRIPTION = """\
Compare ways to run a training job by wall-clock time, cost (GPUs x price per GPU-hour x
hours) and cost including the value of time, and name the one to pick: the lowest total cost;
on equal cost, the faster.

OPTIONS.yaml holds 'options' and/or 'scaling'. Every field, in a file that works as it is:

  price_per_gpu_hour: 2.0      # the default for every option and for scaling
  value_per_hour: 0            # optional: what an hour of waiting is worth (same currency)
  options:                     # one mapping per way to run the job
    - name: 256 GPUs           # a label for the table
      gpus: 256                # GPUs billed
      hours: 48                # wall-clock hours, when known; or the work and the speed:
    - name: 64 GPUs
      gpus: 64
      price_per_gpu_hour: 2.5  # per option, over the default
      throughput: 4000         # samples/s of the whole cluster; or base_throughput (samples/s
                               #   of one GPU) with scaling_efficiency (e.g. 0.9)
      samples_to_target: 690000000   # or steps_to_target with global_batch
      overhead_fraction: 0.02  # optional: share of wall time lost outside the throughput
      value_per_hour: 50       # optional, per option
  scaling:                     # optional: benchmarks/scaling.py's JSON, one option per world size
    path: scaling.json         # relative to this file
    steps_to_target: {256: 90000, 1024: 30000}  # per global batch, or one number for all
                                                # (or samples_to_target)
    include_checkpoint_overhead: true           # add the measured checkpointing share (default)

A wrong field exits with status 2 and a message naming the file and the field.
"""


class _FileError(Exception):
    """A problem with the user's file, already phrased for them (file and field named)."""


def add_commands(subparsers: Any) -> None:
    """Register ``cadence`` and ``cost`` on the ``lightning-resilient`` parser's subparsers."""
    cadence = subparsers.add_parser(
        "cadence", help="how often to checkpoint (Young / Daly) and what each cadence wastes; two tiers too",
        usage="%(prog)s --save-seconds S --mtbf-hours H [--restart-seconds R] [--step-seconds T] [--state-gb G]\n"
              "       %(prog)s --local-save-seconds S --durable-save-seconds S --process-mtbf-hours H"
              " --node-mtbf-hours H [options]",
        description="Optimal checkpoint interval for a save cost and a mean time between failures: Young (1974)"
                    " and Daly (2006), with the expected fraction of wall time wasted at each. With a node-local"
                    " tier (--local-save-seconds, the MTBFs of process failures and node losses): the local"
                    " interval and persist_every for AtomicCheckpointIO(local_tier=..., persist_every=N), compared"
                    " with writing every checkpoint to the durable store.")
    cadence.add_argument("--save-seconds", "--durable-save-seconds", dest="save_seconds", type=float, default=None,
                         metavar="S", help="seconds one checkpoint blocks training when written to the durable"
                                           " store (with a local tier: also how long a background persist takes)")
    cadence.add_argument("--mtbf-hours", type=float, default=None, metavar="H",
                         help="the job's mean time between failures, in hours (all nodes together)")
    cadence.add_argument("--restart-seconds", "--durable-restart-seconds", dest="restart_seconds", type=float,
                         default=0.0, metavar="R",
                         help="seconds from a failure to training again from the durable store, the download"
                              " included (default 0)")
    cadence.add_argument("--step-seconds", type=float, default=None, metavar="T",
                         help="seconds per optimizer step, to express the interval as every_n_train_steps")
    cadence.add_argument("--state-gb", type=float, default=None, metavar="G",
                         help="checkpoint size in GB, to show the object-store traffic per hour")
    tiers = cadence.add_argument_group(
        "two tiers", "a node-local tier in front of the durable store: plan one with --local-save-seconds,"
                     " --durable-save-seconds, --process-mtbf-hours and --node-mtbf-hours (MTBFs of the whole job)")
    tiers.add_argument("--local-save-seconds", type=float, default=None, metavar="S",
                       help="seconds one save blocks training to commit to the node-local tier")
    tiers.add_argument("--process-mtbf-hours", type=float, default=None, metavar="H",
                       help="mean time between failures that leave the node and its disk (crash, GPU fault,"
                            " in-place restart), in hours")
    tiers.add_argument("--node-mtbf-hours", type=float, default=None, metavar="H",
                       help="mean time between losses of a node with its local disk (preemption without notice,"
                            " hardware), in hours")
    tiers.add_argument("--local-restart-seconds", type=float, default=None, metavar="R",
                       help="seconds from a process failure to training again from the local tier (default 0)")
    tiers.add_argument("--persist-blocking-seconds", type=float, default=None, metavar="B",
                       help="training time one background persist costs (default 0: it never holds the loop)")
    tiers.add_argument("--max-store-gb-per-hour", type=float, default=None, metavar="G",
                       help="cap on the durable store's traffic (with --state-gb): the least waste within it")
    cadence.set_defaults(func=functools.partial(run_cadence, parser=cadence))

    cost = subparsers.add_parser(
        "cost", help="compare clusters by wall-clock time and cost", description=COST_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    cost.add_argument("options", metavar="OPTIONS.yaml", help="the options file (its format is above)")
    cost.set_defaults(func=run_cost)


def _fail(command: str, message: str) -> int:
    print(f"lightning-resilient {command}: error: {message}", file=sys.stderr)
    return 2


# -- cadence -----------------------------------------------------------------------------------------------------
_TIER_FLAGS = ("local_save_seconds", "process_mtbf_hours", "node_mtbf_hours", "local_restart_seconds",
               "persist_blocking_seconds", "max_store_gb_per_hour")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def run_cadence(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """``lightning-resilient cadence``: print the intervals and their waste; 2 on bad arguments.

    A missing or conflicting option is a usage error of ``parser`` (argparse's message and exit status 2);
    without a parser it is reported like a bad value.
    """
    def usage_error(message: str) -> int:
        if parser is not None:
            parser.error(message)  # exits with status 2
        return _fail("cadence", message)

    tiered = [dest for dest in _TIER_FLAGS if getattr(args, dest, None) is not None]
    if tiered:
        if args.mtbf_hours is not None:
            return usage_error(f"argument --mtbf-hours: not allowed with {_flag(tiered[0])} (a two-tier plan takes"
                               " --process-mtbf-hours and --node-mtbf-hours; the job's MTBF is their combination)")
        missing = [flag for dest, flag in (("local_save_seconds", "--local-save-seconds"),
                                           ("save_seconds", "--durable-save-seconds"),
                                           ("process_mtbf_hours", "--process-mtbf-hours"),
                                           ("node_mtbf_hours", "--node-mtbf-hours"))
                   if getattr(args, dest) is None]
        if missing:
            return usage_error(f"the following arguments are required with {_flag(tiered[0])} (a two-tier plan):"
                               f" {', '.join(missing)}")
        if args.max_store_gb_per_hour is not None and args.state_gb is None:
            return usage_error("argument --max-store-gb-per-hour: needs --state-gb (the checkpoint size in GB)")
        return _run_tiered_cadence(args)
    missing = [flag for dest, flag in (("save_seconds", "--save-seconds"), ("mtbf_hours", "--mtbf-hours"))
               if getattr(args, dest) is None]
    if missing:
        return usage_error(f"the following arguments are required: {', '.join(missing)}")

    try:
        save = check_positive("--save-seconds", args.save_seconds)
        mtbf = check_positive("--mtbf-hours", args.mtbf_hours) * 3600.0
        restart = check_non_negative("--restart-seconds", args.restart_seconds)
        step = check_positive("--step-seconds", args.step_seconds) if args.step_seconds is not None else None
        state_gb = getattr(args, "state_gb", None)  # a Namespace built by hand before the option existed
        state_gb = check_positive("--state-gb", state_gb) if state_gb is not None else None
    except (TypeError, ValueError) as err:
        return _fail("cadence", str(err))

    rows = [("Young 1974", young_interval(save, mtbf)), ("Daly 2006", daly_interval(save, mtbf))]
    print(f"checkpoint cadence: save {format_duration(save)}, MTBF {format_duration(mtbf)},"
          f" restart {format_duration(restart) if restart else '0 s'}")
    print()
    header = "| method | interval | waste |" + (" every_n_train_steps |" if step else "")
    header += " store GB/h |" if state_gb else ""
    print(header)
    print("|---|---:|---:|" + ("---:|" if step else "") + ("---:|" if state_gb else ""))
    for title, interval in rows:
        waste = expected_waste(interval, save, mtbf, restart)
        line = f"| {title} | {format_duration(interval)} | {format_percent(waste)} |"
        if step:
            line += f" {steps_for_interval(interval, step)} |"
        if state_gb:
            line += f" {_gb(state_gb * 3600.0 / (interval + save))} |"
        print(line)
    print()
    daly = rows[1][1]
    advice = f"recommended: checkpoint every {format_duration(daly)} of training (Daly)"
    if step:
        advice += f": ModelCheckpoint(every_n_train_steps={steps_for_interval(daly, step)})"
    print(advice)
    return 0


def _gb(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _run_tiered_cadence(args: argparse.Namespace) -> int:
    try:
        costs = TierCosts(
            local_save_seconds=check_positive("--local-save-seconds", args.local_save_seconds),
            durable_save_seconds=check_positive("--durable-save-seconds", args.save_seconds),
            process_mtbf_seconds=check_positive("--process-mtbf-hours", args.process_mtbf_hours) * 3600.0,
            node_mtbf_seconds=check_positive("--node-mtbf-hours", args.node_mtbf_hours) * 3600.0,
            local_restart_seconds=check_non_negative("--local-restart-seconds", _or_zero(args.local_restart_seconds)),
            durable_restart_seconds=check_non_negative("--durable-restart-seconds", args.restart_seconds),
            persist_blocking_seconds=check_non_negative("--persist-blocking-seconds",
                                                        _or_zero(args.persist_blocking_seconds)),
        )
        step = check_positive("--step-seconds", args.step_seconds) if args.step_seconds is not None else None
        state_gb = check_positive("--state-gb", args.state_gb) if args.state_gb is not None else None
        cap_gb = (check_positive("--max-store-gb-per-hour", args.max_store_gb_per_hour)
                  if args.max_store_gb_per_hour is not None else None)
    except (TypeError, ValueError) as err:
        return _fail("cadence", str(err))

    best = plan_tiers(costs)
    chosen = best
    if cap_gb is not None and state_gb is not None:
        try:
            capped = plan_tiers(costs, max_persists_per_hour=cap_gb / state_gb)
        except ValueError as err:
            return _fail("cadence", f"--max-store-gb-per-hour {cap_gb:g}: {err}")
        if capped.persist_every != best.persist_every:
            chosen = capped
    # What persisting less often costs: the best local interval for 2, 4 and 8 times the chosen persist_every.
    rows = [("two tiers, least waste", best)]
    if chosen is not best:
        rows.append((f"two tiers, <= {cap_gb:g} GB/h", chosen))
    rows += [("two tiers", plan_tiers(costs, persist_every=chosen.persist_every * k)) for k in (2, 4, 8)]

    print("two-tier checkpoint cadence")
    print(f"  local tier:   save {_seconds(costs.local_save_seconds)}, restart {_seconds(costs.local_restart_seconds)};"
          f" process failures: MTBF {format_duration(costs.process_mtbf_seconds)}")
    print(f"  durable tier: save {_seconds(costs.durable_save_seconds)}, persist blocks"
          f" {_seconds(costs.persist_blocking_seconds)}, restart {_seconds(costs.durable_restart_seconds)};"
          f" node losses: MTBF {format_duration(costs.node_mtbf_seconds)}")
    print()
    print("| plan | local every | persist_every | durable every | waste |"
          + (" every_n_train_steps |" if step else "") + (" store GB/h |" if state_gb else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|" if step else "") + ("---:|" if state_gb else ""))
    for title, plan in rows:
        line = (f"| {title} | {format_duration(plan.local_interval_seconds)} | {plan.persist_every} |"
                f" {format_duration(plan.durable_interval_seconds)} | {format_percent(plan.waste)} |")
        if step:
            line += f" {steps_for_interval(plan.local_interval_seconds, step)} |"
        if state_gb:
            line += f" {_gb(state_gb * plan.persists_per_hour)} |"
        print(line)
    single = best.single_tier_interval_seconds
    line = f"| durable only (Daly) | - | - | {format_duration(single)} | {format_percent(best.single_tier_waste)} |"
    if step:
        line += f" {steps_for_interval(single, step)} |"
    if state_gb:
        line += f" {_gb(state_gb * best.single_tier_saves_per_hour)} |"
    print(line)
    print()
    if costs.persist_blocking_seconds == 0 and chosen is best:
        print("A persist is taken not to slow training (--persist-blocking-seconds 0), so the least waste persists as"
              " often as uploads allow;")
        print("the rows below it show what persisting less often costs (cap the traffic with"
              " --max-store-gb-per-hour).")
    if not chosen.pays:
        advice = (f"recommended: no local tier: save to the durable store every {format_duration(single)} of training"
                  f" (Daly), {format_percent(best.single_tier_waste)} waste; two tiers would waste"
                  f" {format_percent(chosen.waste)}")
        if step:
            advice += f": ModelCheckpoint(every_n_train_steps={steps_for_interval(single, step)})"
        print(advice)
        return 0
    every = ("every save" if chosen.persist_every == 1 else
             f"every {chosen.persist_every} saves = every {format_duration(chosen.durable_interval_seconds)}")
    print(f"recommended: save locally every {format_duration(chosen.local_interval_seconds)} of training, persist"
          f" {every}: {format_percent(chosen.waste)} waste, against {format_percent(best.single_tier_waste)} with"
          " every checkpoint written to the durable store")
    print(f"  AtomicCheckpointIO(local_tier=<node-local dir>, persist_every={chosen.persist_every})")
    if step:
        print(f"  ModelCheckpoint(dirpath=<durable root>,"
              f" every_n_train_steps={steps_for_interval(chosen.local_interval_seconds, step)})")
    return 0


def _or_zero(value: float | None) -> float:
    return 0.0 if value is None else value


def _seconds(value: float) -> str:
    return format_duration(value) if value else "0 s"


# -- cost --------------------------------------------------------------------------------------------------------
def run_cost(args: argparse.Namespace) -> int:
    """``lightning-resilient cost``: print the comparison table and verdict; 2 on a bad file."""
    path = args.options
    try:
        options = _options_from_file(path)
        comparison = compare(options)
    except _FileError as err:
        return _fail("cost", str(err))
    except (TypeError, ValueError) as err:
        return _fail("cost", f"{path}: {err}")
    print(comparison.to_markdown())
    return 0


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise _FileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise _FileError(f"{path}: cannot read it ({err})") from None
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        raise _FileError(f"{path}: not valid YAML ({detail})") from None
    if not isinstance(doc, dict):
        raise _FileError(f"{path}: expected a mapping with 'options' and/or 'scaling', got"
                         f" {type(doc).__name__ if doc is not None else 'an empty file'}")
    _no_unknown(path, "", doc, _TOP_FIELDS)
    if "options" not in doc and "scaling" not in doc:
        raise _FileError(f"{path}: needs 'options' (a list of options) and/or 'scaling' (a scaling JSON)")
    return doc


def _no_unknown(path: str, where: str, record: dict[str, Any], known: tuple[str, ...]) -> None:
    for key in record:
        if key not in known:
            raise _FileError(f"{path}: {where}unknown field {key!r} (known: {', '.join(known)})")


def _options_from_file(path: str) -> list[ClusterOption]:
    doc = _read_yaml(path)
    defaults = {k: doc[k] for k in ("price_per_gpu_hour", "value_per_hour") if k in doc}
    options: list[ClusterOption] = []

    raw_options = doc.get("options", [])
    if not isinstance(raw_options, list):
        raise _FileError(f"{path}: options must be a list of mappings, got {type(raw_options).__name__}")
    for i, raw in enumerate(raw_options):
        where = f"options[{i}]"
        if not isinstance(raw, dict):
            raise _FileError(f"{path}: {where} must be a mapping of ClusterOption fields, got {raw!r}")
        _no_unknown(path, f"{where}: ", raw, _OPTION_FIELDS)
        fields = {**defaults, **raw}
        for required in ("name", "gpus", "price_per_gpu_hour"):
            if required not in fields:
                raise _FileError(f"{path}: {where} has no {required!r} field")
        if isinstance(fields["name"], (int, float)):
            fields["name"] = str(fields["name"])  # `name: 256` is a fine label
        try:
            options.append(ClusterOption(**fields))
        except (TypeError, ValueError) as err:
            raise _FileError(f"{path}: {where}: {err}") from None

    if "scaling" in doc:
        options.extend(_scaling_options(path, doc))
    if not options:
        raise _FileError(f"{path}: no options: 'options' is empty and there is no 'scaling'")
    return options


def _scaling_options(path: str, doc: dict[str, Any]) -> list[ClusterOption]:
    spec = doc["scaling"]
    if isinstance(spec, str):
        spec = {"path": spec}
    if not isinstance(spec, dict):
        raise _FileError(f"{path}: scaling must be a path or a mapping with 'path', got {spec!r}")
    _no_unknown(path, "scaling: ", spec, _SCALING_FIELDS)
    spec = {**{k: doc[k] for k in _SCALING_DEFAULTS if k in doc}, **spec}
    for required in ("path", "price_per_gpu_hour"):
        if required not in spec:
            raise _FileError(f"{path}: scaling has no {required!r} field")
    json_path = spec.pop("path")
    if not isinstance(json_path, str) or not json_path:
        raise _FileError(f"{path}: scaling.path must be a file path, got {json_path!r}")
    if "://" not in json_path and not os.path.isabs(json_path):
        json_path = os.path.join(os.path.dirname(os.path.abspath(path)), json_path)  # relative to the YAML
    steps = spec.get("steps_to_target")
    if isinstance(steps, dict):
        # A YAML key written "256" or 256 means the same global batch.
        spec["steps_to_target"] = {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v
                                   for k, v in steps.items()}
    try:
        return load_scaling(json_path, **spec)
    except (OSError, TypeError, ValueError) as err:
        raise _FileError(f"{path}: scaling: {err}") from None
