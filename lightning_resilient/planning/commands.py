"""The planning subcommands of ``lightning-resilient``: ``cadence`` and ``cost``.

``lightning-resilient cadence --save-seconds 6 --mtbf-hours 2.8 [--restart-seconds R] [--step-seconds T]``
prints Young's and Daly's checkpoint intervals, the waste at each and, with ``--step-seconds``, the matching
``every_n_train_steps``.

``lightning-resilient cost OPTIONS.yaml`` prints a cost comparison and the verdict. The file's format is in
:data:`COST_DESCRIPTION`, which ``lightning-resilient cost --help`` prints. A file that cannot be read, is not YAML or
has a wrong field exits with status 2 and a message naming the file and the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import yaml

from lightning_resilient.planning._checks import check_non_negative, check_positive
from lightning_resilient.planning._units import format_duration, format_percent
from lightning_resilient.planning.cadence import daly_interval, expected_waste, steps_for_interval, young_interval
from lightning_resilient.planning.cost import ClusterOption, compare, load_scaling

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
        "cadence", help="how often to checkpoint (Young / Daly) and what each cadence wastes",
        description="Optimal checkpoint interval for a save cost and a mean time between failures: Young (1974)"
                    " and Daly (2006), with the expected fraction of wall time wasted at each.")
    cadence.add_argument("--save-seconds", type=float, required=True, metavar="S",
                         help="seconds one checkpoint blocks training")
    cadence.add_argument("--mtbf-hours", type=float, required=True, metavar="H",
                         help="the job's mean time between failures, in hours (all nodes together)")
    cadence.add_argument("--restart-seconds", type=float, default=0.0, metavar="R",
                         help="seconds from a failure to training again (default 0)")
    cadence.add_argument("--step-seconds", type=float, default=None, metavar="T",
                         help="seconds per optimizer step, to express the interval as every_n_train_steps")
    cadence.set_defaults(func=run_cadence)

    cost = subparsers.add_parser(
        "cost", help="compare clusters by wall-clock time and cost", description=COST_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    cost.add_argument("options", metavar="OPTIONS.yaml", help="the options file (its format is above)")
    cost.set_defaults(func=run_cost)


def _fail(command: str, message: str) -> int:
    print(f"lightning-resilient {command}: error: {message}", file=sys.stderr)
    return 2


# -- cadence -----------------------------------------------------------------------------------------------------
def run_cadence(args: argparse.Namespace) -> int:
    """``lightning-resilient cadence``: print the intervals and their waste; 2 on bad arguments."""
    try:
        save = check_positive("--save-seconds", args.save_seconds)
        mtbf = check_positive("--mtbf-hours", args.mtbf_hours) * 3600.0
        restart = check_non_negative("--restart-seconds", args.restart_seconds)
        step = check_positive("--step-seconds", args.step_seconds) if args.step_seconds is not None else None
    except (TypeError, ValueError) as err:
        return _fail("cadence", str(err))

    rows = [("Young 1974", young_interval(save, mtbf)), ("Daly 2006", daly_interval(save, mtbf))]
    print(f"checkpoint cadence: save {format_duration(save)}, MTBF {format_duration(mtbf)},"
          f" restart {format_duration(restart) if restart else '0 s'}")
    print()
    header = "| method | interval | waste |" + (" every_n_train_steps |" if step else "")
    print(header)
    print("|---|---:|---:|" + ("---:|" if step else ""))
    for title, interval in rows:
        waste = expected_waste(interval, save, mtbf, restart)
        line = f"| {title} | {format_duration(interval)} | {format_percent(waste)} |"
        if step:
            line += f" {steps_for_interval(interval, step)} |"
        print(line)
    print()
    daly = rows[1][1]
    advice = f"recommended: checkpoint every {format_duration(daly)} of training (Daly)"
    if step:
        advice += f": ModelCheckpoint(every_n_train_steps={steps_for_interval(daly, step)})"
    print(advice)
    return 0


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
