"""A model-based randomized test of the storage protocol, on local disk and moto S3.

Several jobs write the same root, some of them at once: the current writer; old jobs still running after a newer one
claimed the root (fenced: every save must raise and never move the pointer); new jobs that resume the latest, roll back
to an older commit (leaving an abandoned branch), go back to an abandoned branch, resume a stray (a manifest its writer
never got into the pointer) or start fresh; forks, which resume a commit of the root into a second root; jobs that save
in the background (``AsyncSaver``) or through a node-local tier (``TieredRoot``, persisting every Nth save); every other
synchronous, background or tier job (and subprocess writer) saves incrementally (``dedup``), so commits reference
objects of other commits, across steps and, from a resumed job's first save, across writer epochs. A save can be paused
at random instants (before its n-th object, before or after its manifest, before its pointer write), and while it is
paused other operations run: readers load the root and commit URLs, ``gc`` runs at grace 0 (plain, with ``--abandoned``
or as ``gc --keep-last``), a new job claims the root, the pointer is deleted, objects and manifests of other commits are
damaged. A paused job is then released (a stalled writer waking up after it was fenced and its upload collected), or
never is (it died there). Bursts of damage to the newest checkpoints make resumes fall back deep into the lineage,
across abandoned branches. The root is sometimes deleted and a new run started on it while its old jobs still run (they
must be refused). The slow variant also SIGKILLs real writer processes at random instants of their saves.

The pauses are instance attributes on the job's own store object (``Gate``), as other tests here replace a store
method; nothing else of the store or the package is replaced.

The model (``protocol_model.py``) knows every commit and its lineage; after every operation the test checks against
the store that

(1) nothing that must be kept is gone: what the writing job resumed from, every commit the catalog named that no
    retention rule may have dropped (abandoned branches included, until ``gc --abandoned``), every stray of the
    lineage; every commit the pointer names is whole;
(2) no stale writer moves the pointer: the pointer's writer epoch is the newest claim's, its latest is that job's
    newest state, and a fenced save raises and leaves the pointer's bytes as they were;
(3) no load returns another lineage: ``find_latest_checkpoint`` and a load of the root URL give the newest intact
    checkpoint of the current lineage, a load of a commit URL falls back only along the lineage below that commit;
(4) loads are bit-exact: what loads equals, tensor for tensor, what that job saved at that step;
(5) a manifest never names an object that is gone (checked at every pause of a save after its manifest, and when a
    refused save ends; a fenced writer's manifest may do so for a moment, until it learns it is fenced).

The directed tests at the end each reproduce one rule the random run reaches only rarely (or one protocol gap it
found: a fixed one as a plain test, the one left as a strict xfail). ``tests/io/mutations.py`` shows which of these
tests catch nineteen one-line breakages of the protocol's safety rules (its last table: ``docs/development.md``).

Seeds in the suite: ``SEEDS`` per store (and ``KILL_SEEDS`` for the variant with SIGKILLs), each its own test item,
sized so that the randomized items together cost about a minute of one core. ``pytest --soak`` runs
``SOAK_OPERATIONS`` operations per store with a new seed; ``--protocol-seed N`` replays seed N. A failure names the
seed, the replay command and the last 25 operations (``PROTOCOL_TAIL=N`` in the environment: the last N). An
in-process run replays exactly (no choice depends on a folder name, which holds a time and a random id, or on a
timing); one with SIGKILLs kills at other instants each time.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_resilient import (
    AtomicCheckpointIO,
    CheckpointCorruptedError,
    CheckpointError,
    StaleWriterError,
    find_latest_checkpoint,
)
from lightning_resilient.io.async_save import AsyncSaver, SaveStats
from lightning_resilient.io.catalog import normalize, reader
from lightning_resilient.io.folders import writer_epoch_of
from lightning_resilient.io.lineage import ORIGINS_DIR
from lightning_resilient.io.local_tier import local_tier_url
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import POINTER_NAME, Entry, Pointer
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.root import CheckpointRoot, RootSettings
from lightning_resilient.io.store import open_store
from lightning_resilient.io.tiered import TieredRoot
from tests import procs

from .protocol_model import Commit, Job, RootModel
from .protocol_worker import content
from .test_crash import _env

WORKER = Path(__file__).with_name("protocol_worker.py")
KEEP_LAST = 3  # the main root's keep_last (the fork root keeps everything)
LOCAL_KEEP = 2
# Seeds the suite runs, per store, each its own test item (a few seconds on local disk, more on moto S3), and those
# of the variant with SIGKILLed writer processes (slow).
SEEDS = {"local": [20261203, 7, 1234567, 22, 33], "s3": [20261203]}
OPERATIONS = {"local": 150, "s3": 60}
KILL_SEEDS = {"local": [20261203], "s3": [20261203]}
KILL_OPERATIONS = {"local": 60, "s3": 40}
SOAK_OPERATIONS = {"local": 3000, "s3": 1200}
SETTINGS: dict[str, Any] = {"shard_size": 4096, "chunk_size": 2048, "orphan_grace_seconds": 0.0,
                            "fallback_on_corruption": True}
WAIT = 60.0  # seconds a paused or saving job may take to reach its next instant (a hang fails the run)

# A protocol gap the model finds gets a directed test at the end of this module; while it is open, a strict xfail
# naming it (and a tolerance in the randomized run, marked KNOWN), both removed with the fix. None is open.


class Died(BaseException):
    """Raised in a job paused forever (it died there) when the run ends, so its threads unwind."""


class Gate:
    """Pauses one job's store at chosen instants of a save: before its n-th object write (``object:n``), before
    its manifest write (``manifest``), after it (``written``: at the next pointer read, or at the pointer write when
    the job writes it without reading it first: against the version of its own last write), before the pointer
    write (``pointer``). Installed on the job's own store object (its other calls, and every other job's, pass)."""

    def __init__(self, store: Any, cond: threading.Condition) -> None:
        self.cond = cond
        self.points: list[str] = []
        self.at: str | None = None  # where it is paused now
        self.folders: list[str] = []  # the commit folders the save in flight wrote into, in order
        self.objects = 0
        self._go = False
        self.died = False
        self.wrote_manifest = False  # the save in flight wrote its manifest
        self.read_since = False  # it read the pointer since it wrote its manifest
        write_pieces, write_versioned, read_versioned = store.write_pieces, store.write_versioned, store.read_versioned

        def gated_write_pieces(rel: str, pieces: Any) -> None:
            manifest = False
            if not rel.startswith(".") and writer_epoch_of(rel.rsplit("/", 1)[0]) is not None:
                folder, leaf = rel.rsplit("/", 1)
                manifest = leaf == MANIFEST_NAME
                if manifest:
                    self._pause("manifest", folder)
                else:
                    self._pause(f"object:{self.objects}", folder)
                    self.objects += 1
            write_pieces(rel, pieces)
            if manifest:
                self.wrote_manifest, self.read_since = True, False

        def gated_read_versioned(rel: str) -> Any:
            if rel == POINTER_NAME and self.wrote_manifest:
                self.read_since = True
                self._pause("written", None)
            return read_versioned(rel)

        def gated_write_versioned(rel: str, data: bytes, expected: str | None) -> str | None:
            if rel == POINTER_NAME:
                if self.wrote_manifest and not self.read_since:
                    self.read_since = True
                    self._pause("written", None)
                self._pause("pointer", None)
            return write_versioned(rel, data, expected)  # type: ignore[no-any-return]

        store.write_pieces = gated_write_pieces
        store.write_versioned = gated_write_versioned
        store.read_versioned = gated_read_versioned

    def arm(self, points: list[str]) -> None:
        with self.cond:
            self.points, self.objects, self.folders, self.wrote_manifest = list(points), 0, [], False
            self.read_since = False

    def _pause(self, point: str, folder: str | None) -> None:
        with self.cond:
            if folder is not None and folder not in self.folders:
                self.folders.append(folder)
            if self.died:
                raise Died()
            if not self.points or self.points[0] != point:
                return
            self.points.pop(0)
            self.at = point
            self.cond.notify_all()
            while not self._go and not self.died:
                self.cond.wait()
            self._go = False
            if self.died:
                raise Died()

    def release(self) -> None:
        with self.cond:
            self.at, self._go = None, True
            self.cond.notify_all()

    def kill(self) -> None:
        with self.cond:
            self.died = True
            self.cond.notify_all()


@dataclass(eq=False)
class Saving:
    """A save in flight: one job's names at one step, in a thread of its own (sync) or in its saver's (async)."""

    job: Job
    step: int
    names: list[str]
    entries: list[Entry] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False
    stats: list[SaveStats] = field(default_factory=list)


@dataclass(eq=False)
class Handle:
    """The live objects of one in-process job."""

    root: CheckpointRoot  # its durable root
    gate: Gate
    saver: AsyncSaver | None = None
    tiers: TieredRoot | None = None
    saving: Saving | None = None
    worker: Worker | None = None  # a subprocess job (kind "proc")


class RunFailed(AssertionError):
    pass


class Run:
    """One randomized run: the jobs, the model, the operations and the checks."""

    def __init__(self, backend: Any, seed: int, operations: int, folder: Path, *, kills: int = 0,
                 replay: str = "") -> None:
        self.backend, self.seed, self.operations = backend, seed, operations
        self.replay = replay or f"pytest tests/io/test_protocol_random.py -k {backend.kind} --protocol-seed {seed}"
        self.rng = random.Random(seed)
        self.options = backend.storage_options
        fork_url = f"{backend.root}-fork"
        self.main = RootModel("main", normalize(backend.root), KEEP_LAST)
        self.fork = RootModel("fork", normalize(fork_url), None)
        self.roots = [self.main, self.fork]
        self.node = str(folder / "node")  # the node-local tier folder of every tier job (one node)
        self.folder = folder
        self.kills = kills
        self.cond = threading.Condition()
        self.handles: dict[Job, Handle] = {}
        self.frozen: dict[str, torch.Tensor] = {}  # each dedup job's frozen tensor
        self.jobs: list[Job] = []
        self.observer = {m.label: reader(m.url, self.options) for m in self.roots}
        self.reader_io = AtomicCheckpointIO(storage_options=self.options, claim_on_load=False, node_cache=False,
                                            retry_base_delay=0.01)
        self.tier_io = AtomicCheckpointIO(storage_options=self.options, claim_on_load=False, node_cache=False,
                                          retry_base_delay=0.01, local_tier=self.node)
        self.log: list[str] = []
        self.counts: dict[str, int] = {}
        self.zygote: Zygote | None = None
        self.save_seconds = [0.3]
        # Jobs paused before their manifest write (after the check that their objects are stored) while a newer job
        # claimed the root: gc may delete their objects before the manifest names them (see note in check_paused).
        self.gap: set[Job] = set()

    # -- plumbing ------------------------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        self.log.append(f"{len(self.log)}: {text}")

    def fail(self, message: str) -> None:
        raise RunFailed(message)

    def expect(self, ok: bool, message: str, model: RootModel | None = None) -> None:
        """Fail the run with ``message`` (and the state of ``model``) unless ``ok``."""
        if not ok:
            self.fail(f"{message}; {model.describe()}" if model is not None else message)

    def pointer(self, model: RootModel) -> Pointer | None:
        pointer, _ = self.observer[model.label].read_pointer()
        return pointer

    def raw_pointer(self, model: RootModel) -> bytes | None:
        got = self.observer[model.label].store.read_versioned(POINTER_NAME)
        return got[0] if got is not None else None

    def pointer_or_scan(self, model: RootModel) -> Pointer | None:
        """The pointer, or the one a scan of the manifests rebuilds when it is lost (what resumes then read)."""
        pointer = self.pointer(model)
        if pointer is None:
            scan = self.observer[model.label].scan()
            pointer = scan.pointer() if scan.manifests else None
        return pointer

    def store(self, model: RootModel) -> Any:
        return self.observer[model.label].store

    def sizes(self, model: RootModel, cache: dict[str, dict[str, int]]) -> dict[str, int]:
        """Every object of ``model``'s root (root-relative path -> size), listed once per ``cache`` (one check): a
        recursive listing costs one request on S3, where a listing per folder costs one each."""
        if model.label not in cache:
            store = self.store(model)
            store.fs.invalidate_cache(store.root_path)
            try:
                found = store.fs.find(store.root_path, detail=True)
            except FileNotFoundError:
                found = {}
            start = len(store.root_path.rstrip("/")) + 1
            cache[model.label] = {str(name)[start:]: int(info["size"]) for name, info in found.items()
                                  if info.get("type", "file") == "file"}
        return cache[model.label]

    def stored(self, model: RootModel, path: str, cache: dict[str, dict[str, int]]) -> int | None:
        """The size of object ``path`` as the listing in ``cache`` has it (None: it is gone)."""
        return self.sizes(model, cache).get(path)

    def has_manifest(self, model: RootModel, folder: str, cache: dict[str, dict[str, int]] | None = None) -> bool:
        path = f"{folder}/{MANIFEST_NAME}"
        if cache is not None:
            return self.stored(model, path, cache) is not None
        return bool(self.store(model).exists(path))

    def objects_of(self, model: RootModel, folder: str) -> dict[str, int]:
        manifest = self.observer[model.label].read_manifest(folder)
        return {o.path: o.size for o in manifest.objects}

    def open_job(self, model: RootModel, job: Job) -> Handle:
        store = open_store(model.url, self.options, RetryPolicy(3, 0.01, 0.1))
        # Every other synchronous, async or tier job saves incrementally (dedup), with no random draw.
        dedup = job.kind in ("sync", "async", "tier") and int(job.tag.lstrip("j") or 0) % 2 == 0
        settings = RootSettings(keep_last=model.keep, max_concurrency=1, dedup=dedup, **SETTINGS)
        root = CheckpointRoot(store, settings, lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
        handle = Handle(root, Gate(store, self.cond))
        if job.kind == "async":
            handle.saver = AsyncSaver(pin_memory=False)
        elif job.kind == "tier":
            local_store = open_store(local_tier_url(self.node, model.url), None, RetryPolicy(3, 0.01, 0.1))
            local = CheckpointRoot(local_store, RootSettings(keep_last=LOCAL_KEEP, max_concurrency=1, dedup=dedup,
                                                             **SETTINGS),
                                   lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
            handle.tiers = TieredRoot(root, local, persist_every=self.rng.choice([1, 1, 2, 3]),
                                      executor=lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
        self.handles[job] = handle
        return handle

    def busy(self, job: Job) -> bool:
        handle = self.handles.get(job)
        return job.dead or (handle is not None and handle.saving is not None)

    def register(self, model: RootModel, job: Job, entry_or_folder: Entry | str, *, stray: bool) -> Commit:
        folder = entry_or_folder if isinstance(entry_or_folder, str) else entry_or_folder.commit
        commit = model.commits.get(folder)
        if commit is None:
            manifest = self.observer[model.label].read_manifest(folder)
            model.seq += 1
            commit = Commit(folder, manifest.name, manifest.step, job, model.seq,
                            {o.path: o.size for o in manifest.objects}, origin_record=manifest.origin)
            if any(o.path.rsplit("/", 1)[0] != folder for o in manifest.objects):
                # (A commit that references objects of another: dedup, or a save of the same step.)
                self.counts["shares_objects"] = self.counts.get("shares_objects", 0) + 1
                others = {o.path.rsplit("/", 1)[0] for o in manifest.objects} - {folder}
                with contextlib.suppress(Exception):  # (a referenced manifest the run damaged: not counted)
                    if manifest.step not in {self.observer[model.label].read_manifest(f).step for f in others}:
                        self.counts["shares_across_steps"] = self.counts.get("shares_across_steps", 0) + 1
            model.commits[folder] = commit
        commit.stray = stray and not commit.cataloged
        if not stray:
            commit.stray, commit.cataloged, commit.durable = False, True, True
            self.committed(model, commit)
        return commit

    def register_stray(self, model: RootModel, job: Job, folder: str) -> Commit:
        """A manifest ``job``'s save wrote that the pointer does not name (yet, or ever)."""
        stray = self.register(model, job, folder, stray=True)
        if job in self.gap:  # (a save in flight: gc may have collected what its manifest names; see check_paused)
            cache: dict[str, dict[str, int]] = {}
            model.damaged.update(p for p, size in stray.objects.items()
                                 if self.stored(model, p, cache) != size)
        return stray

    def committed(self, model: RootModel, commit: Commit) -> None:
        """The pointer moved to ``commit``: its name's older commit leaves the catalog, retention runs."""
        model.replaced(commit)
        if model.keep is not None:
            model.retain(model.keep)

    # -- the checks ----------------------------------------------------------------------------------------------
    def check(self) -> None:
        cache: dict[str, dict[str, int]] = {}
        for model in self.roots:
            self.check_root(model, cache)
        if any(j.kind == "tier" for j in self.main.claimed()):
            self.check_tiered_latest()

    def check_root(self, model: RootModel, cache: dict[str, dict[str, int]]) -> None:
        pointer = self.pointer(model)
        catalog = {e.commit for e in pointer.checkpoints.values()} if pointer is not None else None
        if model.lost and pointer is not None:
            model.rebuilt()
            model.lost = False
        for folder in catalog or ():
            if folder in model.commits:
                model.commits[folder].cataloged = True
                model.commits[folder].stray = False
        model.settle(catalog)
        head = model.head()
        if pointer is not None and head is not None:
            # (2) no stale writer moved it
            self.expect(pointer.writer_epoch == head.epoch,
                        f"{model.label}: pointer writer epoch {pointer.writer_epoch}, but the newest claim is"
                        f" {head}", model)
            latest = model.expected_latest({e.commit for e in pointer.entries()})
            got = (pointer.latest.writer_epoch, pointer.latest.step) if pointer.latest is not None else None
            self.expect(got == (latest.state if latest is not None else None),
                        f"{model.label}: pointer latest {pointer.latest and pointer.latest.commit} at {got},"
                        f" expected {latest}", model)
        if pointer is not None:
            for entry in pointer.entries():
                commit = model.commits.get(entry.commit)
                self.expect(commit is not None,
                            f"{model.label}: the pointer names {entry.commit}, which no job committed", model)
        # (1) nothing that must be kept is gone
        names = {e.commit for e in pointer.entries()} if pointer is not None else None
        for commit in model.must_keep():
            if names is not None and commit.cataloged and not commit.may_go:
                self.expect(commit.folder in names,
                            f"{model.label}: {commit} left the catalog, and no rule drops it", model)
            for path, size in [*commit.objects.items(), (f"{commit.folder}/{MANIFEST_NAME}", None)]:
                stored = self.stored(model, path, cache)
                self.expect(stored is not None and (size is None or stored == size),
                            f"{model.label}: {path} of {commit} is gone ({stored})", model)
        # (3) the resume target
        self.check_latest(model, pointer, cache)

    def candidates(self, model: RootModel, pointer: Pointer | None, lineage: list[Commit],
                   cache: dict[str, dict[str, int]]) -> list[Commit]:
        """Of ``lineage``, what the root's catalog offers: the pointer's entries (or, without one, every intact
        manifest, as a scan finds them)."""
        if pointer is None:
            return [c for c in lineage if c.durable and not c.manifest_damaged
                    and self.has_manifest(model, c.folder, cache)]
        names = {e.commit for e in pointer.entries()}
        return [c for c in lineage if c.folder in names]

    def check_latest(self, model: RootModel, pointer: Pointer | None, cache: dict[str, dict[str, int]]) -> str | None:
        if model.head() is None:
            return None
        candidates = self.candidates(model, pointer, model.lineage(), cache)
        readable = [c for c in candidates if not c.manifest_damaged]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = find_latest_checkpoint(model.url, self.options)
        except CheckpointCorruptedError as exc:
            damaged = candidates or (pointer is None and any(
                c.manifest_damaged and self.has_manifest(model, c.folder, cache) for c in model.commits.values()))
            self.expect(not readable and bool(damaged),
                        f"{model.label}: find_latest_checkpoint raised {exc!r}, expected {readable[:1]}", model)
            return None
        want = f"{model.url}/{readable[0].folder}" if readable else None
        self.expect(got == want, f"{model.label}: find_latest_checkpoint gave {got}, expected {want}", model)
        return got

    def check_load(self, model: RootModel, target: Commit | None) -> Commit | None:
        """Load the root URL (``target`` None) or ``target``'s commit URL read-only, as a resume or an evaluation
        does; check it loads what the protocol promises, bit for bit. Returns the commit loaded (None when no load
        is possible, and none happened)."""
        if model.head() is None and target is None:
            return None
        pointer = self.pointer_or_scan(model)  # (a lost pointer: the load reads the root by scanning)
        entries = {e.commit for e in pointer.entries()} if pointer is not None else set()
        error: type[BaseException] | None = None
        if target is None:
            candidates = [c for c in model.lineage() if c.folder in entries]
            url = model.url
            if not candidates:
                error = FileNotFoundError
        elif target.folder in entries or (target.durable and self.has_manifest(model, target.folder)):
            if target.folder not in entries and target.manifest_damaged:
                error = CheckpointCorruptedError
            candidates = [target, *(c for c in model.below(target) if c.folder in entries)]
            url = f"{model.url}/{target.folder}"
        else:
            self.expect(target.may_go or not target.durable,
                        f"{model.label}: {target} is gone", model)
            candidates, url, error = [], f"{model.url}/{target.folder}", FileNotFoundError
        cache: dict[str, dict[str, int]] = {}
        want = next((c for c in candidates if model.intact(c) and (not c.may_go or self.whole(model, c, cache))),
                    None)
        if error is None and want is None:
            error = CheckpointCorruptedError
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = self.reader_io.load_checkpoint(url)
        except (CheckpointCorruptedError, FileNotFoundError) as exc:
            self.expect(error is not None and isinstance(exc, error),
                        f"{model.label}: loading {url} raised {exc!r}, expected {want or error}", model)
            return None
        assert self.reader_io.last_load is not None
        folder = self.reader_io.last_load.commit
        got = model.commits.get(folder)
        self.expect(error is None and got is want,
                    f"{model.label}: loading {url} loaded {got or folder}, expected {want or error}; candidates"
                    f" {candidates}", model)
        assert got is not None
        self.check_bits(loaded, got)
        return got

    def whole(self, model: RootModel, commit: Commit, cache: dict[str, dict[str, int]]) -> bool:
        """Whether every object ``commit`` names is stored with its size (one that may be gone may be partly gone)."""
        return all(self.stored(model, p, cache) == size for p, size in commit.objects.items())

    def check_bits(self, loaded: dict[str, Any], commit: Commit) -> None:
        """(4) What loaded is, tensor for tensor, what ``commit``'s job saved at its step."""
        expected = content(commit.job.tag, commit.step)
        self.expect(loaded["job"] == commit.job.tag and loaded["global_step"] == commit.step,
                    f"loaded job {loaded['job']} step {loaded['global_step']}, expected {commit}")
        for key, tensor in expected["state_dict"].items():
            got = loaded["state_dict"][key]
            self.expect(got.dtype == tensor.dtype and torch.equal(got, tensor), f"{key} of {commit} differs")

    def check_tiered_latest(self) -> None:
        """With a local tier on this node: the newest checkpoint of the durable lineage in either tier."""
        model = self.main
        pointer = self.pointer(model)
        durable = {e.commit for e in pointer.entries()} if pointer is not None else set()
        local: set[str] = set()
        local_root = reader(local_tier_url(self.node, model.url))
        record = local_root.store.exists(".lightning_resilient/tier.json") and json.loads(
            local_root.store.read(".lightning_resilient/tier.json"))
        if pointer is not None and record and record.get("root_id") == pointer.root_id and pointer.root_id:
            with contextlib.suppress(CheckpointError):
                local_pointer, _ = local_root.read_pointer()
                if local_pointer is not None:
                    local = {e.commit for e in local_pointer.entries() if e.writer_epoch in pointer.origins}
        if pointer is None:
            return  # resumes read the durable tier alone (checked by check_latest)
        line = model.lineage()
        candidates = [c for c in line if c.folder in durable or c.folder in local]
        readable = [c for c in candidates
                    if not c.manifest_damaged or local_root.store.exists(f"{c.folder}/{MANIFEST_NAME}")]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                got = find_latest_checkpoint(model.url, self.options, local_tier=self.node)
            except CheckpointCorruptedError:
                got = "corrupted"
        if not readable:
            return  # falls back to the durable tier's answer (checked by check_latest)
        want = f"{model.url}/{readable[0].folder}"
        self.expect(got == want, f"tiered find_latest_checkpoint gave {got}, expected {want} of {candidates}", model)

    def check_paused(self, model: RootModel, job: Job) -> None:
        """(5) At a pause before the pointer move: the save's manifest names only objects that are stored (it was
        written after they were checked)."""
        gate = self.handles[job].gate
        folder = gate.folders[-1] if gate.folders else None
        known = model.commits.get(folder) if folder is not None else None
        if folder is None or not self.has_manifest(model, folder) or job in self.gap or (
                known is not None and known.manifest_damaged):
            # gc ran while this job, fenced, was paused between its stored-objects check and its manifest write: its
            # manifest may name what gc deleted until the job learns it is fenced and deletes that manifest again
            # (checked when its save ends: test_a_manifest_never_names_an_object_gc_collected).
            return
        objects = self.objects_of(model, folder)
        cache: dict[str, dict[str, int]] = {}
        for path, size in objects.items():
            stored = self.stored(model, path, cache)
            self.expect(stored == size, f"{model.label}: {job}'s manifest in {folder} names {path},"
                                        f" which is {'gone' if stored is None else 'of another size'}", model)

    # -- jobs ----------------------------------------------------------------------------------------------------
    def start_job(self, model: RootModel, kind: str, target: str | Commit | None, *, fork: bool = False) -> Job:
        """A new job on ``model``: resume ``"latest"``, a commit, or nothing (a fresh start); claim the root."""
        previous = model.head()
        source: Commit | None = None
        origin: Commit | None = None
        elsewhere = False
        if fork:
            assert isinstance(target, Commit)
            source = self.check_load(self.main, target)
        elif kind == "tier" and target == "latest":
            origin, elsewhere = self.tier_resume(model)
        elif target == "latest":
            origin = self.check_load(model, None) if model.head() is not None else None
        elif isinstance(target, Commit):
            origin = self.check_load(model, target)
        step = (source or origin).step if (source or origin) else 0
        job = Job(f"j{len(self.jobs)}", model, origin, kind, model.incarnation, step=step, source=source,
                  elsewhere=elsewhere)
        self.jobs.append(job)
        handle = self.open_job(model, job)
        if origin is not None:
            # (What the load read: the local tier's copy, for a tier job, when the durable manifest is damaged.)
            local = elsewhere or (kind == "tier" and target == "latest" and origin.manifest_damaged)
            holder = self.observer[model.label] if not local else reader(local_tier_url(self.node, model.url))
            manifest = holder.read_manifest(origin.folder)
            handle.root.resumed(Entry.from_manifest(manifest), elsewhere=elsewhere)
            if not local:
                handle.root.writer.remember_loaded(manifest)  # as the plugin's load does: a dedup job references it
        catalog = self.catalog(model)
        if model.lost:  # the claim rebuilds the pointer first, along the lineage before it
            model.rebuilt()
            model.lost = False
        epoch = handle.root.claim()
        earlier = [j.epoch for j in model.claimed() if j.epoch is not None]
        self.expect(epoch > max(earlier, default=0), f"{job} claimed epoch {epoch} after {earlier}")
        job.epoch = epoch
        model.jobs.append(job)
        model.claimed_by(job, previous, catalog)
        self.note(f"{job} {kind} claims {model.label} from {source or origin or 'nothing'}"
                  + (f" (fork of {source})" if fork else "") + (" elsewhere" if elsewhere else ""))
        return job

    def catalog(self, model: RootModel) -> set[str] | None:
        pointer = self.pointer(model)
        return {e.commit for e in pointer.checkpoints.values()} if pointer is not None else None

    def tier_resume(self, model: RootModel) -> tuple[Commit | None, bool]:
        """A tier job resumes the newest checkpoint of the lineage in either tier of this node."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                url = find_latest_checkpoint(model.url, self.options, local_tier=self.node)
            except CheckpointCorruptedError:
                return None, False
            if url is None:
                return None, False
            try:
                loaded = self.tier_io.load_checkpoint(url)
            except CheckpointCorruptedError:
                return None, False
        assert self.tier_io.last_load is not None
        commit = model.commits.get(self.tier_io.last_load.commit)
        self.expect(commit is not None and model.in_lineage(commit),
                    f"a tiered resume loaded {self.tier_io.last_load.commit}, outside the lineage", model)
        assert commit is not None
        self.check_bits(loaded, commit)
        elsewhere = not self.has_manifest(model, commit.folder)
        return commit, elsewhere

    def stop(self, job: Job, *, graceful: bool) -> None:
        """``job`` ends (it is not killed mid-operation): a tier job persists its newest save, as fit's end does."""
        handle = self.handles[job]
        job.stopped = True
        if self.busy(job):
            return  # its save in flight ends as it will (the run unwinds it at the end)
        if handle.tiers is not None and graceful:
            try:
                handle.tiers.close()
            except CheckpointError:
                self.expect(job.root.fenced(job) or job.incarnation != job.root.incarnation,
                            f"{job}'s final persist failed though it writes the root")
            self.tier_persisted(job)
        if handle.saver is not None:
            with contextlib.suppress(CheckpointError):
                handle.saver.close()

    # -- saves ---------------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        r = self.rng.random()
        return ["top"] if r < 0.5 else ["last"] if r < 0.7 else ["top", "last"]

    def begin_save(self, job: Job, names: list[str], points: list[str]) -> Saving:
        handle = self.handles[job]
        step = job.step + 1
        files = [f"step={step}.ckpt" if n == "top" else "last.ckpt" for n in names]
        saving = Saving(job, step, files)
        handle.saving = saving
        handle.gate.arm(points)
        checkpoint = content(job.tag, step)
        if handle.root.settings.dedup:
            # The same frozen tensor object at every save of the job: unchanged by identity and version counter (the
            # bytes are content's, so a load still compares with content(tag, step)).
            checkpoint["state_dict"]["frozen"] = self.frozen.setdefault(job.tag, checkpoint["state_dict"]["frozen"])
        if handle.saver is not None:
            for name in files:
                stats = SaveStats(name=name, step=step)
                saving.stats.append(stats)
                try:
                    handle.saver.save(handle.root, checkpoint, name, stats)
                except BaseException as exc:  # an earlier background failure, raised by this save
                    saving.error = exc
                    break
        else:
            def body() -> None:
                try:
                    for name in files:
                        if handle.tiers is not None:
                            saving.entries.append(handle.tiers.commit(handle.tiers.prepare(checkpoint, name)))
                        else:
                            saving.entries.append(handle.root.save(checkpoint, name))
                except BaseException as exc:
                    saving.error = exc
                finally:
                    with self.cond:
                        saving.done = True
                        self.cond.notify_all()

            threading.Thread(target=body, name=f"model-save-{job.tag}", daemon=True).start()
        return saving

    def settled(self, job: Job) -> bool:
        """Whether ``job``'s save in flight is paused or has ended."""
        handle = self.handles[job]
        saving = handle.saving
        assert saving is not None
        if handle.gate.at is not None:
            return True
        if handle.saver is not None:
            return saving.error is not None or all(s.upload is not None for s in saving.stats)
        return saving.done

    def wait(self, job: Job) -> None:
        deadline = time.monotonic() + WAIT
        with self.cond:
            while not self.settled(job):
                self.expect(time.monotonic() < deadline, f"{job}'s save neither paused nor ended in {WAIT} s")
                self.cond.wait(0.01)

    def end_save(self, job: Job, before: bytes | None) -> None:
        """``job``'s save has ended: it committed (if it may write the root) or raised, leaving the pointer's bytes
        as they were (``before``)."""
        handle = self.handles[job]
        saving = handle.saving
        assert saving is not None and handle.gate.at is None
        handle.saving = None
        folders = list(handle.gate.folders)
        handle.gate.arm([])
        model = job.root
        if handle.saver is not None and saving.error is None:
            handle.saver.wait()
            try:
                handle.saver.raise_error()
            except BaseException as exc:
                saving.error = exc
            else:
                pointer = self.pointer(model)
                assert pointer is not None
                saving.entries = [pointer.checkpoints[name] for name in saving.names]
        if handle.tiers is not None:
            # (Also after a save that raised: it may have raised an earlier persist's error after committing locally
            # and queuing its own persist, which must not run on beside the operations and checks that follow.)
            handle.tiers.wait()
            if saving.error is None:
                try:
                    handle.tiers.raise_error()
                except BaseException as exc:
                    saving.error = exc
        writes = not model.fenced(job) and job.incarnation == model.incarnation
        if saving.error is not None:
            # A fenced writer learns it from the pointer: StaleWriterError. Only with no pointer to read (it was lost)
            # may it learn it otherwise (its objects collected: "missing just before ... was to be committed").
            refusal = StaleWriterError if before is not None else CheckpointError
            self.expect(not writes and isinstance(saving.error, refusal),
                        f"{job}'s save of step {saving.step} failed: {_trace(saving.error)}", model)
            self.expect(self.raw_pointer(model) == before or handle.tiers is not None,
                        f"{job}, fenced, failed its save but moved the pointer")
            cache: dict[str, dict[str, int]] = {}
            for folder in folders:
                if self.has_manifest(model, folder, cache):
                    # Refused after its manifest: a stray, kept while the pointer may name it (it is missing, or a
                    # job resumed it), else discarded by its writer; never naming an object that is gone (5).
                    known = model.commits.get(folder)
                    damaged = known is not None and known.manifest_damaged  # (then no load reads it, nor may we)
                    missing = [] if damaged else [p for p, size in self.objects_of(model, folder).items()
                                                  if self.stored(model, p, cache) != size]
                    self.expect(not missing, f"{job}, refused, left the manifest of {folder}, which names {missing}"
                                             " (gone)", model)
                    self.register_stray(model, job, folder)
                elif folder in model.commits:
                    del model.commits[folder]
            if handle.tiers is not None:
                self.tier_local(job, saving.entries)
            self.note(f"{job} save {saving.names} step {saving.step}: refused ({type(saving.error).__name__})")
            return
        self.expect(writes or (handle.tiers is not None and self.raw_pointer(model) == before),
                    f"{job} committed {[e.commit for e in saving.entries]} though {model.head()} claimed the"
                    f" root after it", model)
        job.step = saving.step
        if handle.tiers is not None:
            self.tier_local(job, saving.entries)
            self.tier_persisted(job)
        else:
            for entry in saving.entries:
                self.register(model, job, entry, stray=False)
        self.note(f"{job} saved {saving.names} step {saving.step}")

    def tier_local(self, job: Job, entries: list[Entry]) -> None:
        model = job.root
        for entry in entries:
            commit = model.commits.get(entry.commit)
            if commit is None:
                model.seq += 1
                commit = Commit(entry.commit, entry.name, entry.step, job, model.seq, durable=False, local=True)
                model.commits[entry.commit] = commit

    def tier_persisted(self, job: Job) -> None:
        """Which of ``job``'s local commits its persists published to the durable root."""
        model = job.root
        for commit in [c for c in model.commits.values() if c.job is job and not c.durable]:
            if self.has_manifest(model, commit.folder):
                commit.objects = self.objects_of(model, commit.folder)
                commit.durable, commit.cataloged = True, True
                self.committed(model, commit)

    def save(self, job: Job, names: list[str] | None = None) -> None:
        before = self.raw_pointer(job.root)
        self.begin_save(job, names or self.names(), [])
        self.wait(job)
        self.end_save(job, before)

    # -- operations ----------------------------------------------------------------------------------------------
    def writer(self, model: RootModel) -> Job | None:
        head = model.head()
        return head if head is not None and not self.busy(head) and not head.stopped else None

    def op_save(self) -> None:
        model = self.fork if self.fork.head() is not None and self.rng.random() < 0.15 else self.main
        job = self.writer(model)
        if job is None:
            self.op_new_job()
            return
        self.save(job)

    def op_paused_save(self) -> None:
        """The writing job's save, paused at a random instant; other operations run meanwhile."""
        job = self.writer(self.main)
        if job is None or job.kind == "tier":
            self.op_save()
            return
        # The instants in save order: before the n-th object, before the manifest (its objects checked), after the
        # manifest (the pointer not read yet), before the pointer write. Paused at one, then perhaps at later ones.
        instants = ["object:0", "object:1", "object:2", "manifest", "written", "pointer"]
        start = self.rng.randrange(len(instants))
        points = [instants[start]] + [p for p in instants[start + 1:] if p == "written" or self.rng.random() < 0.3]
        before = None
        self.begin_save(job, [self.rng.choice(["top", "last"])], points)
        self.note(f"{job} save step {job.step + 1} paused at {points}")
        for point in points:
            self.wait(job)
            gate = self.handles[job].gate
            if gate.at is None:
                break  # it ended before that instant (refused: another job claimed meanwhile)
            if point in ("written", "pointer"):
                self.check_paused(self.main, job)
                if gate.folders and self.has_manifest(self.main, gate.folders[-1]):
                    self.register_stray(self.main, job, gate.folders[-1])
            for _ in range(self.rng.randint(0, 3)):
                self.interleave(job)
                self.check()
            if self.rng.random() < 0.08:
                job.dead = True  # it never wakes up
                self.note(f"{job} died paused at {point}")
                return
            if point == "manifest" and self.main.fenced(job):
                self.gap.add(job)
            before = self.raw_pointer(self.main)
            gate.release()
        self.wait(job)
        self.end_save(job, before)

    def interleave(self, paused: Job) -> None:
        op = self.rng.choices([self.op_read, self.op_gc, self.op_new_job, self.op_delete_pointer, self.op_damage,
                               self.op_stale_save, self.op_fork], [5, 5, 3, 1, 2, 2, 1])[0]
        self.note(f"  while {paused} is paused: {op.__name__}")
        op()

    def op_new_job(self, *, kind: str | None = None) -> None:
        model = self.main
        head = model.head()
        cache: dict[str, dict[str, int]] = {}
        line = [c for c in model.lineage() if c.durable and self.has_manifest(model, c.folder, cache)]
        outside = [c for c in model.commits.values() if c.durable and not model.in_lineage(c)
                   and not c.manifest_damaged and self.has_manifest(model, c.folder, cache)]
        choices: list[tuple[str, Any]] = [("latest", "latest")] * 5 + [("fresh", None)]
        if len(line) > 1:
            choices += [("rollback", self.rng.choice(line[1:]))] * 2
        if outside:
            choices += [("branch", self.rng.choice(outside))]
        _, target = self.rng.choice(choices)
        kind = kind or self.rng.choice(["sync", "sync", "async", "tier"])
        if head is not None and not head.dead and not head.stopped and self.rng.random() < 0.5:
            self.stop(head, graceful=not self.busy(head))
        self.start_job(model, kind, target)

    def op_resume_stray(self) -> None:
        """The writer's save stops between its manifest and its pointer move; a new job resumes that very commit
        (its URL, as a scan or ``ls`` shows it); the old job is released: it is fenced, and keeps nothing else."""
        job = self.writer(self.main)
        if job is None or job.kind == "tier":
            return
        before = self.raw_pointer(self.main)
        self.begin_save(job, [self.rng.choice(["top", "last"])], ["pointer"])
        self.wait(job)
        gate = self.handles[job].gate
        self.expect(gate.at == "pointer", f"{job}'s save ended before its pointer move")
        self.check_paused(self.main, job)
        assert gate.folders
        stray = self.register(self.main, job, gate.folders[-1], stray=True)
        self.note(f"{job}'s save of step {job.step + 1} paused before its pointer move: {stray}")
        self.start_job(self.main, self.rng.choice(["sync", "async"]), stray)
        before = self.raw_pointer(self.main)
        gate.release()
        self.wait(job)
        self.end_save(job, before)

    def op_zombie(self) -> None:
        """The writer stalls mid-upload (a long GC pause, a partition); a new job claims the root, and its claim's
        gc collects the stalled save's folder; then the old writer wakes up and goes on: it must be refused before
        any manifest names what was collected."""
        job = self.writer(self.main)
        if job is None or job.kind == "tier":
            return
        before = self.raw_pointer(self.main)
        self.begin_save(job, [self.rng.choice(["top", "last"])], [self.rng.choice(["object:1", "object:2"]),
                                                                    "written", "pointer"])
        self.wait(job)
        gate = self.handles[job].gate
        if gate.at is None:
            self.end_save(job, before)
            return
        self.note(f"{job}'s save of step {job.step + 1} stalls at {gate.at}")
        self.op_new_job()
        if self.rng.random() < 0.3:
            self.op_delete_pointer()
        self.check()
        for _ in range(2):
            before = self.raw_pointer(self.main)
            gate.release()
            self.wait(job)
            if gate.at is None:
                break
            self.check_paused(self.main, job)  # its manifest may name only objects that are stored
        self.end_save(job, before)

    def op_gc_beside_save(self) -> None:
        """``gc`` at grace 0 while the writing job's save is paused with some of its objects, or its manifest,
        stored (it may still commit them: nothing of it may go)."""
        job = self.writer(self.main)
        if job is None or job.kind == "tier":
            return
        before = self.raw_pointer(self.main)
        point = self.rng.choice(["object:1", "object:2", "manifest", "written", "pointer"])
        self.begin_save(job, [self.rng.choice(["top", "last"])], [point])
        self.wait(job)
        gate = self.handles[job].gate
        self.expect(gate.at == point, f"{job}'s save ended before {point}")
        self.note(f"{job}'s save of step {job.step + 1} paused at {point}: gc beside it")
        if point in ("written", "pointer"):
            self.register_stray(self.main, job, gate.folders[-1])
        self.op_gc(self.main)
        self.check()
        gate.release()
        self.wait(job)
        self.end_save(job, before)

    def op_stale_save(self) -> None:
        stale = [j for j in self.jobs if j.epoch is not None and j.root.fenced(j) and not self.busy(j)
                 and not j.stopped and j.kind != "proc"]
        if not stale:
            return
        self.save(self.rng.choice(stale))

    def op_fork(self) -> None:
        """A new job resumes a commit of the main root into the fork root: the main root is read, never written."""
        cache: dict[str, dict[str, int]] = {}
        line = [c for c in self.main.lineage() if c.durable and self.has_manifest(self.main, c.folder, cache)]
        if not line:
            return
        before = self.raw_pointer(self.main)
        head = self.fork.head()
        if head is not None and not head.dead and not self.busy(head) and self.rng.random() < 0.5:
            self.stop(head, graceful=True)
        job = self.start_job(self.fork, "sync", self.rng.choice(line), fork=True)
        self.save(job)
        self.expect(self.raw_pointer(self.main) == before, "a fork into another root changed the main root's pointer")

    def op_read(self) -> None:
        model = self.fork if self.fork.commits and self.rng.random() < 0.15 else self.main
        commits = [c for c in model.commits.values() if c.durable]
        cache: dict[str, dict[str, int]] = {}
        stored = [c for c in commits if self.has_manifest(model, c.folder, cache)]
        target: Commit | None = None
        if stored and self.rng.random() < 0.55:
            damaged = [c for c in stored if not model.intact(c)]
            target = self.rng.choice(damaged if damaged and self.rng.random() < 0.5 else stored)
        elif commits and self.rng.random() < 0.2:
            target = self.rng.choice(commits)  # perhaps one retention deleted: FileNotFoundError
        got = self.check_load(model, target)
        self.note(f"read {model.label} {target or 'root'} -> {got}")
        if any(j.kind == "tier" for j in model.claimed()) and model is self.main and self.rng.random() < 0.5:
            self.tier_read()

    def tier_read(self) -> None:
        model = self.main
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                loaded = self.tier_io.load_checkpoint(model.url)
            except (CheckpointCorruptedError, FileNotFoundError):
                return
        assert self.tier_io.last_load is not None
        commit = model.commits.get(self.tier_io.last_load.commit)
        self.expect(commit is not None and model.in_lineage(commit),
                    f"a tiered load of the root gave {self.tier_io.last_load.commit}, outside the lineage", model)
        assert commit is not None
        self.check_bits(loaded, commit)

    def op_gc(self, model: RootModel | None = None) -> None:
        if model is None:
            model = self.fork if self.fork.commits and self.rng.random() < 0.15 else self.main
        operator = self.observer[model.label]
        how = self.rng.choice(["plain", "plain", "abandoned", "keep"])
        if how == "keep":
            keep = self.rng.randint(1, 3)
            if operator.read_pointer()[0] is not None:
                model.retain(keep)
            operator.retain(keep)
            operator.collect_garbage()
        else:
            if how == "abandoned" and operator.read_pointer()[0] is not None:
                model.abandoned_dropped()
            operator.collect_garbage(abandoned=how == "abandoned")
        self.note(f"gc {model.label} {how}")

    def op_delete_pointer(self) -> None:
        model = self.main
        self.store(model).remove_object(POINTER_NAME)
        model.lost = True
        self.note("pointer deleted")
        # A SIGKILLed job whose claim left no trace but the pointer (killed between its pointer swap and its origin
        # record, before any folder) is forgotten with the pointer: a rebuild cannot know its epoch, and the next
        # claim may get that epoch again. Harmless, the process is gone (a live one is fenced by the record then:
        # test_protocol.py::test_a_claim_whose_epoch_is_claimed_again_after_the_pointer_is_lost_is_fenced); the job
        # fenced before it writes again, as the rebuilt pointer's newest epoch. (Soak seeds 842471445, 25821657.)
        store = self.store(model)
        recorded = {int(r[1:-5]) for r in store.list_dir(ORIGINS_DIR) if re.fullmatch(r"e\d+\.json", r)}
        folders = {writer_epoch_of(c) for n in store.list_dir("") if not n.startswith(".") for c in store.list_dir(n)}
        traced = max(recorded | {e for e in folders if e is not None}, default=0)
        wrote = {c.job for c in model.commits.values()}
        for job in model.claimed():
            if job.dead and job.epoch is not None and job.epoch > traced and job not in wrote:
                self.note(f"{job}'s claim left no trace: forgotten")
                job.epoch = None

    def op_damage(self) -> None:
        """Flip a bit of a commit's object or manifest (often of what the writing job resumed from, or of a commit
        whose folder holds that one's objects: a top-k save whose bytes its ``last.ckpt`` twin shares)."""
        model = self.main
        protected = model.protected()
        # (Not the manifest a paused save just wrote: that save is in flight, its damage is no state of the store.)
        cache: dict[str, dict[str, int]] = {}
        pool = [c for c in model.commits.values() if c.durable and self.has_manifest(model, c.folder, cache)
                and not (c.stray and self.busy(c.job))]
        if not pool:
            return
        victim = protected if protected in pool and self.rng.random() < 0.3 else self.rng.choice(pool)
        # (An object of a commit that may be gone may be gone: a shared folder retention deleted.)
        stored = [p for p in victim.objects if self.stored(model, p, cache) is not None]
        if not stored:
            return
        if self.rng.random() < 0.35:
            # (In the manifest's order, never by name: names hold times and random ids, and a seed must replay.)
            holders = list(dict.fromkeys([p.rsplit("/", 1)[0] for p in stored] + [victim.folder]))
            folder = self.rng.choice(holders)
            owner = model.commits.get(folder)
            if owner is None or not self.has_manifest(model, folder, cache):
                return
            path = f"{folder}/{MANIFEST_NAME}"
        else:
            owner, path = victim, self.rng.choice(stored)
        self.flip(model, owner, path)

    def flip(self, model: RootModel, owner: Commit, path: str) -> None:
        """Flip one bit of object ``path`` (a manifest, or an object ``owner`` names) in the store."""
        store = self.store(model)
        data = bytearray(store.read(path))
        # (One draw whatever the length, which holds times: randrange's draws depend on it, and a seed must replay.)
        data[int(self.rng.random() * len(data))] ^= 1 << self.rng.randrange(8)
        store.write(path, bytes(data))
        if path.endswith(MANIFEST_NAME):
            owner.manifest_damaged = True
        else:
            model.damaged.add(path)
        self.note(f"damaged {path} of {owner}")

    def op_corrupt(self) -> None:
        """Damage the data of some of the newest checkpoints of the lineage (often all of the newest few, so a
        resume falls back past them, across a rollback's abandoned branch), then load the root and one of them:
        every fallback must follow the lineage."""
        model = self.main
        cache: dict[str, dict[str, int]] = {}
        line = [c for c in model.lineage() if c.durable and c.cataloged
                and self.has_manifest(model, c.folder, cache)][:5]
        if not line:
            return
        head = model.head()
        count = self.rng.randint(1, min(3, len(line)))
        victims = line[:count] if self.rng.random() < 0.5 else self.rng.sample(line, count)
        if head is not None and self.rng.random() < 0.5:
            # Every checkpoint the writing job saved, and what it resumed from: a resume falls back below its origin,
            # past the abandoned branch a rollback left there (of its origin's writer epoch, at later steps).
            victims = [c for c in line if c.job is head or c is head.origin] or victims
        for victim in victims:
            stored = [p for p in victim.objects if self.stored(model, p, cache) is not None]
            if stored:
                self.flip(model, victim, self.rng.choice(stored))
        got = self.check_load(model, None)
        target = self.rng.choice(victims)
        self.note(f"read main root -> {got}; {target} -> {self.check_load(model, target)}")

    def op_recreate(self) -> None:
        """The root is deleted and a new run starts on it: every job that wrote the old one must be refused."""
        model = self.main
        fs, path = self.backend.fs(), self.backend.path()
        if fs.exists(path):
            fs.rm(path, recursive=True)
        model.incarnation += 1
        model.commits = {}
        model.damaged = set()
        model.lost = False
        self.note("root deleted")
        self.start_job(model, self.rng.choice(["sync", "async"]), None)

    def op_kill(self) -> None:
        """A writer process resumes the latest, saves a step or two, and is SIGKILLed at a random instant of its
        next save."""
        model = self.main
        previous = model.head()
        catalog = self.catalog(model)
        origin = self.check_load(model, None) if previous is not None else None
        if self.zygote is None:
            self.zygote = Zygote(_env(AWS_ENDPOINT_URL=self.backend.endpoint or ""), self.folder)
        job = Job(f"j{len(self.jobs)}", model, origin, "proc", model.incarnation, step=origin.step if origin else 0)
        self.jobs.append(job)
        worker = self.zygote.spawn()
        # (A process's store is its own: no gate, it is killed instead.)
        unused = SimpleNamespace(write_pieces=None, write_versioned=None, read_versioned=None)
        self.handles[job] = Handle(self.observer[model.label], Gate(unused, self.cond), worker=worker)
        target = f"{model.url}/{origin.folder}" if origin is not None else "-"
        worker.send(f"{model.url} {json.dumps(self.options).replace(' ', '')} {KEEP_LAST} {job.tag} {target}")
        worker.wait(("READY",), 0)
        self.note(f"{job} proc starts from {origin}")
        for _ in range(self.rng.randint(0, 2)):
            step, name = job.step + 1, self.rng.choice(["step={}.ckpt", "last.ckpt"])
            mark = len(worker.lines)
            started = time.monotonic()
            worker.send(f"save {step} {name.format(step)}")
            line = worker.wait(("END", "ERROR"), mark)
            self.expect(line.startswith("END"), f"{job}: {line}")
            self.save_seconds.append(time.monotonic() - started)
            self.proc_claimed(job, previous, catalog)
            self.register(model, job, line.split()[1], stray=False)
            job.step = step
        step, name = job.step + 1, self.rng.choice(["step={}.ckpt", "last.ckpt"]).format(job.step + 1)
        worker.send(f"save {step} {name}")
        time.sleep(self.rng.uniform(0, 1.3 * max(self.save_seconds[-5:])))
        worker.kill()
        job.dead = True
        self.proc_claimed(job, previous, catalog)
        pointer = self.pointer(model)
        for child in self.store(model).list_dir(name):
            folder = f"{name}/{child}"
            if writer_epoch_of(child) == job.epoch and job.epoch is not None and self.has_manifest(model, folder):
                named = pointer is not None and folder in {e.commit for e in pointer.entries()}
                if not named:
                    try:
                        self.observer[model.label].read_manifest(folder)
                    except CheckpointCorruptedError:
                        # Killed while writing its manifest (local disk writes it in place): a torn manifest, never
                        # referenced, which scans report as unreadable and gc collects. No commit.
                        self.note(f"{job} left a torn manifest in {folder}")
                        continue
                self.register(model, job, folder, stray=not named)
                if named:
                    job.step = step
        self.note(f"{job} SIGKILLed in its save of step {step}")

    def proc_claimed(self, job: Job, previous: Job | None, catalog: set[str] | None) -> None:
        """Whether the process claimed the root (its first save does, first thing): a newer writer epoch exists."""
        if job.epoch is not None:
            return
        model = job.root
        store = self.store(model)
        known = max([j.epoch for j in model.claimed() if j.epoch is not None], default=0)
        seen = [writer_epoch_of(c) or 0 for n in store.list_dir("") if not n.startswith(".")
                for c in store.list_dir(n)]
        seen += [int(r[1:-5]) for r in store.list_dir(ORIGINS_DIR)]
        pointer = self.pointer(model)
        seen.append(pointer.writer_epoch if pointer else 0)
        if max(seen) > known:
            if model.lost and pointer is not None:
                model.rebuilt()
                model.lost = False
            job.epoch = max(seen)
            model.jobs.append(job)
            model.claimed_by(job, previous, catalog)

    # -- the run -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        ops: list[tuple[Callable[[], None], int]] = [
            (self.op_save, 28), (self.op_paused_save, 14), (self.op_new_job, 9), (self.op_resume_stray, 3),
            (self.op_stale_save, 6), (self.op_read, 10), (self.op_gc, 8), (self.op_delete_pointer, 3),
            (self.op_damage, 4), (self.op_corrupt, 6), (self.op_fork, 3), (self.op_zombie, 3), (self.op_recreate, 2),
            (self.op_gc_beside_save, 3)]
        if self.kills:
            ops.append((self.op_kill, 10))
        functions, weights = zip(*ops, strict=True)
        try:
            self.start_job(self.main, "sync", None)
            self.check()
            for _ in range(self.operations):
                op = self.rng.choices(functions, weights)[0]
                if op is self.op_kill and self.counts.get("op_kill", 0) >= self.kills:
                    op = self.op_save
                self.counts[op.__name__] = self.counts.get(op.__name__, 0) + 1
                self.note(op.__name__)
                op()
                self.check()
        except BaseException as exc:
            tail = "\n  ".join(self.log[-int(os.environ.get("PROTOCOL_TAIL", "25")):])
            raise RunFailed(
                f"seed {self.seed} on {self.backend.kind} failed at operation {len(self.log)}: {exc}\n"
                f"replay: {self.replay}\nlast operations:\n  {tail}") from exc
        finally:
            self.close()

    def close(self) -> None:
        """Unwind every job: paused ones die where they are, savers and persists are waited for."""
        for handle in self.handles.values():
            handle.gate.kill()
            if handle.worker is not None:
                handle.worker.kill()
        for handle in self.handles.values():
            if handle.saver is not None:
                with contextlib.suppress(BaseException):
                    handle.saver.close()
            if handle.tiers is not None:
                with contextlib.suppress(BaseException):
                    handle.tiers.wait()
        deadline = time.monotonic() + WAIT
        for thread in [t for t in threading.enumerate() if t.name.startswith("model-save-")]:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.zygote is not None:
            self.zygote.stop()
        for plugin in (self.reader_io, self.tier_io):
            plugin.teardown()


