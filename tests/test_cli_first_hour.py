"""A new user's first hour with ``lightning-resilient``: every ``--help`` answers without importing torch, and a
representative bad input to each subcommand ends with exit status 2 and one line that names the fix, never a
traceback. Run as a user runs it: the installed console script, in a subprocess, with no cloud credentials at all
(the only store is moto's S3 server on loopback)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Lightning binds a log handler to sys.stderr when first imported: imported here, outside any test's capsys, it does
# not write to a stream a test has closed ("--- Logging error ---", with a traceback, in a later test's output).
import lightning.pytorch  # noqa: F401
import pytest

import lightning_resilient
from lightning_resilient.cli import main
from tests import procs

CONFIGS = Path(__file__).parents[1] / "configs"
SCRIPT = shutil.which("lightning-resilient", path=os.path.dirname(sys.executable))
COMMANDS = ["ls", "verify", "gc", "export", "goodput", "cadence", "cost", "demo", "train"]


@pytest.fixture
def bare_env(tmp_path) -> dict[str, str]:
    """A user's environment without cloud credentials; no client may look further than loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_"))}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"), NO_GCE_CHECK="True",
               PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def cli(env: dict[str, str], *argv: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    assert SCRIPT, "the package installs the lightning-resilient console script"
    return subprocess.run([SCRIPT, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def message(proc: subprocess.CompletedProcess, command: str) -> str:
    """Our message: the first line of stderr that starts with the command's name (train's Trainer logs first)."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"lightning-resilient {command}")]
    assert lines, proc.stderr[-3000:]
    return lines[0]


# -- --help ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_help_answers(command, bare_env, capsys):
    started = time.perf_counter()
    proc = cli(bare_env, *([command] if command else []), "--help")
    seconds = time.perf_counter() - started
    with capsys.disabled():  # measured, not asserted (benchmarks/first_hour.py records the figures quoted)
        print(f"\n  lightning-resilient {command + ' ' if command else ''}--help: {seconds:.2f} s")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: lightning-resilient {command}".rstrip()) and proc.stderr == ""
    assert "``" not in proc.stdout  # plain text, not reStructuredText


def test_help_imports_no_torch_lightning_or_cloud_client(bare_env):
    """What keeps --help fast, checked without a clock: no subcommand's --help imports a heavy module."""
    code = (
        "import sys\n"
        "from lightning_resilient.cli import main\n"
        f"for command in {COMMANDS!r}:\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'lightning', 'botocore', 's3fs', 'gcsfs', 'matplotlib', 'jsonargparse')"
        " if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=bare_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_short_train_help_and_a_bare_train(bare_env):
    proc = cli(bare_env, "train")
    assert proc.returncode == 2 and proc.stderr.startswith("usage: lightning-resilient train {fit,")


# -- bad input: exit status 2, one line naming the fix, no traceback -----------------------------------------------
# In this process: main() returning 2 means no exception escaped, so no traceback could be printed; the console
# script itself is run above (--help) and below (train, where sys.argv matters).
def run(capsys, *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return status, captured.err


@pytest.mark.parametrize(("argv", "fix"), [
    (["ls", "s4://bucket/run"], "Use a local path, s3://bucket/prefix, gs://bucket/prefix"),
    (["verify", "s4://bucket/run"], "Use a local path"),
    (["gc", ".", "--grace", "-1"], "--grace must be >= 0 seconds"),
    (["export", "s4://bucket/run", "out.ckpt"], "Use a local path"),
    (["cadence", "--save-seconds", "0", "--mtbf-hours", "2"], "--save-seconds must be > 0"),
    (["demo", "--kill-step", "25"], "--kill-step must be a multiple of --every (10)"),
])
def test_bad_input_names_the_fix(argv, fix, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    status, err = run(capsys, *argv)
    assert status == 2
    assert err.startswith(f"lightning-resilient {argv[0]}: ") and len(err.strip().splitlines()) == 1
    assert fix in err


def test_cost_names_the_file_and_the_field(capsys, tmp_path):
    options = tmp_path / "options.yaml"
    options.write_text("options:\n  - {name: a, gpu: 8, price_per_gpu_hour: 2.0, hours: 1}\n")
    status, err = run(capsys, "cost", str(options))
    assert status == 2
    assert str(options) in err and "unknown field 'gpu'" in err and "known: name, gpus" in err


def test_the_cost_help_shows_a_file_that_works(capsys, tmp_path):
    """The format in `cost --help` is a working file: cut out of the help, it runs."""
    from lightning_resilient.cli.planning_commands import COST_DESCRIPTION

    lines = COST_DESCRIPTION.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  price_per_gpu_hour:"))
    last = next(i for i, line in enumerate(lines) if line.startswith("A wrong field"))
    (tmp_path / "options.yaml").write_text("\n".join(line[2:] for line in lines[first:last]))
    results = [{"world_size": n, "global_batch": 256 * n, "throughput_samples_per_s": 900.0 * n,
                "scaling_efficiency": 0.9, "step_seconds": 0.3, "save_seconds": 2.0, "load_seconds": 1.0,
                "checkpoint_overhead_fraction": 0.01} for n in (1, 4)]
    (tmp_path / "scaling.json").write_text(json.dumps({"schema": "lightning_resilient.scaling/1", "model": "m",
                                                       "machine": "x", "results": results}))
    assert main(["cost", str(tmp_path / "options.yaml")]) == 0
    out = capsys.readouterr().out
    assert "| 1 GPU | 1 |" in out and "| 4 GPUs | 4 |" in out and "winner: " in out


@pytest.fixture
def no_credentials(monkeypatch, tmp_path) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_s3_without_credentials_names_the_variables_and_the_cli_option(s3_endpoint, no_credentials, capsys):
    options = json.dumps({"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True})
    status, err = run(capsys, "ls", "s3://any-bucket/run", "--storage-options", options)
    assert status == 2
    assert "no credentials" in err and "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)" in err
    assert "--storage-options" in err and "storage_options=" not in err  # the CLI's option, not Python's


def test_a_missing_bucket_says_so(s3_endpoint, capsys):
    options = json.dumps({"client_kwargs": {"endpoint_url": s3_endpoint}})
    status, err = run(capsys, "ls", "s3://no-such-bucket-first-hour/run", "--storage-options", options)
    assert status == 2
    assert "bucket 'no-such-bucket-first-hour' does not exist" in err and "create it" in err


@pytest.mark.slow
def test_train_with_a_missing_bucket_prints_one_line(s3_endpoint, bare_env, tmp_path):
    """configs/s3.yaml with its bucket missing, through the console script: the message, not a 20-line traceback,
    and no LightningCLI warning about the arguments the script hands over."""
    env = dict(bare_env, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=s3_endpoint)
    proc = cli(env, "train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(CONFIGS / "s3.yaml"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "bucket 'lightning-resilient-example' does not exist" in message(proc, "train")
    assert "args parameter is intended" not in proc.stderr


def test_train_whose_model_checkpoint_has_no_credentials_says_where_to_set_them(s3_endpoint, no_credentials,
                                                                                 monkeypatch, capsys, tmp_path):
    """Credentials in storage_options only: ModelCheckpoint's own client has none. Ours says so before its first
    listing fails with botocore's bare NoCredentialsError."""
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="k", aws_secret_access_key="s",
                 region_name="us-east-1").create_bucket(Bucket="first-hour-creds")
    store = (CONFIGS / "s3.yaml").read_text().replace("s3://lightning-resilient-example/", "s3://first-hour-creds/")
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
               "skip_instance_cache": True}
    (tmp_path / "store.yaml").write_text(store.replace("storage_options: {}",
                                                       f"storage_options: {json.dumps(options)}"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.chdir(tmp_path)
    status, err = run(capsys, "train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(tmp_path / "store.yaml"),
                      "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false")
    assert status == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("lightning-resilient train: ModelCheckpoint lists s3://first-hour-creds/run-1/checkpoints"
                           " with its own client")
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment" in line


def test_a_trainer_with_the_plugin_alone_says_where_to_set_credentials_before_modelcheckpoint_fails(
        s3_endpoint, no_credentials, monkeypatch):
    """No ResumeStateCallback, no CLI: the fit-start check (our callbacks_factory entry point) runs its credentials
    check before ModelCheckpoint.setup lists the dirpath with a client that has none."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import TinyModel, tiny_loader

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    model = TinyModel()
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      plugins=[lightning_resilient.AtomicCheckpointIO(storage_options=options)],
                      callbacks=[ModelCheckpoint(dirpath="s3://plugin-only/run", every_n_train_steps=1)])
    with pytest.raises(lightning_resilient.StoreCredentialsError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        trainer.fit(model, tiny_loader())
    assert trainer.global_step == 0 and model.losses == []


# -- missing extras: said before any work, with the pip command ----------------------------------------------------
@pytest.mark.parametrize(("argv", "module", "extra"), [
    (["demo"], "matplotlib", "demo"),
    (["demo"], "moto", "demo"),
    (["train", "fit", "-c", "anything.yaml"], "jsonargparse", "cli"),
])
def test_a_missing_extra_is_named_with_its_install_command_before_any_work(argv, module, extra, monkeypatch, capsys,
                                                                              tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # what find_spec reports for a module that is not installed

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"work started before the missing extra was reported: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_work)  # the demo's trainings and servers are processes
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lightning-resilient {argv[0]}: ") and len(err.strip().splitlines()) == 1
    assert f"pip install 'lightning-resilient[{extra}]'" in err
    assert not (tmp_path / "demo_output").exists()  # nothing was started or written


# -- the Python API raises the messages the CLI prints -------------------------------------------------------------
def test_find_latest_checkpoint_of_an_unknown_protocol_says_what_ls_says(capsys):
    with pytest.raises(ValueError) as info:
        lightning_resilient.find_latest_checkpoint("s4://bucket/run")
    assert isinstance(info.value, lightning_resilient.StoreURLError)
    assert run(capsys, "ls", "s4://bucket/run") == (2, f"lightning-resilient ls: {info.value}\n")


def test_python_credentials_errors_name_the_python_argument(s3_endpoint, no_credentials):
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    with pytest.raises(PermissionError) as info:
        lightning_resilient.find_latest_checkpoint("s3://any-bucket/run", storage_options=options)
    assert isinstance(info.value, lightning_resilient.StoreCredentialsError)
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)" in str(info.value)
    assert "storage_options={'profile': ...}" in str(info.value) and "--storage-options" in info.value.cli_message


def test_gcs_refusals_name_google_application_credentials():
    from gcsfs.retry import HttpError

    from lightning_resilient.io.store.errors import translate_error

    denied = HttpError({"code": 401, "message": "Anonymous caller does not have storage.objects.list"})
    refused = translate_error(denied, "gs://bucket/run", "list")
    assert isinstance(refused, lightning_resilient.StoreCredentialsError)
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(refused) and "Anonymous caller" in str(refused)
    assert "--storage-options '{\"token\": " in refused.cli_message


# -- docs/local-s3.md: your own training against moto, as the demo runs --------------------------------------------
@pytest.mark.slow
def test_the_local_s3_page_script_runs_as_it_is_and_its_restart_resumes(bare_env, tmp_path):
    page = (Path(__file__).parents[1] / "docs" / "local-s3.md").read_text()
    (script,) = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in bare_env.items() if k != "AWS_EC2_METADATA_DISABLED"}  # the page sets it itself
    proc = procs.run([sys.executable, "train.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                     timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("trained to step")]
    assert [line.split(";")[0] for line in lines] == ["trained to step 4", "trained to step 8"]
    assert "latest: s3://my-bucket/run-1/checkpoints/epoch=0-step=4.ckpt/" in lines[0]
    assert "latest: s3://my-bucket/run-1/checkpoints/epoch=0-step=8.ckpt/" in lines[1]
    resumed = ("AtomicCheckpointIO: resuming the run in s3://my-bucket/run-1/checkpoints from its checkpoint"
               " epoch=0-step=4.ckpt")
    assert resumed in proc.stderr  # the restart resumed, and said so
