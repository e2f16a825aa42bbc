"""The example configs parse and train on their store, and rerunning the same command resumes (auto_resume)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from lightning_resilient import find_latest_checkpoint
from lightning_resilient.cli import main
from lightning_resilient.io.pointer import POINTER_NAME, Pointer

CONFIGS = Path(__file__).parents[1] / "configs"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def dirpath(store: str) -> str:
    config = yaml.safe_load((CONFIGS / f"{store}.yaml").read_text())
    checkpoint = next(c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    return checkpoint["init_args"]["dirpath"]


def fit(store: str, max_steps: int, *extra: str) -> None:
    main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(CONFIGS / f"{store}.yaml"),
          "--trainer.max_steps", str(max_steps), *QUIET, *extra])


def pointer(root: str, options: dict | None = None) -> Pointer:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **(options or {}))
    fs.invalidate_cache()
    return Pointer.from_bytes(fs.cat_file(f"{path}/{POINTER_NAME}"), where=root)


@pytest.fixture
def store_env(request, tmp_path, monkeypatch):
    """Run in tmp_path with the store of the config under test reachable as a user would reach it. The configs name
    one fixed bucket, so it is made for the test and deleted after it: a test that expects it missing
    (tests/test_cli_first_hour.py) may run next on the same server."""
    import fsspec

    monkeypatch.chdir(tmp_path)
    store = request.param
    root = dirpath(store)
    bucket = "lightning-resilient-example"
    if store == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # reaches our plugin and ModelCheckpoint's own client
        fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    elif store == "gcs":
        endpoint = request.getfixturevalue("gcs_endpoint")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        fs = fsspec.filesystem("gcs", endpoint_url=endpoint, token="anon", skip_instance_cache=True)
    else:
        root = str(tmp_path / root)
    if store == "local":
        yield store, root
        return
    fs.mkdir(bucket)
    try:
        yield store, root
    finally:
        for path in fs.find(bucket):  # one DELETE each: fake-gcs-server mishandles gcsfs's batch deletes
            fs.rm_file(path)
        fs.rmdir(bucket)


@pytest.mark.parametrize("store_env", ["local", "s3", "gcs"], indirect=True)
def test_each_config_trains_and_the_same_command_resumes(store_env, caplog):
    store, root = store_env
    caplog.set_level(logging.INFO)
    fit(store, 4)
    first = pointer(root)
    assert first.latest is not None and first.latest.step == 4 and first.writer_epoch == 1
    assert "no committed checkpoint" in caplog.text and "starting fresh" in caplog.text
    caplog.clear()
    fit(store, 6)  # the same command, further: resumes instead of starting over
    assert "auto_resume: resuming from" in caplog.text
    second = pointer(root)
    assert second.latest.step == 6
    assert second.writer_epoch == 2  # the rerun claimed the root when it resumed
    assert any(v.startswith("resumed from") for v in second.protected.values())


def with_plugin(store: str, folder: Path, **init_args: object) -> str:
    """The store's config with ``init_args`` added to its AtomicCheckpointIO, written to ``folder``."""
    config = yaml.safe_load((CONFIGS / f"{store}.yaml").read_text())
    plugin = next(p for p in config["trainer"]["plugins"] if p["class_path"].endswith("AtomicCheckpointIO"))
    plugin["init_args"].update(init_args)
    path = folder / f"{store}-{'-'.join(init_args)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("store_env", ["local"], indirect=True)
def test_explicit_ckpt_path_wins_and_auto_resume_can_be_turned_off(store_env, caplog, capsys, tmp_path):
    store, root = store_env
    caplog.set_level(logging.INFO)
    fit(store, 4)
    # Turned off over a root that holds a run, it would train from step 0 and leave the run behind: refused at the
    # fit's start, in one line, unless the plugin is told it is a new run.
    capsys.readouterr()
    assert main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(CONFIGS / f"{store}.yaml"),
                 "--trainer.max_steps", "4", *QUIET, "--auto_resume", "false"]) == 2
    err = capsys.readouterr().err  # Lightning's own log lines come first
    last = err.strip().splitlines()[-1]
    assert last.startswith("lightning-resilient train: this fit loads no checkpoint, but its checkpoint folder")
    assert "new_run=True" in last and "Traceback" not in err
    assert pointer(root).writer_epoch == 1
    fit(store, 4, "--auto_resume", "false", "-c", with_plugin(store, tmp_path, new_run=True))  # starts over
    # Resumed, it would have had nothing left to train and committed nothing; fresh, it wrote step 4 again.
    assert pointer(root).latest.writer_epoch == 2
    older = find_latest_checkpoint(root)
    fit(store, 5, "--ckpt_path", older)
    assert pointer(root).latest.step == 5