class Zygote:
    """protocol_worker.py, imported once; each writer is a fork of it (a real process, SIGKILLed for real)."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.proc = procs.popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
        self.folder = folder
        self.spawned = 0
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ZYGOTE"

    def spawn(self) -> Worker:
        self.spawned += 1
        fifo_in, fifo_out = self.folder / f"in-{self.spawned}", self.folder / f"out-{self.spawned}"
        os.mkfifo(fifo_in)
        os.mkfifo(fifo_out)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"spawn {fifo_in} {fifo_out}\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline().split()[1])
        return Worker(pid, open(fifo_in, "w"), open(fifo_out))  # closed by Worker.kill

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class Worker:
    """One writer process: lines to it, lines from it (read by a thread, so a wait never blocks on a dead one)."""

    def __init__(self, pid: int, to: Any, back: Any) -> None:
        self.pid, self.to, self.back = pid, to, back
        self.lines: list[str] = []
        self.done = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name="model-worker-lines").start()

    def _read(self) -> None:
        for line in self.back:
            with self.cond:
                self.lines.append(line.strip())
                self.cond.notify_all()
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def send(self, line: str) -> None:
        self.to.write(line + "\n")
        self.to.flush()

    def wait(self, prefixes: tuple[str, ...], after: int, timeout: float = WAIT) -> str:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines[after:]:
                    if line.startswith(prefixes):
                        return line
                if time.monotonic() > deadline or self.done:
                    raise AssertionError(f"writer never printed {prefixes}; got {self.lines[-5:]}")
                self.cond.wait(0.5)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with self.cond:
            self.cond.wait_for(lambda: self.done, timeout=30)
        for f in (self.to, self.back):
            with contextlib.suppress(OSError):
                f.close()


def _trace(error: BaseException | None) -> str:
    import traceback

    return "".join(traceback.format_exception(error)) if error is not None else "None"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test item per (store, seed), so xdist spreads them over its workers: the suite's seeds; with
    ``--protocol-seed N`` that seed on each store; with ``--soak`` a new seed per store (drawn when the test runs:
    every xdist worker collects the same items)."""
    if "seed" not in metafunc.fixturenames:
        return
    config = metafunc.config
    replay, soak = config.getoption("--protocol-seed"), config.getoption("--soak")
    suite = KILL_SEEDS if metafunc.function is test_randomized_protocol_model_with_sigkills else SEEDS
    cases = [(kind, seed) for kind in ("local", "s3")
             for seed in ([replay] if replay is not None else [None] if soak else suite[kind])]
    # The S3 run is about 2000 requests through moto (20 s): left out of `make test-fast` with the other slow tests,
    # as are the local seeds past the first three (the fast suite's time: each is 3 s of a worker).
    local = [seed for kind, seed in cases if kind == "local"]
    metafunc.parametrize(("kind", "seed"), [
        pytest.param(kind, seed, id=f"{kind}-{'soak' if seed is None else seed}",
                     marks=[pytest.mark.slow] if kind == "s3" or local.index(seed) >= 3 else [])
        for kind, seed in cases])


