"""RootReader: what a restore holds for the load that follows it (the rest of reading: test_protocol*.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_resilient import CheckpointCorruptedError
from lightning_resilient.io import layout
from lightning_resilient.io.root import open_root

from .helpers import assert_same, make_checkpoint


def _saved(local_backend, make_io):
    ckpt = make_checkpoint(3, size=4096)
    make_io(local_backend).save_checkpoint(ckpt, local_backend.url("step=3.ckpt"))
    root = open_root(local_backend.root)
    pointer, _ = root.read_pointer()
    assert pointer is not None and pointer.latest is not None
    manifest = root.read_manifest(pointer.latest.commit)
    return ckpt, root, manifest


def _stored(root, obj) -> torch.Tensor:
    data = torch.empty(obj.size, dtype=torch.uint8)
    assert root.store.read_into(obj.path, 0, [layout.raw_bytes(data)]) == obj.size
    return data


def _damage_on_disk(root, manifest) -> None:
    for obj in manifest.objects:
        path = root.store.path(obj.path)
        with open(path, "r+b") as f:
            f.seek(obj.size // 2)
            byte = f.read(1)
            f.seek(obj.size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_held_bytes_are_what_every_load_reads_until_they_are_dropped(local_backend, make_io):
    ckpt, root, manifest = _saved(local_backend, make_io)
    for obj in manifest.objects:
        root.reader.hold_verified(obj, _stored(root, obj))
    _damage_on_disk(root, manifest)  # the loads cannot have read the disk: they would fail its checksums
    for _ in range(2):  # (a sharded load reads some objects twice: each read takes the held bytes)
        loaded = root.load(manifest.commit, manifest=manifest, map_location=None, weights_only=True)
        assert_same(loaded.checkpoint["state_dict"], ckpt["state_dict"])
    root.reader.drop_held()
    with pytest.raises(CheckpointCorruptedError, match="checksum"):  # dropped: the next load reads the disk
        root.load(manifest.commit, manifest=manifest, map_location=None, weights_only=True)


def test_held_bytes_serve_only_a_manifest_with_the_same_digests_and_can_be_dropped(local_backend, make_io):
    _, root, manifest = _saved(local_backend, make_io)
    obj = manifest.objects[manifest.skeleton]
    other = dataclasses.replace(obj, chunks=["0" * len(c) for c in obj.chunks])  # another commit's object there
    root.reader.hold_verified(other, _stored(root, obj))
    _damage_on_disk(root, manifest)
    with pytest.raises(CheckpointCorruptedError, match="checksum"):
        root.load(manifest.commit, manifest=manifest, map_location=None, weights_only=True)
    for obj in manifest.objects:
        root.reader.hold_verified(obj, torch.zeros(obj.size, dtype=torch.uint8))
    root.reader.drop_held()
    with pytest.raises(CheckpointCorruptedError, match="checksum"):
        root.load(manifest.commit, manifest=manifest, map_location=None, weights_only=True)
