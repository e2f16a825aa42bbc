"""The waits of a new user's first hour, measured: every ``lightning-resilient ... --help`` and one demo.

    python benchmarks/first_hour.py --out benchmarks/results/first_hour_cpu     # --help x5 each, the demo once
    python benchmarks/first_hour.py --no-demo --runs 1 --out /tmp/first_hour    # --help only (the suite's smoke run)
    python benchmarks/first_hour.py ... --suite-time 17:18 --suite-source "CI run of make test"

Each ``--help`` runs the installed console script in a fresh process (median and slowest of ``--runs``). The demo
is ``lightning-resilient demo`` in a temporary folder, output to a file (not a terminal), timed from its start to
its exit. ``make test`` is not run here (it takes a quarter of an hour); ``--suite-time`` copies a measured time
into the results, with its source. Writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

COMMANDS = ["", "ls", "verify", "gc", "export", "cadence", "cost", "demo", "train"]


def machine_description() -> str:
    """CPU model and cores, GPU (none here: the figures need none), Python and the torch/Lightning versions."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    return (f"{platform.machine()} {cpu}, {os.cpu_count()} cores, {gpu}, Python {platform.python_version()},"
            f" torch {torch.__version__}, lightning {lightning.__version__}")


def script() -> str:
    found = shutil.which("lightning-resilient", path=os.path.dirname(sys.executable))
    if not found:
        raise SystemExit("the lightning-resilient console script is not installed next to this Python:"
                         " pip install -e .")
    return found


def time_help(command: str, runs: int) -> dict[str, Any]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run([script(), *([command] if command else []), "--help"], capture_output=True, text=True,
                              timeout=120)
        times.append(time.perf_counter() - started)
        if proc.returncode != 0:
            raise SystemExit(f"lightning-resilient {command} --help failed ({proc.returncode}): {proc.stderr}")
    return {"command": f"lightning-resilient {command + ' ' if command else ''}--help",
            "median_s": statistics.median(times), "max_s": max(times), "runs": runs}


def time_demo() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="first-hour-demo-") as folder:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with open(os.path.join(folder, "demo.log"), "w") as log:
            started = time.perf_counter()
            status = subprocess.run([script(), "demo"], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=900).returncode
            seconds = time.perf_counter() - started
        with open(os.path.join(folder, "demo.log")) as log:
            tail = log.read().rstrip().splitlines()[-1:]
    return {"command": "lightning-resilient demo", "seconds": seconds, "exit_status": status,
            "verdict": tail[0] if tail else ""}


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}" if seconds >= 60 else f"{seconds:.1f} s"


def report(result: dict[str, Any]) -> str:
    lines = ["# The first hour: how long a new user waits", "", f"Machine: {result['machine']}", "",
             "| what | time | how measured |", "|---|---:|---|"]
    lines += [f"| `{row['command']}` | {row['median_s']:.2f} s (slowest {row['max_s']:.2f} s) |"
              f" median of {row['runs']} fresh processes |" for row in result["help"]]
    if result.get("demo"):
        demo = result["demo"]
        lines.append(f"| `{demo['command']}` (= `make demo` after the install) | {_clock(demo['seconds'])} |"
                     f" once, output to a file; exit status {demo['exit_status']}, \"{demo['verdict']}\" |")
    if result.get("suite"):
        suite = result["suite"]
        lines.append(f"| `make test` (the whole suite) | {suite['time']} | {suite['source']} |")
    lines += ["", "The --help times include starting Python; none of them imports torch, Lightning or a cloud client."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/first_hour", help="OUT.md and OUT.json are written")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per --help (default 5)")
    parser.add_argument("--no-demo", action="store_true", help="skip the demo (about a minute)")
    parser.add_argument("--suite-time", default=None, metavar="M:SS", help="a measured time of make test, to record")
    parser.add_argument("--suite-source", default=None, help="where --suite-time comes from (a CI run, ...)")
    args = parser.parse_args(argv)
    if (args.suite_time is None) != (args.suite_source is None):
        parser.error("--suite-time and --suite-source go together")
    result: dict[str, Any] = {"machine": machine_description(), "help": [time_help(c, args.runs) for c in COMMANDS]}
    if not args.no_demo:
        result["demo"] = time_demo()
    if args.suite_time:
        result["suite"] = {"time": args.suite_time, "source": args.suite_source}
    text = report(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(f"{args.out}.md", "w") as f:
        f.write(text)
    with open(f"{args.out}.json", "w") as f:
        json.dump(result, f, indent=1)
    print(text)
    return text


if __name__ == "__main__":
    main()