def _run(request: pytest.FixtureRequest, kind: str, seed: int | None, folder: Path, *, kills: bool = False) -> Run:
    """Run the model on ``kind``'s store with ``seed`` (None: a new one) for the suite's, or ``--soak``'s, number of
    operations; with ``kills``, writer processes are SIGKILLed too."""
    soak = request.config.getoption("--soak")
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    operations = (SOAK_OPERATIONS if soak else KILL_OPERATIONS if kills else OPERATIONS)[kind]
    backend = request.getfixturevalue(f"{kind}_backend")
    replay = (f"pytest '{request.node.nodeid.split('[')[0]}[{kind}-{seed}]' --protocol-seed {seed}"
              + (" --soak" if soak else ""))
    run = Run(backend, seed, operations, folder, kills=max(3, operations // 20) if kills else 0, replay=replay)
    print(f"protocol run on {kind}, seed {seed}, {operations} operations{' with kills' if kills else ''}")
    run.run()
    print(f"  operations run: {run.counts}")
    return run


def test_randomized_protocol_model(kind, seed, request, tmp_path):
    """Several in-process jobs at once on one store: saves paused at random instants among readers, gc, claims,
    pointer losses, damage and recreated roots; checked against the model after every operation."""
    run = _run(request, kind, seed, tmp_path)
    # (A run that tells something: saves paused among other operations, and several writers.)
    assert run.counts.get("op_paused_save", 0) >= 3 and len(run.jobs) >= 4, (run.counts, run.jobs)


@pytest.mark.slow
def test_randomized_protocol_model_with_sigkills(kind, seed, request, tmp_path):
    """The same run with writer processes SIGKILLed at random instants of their saves (real processes)."""
    run = _run(request, kind, seed, tmp_path, kills=True)
    assert run.counts.get("op_kill", 0) >= 1, run.counts


# -- what the model found: each a protocol bug, reproduced on its own -------------------------------------------

def _job(url: str, keep: int | None = None) -> CheckpointRoot:
    return CheckpointRoot(open_store(url, None, RetryPolicy(3, 0.01, 0.1)),
                          RootSettings(keep_last=keep, max_concurrency=1, **SETTINGS),
                          lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))


def _paused_save(job: CheckpointRoot, step: int, name: str, at: str) -> tuple[Gate, threading.Thread, list[Any]]:
    """Start ``job``'s save of ``name`` and return once it is paused at ``at``."""
    cond = threading.Condition()
    gate = Gate(job.store, cond)
    gate.arm([at])
    outcome: list[Any] = []

    def body() -> None:
        try:
            outcome.append(job.save(content("a", step), name))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=body, name="model-save-bug", daemon=True)
    thread.start()
    with cond:
        assert cond.wait_for(lambda: gate.at == at or not thread.is_alive(), timeout=WAIT) and gate.at == at
    return gate, thread, outcome


