"""The suite's own options (tests/conftest.py): ``--stores`` selects the stores tests run on (``make test-fast`` leaves
S3 out). The cases that need pytest's own run of a module run it in a subprocess (collection only where they can: its
imports cost ~4 s, hence ``slow``)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "tests/cli/test_root_commands.py"  # store tests of every kind: the backend fixture's, a dynamic s3_backend


def collect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def ids(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_stores_deselects_the_tests_of_a_store_left_out_and_keeps_the_rest():
    everything = ids(collect(MODULE))
    without_s3 = ids(collect(MODULE, "--stores", "local,memory,gcs"))
    assert [i for i in everything if "[s3" in i], "the module has S3 cases to leave out"
    # The S3 case of every store-parametrized test is left out, and its other stores' cases stay.
    assert not [i for i in without_s3 if "[s3" in i]
    assert [i for i in everything if "[local" in i or "[memory" in i or "[gcs" in i] == [
        i for i in without_s3 if "[" in i]
    # A test that asks for the S3 fixture by name goes too; one that asks for none stays.
    assert f"{MODULE}::test_bad_input_exits_2_with_a_message" in everything
    assert f"{MODULE}::test_bad_input_exits_2_with_a_message" not in without_s3
    assert f"{MODULE}::test_empty_root_is_not_an_error" in without_s3
    assert f"{len(everything) - len(without_s3)} deselected" in collect(MODULE, "--stores", "local,memory,gcs").stdout


@pytest.mark.slow
def test_a_test_that_asks_for_a_left_out_store_at_run_time_is_skipped_with_the_reason():
    # test_commands asks for s3_backend inside the test (request.getfixturevalue): not seen at collection.
    test = f"{MODULE}::test_what_ls_says_of_abandoned_checkpoints_gc_abandoned_deletes_each_once"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs",
                           "--stores", "local", test], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "s3 is left out by --stores" in proc.stdout, proc.stdout[-2000:]


def test_an_unknown_store_is_refused_before_anything_runs():
    # Refused in pytest_configure, which pytest runs before it collects anything; called here as pytest would (a
    # pytest in a subprocess, as the cases above, spent 5-13 s of the inner loop importing what the conftest imports).
    config = SimpleNamespace(option=SimpleNamespace(), getoption={"--stores": "local,s4"}.__getitem__)
    with pytest.raises(pytest.UsageError, match=r"^--stores: unknown s4; choose among local, memory, s3, gcs$"):
        conftest.pytest_configure(config)
