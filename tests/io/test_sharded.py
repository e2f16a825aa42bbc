"""Sharded checkpoints (torch.distributed.checkpoint) in the atomic layout.

In-process: the DCP storage writer/reader on every store (one process, no process group). Subprocesses (2 gloo
processes, FSDP2 through AtomicModelParallelStrategy and FSDP1 through AtomicFSDPStrategy): bit-exact resume
through a kill, a rank killed mid-save keeps the previous checkpoint latest, a damaged shard makes every rank
resume the previous checkpoint, resharding from 2 processes to 1 (mid-epoch: with ResumeStateCallback the epoch's
data continues too, each sample once), and S3.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilient import AtomicCheckpointIO, CheckpointCorruptedError, CheckpointError, ShardedCheckpointError
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest
from lightning_resilient.io.sharded import AtomicStorageReader, load_full, load_sharded, root_and_name, save_sharded
from tests import procs

from ..conftest import Backend
from .helpers import read_pointer

CHILD = Path(__file__).with_name("sharded_child.py")


def sharded_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g).double()},
            "optimizer_0": {"state": {"w": {"exp_avg": torch.randn(300, 7, generator=g), "step": torch.tensor(3.0)}},
                            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]}}


def zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    return state


def test_sharded_roundtrip_consolidation_and_corruption(backend, make_io):
    io = make_io(backend, shard_size=2048, chunk_size=1024)
    root, name = root_and_name(io, backend.url("epoch=0-step=3.ckpt"))
    state = sharded_state()
    rest = {"global_step": 3, "epoch": 0, "loops": {"x": 1}, "rng": torch.arange(5)}
    entry = save_sharded(state, root, name, rest=rest, no_dist=True)
    assert read_pointer(backend).latest.commit == entry.commit
    target = zeros_like(state)
    target["optimizer_0"]["param_groups"] = [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["w"]}]
    load_sharded(target, root, entry.commit, no_dist=True)
    assert torch.equal(target["state_dict"]["w"], state["state_dict"]["w"])
    assert torch.equal(target["state_dict"]["b"], state["state_dict"]["b"])
    assert torch.equal(target["optimizer_0"]["state"]["w"]["exp_avg"], state["optimizer_0"]["state"]["w"]["exp_avg"])
    assert target["optimizer_0"]["param_groups"][0]["lr"] == 0.1
    full = load_full(backend.root, backend.storage_options)
    assert full["global_step"] == 3 and torch.equal(full["rng"], rest["rng"])
    assert torch.equal(full["state_dict"]["w"], state["state_dict"]["w"])
    # A plain load cannot place per-rank shards: a clear error, not a silently partial checkpoint.
    with pytest.raises(ShardedCheckpointError, match="AtomicModelParallelStrategy"):
        make_io(backend, claim_on_load=False).load_checkpoint(backend.root)
    # Every chunk a load reads is verified.
    # One process holds every tensor whole: its stream is all whole items (r<rank>-whole-..., see io/sharded.py).
    shard = next(p for p in backend.fs().find(backend.path(entry.commit)) if "/r00000-whole-shard-" in p)
    data = bytearray(backend.fs().cat_file(shard))
    data[100] ^= 1
    backend.fs().pipe_file(shard, bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="blake3 checksum") as info:
        load_sharded(zeros_like(state), root, entry.commit, no_dist=True)
    assert info.value.object == backend.url(f"{entry.commit}/r00000-whole-shard-00000.bin")


def test_a_partial_load_reads_only_the_chunks_it_needs(local_backend, make_io):
    io = make_io(local_backend, shard_size=4096, chunk_size=1024)
    root, name = root_and_name(io, local_backend.url("a.ckpt"))
    state = sharded_state()
    entry = save_sharded(state, root, name, no_dist=True)
    reads: list[tuple[str, int]] = []
    original = root.store.read_range

    def counting(rel: str, start: int, end: int, consume: Any) -> Any:
        reads.append((rel, start))
        return original(rel, start, end, consume)

    root.store.read_range = counting  # type: ignore[method-assign]
    only_b = {"state_dict": {"b": torch.zeros(7, dtype=torch.float64)}}
    load_sharded(only_b, root, entry.commit, no_dist=True)
    assert torch.equal(only_b["state_dict"]["b"], state["state_dict"]["b"])
    manifest = root.read_manifest(entry.commit)
    total_chunks = sum(len(manifest.objects[i].chunks) for i in manifest.sharded.ranks[0])
    data_reads = [r for r in reads if "/r00000-" in r[0]]
    assert 1 <= len(data_reads) <= 2 < total_chunks  # the 56 bytes of "b", not the whole stream


def test_one_reader_serves_every_load_of_a_resume_with_one_manifest_and_one_metadata_read(local_backend, make_io):
    io = make_io(local_backend)
    root, name = root_and_name(io, local_backend.url("a.ckpt"))
    state = sharded_state()
    entry = save_sharded(state, root, name, no_dist=True)
    manifest_reads: list[str] = []
    metadata_reads: list[str] = []
    original_read, original_range = root.store.read, root.store.read_range

    def read(rel: str) -> bytes:
        manifest_reads.append(rel)
        return original_read(rel)

    def read_range(rel: str, start: int, end: int, consume: Any) -> Any:
        if rel.endswith("dcp.metadata"):
            metadata_reads.append(rel)
        return original_range(rel, start, end, consume)

    root.store.read = read  # type: ignore[method-assign]
    root.store.read_range = read_range  # type: ignore[method-assign]
    reader = AtomicStorageReader(root, entry.commit)
    target = zeros_like(state)
    load_sharded({"state_dict": target["state_dict"]}, root, entry.commit, reader=reader, no_dist=True)
    load_sharded({"optimizer_0": target["optimizer_0"]}, root, entry.commit, reader=reader, no_dist=True)
    assert torch.equal(target["state_dict"]["w"], state["state_dict"]["w"])
    assert torch.equal(target["optimizer_0"]["state"]["w"]["exp_avg"], state["optimizer_0"]["state"]["w"]["exp_avg"])
    assert len([r for r in manifest_reads if r.endswith(MANIFEST_NAME)]) == 1 and len(metadata_reads) == 1
    with pytest.raises(ValueError, match="reader is for"):
        load_sharded(zeros_like(state), root, "c0-e1-other", reader=reader, no_dist=True)


def _new_bytes(root: Any, commit: str) -> int:
    return sum(o.size for o in root.read_manifest(commit).objects if o.path.rsplit("/", 1)[0] == commit)


@pytest.mark.parametrize("backend_name", ["local", "s3"])
def test_dedup_sharded_saves_reference_what_is_unchanged_and_every_commit_loads_alone(backend_name, request, make_io,
                                                                                      monkeypatch):
    """``dedup`` with DCP (io/sharded.py, one process: every tensor is a whole item): the second save references the
    frozen tensor's objects in the first commit, writes the changed ones, and both commits load bit-exact, alone
    (DCP and load_full). A save that fails forgets what the rank stored: the next one writes everything."""
    from lightning_resilient.io.sharded import AtomicStorageWriter

    backend = request.getfixturevalue(f"{backend_name}_backend")
    io = make_io(backend, dedup=True, shard_size=2**20, chunk_size=2**16)
    root, _ = root_and_name(io, backend.url("step=1.ckpt"))
    g = torch.Generator().manual_seed(0)
    frozen, w = torch.randn(2**19, generator=g), torch.randn(300, 7, generator=g)
    state = {"state_dict": {"frozen": frozen, "w": w}, "optimizer_0": {"state": {"w": {"exp_avg": w * 0.1}},
                                                                       "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    snapshots = {}
    entries = {}
    for step in (1, 2):
        w.add_(1.0)  # in place: the trained tensor changes, the frozen one does not
        state["optimizer_0"]["state"]["w"]["exp_avg"] = w * 0.1
        snapshots[step] = {k: v.clone() for k, v in {"frozen": frozen, "w": w}.items()}
        entries[step] = save_sharded(state, root, f"step={step}.ckpt", rest={"global_step": step}, no_dist=True)
    first, second = entries[1].commit, entries[2].commit
    manifest = root.read_manifest(second)
    assert any(o.path.startswith(f"{first}/") for o in manifest.objects), "nothing referenced"
    assert _new_bytes(root, first) >= frozen.numel() * 4
    assert _new_bytes(root, second) < 64 * 1024  # w, its moment, DCP's metadata, the rest
    assert set(read_pointer(backend).latest.folders) == {first, second}
    for step, entry in entries.items():
        target = zeros_like({"state_dict": {"frozen": frozen, "w": w}})
        load_sharded(target, root, entry.commit, no_dist=True)
        assert all(torch.equal(target["state_dict"][k], snapshots[step][k]) for k in ("frozen", "w"))
        root.reader.verify(entry.commit)
    full = load_full(backend.url("step=2.ckpt"), backend.storage_options)
    assert torch.equal(full["state_dict"]["frozen"], frozen) and torch.equal(full["state_dict"]["w"], w)

    finish = AtomicStorageWriter.finish

    def failing(self: AtomicStorageWriter, *args: Any, **kwargs: Any) -> None:
        raise CheckpointError("the store went away before the manifest")

    # A save whose commit fails (its objects stored, never published): the next save references nothing of it.
    w.add_(1.0)
    monkeypatch.setattr(AtomicStorageWriter, "finish", failing)
    with pytest.raises(CheckpointError, match="the store went away"):
        save_sharded(state, root, "step=3.ckpt", rest={"global_step": 3}, no_dist=True)
    monkeypatch.setattr(AtomicStorageWriter, "finish", finish)
    failed = {p.rsplit("/", 1)[0] for p in backend.fs().find(backend.path("step=3.ckpt"))}
    entry = save_sharded(state, root, "step=3.ckpt", rest={"global_step": 3}, no_dist=True)
    folders = {o.path.rsplit("/", 1)[0] for o in root.read_manifest(entry.commit).objects}
    assert folders == {entry.commit, first}, folders  # the frozen tensor still referenced, the failed folder never
    assert all(not f.endswith(entry.commit) for f in failed)
    target = zeros_like({"state_dict": {"frozen": frozen, "w": w}})
    load_sharded(target, root, entry.commit, no_dist=True)
    assert torch.equal(target["state_dict"]["w"], w) and torch.equal(target["state_dict"]["frozen"], frozen)


def test_a_dedup_sharded_save_whose_referenced_commit_is_dropped_meanwhile_is_refused_and_the_next_writes_all(
        local_backend, make_io, monkeypatch):
    """The worst instant of a sharded dedup save: every rank planned its streams (referencing the frozen tensor's
    objects in the first commit), then an operator drops both earlier checkpoints before the coordinator's pointer
    update. The update refuses the commit (nothing names a missing object); the next save references nothing of
    the dropped folders, commits and loads bit-exact."""
    from lightning_resilient.io.sharded import AtomicStorageWriter

    io = make_io(local_backend, dedup=True, shard_size=2**20, chunk_size=2**16)
    root, _ = root_and_name(io, local_backend.url("step=1.ckpt"))
    g = torch.Generator().manual_seed(0)
    frozen, w = torch.randn(2**19, generator=g), torch.randn(300, 7, generator=g)
    state = {"state_dict": {"frozen": frozen, "w": w}}
    for step in (1, 2):
        w.add_(1.0)
        save_sharded(state, root, f"step={step}.ckpt", rest={"global_step": step}, no_dist=True)
    finish = AtomicStorageWriter.finish

    def drop_then_finish(self: AtomicStorageWriter, *args: Any, **kwargs: Any) -> None:
        operator = make_io(local_backend).root(local_backend.root)
        operator.retention.drop({e.commit for e in read_pointer(local_backend).entries()})
        finish(self, *args, **kwargs)

    w.add_(1.0)
    monkeypatch.setattr(AtomicStorageWriter, "finish", drop_then_finish)
    with pytest.raises(CheckpointError, match=r"retired while it uploaded|is missing just before"):
        save_sharded(state, root, "step=3.ckpt", rest={"global_step": 3}, no_dist=True)
    monkeypatch.setattr(AtomicStorageWriter, "finish", finish)
    assert read_pointer(local_backend).latest is None  # the refused commit was never named
    entry = save_sharded(state, root, "step=3.ckpt", rest={"global_step": 3}, no_dist=True)
    manifest = root.read_manifest(entry.commit)
    assert {o.path.rsplit("/", 1)[0] for o in manifest.objects} == {entry.commit}  # written whole
    target = zeros_like({"state_dict": {"frozen": frozen, "w": w}})
    load_sharded(target, root, entry.commit, no_dist=True)
    assert torch.equal(target["state_dict"]["frozen"], frozen) and torch.equal(target["state_dict"]["w"], w)


# -- real processes ------------------------------------------------------------------------------------------------

def launch(root: str, out: Path, options: dict[str, Any], *, kill_after: int | None = None,
           env: dict[str, str] | None = None, stderr: bool = False) -> str:
    """Run the child; with ``kill_after``, SIGKILL every process of the job once rank 0 saved that step.

    Returns its stdout, or with ``stderr`` its stderr (a run that is not killed)."""
    proc = procs.popen([sys.executable, str(CHILD), root, str(out), json.dumps(options)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                       env={**os.environ, **(env or {})})
    with open(str(out) + ".losses", "a") as f:
        f.write("START\n")
    assert proc.stdout is not None
    lines = []
    if kill_after is not None or options.get("die"):
        want = f"SAVED {kill_after}" if kill_after is not None else f"DYING {options['die'][0]}"
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == want:
                if options.get("die"):
                    time.sleep(1.0)  # the dead rank's peers fail in (or hang on) DCP's collective: end them too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=120)
        assert proc.returncode != 0, "".join(lines)[-2000:]  # killed, or failed when its peer died
        assert want in "".join(lines), "".join(lines)[-2000:]
        return "".join(lines)
    out_text, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    return err if stderr else out_text


def losses(out: Path) -> list[list[str]]:
    runs: list[list[str]] = []
    for line in Path(str(out) + ".losses").read_text().splitlines():
        if line == "START":
            runs.append([])
        else:
            runs[-1].append(line)
    return runs


BASE = {"devices": 2, "max_steps": 6, "every": 2}


def batches(out: Path) -> list[dict[str, Any]]:
    """Every rank's logged training batches so far (``epoch``, ``step`` after the batch, ``ids``), with ``rank``."""
    return [{**json.loads(line), "rank": int(path.name.rsplit(".r", 1)[1])}
            for path in sorted(out.parent.glob(f"{out.name}.ids.r*")) for line in path.read_text().splitlines()]