def test_a_resumed_stray_is_kept_in_the_lineage(local_backend):
    """Job A's save stops between its manifest and its pointer move (a stray S: committed, never cataloged). Job B
    resumes exactly that commit, and its own first save stops there too (a stray S2). C resumes S2 and saves; D
    resumes C and saves on (its keep_last drops C's checkpoint); E resumes D, F resumes E. S and S2 are in F's lineage
    (F <- E <- D <- C <- S2 <- S), and retention never dropped them (no catalog named them): they must be kept,
    though each was live only as the protection of the job that resumed it, each claim drops the protections of the
    job before it (at C's claim, the pointer's latest is still S), and the origins of epochs older than the catalog
    are pruned."""
    url = normalize(local_backend.root)
    a = _job(url)
    a.claim()
    for step in (1, 2):
        a.save(content("a", step), f"step={step}.ckpt")
    gate, thread, _ = _paused_save(a, 3, "step=3.ckpt", "pointer")
    stray = gate.folders[-1]
    b = _job(url)
    b.claim(resumed_from=Entry.from_manifest(b.read_manifest(stray)))
    gate.release()
    thread.join(WAIT)
    gate, thread, _ = _paused_save(b, 4, "last.ckpt", "pointer")  # B dies there
    try:
        second = gate.folders[-1]
        c = _job(url)
        c.claim(resumed_from=Entry.from_manifest(c.read_manifest(second)))
        assert c.store.exists(f"{stray}/{MANIFEST_NAME}"), "the stray B resumed, in C's lineage, was retired"
        entry = c.save(content("c", 5), "step=5.ckpt")
        d = _job(url, keep=1)
        d.claim(resumed_from=entry)
        for step in (6, 7):  # keep_last drops C's checkpoint: the origins of the epochs before D's go
            d.save(content("d", step), f"step={step}.ckpt")
        for tag, step in (("e", 8), ("f", 9)):
            job = _job(url)
            job.claim(resumed_from=job.read_pointer()[0].latest)
            job.save(content(tag, step), f"step={step}.ckpt")
        reader(url).collect_garbage()
        for folder in (stray, second):
            reader(url).reader.verify(folder)
    finally:
        gate.kill()
        thread.join(WAIT)


