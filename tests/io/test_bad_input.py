"""Bad input meets this package's errors, each naming the fix, not a client's (botocore's ParamValidationError, a bare
ENOTDIR) or a quiet success (a folder named " "). The node cache's planted symlinks: ``test_node_cache.py``."""

from __future__ import annotations

import os
import re

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilient import AtomicCheckpointIO, StoreURLError, find_latest_checkpoint, load_checkpoint
from lightning_resilient.cli import main
from lightning_resilient.io.store import check_url
from tests.models import TinyModel, tiny_loader

from .helpers import make_checkpoint


def entry_points(url: str, storage_options: dict) -> list:
    """What a user calls with a root (or a checkpoint under it): find, load, save, and the plugin's fit-start check."""
    return [lambda: find_latest_checkpoint(url, storage_options),
            lambda: load_checkpoint(url, storage_options=storage_options),
            lambda: AtomicCheckpointIO(storage_options=storage_options).save_checkpoint(
                make_checkpoint(1), f"{url}{'' if url.endswith('/') else '/'}epoch=0.ckpt"),
            lambda: AtomicCheckpointIO(storage_options=storage_options).check_root(url)]


@pytest.mark.parametrize("url", ["s3://", "s3:///run", "s3:////run/ckpt"])
def test_an_s3_url_without_a_bucket_is_refused_naming_the_fix_not_botocores_words(url, s3_backend, monkeypatch,
                                                                                      capsys):
    """``s3://${BUCKET}/run`` with BUCKET unset: botocore refused it with its raw ParamValidationError."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_backend.endpoint)  # a reachable server: only the URL is wrong
    for call in entry_points(url, s3_backend.storage_options):
        with pytest.raises(StoreURLError, match=rf"cannot open '{re.escape(url)}[^']*': it names no bucket \(s3://BUCKET/"):
            call()
    assert main(["ls", url]) == 2
    assert capsys.readouterr().err.strip().endswith("whose filesystem is installed.")  # our one line, no traceback


@pytest.mark.parametrize(("url", "meant"), [("gs://", None), ("gs:///run", None), ("s3a://", None),
                                            ("s3://bucket/run?versionId=1", "s3://bucket/run"),
                                            ("s3://bucket/run/?versionId=abc", "s3://bucket/run"),
                                            ("gs://bucket/run#1700000000", "gs://bucket/run"),
                                            ("gs://bucket/run?generation=1", "gs://bucket/run")])
def test_a_cloud_url_without_a_bucket_or_with_a_version_is_refused_before_any_client(url, meant):
    with pytest.raises(StoreURLError) as info:
        check_url(url)
    message = str(info.value)
    assert message.startswith(f"cannot open {url!r}: ") and "\n" not in message
    if meant is None:
        assert "it names no bucket" in message
    else:
        assert "is a query or fragment" in message and f"Did you mean {meant!r}?" in message


def test_a_root_url_with_a_version_id_is_refused_not_read_as_a_damaged_pointer(s3_backend):
    """s3fs reads ``?versionId=`` as an object version: on an empty bucket the root read as a pointer "truncated or
    overwritten", on one with checkpoints as something else again. A root is the bucket as it is now."""
    url = f"{s3_backend.root}?versionId=1"
    for call in entry_points(url, s3_backend.storage_options):
        with pytest.raises(StoreURLError, match=re.escape(f"Did you mean {s3_backend.root!r}?")):
            call()
    assert not s3_backend.fs().exists(s3_backend.path())  # nothing was written anywhere


def test_saving_or_finding_under_a_file_names_the_file_and_the_fix(tmp_path):
    """A dirpath that is a file, or under one: a bare ``[Errno 20] Not a directory: '.../.lightning_resilient/
    origins'`` named a folder of ours the user never chose."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    expected = re.escape(f"{str(a_file)!r} is a file, not a folder") + ".*Choose another dirpath, or move the file away"
    with pytest.raises(NotADirectoryError, match=expected):
        AtomicCheckpointIO().save_checkpoint(make_checkpoint(1), str(a_file / "epoch=0.ckpt"))
    for call in entry_points(str(a_file / "run"), {}):
        with pytest.raises(NotADirectoryError, match=expected):
            call()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and a_file.read_text() == "not a folder"


@pytest.mark.parametrize("given", [" ", "  ", "\t", " /run", " run", " s3://bucket/run", "{tmp}/ /run", "{tmp}/ "])
def test_a_blank_root_or_folder_is_refused_not_made(given, tmp_path, monkeypatch):
    """``" "`` quietly became a folder named with a space in the working folder (and ModelCheckpoint(dirpath=" ")
    saves into ``<working folder>/ ``)."""
    monkeypatch.chdir(tmp_path)
    url = given.format(tmp=tmp_path)
    for call in entry_points(url, {}):
        with pytest.raises(StoreURLError, match=r"blank|only whitespace|starts with whitespace"):
            call()
    assert os.listdir(tmp_path) == []
    if url.strip():
        check_url(url.replace(" ", "_").replace("\t", "_"))  # a name with something in it passes


@pytest.mark.parametrize("url", ["s3://bucket/ /run", "gs://bucket/run/ ", "s3://bucket/\t/run"])
def test_a_cloud_url_with_a_blank_folder_is_refused_before_any_client(url):
    with pytest.raises(StoreURLError, match=r"only whitespace"):
        check_url(url)
    check_url("s3://bucket/my run/ckpt")  # a space inside a name is a name
    check_url("s3://bucket/run#1/ckpt")  # and so is a "#" to s3fs (not to gcsfs: a generation)


def test_a_trainer_whose_dirpath_is_blank_stops_before_its_first_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath=" ", every_n_train_steps=1)])
    with pytest.raises(StoreURLError, match=re.escape(f"cannot open {str(tmp_path / ' ')!r}: it has a folder named"
                                                      " ' ', only whitespace")):
        trainer.fit(TinyModel(), tiny_loader())
    assert trainer.global_step == 0 and os.listdir(tmp_path) == []