def uninterrupted(shared_runs, options: dict[str, Any]) -> Path:
    """The output prefix (``.weights``, ``.losses``) of the job run once, to its end, with ``options``."""
    def run(folder: Path) -> None:
        launch(str(folder / "root"), folder / "run", options)

    return shared_runs.get("sharded", options, run) / "run"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["model_parallel", "fsdp"])
def test_sharded_training_resumes_bit_exact_through_a_kill(tmp_path, strategy, shared_runs):
    options = {**BASE, "strategy": strategy}
    full = uninterrupted(shared_runs, options)
    launch(str(tmp_path / "part"), tmp_path / "part", options, kill_after=4)
    assert read_pointer(Backend("local", str(tmp_path / "part"))).latest.step == 4
    launch(str(tmp_path / "part"), tmp_path / "part", options)
    weights = torch.load(str(full) + ".weights")
    part = torch.load(str(tmp_path / "part") + ".weights")
    assert weights.keys() == part.keys() and all(torch.equal(weights[k], part[k]) for k in weights)
    resumed = losses(tmp_path / "part")[-1]
    assert resumed and losses(full)[0][-len(resumed):] == resumed
    assert len(resumed) == 2  # steps 5 and 6 only: the resume started at the step-4 checkpoint
    # The sharded checkpoint consolidates to the same full weights without a process group.
    consolidated = load_full(str(tmp_path / "part"))
    assert consolidated["global_step"] == 6
    assert all(torch.equal(consolidated["state_dict"][k], part[k]) for k in part)