def test_a_rebuilt_pointer_never_takes_an_abandoned_branch_for_the_lineage(local_backend):
    """A started fresh is abandoned by B; C resumes B, D resumes C, E resumes D: B's checkpoints are retired and the
    origins of epochs before C's are pruned (in the pointer by E's claim, their records by gc). Then the pointer is
    lost while A (stale, still running) saves: refused, its manifest stays. The rebuilt pointer knows no origin for
    B's epoch; before origins listed their ancestors it took every older epoch (A's) for the lineage, and with the
    lineage's checkpoints damaged a load of the root loaded A's abandoned branch instead of failing. Now C's origin
    (and D's, E's) says B started fresh: A's stray stays outside."""
    from lightning_resilient import repair_pointer

    url = normalize(local_backend.root)
    a = _job(url)
    a.claim()
    a.save(content("a", 1), "step=1.ckpt")
    b = _job(url)
    with pytest.warns(RuntimeWarning, match="started from scratch"):
        b.claim()
    for step in (1, 2, 3):
        b.save(content("b", step), f"step={step}.ckpt")
    c = _job(url, keep=2)
    pointer, _ = c.read_pointer()
    assert pointer is not None and pointer.latest is not None
    c.claim(resumed_from=pointer.latest)
    for step in (4, 5):
        c.save(content("c", step), f"step={step}.ckpt")
    d = _job(url, keep=2)
    pointer, _ = d.read_pointer()
    assert pointer is not None and pointer.latest is not None
    d.claim(resumed_from=pointer.latest)
    for step in (6, 7):
        d.save(content("d", step), f"step={step}.ckpt")
    e = _job(url, keep=2)
    pointer, _ = e.read_pointer()
    assert pointer is not None and pointer.latest is not None
    e.claim(resumed_from=pointer.latest)  # prunes the origins of the epochs before C's (B's among them)
    e.save(content("e", 8), "step=8.ckpt")
    reader(url).collect_garbage(abandoned=True)  # and their records
    d.store.remove_object(POINTER_NAME)
    with pytest.raises(StaleWriterError):
        a.save(content("a", 2), "a-step=2.ckpt")
    repair_pointer(url)
    pointer, _ = d.read_pointer()
    assert pointer is not None
    for entry in pointer.entries():
        if entry.writer_epoch > 1:  # every checkpoint of D's lineage is damaged
            path = f"{entry.commit}/shard-00000.bin"
            data = bytearray(d.store.read(path))
            data[0] ^= 1
            d.store.write(path, bytes(data))
    io = AtomicCheckpointIO(claim_on_load=False, node_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCorruptedError):
            loaded = io.load_checkpoint(url)
            assert loaded["job"] != "a", "the load of the root fell back to A's abandoned branch"