def test_auto_resume_explains_why_it_cannot_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({"trainer": {"callbacks": [], "plugins": []}}))
    with pytest.warns(UserWarning, match="no ModelCheckpoint with a dirpath"):
        main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(bare), "--trainer.max_steps", "1", *QUIET])
    stock = tmp_path / "stock.yaml"
    stock.write_text(yaml.safe_dump({"trainer": {"plugins": [], "callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": "ckpt"}}]}}))
    with pytest.warns(UserWarning, match="auto_resume needs lightning_resilient.AtomicCheckpointIO"):
        main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(stock), "--trainer.max_steps", "1", *QUIET])


def test_every_plugin_argument_is_settable_from_a_config():
    """Any plugin argument without a type hint could not be set from YAML: that is a bug."""
    import inspect

    from lightning_resilient import (
        AtomicCheckpointIO,
        AutoPrecision,
        CheckpointCadence,
        ResumeStateCallback,
        TransferAudit,
    )
    from lightning_resilient.demo import DemoData, DemoModel

    for cls in (AtomicCheckpointIO, AutoPrecision, ResumeStateCallback, CheckpointCadence, TransferAudit, DemoModel,
                DemoData):
        params = inspect.signature(cls.__init__).parameters
        untyped = [n for n, p in params.items() if n not in ("self", "args", "kwargs")
                   and p.annotation is inspect.Parameter.empty]
        assert not untyped, f"{cls.__name__}: {untyped}"


@pytest.mark.parametrize("store_env", ["local"], indirect=True)
def test_the_saved_config_never_holds_credentials(store_env, tmp_path):
    _, root = store_env
    config = yaml.safe_load((CONFIGS / "local.yaml").read_text())
    plugin = next(p for p in config["trainer"]["plugins"] if p["class_path"].endswith("AtomicCheckpointIO"))
    plugin["init_args"]["storage_options"] = {"key": "AKIAEXAMPLEKEY", "secret": "s3cr3t-value",
                                              "client_kwargs": {"aws_session_token": "t0ken-value", "verify": False},
                                              "headers": {"Authorization": "Bearer b3arer-value", "Accept": "*/*"},
                                              "accessKeyId": "AKIACAMELKEY", "auth": ["alice", "pa55word"],
                                              "endpoint_url": "https://alice:url-pa55@store.example:9000/x"}
    with_secrets = tmp_path / "with-secrets.yaml"
    with_secrets.write_text(yaml.safe_dump(config))
    main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(with_secrets), "--trainer.max_steps", "2",
          *QUIET])
    saved = (tmp_path / "runs" / "run-1" / "config.yaml").read_text()  # base.yaml's default_root_dir
    for secret in ("AKIAEXAMPLEKEY", "s3cr3t-value", "t0ken-value", "b3arer-value", "AKIACAMELKEY", "pa55word",
                   "url-pa55"):
        assert secret not in saved
    options = next(p for p in yaml.safe_load(saved)["trainer"]["plugins"]
                   if p["class_path"].endswith("AtomicCheckpointIO"))["init_args"]["storage_options"]
    assert options == {"key": "<redacted>", "secret": "<redacted>",
                       "client_kwargs": {"aws_session_token": "<redacted>", "verify": False},
                       "headers": {"Authorization": "<redacted>", "Accept": "*/*"},
                       "accessKeyId": "<redacted>", "auth": "<redacted>",
                       "endpoint_url": "https://<redacted>@store.example:9000/x"}
    assert pointer(root).latest.step == 2  # the run itself had the real options


@pytest.mark.parametrize("store_env", ["s3"], indirect=True)
def test_the_s3_config_with_a_local_tier_resumes_from_local_disk(store_env, tmp_path, caplog):
    # The commented-out local_tier lines of configs/s3.yaml, switched on: the durable root gets every 4th step and
    # the last of the fit, and the same command resumes the newest checkpoint, read from this node's local tier.
    _, root = store_env
    config = yaml.safe_load((CONFIGS / "s3.yaml").read_text())
    config["trainer"]["plugins"][0]["init_args"].update(local_tier=str(tmp_path / "nvme"), persist_every=4)
    saver = next(c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    saver["init_args"]["every_n_train_steps"] = 1
    tiered = tmp_path / "s3-tiered.yaml"
    tiered.write_text(yaml.safe_dump(config))
    caplog.set_level(logging.INFO)
    main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(tiered), "--trainer.max_steps", "6", *QUIET])
    durable = pointer(root)
    assert durable.latest is not None and durable.latest.step == 6
    assert sorted({e.step for e in durable.entries()}) == [4, 6]  # every 4th step, and the last of the fit
    caplog.clear()
    main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(tiered), "--trainer.max_steps", "9", *QUIET])
    assert "auto_resume: resuming from" in caplog.text
    assert "(step 6) from the local tier" in caplog.text
    assert pointer(root).latest.step == 9