@pytest.mark.slow
def test_dedup_fsdp2_saves_reference_the_frozen_layers_shards_and_resume_bit_exact_through_a_kill(tmp_path,
                                                                                                   shared_runs):
    """FSDP2 on two processes with ``dedup`` and a frozen first layer: from the third save on, each rank's shards of
    the frozen layer are referenced in the commit that stored them (the second packs them apart); killed after the
    step-6 save (which references step 4's objects) and resumed: bit-identical to a run without ``dedup``, and the
    resumed job's first save references the frozen shards of the checkpoint it loaded."""
    options = {**BASE, "max_steps": 8, "frozen": True}
    full = uninterrupted(shared_runs, options)
    root = str(tmp_path / "part")
    launch(root, tmp_path / "part", {**options, "dedup": True}, kill_after=6)
    backend = Backend("local", root)
    pointer = read_pointer(backend)
    assert pointer.latest.step == 6
    manifest = Manifest.from_bytes(Path(root, pointer.latest.commit, MANIFEST_NAME).read_bytes(), where=root)
    shared = [o.path for o in manifest.objects if not o.path.startswith(pointer.latest.commit + "/")]
    assert {p.rsplit("/", 1)[1][:7] for p in shared} >= {"r00000-", "r00001-"}, shared  # both ranks reference
    launch(root, tmp_path / "part", {**options, "dedup": True})
    weights = torch.load(str(full) + ".weights")
    part = torch.load(str(tmp_path / "part") + ".weights")
    assert weights.keys() == part.keys() and all(torch.equal(weights[k], part[k]) for k in weights)
    # The resumed job's first save (step 8, a new writer epoch) references the frozen shards by digest, on both
    # ranks, among the objects of the checkpoint it loaded: a restart does not write the base again.
    pointer = read_pointer(backend)
    manifest = Manifest.from_bytes(Path(root, pointer.latest.commit, MANIFEST_NAME).read_bytes(), where=root)
    shared = [o.path for o in manifest.objects if not o.path.startswith(pointer.latest.commit + "/")]
    assert pointer.latest.step == 8 and {p.rsplit("/", 1)[1][:7] for p in shared} >= {"r00000-", "r00001-"}, shared
    consolidated = load_full(root)
    assert consolidated["global_step"] == 8
    assert all(torch.equal(consolidated["state_dict"][k], part[k]) for k in part)