def test_a_second_set_aside_in_one_second_saves(local_backend, tmp_path):
    """A local tier holding another incarnation's lineage is moved aside at the next tier save; a set-aside folder of
    the same second already there (the previous set-aside, a second ago at most) must not fail the save."""
    url = normalize(local_backend.root)
    node = str(tmp_path / "node")
    durable = _job(url)
    tiers = TieredRoot(durable, _job(local_tier_url(node, url)), persist_every=1,
                       executor=lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
    durable.claim()
    tiers.save(content("a", 1), "step=1.ckpt")
    tiers.wait()
    shutil.rmtree(local_backend.root)  # written again below: another incarnation, so the node's tier is foreign
    path = local_tier_url(node, url)
    now = int(time.time())
    for second in range(now, now + 5):  # the set-aside of a moment ago (within this second, whichever it is)
        os.makedirs(f"{path}.set-aside-{second}/x")
    again = _job(url)
    again.claim()
    tiers = TieredRoot(again, _job(local_tier_url(node, url)), persist_every=1,
                       executor=lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
    with pytest.warns(RuntimeWarning, match="was moved to"):
        second = tiers.save(content("b", 1), "step=1.ckpt")
    tiers.wait()
    tiers.raise_error()
    assert len(list(Path(node).glob("*.set-aside-*"))) == 6
    assert find_latest_checkpoint(url, local_tier=node) == f"{url}/{second.commit}"


def test_a_manifest_never_names_an_object_gc_collected(local_backend):
    """Writer A has checked its objects are stored and is about to write its manifest when job B claims the root
    (fencing A) and gc runs at grace 0 (A's folder has no manifest and a fenced epoch: collected). A then writes its
    manifest, naming objects that are gone, and is refused. With the pointer missing (here) its folder is kept (a job
    may have resumed it), but never as a checkpoint naming what is gone: A deletes that manifest again."""
    url = normalize(local_backend.root)
    a = _job(url)
    a.claim()
    a.save(content("a", 1), "step=1.ckpt")
    gate, thread, outcome = _paused_save(a, 2, "step=2.ckpt", "manifest")
    folder = gate.folders[-1]
    b = _job(url)
    pointer, _ = b.read_pointer()
    assert pointer is not None and pointer.latest is not None
    b.claim(resumed_from=pointer.latest)  # fences A; its claim's gc collects A's folder
    assert not b.store.exists(folder)
    b.store.remove_object(POINTER_NAME)
    gate.release()
    thread.join(WAIT)
    assert outcome and isinstance(outcome[0], StaleWriterError)
    assert not b.store.exists(f"{folder}/{MANIFEST_NAME}"), "a manifest names objects gc collected"
    assert [m.commit for m in reader(url).scan().manifests] == [pointer.latest.commit]


def _second_job(url: str) -> CheckpointRoot:
    """Job A of the root ``url``, writer epoch 2 (it resumed the first job's step 1), having saved step 2."""
    first = _job(url)
    first.claim()
    first.save(content("a", 1), "step=1.ckpt")
    a = _job(url)
    pointer, _ = a.read_pointer()
    assert pointer is not None and pointer.latest is not None
    a.claim(resumed_from=pointer.latest)
    a.save(content("a", 2), "step=2.ckpt")
    return a


def test_a_recreated_root_refuses_the_old_job(local_backend):
    """Job A writes root R as writer epoch 2; R is deleted and job C starts on it (writer epoch 1). A's next save
    must be refused and leave C's pointer as it was; a restart resumes C's checkpoint, never A's."""
    url = normalize(local_backend.root)
    a = _second_job(url)
    shutil.rmtree(local_backend.root)
    c = _job(url)
    c.claim()
    mine = c.save(content("c", 1), "step=1.ckpt")
    before = c.store.read_versioned(POINTER_NAME)
    with pytest.raises(StaleWriterError):
        a.save(content("a", 3), "step=3.ckpt")
    assert c.store.read_versioned(POINTER_NAME) == before
    assert find_latest_checkpoint(url) == f"{url}/{mine.commit}"


def test_a_recreated_root_refuses_the_old_job_after_its_pointer_is_lost(local_backend):
    """As above, but the recreated root's pointer is then lost: the old job A (writer epoch 2, of the deleted
    incarnation) must still be refused (the rebuilt pointer keeps the incarnation the origin records name), and its
    refused save must leave nothing that a rebuild would take for the newest writer epoch: C goes on."""
    url = normalize(local_backend.root)
    a = _second_job(url)
    shutil.rmtree(local_backend.root)
    c = _job(url)
    c.claim()
    mine = c.save(content("c", 1), "step=1.ckpt")
    c.store.remove_object(POINTER_NAME)
    refused = False
    try:
        a.save(content("a", 3), "step=3.ckpt")
    except StaleWriterError:
        refused = True
    assert refused, "the old incarnation's job committed into the recreated root"
    c.save(content("c", 2), "step=2.ckpt")  # the new run goes on
    assert find_latest_checkpoint(url) != f"{url}/{mine.commit}"


def test_a_rebuilt_pointer_of_a_recreated_root_never_takes_the_old_jobs_stray(local_backend):
    """A double fault: job A (writer epoch 2 of a deleted incarnation) is saving while the root is deleted and a new
    run C starts on it (writer epoch 1); A's save writes its manifest into the recreated root and A dies before its
    pointer move; then C's pointer is lost. The rebuild finds A's manifest, of a higher writer epoch: unless manifests
    name their incarnation, it takes A's run for the newest lineage, and a resume loads the deleted incarnation's
    checkpoint."""
    url = normalize(local_backend.root)
    a = _second_job(url)
    gate, thread, _ = _paused_save(a, 3, "step=3.ckpt", "object:0")  # A's save is under way
    try:
        shutil.rmtree(local_backend.root)
        c = _job(url)
        c.claim()
        mine = c.save(content("c", 1), "step=1.ckpt")
        with gate.cond:
            gate.points = ["written"]  # A dies after its manifest, at its pointer read
        gate.release()
        with gate.cond:
            assert gate.cond.wait_for(lambda: gate.at == "written", timeout=WAIT)
        stray = gate.folders[-1]
        assert c.store.exists(f"{stray}/{MANIFEST_NAME}")
        c.store.remove_object(POINTER_NAME)
        assert find_latest_checkpoint(url) == f"{url}/{mine.commit}"
        loaded = AtomicCheckpointIO(claim_on_load=False, node_cache=False).load_checkpoint(url)
        assert loaded["job"] == "c"  # (a load of the root: C's, rebuilt without A's manifest)
        c.save(content("c", 2), "step=2.ckpt")  # the new run goes on, fenced by nothing of A's
        pointer, _ = c.read_pointer()
        assert pointer is not None and stray not in {e.commit for e in pointer.lineage().members(pointer.entries())}
        for tag, step in (("d", 3), ("e", 4)):  # writer epochs 2 and 3: A's stray (epoch 2, step 3) is in their range
            job = _job(url)
            job.claim(resumed_from=job.read_pointer()[0].latest)
            job.save(content(tag, step), f"step={step}.ckpt")
        reader(url).collect_garbage()  # (a claim collects the garbage of fenced writers too)
        assert not c.store.list_dir(stray)  # another incarnation's commit: garbage, whatever its epoch and step
        assert find_latest_checkpoint(url).startswith(f"{url}/step=4.ckpt/")
    finally:
        gate.kill()
        thread.join(WAIT)


def test_a_pointer_rebuilt_without_origin_records_keeps_the_incarnation_its_commits_name(local_backend):
    """Job J's origin record never landed (its write is best effort) and the pointer is lost; job K resumes J's step
    2, its claim rebuilding the pointer; the pointer is lost again. Had the first rebuild given the root a new
    incarnation (K's record names it), J's commits would look like another incarnation's at the second: left out of
    the rebuild, and collected by gc."""
    url = normalize(local_backend.root)
    j = _job(url)
    j.claim()
    j.save(content("j", 1), "step=1.ckpt")
    second = j.save(content("j", 2), "step=2.ckpt")
    incarnation = j.fence.root_id
    for record in j.store.list_dir(ORIGINS_DIR):
        j.store.remove_object(f"{ORIGINS_DIR}/{record}")
    j.store.remove_object(POINTER_NAME)
    k = _job(url)
    k.claim(resumed_from=second)
    assert k.fence.root_id == incarnation
    k.store.remove_object(POINTER_NAME)
    assert find_latest_checkpoint(url) == f"{url}/{second.commit}"
    k.save(content("k", 3), "step=3.ckpt")
    reader(url).collect_garbage()
    pointer, _ = k.read_pointer()
    assert pointer is not None and [e.step for e in pointer.lineage().members(pointer.entries())] == [3, 2, 1]
    for entry in pointer.entries():
        reader(url).reader.verify(entry.commit)


def test_a_rebuilt_pointer_keeps_the_data_of_a_resumed_commit_no_name_catalogs(local_backend):
    """A saves step 6 as step=6.ckpt and last.ckpt (one data folder); B resumes last.ckpt@6 and saves step 7 under
    both names, so last.ckpt@6 is named by nothing and kept only by its protection (B resumed it; C, resuming B,
    keeps it: it is in C's lineage). The pointer is lost and rebuilt at C's next save, its protections with it;
    keep_last then drops step=6.ckpt. Found by a soak of the model test (seed 687715158): the rebuilt pointer did
    not protect last.ckpt@6, so retention deleted the data it shares with step=6.ckpt, leaving a commit of the
    lineage without its data."""
    url = normalize(local_backend.root)
    a = _job(url)
    a.claim()
    sixth = [a.save(content("a", 6), name) for name in ("step=6.ckpt", "last.ckpt")][-1]
    b = _job(url, keep=2)
    b.claim(resumed_from=sixth)
    seventh = [b.save(content("b", 7), name) for name in ("step=7.ckpt", "last.ckpt")][-1]
    c = _job(url, keep=2)
    c.claim(resumed_from=seventh)
    pointer, _ = c.read_pointer()
    assert pointer is not None and sixth.commit in pointer.protected  # a stray of C's lineage
    c.store.remove_object(POINTER_NAME)
    for step in (8, 9, 10):
        c.save(content("c", step), f"step={step}.ckpt")
    reader(url).collect_garbage()
    pointer, _ = c.read_pointer()
    assert pointer is not None and "step=6.ckpt" not in pointer.checkpoints  # dropped by keep_last
    reader(url).reader.verify(sixth.commit)  # its data is all there


def test_a_recreated_root_refuses_a_tier_job_that_had_not_saved_yet(local_backend, tmp_path):
    """Tier job A claims the root as writer epoch 3 and has not saved yet when the root is deleted; tier job C starts
    on the new incarnation (writer epoch 1) on the same node and saves. A's first save must be refused before it
    adopts the node's local tier (it would take the tier over with the new incarnation's identity and its old epoch,
    3 > 1, and C's next save would be refused), and C goes on saving."""
    url = normalize(local_backend.root)
    node = str(tmp_path / "node")

    def tiers(durable: CheckpointRoot) -> TieredRoot:
        return TieredRoot(durable, _job(local_tier_url(node, url), keep=LOCAL_KEEP), persist_every=1,
                          executor=lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))

    for step in (1, 2):
        job = tiers(_job(url))
        pointer, _ = job.durable.read_pointer()
        job.durable.claim(resumed_from=pointer.latest if pointer is not None else None)
        job.save(content("a", step), f"step={step}.ckpt")
        job.wait()
    a = tiers(_job(url))
    pointer, _ = a.durable.read_pointer()
    assert pointer is not None
    a.durable.claim(resumed_from=pointer.latest)  # writer epoch 3, no save yet
    shutil.rmtree(local_backend.root)
    c = tiers(_job(url))
    c.durable.claim()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old incarnation's local tier is set aside
        c.save(content("c", 1), "step=1.ckpt")
    c.wait()
    c.raise_error()
    with pytest.raises(StaleWriterError, match="deleted and written again"):
        a.save(content("a", 3), "step=3.ckpt")
    a.wait()
    second = c.save(content("c", 2), "step=2.ckpt")
    c.wait()
    c.raise_error()
    assert find_latest_checkpoint(url, local_tier=node) == f"{url}/{second.commit}"


def test_a_local_only_origin_outside_every_catalog_survives_the_local_tiers_gc(local_backend, tmp_path):
    """Tier job A's local save stops between its manifest and its local pointer move, and A dies (a stray that only
    the node's local tier holds). Job B on the node resumes exactly that commit (its URL): B's origin is in no
    catalog of either tier. B's first save adopts the local tier and collects its garbage at grace 0: the stray is
    in B's lineage (its origin), so it stays, as the data B resumed from."""
    url = normalize(local_backend.root)
    node = str(tmp_path / "node")
    local_url = local_tier_url(node, url)

    def tiers(durable: CheckpointRoot) -> TieredRoot:
        return TieredRoot(durable, _job(local_url, keep=LOCAL_KEEP), persist_every=2,
                          executor=lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))

    a_durable = _job(url, keep=KEEP_LAST)
    a_durable.claim()
    a = tiers(a_durable)
    for step in (1, 2):
        a.save(content("a", step), f"step={step}.ckpt")
    a.wait()
    gate, thread, _ = _paused_save(a.local, 3, "step=3.ckpt", "pointer")  # A dies there
    try:
        stray = gate.folders[-1]
        b_durable = _job(url, keep=KEEP_LAST)
        b_durable.resumed(Entry.from_manifest(a.local.read_manifest(stray)), elsewhere=True)
        b_durable.claim()
        b = tiers(b_durable)
        b.save(content("b", 4), "step=4.ckpt")  # adopts the local tier: its gc runs at grace 0
        b.wait()
        b.raise_error()
        local = reader(local_url)
        assert local.store.exists(f"{stray}/{MANIFEST_NAME}"), "the local tier's gc deleted what B resumed from"
        local.reader.verify(stray)
    finally:
        gate.kill()
        thread.join(WAIT)


