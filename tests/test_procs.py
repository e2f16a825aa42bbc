"""The suite's fork server (tests/procs.py): a forked child is set up as ``python SCRIPT ARGS`` would be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import procs

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile, warnings
    import torch
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    line = sys.stdin.readline().strip()
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PROCS_TEST"),
                      "path0": sys.path[0], "tmp": tempfile.gettempdir(), "rank": rank_zero_only.rank,
                      "stdin": line, "draw": torch.rand(4).tolist(), "threads": torch.get_num_threads(),
                      "warn_filters": [f[0] for f in warnings.filters[:1]],
                      "imported": "lightning_resilient" in sys.modules}), flush=True)
    sys.stderr.write("to stderr\\n")
    sys.exit(int(sys.argv[1]))
""")


@pytest.mark.slow
def test_a_forked_child_gets_its_own_environment_folder_streams_rank_and_entropy(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PROCS_TEST": "yes", "TMPDIR": str(tmp_path / "tmp"), "LOCAL_RANK": "1",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error"}
    seen = []
    for code in (3, 0):
        done = procs.run([sys.executable, str(script), str(code), "x y"], input="hello\n", env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
        assert done.returncode == code, done.stderr
        assert done.stderr == "to stderr\n"
        seen.append(json.loads(done.stdout))
    first, second = seen
    assert first["argv"] == [str(3), "x y"] and first["cwd"] == str(tmp_path) and first["env"] == "yes"
    assert first["path0"] == str(tmp_path) and first["tmp"] == str(tmp_path / "tmp") and first["stdin"] == "hello"
    assert first["rank"] == 1 and first["threads"] == 1 and first["warn_filters"] == ["error"]
    assert not first["imported"]  # the server never imports the package: each child takes its own tree's
    assert first["draw"] != second["draw"]  # each child seeds torch from the OS, as a fresh interpreter does


@pytest.mark.slow
def test_a_forked_child_dies_by_a_signal_to_its_group_and_says_so():
    proc = procs.popen([sys.executable, "-c", "pass"])  # not a script: plain subprocess, unchanged
    assert isinstance(proc, subprocess.Popen)
    proc.wait(timeout=60)
    child = procs.popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert isinstance(child, procs.Process) and child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL
    assert child.stdout is not None and child.stdout.read() is not None  # (the pipe reaches its end)