@pytest.mark.slow
def test_a_rank_killed_mid_save_keeps_the_last_checkpoint_and_resumes_on_one_process(tmp_path):
    root = str(tmp_path / "root")
    launch(root, tmp_path / "run", {**BASE, "die": [1, 4]})  # rank 1 dies inside the step-4 save
    assert read_pointer(Backend("local", root)).latest.step == 2
    partial = [p for p in Path(root, "epoch=0-step=4.ckpt").rglob("*") if p.is_file()]
    assert any("r00001-" in p.name for p in partial), "rank 1 stored part of its shards before it died"
    assert not any(p.name == MANIFEST_NAME for p in partial)
    kept = [b for b in batches(tmp_path / "run") if b["step"] <= 2]  # what the checkpoint of step 2 holds
    # Resharding: the 2-process checkpoint of step 2 resumes on one process and trains on to the end of epoch 0
    # (64 samples, 16 trained before the checkpoint: 12 batches of 4 on one process). The weights and optimizer
    # reshard, and ResumeStateCallback splits the rest of the epoch's order: every sample of it trained once.
    launch(root, tmp_path / "run", {**BASE, "devices": 1, "max_steps": 14, "every": 7})
    resumed = [b for b in batches(tmp_path / "run") if b["step"] > 2 and b["rank"] == 0][-12:]
    assert [b["step"] for b in resumed] == list(range(3, 15)) and {b["epoch"] for b in resumed} == {0}
    assert sorted(i for b in kept + resumed for i in b["ids"]) == list(range(64))
    final = torch.load(str(tmp_path / "run") + ".weights")
    consolidated = load_full(root)  # the step-14 checkpoint, written by one process, as full tensors
    assert consolidated["global_step"] == 14
    assert all(torch.equal(consolidated["state_dict"][k], final[k]) for k in final)
    step2 = load_full(f"{root}/epoch=0-step=2.ckpt")
    assert step2["global_step"] == 2 and set(step2["state_dict"]) == set(final)


