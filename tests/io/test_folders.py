"""Commit folder names: what garbage collection and resolution read from a name without opening the folder."""

from __future__ import annotations

import pytest

from lightning_resilient.io.folders import commit_time, new_commit_folder, writer_epoch_of, writer_identity


def test_a_new_commit_folder_carries_its_writer_epoch_and_start_time():
    folder = new_commit_folder("epoch=0-step=4.ckpt", 1_700_000_000.25, 12)
    name, commit = folder.split("/")
    assert name == "epoch=0-step=4.ckpt" and commit.startswith("c1700000000250-e12-")
    assert writer_epoch_of(folder) == 12 and writer_epoch_of(commit) == 12
    assert commit_time(folder) == pytest.approx(1_700_000_000.25)
    assert new_commit_folder("a", 1.0, 1) != new_commit_folder("a", 1.0, 1)  # two saves in one millisecond


@pytest.mark.parametrize("name", ["last.ckpt", "c123-e1-0123abcd", "c1700000000000-e1-0123ABCD",
                                  "c1700000000000-e-0123abcd", "c1700000000000-e1-0123abcd.tmp", ""])
def test_anything_else_is_not_a_commit_folder(name):
    assert writer_epoch_of(name) is None and commit_time(name) is None


def test_each_writer_identity_is_its_own():
    assert writer_identity() != writer_identity()  # two plugins of one process are two writers
