"""``KnownObjects``: what a writer may reference by digest, by step without dedup, by live folder always."""

from __future__ import annotations

from lightning_resilient.io.known_objects import KnownObjects
from lightning_resilient.io.manifest import Manifest, ObjectEntry


def manifest(commit: str, step: int, *digests: str) -> Manifest:
    objects = [ObjectEntry(f"{commit}/shard-{i:05d}.bin", 10, d) for i, d in enumerate(digests)]
    return Manifest(name=commit.split("/")[0], commit=commit, step=step, epoch=0, created=0.0, writer_epoch=1,
                    chunk_size=10, skeleton=0, objects=objects)


def test_without_dedup_only_the_same_steps_objects_are_offered():
    known = KnownObjects(dedup=False)
    known.remember(manifest("a.ckpt/c1-e1-x", 1, "d1", "d2"))
    assert set(known.for_save(1, incremental=False)) == {("d1", 10), ("d2", 10)}
    assert known.for_save(2, incremental=False) == {}  # another step never shares bytes
    known.remember(manifest("b.ckpt/c2-e1-y", 2, "d3"))
    assert set(known.for_save(2, incremental=False)) == {("d3", 10)}  # (the new step forgot the old one's)


def test_with_dedup_every_step_is_offered_and_only_live_folders_are_kept():
    known = KnownObjects(dedup=True)
    known.remember(manifest("a.ckpt/c1-e1-x", 1, "d1"))
    known.remember(manifest("b.ckpt/c2-e2-y", 2, "d2"))  # (another writer epoch: a resumed checkpoint's)
    assert set(known.for_save(3, incremental=True)) == {("d1", 10), ("d2", 10)}
    base = ObjectEntry("c.ckpt/c3-e2-z/shard-00000.bin", 10, "d1")
    assert known.like(base, {"a.ckpt/c1-e1-x"}) == "a.ckpt/c1-e1-x/shard-00000.bin"
    assert known.like(base, {"b.ckpt/c2-e2-y"}) is None  # known, but its folder is not live
    known.keep_live({"b.ckpt/c2-e2-y"})
    assert set(known.for_save(3, incremental=True)) == {("d2", 10)}
    known.clear()
    assert known.for_save(3, incremental=True) == {}
