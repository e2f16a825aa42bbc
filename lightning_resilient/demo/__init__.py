"""The demo: every plugin on, a training job SIGKILLed mid-upload on an embedded S3 server, resumed bit for bit.

``DemoModel`` and ``DemoData`` are what the example configs in ``configs/`` train; ``AnnouncingCheckpointIO`` lets
the demo driver see its saves. Run the demo with ``make demo``, ``python -m lightning_resilient.demo`` or
``lightning-resilient demo``.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_resilient.demo.events import AnnouncingCheckpointIO
from lightning_resilient.demo.model import DemoData, DemoModel

__all__ = ["AnnouncingCheckpointIO", "DemoData", "DemoModel", "add_commands", "main"]


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps to train (default 60)")
    parser.add_argument("--kill-step", type=int, default=30,
                        help="kill the job while it uploads this step's checkpoint (a multiple of --every)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every this many optimizer steps")
    parser.add_argument("--out-dir", default="demo_output", help="where configs, records, report and plot go")
    parser.add_argument("--preempt", action="store_true",
                        help="instead of a SIGKILL mid-upload, a preemption notice (SIGTERM) after the checkpoint of"
                             " --kill-step: PreemptionCheckpoint saves the step in progress, the restart recomputes none")


def _run(args: argparse.Namespace) -> int:
    from lightning_resilient.demo.driver import run_demo

    try:
        return run_demo(max_steps=args.max_steps, kill_step=args.kill_step, every=args.every, out_dir=args.out_dir,
                        preempt=args.preempt)
    except ValueError as exc:
        print(f"lightning-resilient demo: {exc}")
        return 2


def add_commands(subparsers: Any) -> None:
    """Register ``lightning-resilient demo``."""
    parser = subparsers.add_parser("demo", help="train, SIGKILL mid-upload, resume: the whole suite on embedded S3",
                                   description=__doc__)
    _add_options(parser)
    parser.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_resilient.demo", description=__doc__)
    _add_options(parser)
    return _run(parser.parse_args(argv))
