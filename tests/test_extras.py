"""The object stores are extras (``[s3]``, ``[gcs]``, ``[all]``): the base install trains on local disk, and a root on a
store whose filesystem is not installed is refused with the pip command that installs it. Missing command extras
(``cli``, ``demo``): ``tests/test_cli_first_hour.py``."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient._extras import EXTRAS, PROTOCOL_EXTRAS
from lightning_resilient.cli import main
from lightning_resilient.errors import StoreURLError
from lightning_resilient.io.store import check_default_client

REPO = Path(__file__).parents[1]
STORES = [("s3", "s3://some-bucket/run", "s3fs"), ("gcs", "gs://some-bucket/run", "gcsfs")]


def pyproject() -> Any:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def names(requirements: list[str]) -> set[str]:
    return {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in requirements}


def expanded(extras: dict[str, list[str]], extra: str) -> list[str]:
    """The requirements of ``extra`` with the extras of this package it names (``lightning_resilient[s3,cli]``)
    replaced by theirs, as pip installs them."""
    out: list[str] = []
    for requirement in extras[extra]:
        if requirement.startswith("lightning_resilient["):
            for inner in requirement.split("[", 1)[1].rstrip("]").split(","):
                out += expanded(extras, inner.strip())
        else:
            out.append(requirement)
    return out


def test_the_stores_are_extras_and_the_base_install_pulls_neither_client():
    project = pyproject()
    extras = project["optional-dependencies"]
    every = {name: names(expanded(extras, name)) for name in extras}
    assert not names(project["dependencies"]) & {"s3fs", "gcsfs", "boto3", "botocore", "google-cloud-storage"}
    assert every["s3"] == {"s3fs", "botocore", "boto3"} and every["gcs"] == {"gcsfs"}
    assert every["all"] == every["s3"] | every["gcs"]
    assert every["s3"] | every["gcs"] <= every["test"]  # make test runs every store
    assert every["s3"] <= every["demo"] and every["s3"] <= every["bench"]  # both run on moto's S3
    for extra, modules in EXTRAS.items():  # what the error names is what pip installs
        assert {requirement.split("[")[0] for _, requirement in modules} <= every[extra], extra
    assert set(PROTOCOL_EXTRAS.values()) <= set(extras)


def test_every_extra_that_brings_botocore_or_boto3_takes_them_from_the_s3_extra():
    """[s3] holds botocore and boto3 to a band aiobotocore accepts (pyproject.toml says why): an extra that named
    boto3 itself, unbounded, would bring back pip 23.2's ResolutionImpossible (tests/install_check.py)."""
    extras = pyproject()["optional-dependencies"]
    for extra, requirements in extras.items():
        if extra != "s3":
            assert not names(requirements) & {"s3fs", "boto3", "botocore", "aiobotocore"}, extra
    pins = {r.split(">")[0]: r for r in extras["s3"] if r.startswith(("boto3", "botocore"))}
    assert pins["boto3"].replace("boto3", "botocore") == pins["botocore"]  # boto3 X needs botocore >= X


# Every way the docs install this package: a code line from the clone, or an extra named in a message or the prose.
_INSTALL_LINE = re.compile(r"^pip install (.*?/path/to/lightning_resilient\[.*?)\s*(#.*)?$")
_INSTALL_EXTRA = re.compile(
    r"pip install (?:-e )?'(?:\.|lightning-resilient|/path/to/lightning_resilient)\[([a-z0-9,]+)\]'")


def test_every_install_command_of_the_docs_is_checked_in_a_fresh_venv():
    """tests/install_check.py (run by CI) installs each in a fresh venv with Python 3.11's stock pip; a command
    added to the docs must be added there too."""
    from tests.install_check import CASES

    first = {lines[0] for lines in CASES.values()}
    every = {line for lines in CASES.values() for line in lines}
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    lines, named = set(), set()
    for doc in docs:
        for line in doc.read_text().splitlines():
            match = _INSTALL_LINE.match(line.strip())
            if match:
                lines.add(match.group(1).replace("/path/to/lightning_resilient", "{repo}"))
            named.update(_INSTALL_EXTRA.findall(line))
    assert lines and named >= {"s3", "gcs", "s3,cli", "demo"}  # (the patterns still find the README's)
    assert lines <= first, sorted(lines - first)
    assert {f"-e '{{repo}}[{extra}]'" for extra in named} <= every, sorted(named)


@pytest.mark.parametrize(("extra", "root", "module"), STORES)
def test_a_root_on_a_store_without_its_extra_is_refused_with_the_pip_command(extra, root, module, monkeypatch,
                                                                              capsys):
    monkeypatch.setitem(sys.modules, module, None)  # what find_spec reports for a module that is not installed
    command = f"pip install 'lightning-resilient[{extra}]'"
    with pytest.raises(StoreURLError, match=rf"cannot open '{root}': needs {module} \(the \[{extra}\] extra\)") as e:
        find_latest_checkpoint(root)
    assert command in str(e.value)
    with pytest.raises(StoreURLError, match=re.escape(command)):
        AtomicCheckpointIO().check_root(root)
    with pytest.raises(StoreURLError, match=re.escape(command)):
        check_default_client(root)  # the fit-start check, before ModelCheckpoint's own listing
    assert main(["ls", root]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and command in err


def test_train_names_the_store_extra_before_it_builds_the_trainer(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    configs = REPO / "configs"
    assert main(["train", "fit", "-c", str(configs / "base.yaml"), "-c", str(configs / "s3.yaml"),
                 "--trainer.max_steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("lightning-resilient train: cannot open 's3://lightning-resilient-example/run-1/checkpoints':"
                       " needs s3fs (the [s3] extra), not installed here: pip install 'lightning-resilient[s3]' (in a"
                       " clone: pip install -e '.[s3]')")


BLOCKED = """
import sys

# What a base install (no [s3], no [gcs]) lacks: the stores' clients and what they bring. A None in sys.modules is
# what import and find_spec take for a module that is not installed.
ROOTS = ("s3fs", "gcsfs", "botocore", "aiobotocore", "boto3", "google", "moto")
for name in ROOTS:
    sys.modules[name] = None
"""


@pytest.mark.slow
def test_without_any_store_extra_a_local_root_trains_and_resumes_and_s3_says_what_to_install(tmp_path):
    # A process of its own: nothing of the stores' clients may be imported already, as in a base install.
    script = BLOCKED + textwrap.dedent(f"""
        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint
        from lightning_resilient.errors import StoreURLError
        from tests.models import TinyModel, tiny_loader

        root = {str(tmp_path / "ckpt")!r}
        for steps in (2, 4):
            trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                              enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                              callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2)])
            trainer.fit(TinyModel(), tiny_loader(), ckpt_path=find_latest_checkpoint(root))
        print("local", trainer.global_step, find_latest_checkpoint(root).split("/")[-2])
        try:
            find_latest_checkpoint("s3://some-bucket/run")
        except StoreURLError as exc:
            print("s3", exc)
        print("imported", sorted(m for m, module in sys.modules.items() if m.split(".")[0] in ROOTS and module))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "local 4 epoch=0-step=4.ckpt" in lines
    assert ("s3 cannot open 's3://some-bucket/run': needs s3fs (the [s3] extra), not installed here: pip install"
            " 'lightning-resilient[s3]' (in a clone: pip install -e '.[s3]')") in lines
    assert "imported []" in lines