def test_every_credential_form_in_storage_options_is_redacted_and_nothing_else():
    from lightning_resilient.training_cli import REDACTED, redact_storage_options

    secret = {
        # HTTP headers (gcsfs/s3fs/aiohttp clients), in a dict or as (name, value) pairs
        "headers": {"Authorization": "Bearer a", "x-goog-api-key": "b", "Cookie": "c=d", "Proxy-Authorization": "e",
                    "X-Amz-Security-Token": "f", "User-Agent": "kept/1.0"},
        "client_kwargs": {"headers": [["Authorization", "Basic g"], ["Accept", "kept"]],
                          "endpoint_url": "http://127.0.0.1:9000"},
        # camelCase and other spellings of keys, secrets and tokens
        "accessKeyId": "h", "SecretAccessKey": "i", "sessionToken": "j", "apikey": "k", "apiKey": "l",
        "account_key": "m", "sas_token": "n", "connection_string": "o", "client_secret": "p", "password": "q",
        "token": {"type": "service_account", "private_key": "r"},
        # basic auth as a list, and credentials or signatures in URLs
        "auth": ["user", "s"],
        "proxy": "http://user:t@proxy.example:3128",
        "url": "https://store.example/b?X-Amz-Signature=u&X-Amz-Credential=v&partNumber=1&sig=w",
        # what is no secret stays
        "config_kwargs": {"signature_version": "s3v4", "max_pool_connections": 50},
        "anon": False, "use_ssl": True, "region_name": "eu-west-1", "profile": "dev", "monkey": "kept",
    }
    out = redact_storage_options({"storage_options": secret, "elsewhere": {"password": "not options: kept"}})
    options = out["storage_options"]
    assert options["headers"] == {**dict.fromkeys(["Authorization", "x-goog-api-key", "Cookie", "Proxy-Authorization",
                                                   "X-Amz-Security-Token"], REDACTED), "User-Agent": "kept/1.0"}
    assert options["client_kwargs"] == {"headers": [["Authorization", REDACTED], ["Accept", "kept"]],
                                        "endpoint_url": "http://127.0.0.1:9000"}
    for key in ("accessKeyId", "SecretAccessKey", "sessionToken", "apikey", "apiKey", "account_key", "sas_token",
                "connection_string", "client_secret", "password", "token", "auth"):
        assert options[key] == REDACTED, key
    assert options["proxy"] == f"http://{REDACTED}@proxy.example:3128"
    assert options["url"] == (f"https://store.example/b?X-Amz-Signature={REDACTED}&X-Amz-Credential={REDACTED}"
                              f"&partNumber=1&sig={REDACTED}")
    assert options["config_kwargs"] == {"signature_version": "s3v4", "max_pool_connections": 50}
    assert {k: options[k] for k in ("anon", "use_ssl", "region_name", "profile", "monkey")} == \
        {"anon": False, "use_ssl": True, "region_name": "eu-west-1", "profile": "dev", "monkey": "kept"}
    assert out["elsewhere"] == {"password": "not options: kept"}  # keys are judged inside storage_options only
    # A URL with credentials is one anywhere in a config (a logger's tracking URI, say).
    assert redact_storage_options({"tracking_uri": "https://me:pw@mlflow.example"}) == \
        {"tracking_uri": f"https://{REDACTED}@mlflow.example"}


@pytest.mark.parametrize("store_env", ["s3"], indirect=True)
def test_ckpt_path_last_resumes_the_roots_latest_on_s3(store_env, caplog):
    """Lightning resolves "last" by listing last*.ckpt, without the protocol on S3 (Lightning #18261): it would find
    nothing. lightning-resilient train makes it the root's newest committed checkpoint, on every store."""
    store, root = store_env
    fit(store, 4)
    first = pointer(root)
    caplog.set_level(logging.INFO)
    fit(store, 6, "--ckpt_path", "last", "--auto_resume", "false")
    second = pointer(root)
    assert second.latest.step == 6 and second.writer_epoch == 2
    assert second.origins[2].commit == first.latest.commit  # resumed the latest, not a fresh start


def test_a_checkpoint_url_no_store_reads_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((CONFIGS / "s3.yaml").read_text())
    checkpoint = next(c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    checkpoint["init_args"]["dirpath"] = "S3://lightning-resilient-example/run-1/checkpoints"
    (tmp_path / "upper.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "fit", "-c", str(CONFIGS / "base.yaml"), "-c", str(tmp_path / "upper.yaml"), *QUIET]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("lightning-resilient train: cannot open 'S3://lightning-resilient-example/run-1/checkpoints':"
                    " protocols are lower case. Did you mean 's3://lightning-resilient-example/run-1/checkpoints'?"
                    " Use a local path, s3://bucket/prefix, gs://bucket/prefix or another fsspec URL whose filesystem"
                    " is installed.")
    assert list(tmp_path.iterdir()) == [tmp_path / "upper.yaml"]  # nothing was built or written