@pytest.mark.slow
def test_a_damaged_sharded_checkpoint_is_not_loaded_the_previous_one_is_and_training_ends_the_same(tmp_path,
                                                                                                  shared_runs):
    # A rank's shard. A damaged skeleton (read after the shards, through the same verified reads as any checkpoint's)
    # falls back the same way; every kind of object damage is checked without processes in tests/io/test_protocol.py.
    damaged = "r00001-shard-*.bin"
    full = uninterrupted(shared_runs, {**BASE, "strategy": "model_parallel"})
    root = str(tmp_path / "part")
    launch(root, tmp_path / "part", {**BASE, "max_steps": 4})
    target = next(Path(root, "epoch=0-step=4.ckpt").rglob(damaged))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    # A shard only rank 1 reads: DCP carries its failure to rank 0, so both fall back to step 2 together.
    err = launch(root, tmp_path / "part", BASE, stderr=True)
    assert "is corrupted and was NOT loaded" in err and "epoch=0-step=2.ckpt" in err
    assert [line.split()[0] for line in losses(tmp_path / "part")[-1]] == ["3", "4", "5", "6"]
    weights, part = torch.load(str(full) + ".weights"), torch.load(str(tmp_path / "part") + ".weights")
    assert all(torch.equal(weights[k], part[k]) for k in weights)