def test_a_stale_writer_never_recreates_a_lost_pointer(local_backend):
    """The pointer is lost; writer A rebuilds it from the manifests and is about to create it (a conditional create:
    only if there is none). Job B claims the root meanwhile (creating the pointer), and the pointer is lost again.
    A's create then succeeds, but A must see that it overtook B's claim: the pointer goes back to B's writer epoch,
    A's save is refused, and B goes on."""
    url = normalize(local_backend.root)
    a = _job(url)
    a.claim()
    for step in (1, 2):
        a.save(content("a", step), f"step={step}.ckpt")
    a.store.remove_object(POINTER_NAME)
    gate, thread, outcome = _paused_save(a, 3, "step=3.ckpt", "pointer")
    b = _job(url)
    b.claim(resumed_from=reader(url).scan().pointer().checkpoints["step=2.ckpt"])
    b.store.remove_object(POINTER_NAME)
    gate.release()
    thread.join(WAIT)
    after, _ = b.read_pointer()
    assert after is None or after.writer_epoch == b.writer_epoch, f"stale writer A recreated the pointer: {after}"
    assert outcome and isinstance(outcome[0], StaleWriterError), f"stale writer A committed {outcome}"
    mine = b.save(content("b", 3), "step=3.ckpt")
    assert find_latest_checkpoint(url) == f"{url}/{mine.commit}"


