"""Every install command of README.md and docs/*.md, each in a fresh venv with the stock pip of ``python -m venv``.

A first install must work as written: Python 3.11's venv ships pip 23.2, whose resolver gave up on S3 installs
(``ResolutionImpossible``: aiobotocore accepts only a narrow band of botocore releases, boto3 and moto take the
newest) and whose ``pip install boto3`` after ``[s3]`` left ``pip check`` broken. pyproject.toml's ``[s3]`` holds
botocore and boto3 to aiobotocore's band; this script proves each documented command against the package registry
as it is today: each case starts from a fresh venv (torch already in, as the README has it installed first), runs
its ``pip install`` commands and then ``pip check``. CI runs it (``.ci/run``) before the tests;
``tests/test_extras.py`` checks that every install command the docs show is one of :data:`CASES`.

    python3 tests/install_check.py              # every case, two at a time
    python3 tests/install_check.py demo s3      # only these
    TORCH_PIN='torch==2.13.0' PYTHON=python3.11 python3 tests/install_check.py

Not a pytest module: it needs the package registry and minutes (times in docs/development.md).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> the `pip install` arguments of each command, in order, as the docs write them ({repo}: the clone, which
# the docs call /path/to/lightning_resilient). Each case starts from its own fresh venv.
CASES: dict[str, tuple[str, ...]] = {
    # README.md, "Add it to your Trainer": one line each
    "s3": ("-e '{repo}[s3]'",),
    "gcs": ("-e '{repo}[gcs]'",),
    "all": ("-e '{repo}[all]'",),
    "s3,cli": ("-e '{repo}[s3,cli]'",),
    "demo": ("-e '{repo}[demo]'",),
    # docs/local-s3.md's one-liner, and every extra at once
    "local-s3": ("-e '{repo}[s3]' 'moto[server]'",),
    "s3,cli,demo": ("-e '{repo}[s3,cli,demo]'",),
    # a step at a time: the store, then moto and boto3 on their own (pip does not weigh what is installed: the
    # boto3 of [s3] is what keeps botocore in aiobotocore's band), then the command line (local-s3.md: "Add the
    # [cli] extra")
    "s3-then-moto-then-cli": ("-e '{repo}[s3]'", "'moto[server]' boto3", "-e '{repo}[s3,cli]'"),
}

TORCH_PIN = os.environ.get("TORCH_PIN", "torch==2.13.0")  # the Makefile's: the CPU build, never an unpinned torch
PYTHON = os.environ.get("PYTHON", sys.executable)


def commands(case: str) -> list[list[str]]:
    """The argument lists of ``case``'s ``pip install`` commands, with the clone's path filled in."""
    return [shlex.split(line.format(repo=REPO)) for line in CASES[case]]


def run_case(case: str, base: Path, work: Path) -> tuple[str, float, str | None, str]:
    """(case, seconds, None, a note on backtracking) or (case, seconds, what failed with pip's last lines, "")."""
    venv = work / case.replace(",", "_")
    start = time.monotonic()
    # A hard-linked copy of the venv that has torch: pip replaces files, never writes into one, so the base stays
    # as it is, and each case pays the resolution and installs, not torch's 36 s again.
    subprocess.run(["cp", "-al", str(base), str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # --no-compile: the resolution and the files are the same, without a minute of byte-compiling per case.
    steps = [[python, "-m", "pip", "install", "--no-compile", *args] for args in commands(case)]
    steps.append([python, "-m", "pip", "check"])
    backtracked = []
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        output = done.stdout + done.stderr
        shown = " ".join(shlex.quote(a) for a in step[3:])
        if done.returncode != 0 or "ResolutionImpossible" in output:
            tail = "\n".join(output.splitlines()[-30:])
            return case, time.monotonic() - start, f"{shown} (exit {done.returncode}):\n{tail}", ""
        if "is looking at multiple versions" in output:  # resolved, after trying versions one by one
            backtracked.append(shown)
    shutil.rmtree(venv, ignore_errors=True)
    note = f" (pip backtracked in: {'; '.join(backtracked)})" if backtracked else ""
    return case, time.monotonic() - start, None, note


def main(argv: list[str]) -> int:
    unknown = [name for name in argv if name not in CASES]
    if unknown:
        print(f"install_check: no case {', '.join(unknown)}; the cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    cases = argv or list(CASES)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="install-check-") as tmp:
        work = Path(tmp)
        base = work / "base"
        subprocess.run([PYTHON, "-m", "venv", str(base)], check=True)
        pip = [str(base / "bin" / "python"), "-m", "pip"]
        version = subprocess.run([*pip, "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
        subprocess.run([*pip, "install", "--quiet", TORCH_PIN], check=True)
        print(f"install_check: fresh venvs of {PYTHON} (pip {version}) with {TORCH_PIN}, base in"
              f" {time.monotonic() - start:.0f} s", flush=True)
        failures = []
        # Two at a time: a case waits on the registry as much as on a core.
        with ThreadPoolExecutor(max_workers=int(os.environ.get("INSTALL_CHECK_JOBS", "2"))) as pool:
            for case, seconds, failure, note in pool.map(lambda c: run_case(c, base, work), cases):
                print(f"  {'ok  ' if failure is None else 'FAIL'} {case}: {seconds:.0f} s{note}", flush=True)
                if failure is not None:
                    failures.append(f"{case}: {failure}")
    for failure in failures:
        print(f"\ninstall_check: {failure}", file=sys.stderr)
    print(f"install_check: {len(cases) - len(failures)} of {len(cases)} install cases resolved with pip check clean"
          f" ({time.monotonic() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