@pytest.mark.slow
def test_an_fsdp1_checkpoint_of_two_processes_resumes_on_one(tmp_path):
    root = str(tmp_path / "root")
    options = {**BASE, "strategy": "fsdp", "max_steps": 4}
    launch(root, tmp_path / "run", options)
    launch(root, tmp_path / "run", {**options, "devices": 1, "max_steps": 6})
    assert [line.split()[0] for line in losses(tmp_path / "run")[-1]] == ["5", "6"]
    manifest = AtomicCheckpointIO().root(root).read_manifest(read_pointer(Backend("local", root)).latest.commit)
    assert manifest.sharded.world_size == 1
    step4 = load_full(f"{root}/epoch=0-step=4.ckpt")
    assert step4["global_step"] == 4 and step4["state_dict"].keys() == load_full(root)["state_dict"].keys()


@pytest.mark.slow
def test_sharded_checkpoints_on_s3(s3_backend, tmp_path):
    options = {**BASE, "max_steps": 4, "storage_options": s3_backend.storage_options}
    launch(s3_backend.root, tmp_path / "s3", options, env={"AWS_ENDPOINT_URL": s3_backend.endpoint})
    pointer = read_pointer(s3_backend)
    assert pointer.latest.step == 4
    manifest = AtomicCheckpointIO(storage_options=s3_backend.storage_options).root(s3_backend.root).read_manifest(
        pointer.latest.commit)
    assert manifest.sharded.world_size == 2 and all(manifest.sharded.ranks)
    final = torch.load(str(tmp_path / "s3") + ".weights")
    consolidated = load_full(s3_backend.root, s3_backend.storage_options)
    assert all(torch.equal(consolidated["state_dict"][k], final[k]) for k in final)


class _Payload:
    """Unpickling this runs ``os.mkdir(path)``: a harmless stand-in for code a hostile checkpoint would run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.path,))


def test_sharded_metadata_never_unpickles_more_than_dcp_metadata(local_backend, tmp_path, make_io):
    from lightning_resilient.io._sealed import seal
    from lightning_resilient.io.manifest import chunk_digests, object_digest

    io = make_io(local_backend)
    root, name = root_and_name(io, local_backend.url("a.ckpt"))
    entry = save_sharded(sharded_state(), root, name, rest={"global_step": 1}, no_dist=True)
    marker = tmp_path / "code-ran"
    payload = pickle.dumps(_Payload(marker))
    # A manifest-valid checkpoint whose metadata object is the payload: sizes and digests all match.
    path = local_backend.path(f"{entry.commit}/{MANIFEST_NAME}")
    body = json.loads(local_backend.fs().cat_file(path))["body"]
    meta = body["objects"][body["sharded"]["metadata"]]
    local_backend.fs().pipe_file(local_backend.path(meta["path"]), payload)
    meta.update(size=len(payload), chunks=chunk_digests([memoryview(payload)], body["chunk_size"]))
    meta["digest"] = object_digest(meta["chunks"])
    local_backend.fs().pipe_file(path, seal(body))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to unpickle posix\.mkdir"):
        load_full(local_backend.root)
    with pytest.raises(pickle.UnpicklingError, match="not one of DCP's metadata types"):
        load_sharded(zeros_like(sharded_state()), root, entry.commit, no_dist=True)
    assert not marker.exists()


def test_sharded_non_tensor_items_load_as_weights_only_unless_asked_otherwise(local_backend, tmp_path, make_io):
    io = make_io(local_backend)
    root, name = root_and_name(io, local_backend.url("a.ckpt"))
    marker = tmp_path / "code-ran"
    entry = save_sharded({"extra": {"item": _Payload(marker)}}, root, name, no_dist=True)
    target: dict[str, Any] = {"extra": {"item": None}}
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_sharded(target, root, entry.commit, no_dist=True)  # weights_only by default, as a full load
    assert not marker.exists()
    reader = AtomicStorageReader(root, entry.commit, weights_only=False)  # the caller trusts this checkpoint
    load_sharded(target, root, entry.commit, reader=reader, no_dist=True)
    assert marker.exists()  # DCP's planner unpickled it: the check above is what stood in the way
