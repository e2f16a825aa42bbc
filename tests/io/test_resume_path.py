"""The job's one resume decision (io/resume_path.py): what every rank loads from the ``ckpt_path`` each was given.
The decision itself, in-process; the whole job (two "nodes" given different checkpoints by find_latest_checkpoint,
one of them replaced) is tests/io/test_replicas.py, and several processes given checkpoints of different roots are
refused on every rank in tests/test_compositions.py."""

from __future__ import annotations

import pytest

from lightning_resilient import ResumeMismatchError
from lightning_resilient.io.resume_path import decide


def root_of(url: str) -> str | None:
    """``/runs/<root>/<name>/<commit>`` and ``/runs/<root>`` are in ``/runs/<root>``; ``/files/...`` are plain files."""
    if url.startswith("/files/"):
        return None
    parts = url.split("/")
    return "/".join(parts[:3])


def test_the_same_path_on_every_rank_is_loaded_as_given_without_asking_where_it_is():
    def never(url: str) -> str:
        raise AssertionError(f"asked about {url}")

    assert decide(["/runs/a/x.ckpt/c1-e1-0", "/runs/a/x.ckpt/c1-e1-0"], never) == "/runs/a/x.ckpt/c1-e1-0"
    assert decide([None, None], never) is None
    assert decide(["/runs/a/", "/runs/a"], never) == "/runs/a/"  # (the same root, written two ways)


def test_different_checkpoints_of_one_root_or_none_on_some_ranks_resume_the_roots_newest(caplog):
    assert decide(["/runs/a/x.ckpt/c2-e1-0", "/runs/a/x.ckpt/c1-e1-0"], root_of) == "/runs/a"
    assert decide(["/runs/a/x.ckpt/c2-e1-0", None, None], root_of) == "/runs/a"
    assert decide([None, "/runs/a"], root_of) == "/runs/a"
    assert "rank 0: /runs/a/x.ckpt/c2-e1-0; rank 1: None; rank 2: None" in caplog.text


@pytest.mark.parametrize("given", [["/runs/a/x.ckpt/c1-e1-0", "/runs/b/x.ckpt/c1-e1-0"],
                                   ["/runs/a/x.ckpt/c1-e1-0", "/files/model.ckpt"],
                                   ["/files/model.ckpt", None]])
def test_checkpoints_of_different_roots_or_a_plain_file_are_refused_naming_each_rank_and_the_fix(given):
    with pytest.raises(ResumeMismatchError, match=r"rank 0: .*; rank 1: .* Give every process the same ckpt_path"):
        decide(given, root_of)