def test_a_pointer_lost_before_a_swap_is_rebuilt_on_s3(s3_backend):
    """The writer read the pointer and is about to replace it (If-Match its ETag) when the pointer is lost. The
    replace must fail its condition (moto answers 404 NoSuchKey), so the writer reads again, rebuilds the pointer
    from the manifests and commits: not fail the save with FileNotFoundError."""
    url = normalize(s3_backend.root)
    store = open_store(url, s3_backend.storage_options, RetryPolicy(3, 0.01, 0.1))
    job = CheckpointRoot(store, RootSettings(keep_last=None, max_concurrency=1, **SETTINGS),
                         lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
    job.claim()
    job.save(content("a", 1), "step=1.ckpt")
    gate, thread, outcome = _paused_save(job, 2, "step=2.ckpt", "pointer")
    job.store.remove_object(POINTER_NAME)
    gate.release()
    thread.join(WAIT)
    assert outcome, "the save never ended"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    pointer, _ = job.read_pointer()
    assert pointer is not None and pointer.latest is not None and pointer.latest.step == 2


def test_gc_keeps_the_data_of_what_the_writer_resumed_from_whatever_else_shares_its_folder(local_backend):
    """A's ``last.ckpt`` shares its bytes with the top-k save of the same step (they live in that save's folder). B
    resumes that ``last.ckpt``, saves ``last.ckpt`` again (so the catalog no longer names it) and saves on until
    ``keep_last`` drops the top-k save too. Both are live only as B's protection. The top-k save's manifest is then
    damaged, B saves again, and gc runs at grace 0: the folder holds the data of what B resumed from, so it stays."""
    url = normalize(local_backend.root)
    a = _job(url, keep=2)
    a.claim()
    a.save(content("a", 1), "step=1.ckpt")
    top = a.save(content("a", 2), "step=2.ckpt")
    twin = a.save(content("a", 2), "last.ckpt")
    assert set(twin.folders) == {twin.commit, top.commit}  # the twin's bytes are the top-k save's
    b = _job(url, keep=2)
    b.claim(resumed_from=twin)
    for step in (3, 4, 5):
        b.save(content("b", step), f"step={step}.ckpt")
        b.save(content("b", step), "last.ckpt")
    pointer, _ = b.read_pointer()
    assert pointer is not None and top.commit not in {e.commit for e in pointer.entries()}
    assert twin.commit not in {e.commit for e in pointer.entries()}
    path = f"{top.commit}/{MANIFEST_NAME}"
    data = bytearray(b.store.read(path))
    data[len(data) // 2] ^= 1
    b.store.write(path, bytes(data))
    b.save(content("b", 6), "step=6.ckpt")  # (gc's grace counts from the pointer's last write: after the damage)
    reader(url).collect_garbage()
    reader(url).reader.verify(twin.commit)  # every object of what B resumed from is still there, intact


@pytest.mark.parametrize("dedup", [False, True], ids=["same-step-sharing", "dedup"])
def test_a_stray_of_the_lineage_never_outlives_the_objects_it_shares(local_backend, dedup):
    """A saves step=2.ckpt, then last.ckpt at step 2 (which references step=2's objects: the same step, or with dedup
    every unchanged object back to step=1's) and dies before its pointer move: a stray inside the lineage that B,
    resuming step=2.ckpt, continues. No job resumed the stray, so no catalog or protection keeps the folders it
    references: once C's keep_last retires step=2.ckpt (and step=1.ckpt), their data goes. gc used to keep every
    stray of the lineage, which left its manifest naming objects that were gone (a rebuilt pointer would catalog it
    as last.ckpt, and its load failed verification); now gc collects it with the other strays (at B's claim here,
    grace 0). Every manifest left in the store verifies."""
    url = normalize(local_backend.root)
    a = CheckpointRoot(open_store(url, None, RetryPolicy(3, 0.01, 0.1)),
                       RootSettings(keep_last=None, max_concurrency=1, dedup=dedup, **SETTINGS),
                       lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
    a.claim()
    for step in (1, 2):
        a.save(content("a", step), f"step={step}.ckpt")  # (with dedup, step 2 references step 1's frozen tensor)
    gate, thread, _ = _paused_save(a, 2, "last.ckpt", "pointer")  # A dies there
    stray = gate.folders[-1]
    try:
        shared = set(Entry.from_manifest(a.read_manifest(stray)).folders) - {stray}
        assert shared, "the stray shares no other commit's objects: the test would show nothing"
        b = _job(url)
        b.claim(resumed_from=b.read_pointer()[0].latest)  # step=2.ckpt: the stray is in B's lineage
        b.save(content("b", 3), "step=3.ckpt")
        c = _job(url, keep=1)
        c.claim(resumed_from=c.read_pointer()[0].latest)
        for step in (4, 5, 6):
            c.save(content("c", step), f"step={step}.ckpt")
        reader(url).collect_garbage()
        assert not c.store.exists(f"{stray}/{MANIFEST_NAME}"), "gc kept a stray no job resumed"
        assert not any(c.store.exists(f"{f}/{MANIFEST_NAME}") for f in shared), "retention kept what C dropped"
        operator = reader(url)
        for name in c.store.list_dir(""):
            if name.startswith("."):
                continue
            for child in c.store.list_dir(name):
                if c.store.exists(f"{name}/{child}/{MANIFEST_NAME}"):
                    operator.reader.verify(f"{name}/{child}")  # no manifest names an object that is gone
    finally:
        gate.kill()
        thread.join(WAIT)


@pytest.mark.parametrize("meanwhile", ["claim", "rebuild"])
def test_gc_keeps_a_stray_that_became_live_while_it_ran(local_backend, meanwhile):
    """gc reads the pointer (a stray of the lineage unreferenced: collectable), then, before it deletes, a job claims
    the root resuming that stray (which protects it and makes it the latest), or the pointer is lost and rebuilt
    (which catalogs it as last.ckpt). gc reads the pointer again before deleting and keeps it. (Found by review:
    without the second read, the pointer named a commit that gc had just deleted.)"""
    from lightning_resilient import repair_pointer

    url = normalize(local_backend.root)
    a = _job(url)
    a.claim()
    for step in (1, 2):
        a.save(content("a", step), f"step={step}.ckpt")
    gate, thread, _ = _paused_save(a, 2, "last.ckpt", "pointer")  # A dies there: a stray of the lineage
    stray = gate.folders[-1]
    try:
        patient = RootSettings(keep_last=None, max_concurrency=1, **{**SETTINGS, "orphan_grace_seconds": 3600.0})
        b = CheckpointRoot(open_store(url, None, RetryPolicy(3, 0.01, 0.1)), patient,
                           lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))
        b.claim(resumed_from=b.read_pointer()[0].latest)  # (its own gc keeps the stray: within its grace)
        b.save(content("b", 3), "step=3.ckpt")
        d = _job(url)
        entry = Entry.from_manifest(d.read_manifest(stray))
        operator = reader(url)
        listing = operator.store.list_dir
        fired: list[bool] = []

        def list_dir(path: str, *args: Any, **kwargs: Any) -> list[str]:
            if path == "" and not fired:  # after gc read the pointer, before it lists and deletes
                fired.append(True)
                if meanwhile == "claim":
                    d.claim(resumed_from=entry)
                else:
                    d.store.remove_object(POINTER_NAME)
                    repair_pointer(url)
            return listing(path, *args, **kwargs)

        operator.store.list_dir = list_dir  # type: ignore[method-assign]
        doomed = operator.collect_garbage()
        assert fired and stray not in {url.rsplit("/ckpt/", 1)[-1] for url, _ in doomed}
        assert d.store.exists(f"{stray}/{MANIFEST_NAME}"), "gc deleted a stray the pointer names now"
        pointer = reader(url).read_pointer()[0]
        assert pointer is not None and stray in pointer.live_folders()
        reader(url).reader.verify(stray)
    finally:
        gate.kill()
        thread.join(WAIT)


def test_an_old_incarnations_tier_job_never_sets_aside_the_new_ones_local_tier(local_backend, tmp_path):
    """Tier job A claims the durable root and has not saved yet; the root is deleted and written again, and B (of
    the new incarnation) saves through the same node's local tier. Then the durable pointer is lost. A's first save
    must be refused (the origin records say the root was written again) before it adopts the local tier: adopting,
    it took B's local tier for an earlier incarnation's and set it aside, which fenced B off its own tier. Found by a
    soak of the model test (seed 2126799873, a zombie tier job of an old incarnation)."""
    url = normalize(local_backend.root)
    local_url = local_tier_url(str(tmp_path / "node"), url)

    def tiers(durable: CheckpointRoot) -> TieredRoot:
        return TieredRoot(durable, _job(local_url, keep=LOCAL_KEEP), persist_every=1,
                          executor=lambda: ThreadPoolExecutor(1, thread_name_prefix="model-io"))

    a_durable = _job(url)
    a_durable.claim()
    a = tiers(a_durable)
    shutil.rmtree(local_backend.root)  # deleted; written again below: another incarnation
    b_durable = _job(url)
    b_durable.claim()
    b = tiers(b_durable)
    b.save(content("b", 1), "step=1.ckpt")
    b.wait()
    b.raise_error()
    b_durable.store.remove_object(POINTER_NAME)
    with pytest.raises(StaleWriterError, match="deleted and written again"):
        a.save(content("a", 1), "step=1.ckpt")
    assert not list(tmp_path.joinpath("node").glob("*.set-aside-*")), "A set B's local tier aside"
    b.save(content("b", 2), "step=2.ckpt")  # B goes on through its tier
    b.wait()
    b.raise_error()
