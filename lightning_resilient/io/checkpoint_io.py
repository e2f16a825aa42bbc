"""``AtomicCheckpointIO``: Lightning's CheckpointIO, made atomic, verified and fenced on any fsspec store."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

from lightning_resilient._checks import check_bool, check_number, check_optional_bool
from lightning_resilient._namespaces import register_checkpoint_io, trainer_on_stack
from lightning_resilient._warnings import warn
from lightning_resilient.errors import CheckpointCorruptedError, RunExistsError, SettingTypeError
from lightning_resilient.io import paths
from lightning_resilient.io.async_save import AsyncSaver, SaveStats, WrappedSaves
from lightning_resilient.io.catalog import (
    ALONE,
    Together,
    check_bucket,
    check_not_a_file,
    load_resolved,
    normalize,
    repair_pointer,
)
from lightning_resilient.io.collectives import named
from lightning_resilient.io.folders import writer_epoch_of
from lightning_resilient.io.latest import find_latest_checkpoint
from lightning_resilient.io.manifest import MANIFEST_NAME, Manifest
from lightning_resilient.io.node_cache import NodeCache
from lightning_resilient.io.parts import spans_nodes
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.replicas import (
    DEFAULT_TIMEOUT,
    Access,
    Nodes,
    Replicator,
    Sources,
    load_across_nodes,
    save_sharded_tiered,
)
from lightning_resilient.io.reported import kept_by, reported_in, reported_names
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.root import CheckpointRoot, Loaded, LoadStats, RootSettings, open_root
from lightning_resilient.io.sharded import AtomicStorageReader, root_and_name
from lightning_resilient.io.store import LocalStore, MemoryStore, probe_write
from lightning_resilient.io.tiered import (
    TieredResolved,
    TieredRoot,
    TierSettings,
    is_local_tier_url,
    load_tiered,
    local_tier_url,
    resolve_tiered,
    save_key,
)
from lightning_resilient.io.writer import step_of

__all__ = ["AtomicCheckpointIO", "check_filenames", "find_latest_checkpoint", "fit_roots", "mark_resumed_step_saved",
           "repair_pointer"]

log = logging.getLogger(__name__)


class AtomicCheckpointIO(CheckpointIO):
    """Save Lightning checkpoints to any fsspec URL as immutable, checksummed objects.

    Each save writes its own folder (tensor shards, a skeleton of the rest, then a manifest with every
    object's size and the BLAKE3 digest of each chunk) and becomes visible only when the root's pointer
    (``latest.json``) is moved by a conditional write. A job claims a new writer epoch at its first save (recording
    the checkpoint it resumed from as the origin of its lineage), so an older job that is still running gets
    :class:`~lightning_resilient.StaleWriterError` instead of overwriting it; loading alone never fences anyone.

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning_resilient import AtomicCheckpointIO, find_latest_checkpoint

        root = "s3://my-bucket/run-1/ckpt"
        trainer = Trainer(
            plugins=[AtomicCheckpointIO(storage_options={"anon": False}, keep_last=3)],
            callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=100, save_last=True)],
        )
        trainer.fit(model, ckpt_path=find_latest_checkpoint(root))  # None on the first run

    Args:
        storage_options: fsspec options for the store (credentials, endpoint, ...); Lightning passes none.
        keep_last: keep only the N newest committed checkpoints (None keeps all that Lightning keeps). The
            pointer's target, the checkpoint this job resumed from and every checkpoint a ModelCheckpoint of the run
            still reports (``best_model_path``, ``best_k_models``, ``last_model_path``: kept besides the N newest)
            are never deleted; ``fit`` warns when N is smaller than what the ModelCheckpoints of a folder keep.
        shard_size: largest stored object of tensor data: the tensors' bytes form one stream, cut into objects
            of at most this size (a big tensor spans several; a small checkpoint is cut finer, so that every
            upload thread gets an object), uploaded and downloaded in parallel. At most 5 GiB (S3's single-PUT
            limit).
        chunk_size: bytes per checksummed chunk, which is also the unit of ranged reads on load: every chunk of
            every object is read and verified in parallel.
        max_concurrency: parallel object uploads and ranged downloads per save or load.
        async_save: save in the background. ``save_checkpoint`` returns once the tensors are copied into a
            reusable host buffer (pinned when ``pin_memory``); the upload, the manifest and the pointer move
            follow in a background thread. At most one save is in flight (a second waits, and the wait is
            recorded in :attr:`save_stats`); an error is raised by the next save and by ``teardown``, which
            waits for the last save. A removal Lightning asks for after a save runs only once that save
            committed. The same holds behind Lightning's own ``AsyncCheckpointIO(AtomicCheckpointIO(...))``, with or
            without this setting (docs/fast-checkpoints.md).
        pin_memory: use page-locked host memory for the async snapshot buffer and for loads onto a CUDA device
            (faster, non-blocking copies). None: when CUDA is available. True requires CUDA.
        node_cache: under ``torch.distributed`` with an object store (S3, GCS, ...), the first process of a node
            to load a checkpoint reads it from the store and keeps a verified copy on node-local disk, which the
            node's other processes load: a resume reads the store once per node, not once per rank.
        node_cache_dir: the node-local folder under which that copy goes (in a private
            ``lightning_resilient-<uid>`` folder, mode 0700, one sub-folder per job, one checkpoint at a time);
            default: the system's temp folder (``$TMPDIR``, ``/tmp``).
        orphan_grace_seconds: folders of crashed saves (no manifest, written by a writer epoch that a newer job
            has since fenced off) are deleted once older than this, by the store's own timestamps, as are
            incomplete multipart uploads. A save of the current writer is never deleted, whatever its age.
        fallback_on_corruption: when a checkpoint fails verification on load, load the previous committed one
            of the same lineage (with a loud warning) instead of raising.
        new_run: a ``fit`` that loads no checkpoint may start a new run in a checkpoint folder that holds a committed
            run (a new experiment in a used folder): the old run is kept as an abandoned branch (until
            ``lightning-resilient gc --abandoned``), with a warning. False (the default): such a fit stops when it
            starts (:class:`~lightning_resilient.RunExistsError`, naming the checkpoint to resume) instead of
            training from step 0 over the run; the usual cause is a forgotten ``ckpt_path``, or ``ckpt_path="last"``
            on S3/GCS, which Lightning cannot resolve there. A fit that resumes a checkpoint, continues the previous
            fit in memory, or starts in an empty folder is never refused. With ``new_run=True`` a fit without a
            ``ckpt_path`` starts over every time: its restarts must pass one (``find_latest_checkpoint``).
        allow_unfenced_store: write a store that accepts conditional writes without enforcing them (a server, or a
            proxy in front of it, that ignores ``If-Match``/``If-None-Match`` or ``ifGenerationMatch``: a probe finds
            out before the first write), with a warning. False (the default): ``fit`` refuses to start on such a
            store (``UnfencedStoreError``), since two jobs writing one root at once would overwrite each other's
            pointer and lose checkpoints. Set it only for a root you know one job at a time writes.
        claim_on_load: when loading claims the root (becomes its writer, fencing off the job that wrote it
            before). None (the default): a ``fit`` that resumes claims at once the roots it writes (its
            ModelCheckpoint dirpaths), with the checkpoint it loaded as the origin of their lineage; a root it only
            reads from (a fork into another dirpath) is never claimed; every other load
            (``trainer.validate/test/predict(ckpt_path=...)``, evaluation scripts, notebooks, ``load_checkpoint``
            outside a Trainer) is read-only and never fences the job training into the root. Outside a Trainer
            (Lightning Fabric's ``fabric.load``, a script) a load claims nothing either, but if this plugin saves
            afterwards, its first save into a root claims it with the last checkpoint it loaded from that root as
            the origin (a resume, or a rollback to an older one), or else with the last one it loaded from another
            root (a fork): ``fabric.load(find_latest_checkpoint(root), state)`` then ``fabric.save(...)`` continues
            the run. False: a resuming fit claims only at its first save (the old job, if still running, keeps
            writing until then). True: every load claims, for a process that will train outside ``Trainer.fit`` and
            must fence the old job at once. A job that starts without a checkpoint claims at its first save.
        local_tier: a node-local folder (local NVMe, ``/dev/shm``) to commit every save to first: each save is a
            checkpoint there (same protocol: manifest, pointer, fencing, verification), and every ``persist_every``-th
            saved step, the last save of ``fit`` and every emergency save of ``PreemptionCheckpoint`` are also
            persisted to the ModelCheckpoint dirpath (the durable root) in the background, copied from the local
            tier. The durable root's pointer only names checkpoints complete there. A resume takes the newest
            checkpoint of the durable root's lineage in either tier, read locally when this node holds it and it
            verifies (see ``find_latest_checkpoint(root, local_tier=...)``). None: every save goes to the root.
        persist_every: with ``local_tier``: persist every N-th saved step to the durable root (1: every save).
        local_keep: with ``local_tier``: how many checkpoints the local tier keeps (the newest; a checkpoint being
            persisted is kept until it is durable).
        replicas: with ``local_tier`` on several nodes: how many nodes hold each local commit of a sharded
            strategy (``AtomicModelParallelStrategy``, ``AtomicFSDPStrategy``): a node's part (its ranks' shards)
            is also held by the next ``replicas - 1`` nodes, copied over ``torch.distributed`` in the background, so
            a node that is replaced (its local tier empty) restores its part from a peer instead of the durable
            root. None: 2 on several nodes. Under DDP every node holds every local commit (rank 0 sends it to the
            others), whatever this says. See docs/tiered.md.
        max_persist_failures: with ``local_tier``: a persist that fails (the store is down) is reported (a warning,
            ``lightning-resilient ls --local-tier``) and retried with backoff while training goes on from the local
            tier; after this many failed persists in a row the next save raises
            :class:`~lightning_resilient.PersistFailedError` (after committing locally). None: never for that.
        max_seconds_without_durable: with ``local_tier``: the same, once persists fail and no checkpoint was made
            durable for this many seconds (since this job's last durable commit, or its first save). None: no limit.
        retry_attempts: tries per storage request for transient errors (5xx, throttling, dropped connections).
        retry_base_delay: first backoff in seconds (doubles per retry, full jitter).
        retry_max_delay: longest single backoff in seconds.
        collective_timeout: with a local tier on several processes: seconds each collective between the job's
            processes (the resume decision across the nodes' tiers, a sharded save across them, the copies between
            nodes) waits for the others before it fails on that rank with a
            :class:`~lightning_resilient.CollectiveError` naming the rank and the operation (a process that took
            another path, ended or hangs). Long enough for the slowest rank's load or persist of its part (a sharded
            checkpoint on a slow store). The job's own collectives (the resume decision without a local tier) use the
            strategy's process-group timeout.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        shard_size: int = 64 * 2**20,
        chunk_size: int = 16 * 2**20,
        max_concurrency: int = 8,
        async_save: bool = False,
        pin_memory: bool | None = None,
        node_cache: bool = True,
        node_cache_dir: str | None = None,
        orphan_grace_seconds: float = 3600.0,
        fallback_on_corruption: bool = True,
        new_run: bool = False,
        allow_unfenced_store: bool = False,
        claim_on_load: bool | None = None,
        local_tier: str | os.PathLike[str] | None = None,
        persist_every: int = 1,
        local_keep: int = 2,
        replicas: int | None = None,
        max_persist_failures: int | None = 5,
        max_seconds_without_durable: float | None = None,
        retry_attempts: int = 6,
        retry_base_delay: float = 0.2,
        retry_max_delay: float = 10.0,
        collective_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        register_checkpoint_io(type(self))  # pytorch_lightning.Trainer accepts it too
        self.storage_options = _check_storage_options(storage_options, "storage_options")
        # Checked in the order of the signature, each by the object that keeps it.
        self.settings = RootSettings(keep_last=keep_last, shard_size=shard_size, chunk_size=chunk_size,
                                     max_concurrency=max_concurrency, orphan_grace_seconds=orphan_grace_seconds,
                                     fallback_on_corruption=fallback_on_corruption,
                                     allow_unfenced_store=allow_unfenced_store)
        check_bool("async_save", async_save)
        check_bool("node_cache", node_cache)
        check_bool("new_run", new_run)
        check_optional_bool("claim_on_load", claim_on_load, none_means="a resuming fit claims", none_first=True)
        check_optional_bool("pin_memory", pin_memory, none_means="pin when CUDA is available")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs a CUDA device, and this process sees none: use pin_memory=None"
                             " to pin only where CUDA is available")
        tier = TierSettings.given(local_tier, persist_every, local_keep, replicas, max_persist_failures,
                                  max_seconds_without_durable)
        self.tier_settings = tier
        self.local_tier, self.persist_every, self.local_keep = tier.local_tier, tier.persist_every, tier.local_keep
        self.replicas = tier.replicas
        self.max_persist_failures, self.max_seconds_without_durable = (tier.max_persist_failures,
                                                                        tier.max_seconds_without_durable)
        # float() as before: a delay given as a string ("0.5", from a config file) is still read as seconds.
        self.retry = RetryPolicy(retry_attempts, float(retry_base_delay), float(retry_max_delay))
        self.collective_timeout = check_number("collective_timeout", collective_timeout, above=0,
                                               hint="seconds a collective between the job's processes waits")
        self.max_concurrency = self.settings.max_concurrency  # checked (a plain int)
        self.claim_on_load = claim_on_load
        self.new_run = new_run
        self.async_save = async_save
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._async = AsyncSaver(pin_memory=self.pin_memory) if async_save else None
        self._wrapped: WrappedSaves | None = None  # Lightning's AsyncCheckpointIO around this plugin (wrapped_by)
        if node_cache_dir is not None and not isinstance(node_cache_dir, str):
            raise SettingTypeError(f"node_cache_dir must be a local folder path or None, got {node_cache_dir!r}")
        self.node_cache = node_cache
        self.node_cache_dir = node_cache_dir
        #: Timings of the most recent saves (what the training loop was blocked for, waits, uploads).
        self.save_stats: deque[SaveStats] = deque(maxlen=1000)
        #: What the most recent load read and allocated.
        self.last_load: LoadStats | None = None
        self._roots: dict[tuple[str, str], CheckpointRoot] = {}
        self._tiers: dict[str, TieredRoot] = {}  # durable root URL -> its two tiers, for saves
        # With a local tier on several processes: the job's nodes, and the copies between them (io/replicas.py).
        self._nodes: Nodes | None = None
        self._replicator: Replicator | None = None
        self._lock = threading.Lock()
        self._last_fit: _FitEnd | None = None  # where the last fit ended (a next fit may continue it)
        self._continuing = False  # the current fit continues the previous one from its state in memory
        self._fit_dirpaths: list[str] = []  # the checkpoint folders of the current (or last) fit
        self._fit_trainer: weakref.ref[Any] | None = None  # the Trainer of that fit (its ModelCheckpoints' state)
        # Loads outside a Trainer (Lightning Fabric, a script) that a later save of this plugin continues: the last
        # of each root (by URL), and the last of all (see _continue_outside).
        self._outside: dict[str, _OutsideLoad] = {}
        self._last_outside: _OutsideLoad | None = None
        self._fitting = False  # a Trainer's fit of this plugin is running (between its fit-start check and its end)

    # -- pickling ----------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # ``ddp_spawn`` pickles the Trainer's plugins into every process, ``torch.save(trainer)`` and ``deepcopy`` of
        # objects that hold the Trainer copy them: a copy keeps the settings and starts with no open roots, no
        # claimed writer epoch and no save in flight (those belong to the original; a copy that saves claims anew).
        state = self.__dict__.copy()
        for runtime in ("_roots", "_tiers", "_lock", "_async", "_last_fit", "_nodes", "_replicator", "_outside",
                        "_last_outside", "_fit_trainer"):
            state.pop(runtime, None)
        state.pop("_wrapped", None)  # (a weak reference to the wrapper: a copy finds its own, see wrapped_by)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._roots = {}
        self._tiers = {}
        self._nodes = None
        self._replicator = None
        self._lock = threading.Lock()
        self._last_fit = None
        self._fit_trainer = None
        self._outside = {}
        self._last_outside = None
        self._async = AsyncSaver(pin_memory=self.pin_memory) if self.async_save else None
        self._wrapped = None  # (the copy's wrapper, if any, is found again when its fit starts)

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _executor(self) -> Executor:
        # One pool per save or load: its threads end with the operation, so nothing lingers between saves
        # or after a one-off load, and teardown has no thread to chase.
        return ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="lightning_resilient-io")

    def _options(self, storage_options: Any) -> dict[str, Any]:
        extra = _check_storage_options(storage_options, "save_checkpoint(storage_options=...)")
        return {**self.storage_options, **extra}

    def root(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> CheckpointRoot:
        """The protocol object of the checkpoint root ``url`` (one per root, shared by saves and loads)."""
        options = self._options(storage_options)
        url = normalize(url)
        if paths.split_protocol(url)[0] in (None, "file", "local"):
            # One root per physical folder: ModelCheckpoint saves into the realpath of its dirpath, and a resume
            # through a symlinked dirpath must be the same writer (one claim, one lineage), not a second one.
            url = os.path.realpath(url)
        key = (url, repr(sorted(options.items())))
        with self._lock:
            root = self._roots.get(key)
            if root is None:
                local = self.local_tier is not None and is_local_tier_url(self.local_tier, url)
                # A local tier keeps local_keep checkpoints, and those older that a ModelCheckpoint still reports (the
                # best, say: with persist_every > 1 its only copy may be there until the end of the fit persists it).
                settings = replace(self.settings, keep_last=self.local_keep) if local else self.settings
                root = open_root(url, {} if local else options, settings=settings, retry=self.retry,
                                 executor=self._executor)
                self._roots[key] = root
            return root

    def tiers(self, url: str, storage_options: dict[str, Any] | None = None) -> TieredRoot:
        """The durable root ``url`` and its local tier, as this plugin saves to them (needs ``local_tier``)."""
        assert self.local_tier is not None
        durable = self.root(url, storage_options)
        if isinstance(durable.store, LocalStore) and (durable.url + os.sep).startswith(self.local_tier + os.sep):
            raise ValueError(f"the checkpoint folder {durable.url} is inside local_tier={self.local_tier!r}: the"
                             " durable tier must be another place (an object store, a shared filesystem) than the"
                             " node-local folder. Give local_tier a folder of its own.")
        with self._lock:
            tiers = self._tiers.get(durable.url)
        if tiers is None or tiers.durable is not durable:  # first save, or a new fit reopened the root
            local = self.root(local_tier_url(self.local_tier, durable.url))
            tiers = TieredRoot(durable, local, persist_every=self.persist_every, executor=self._executor,
                               max_persist_failures=self.max_persist_failures,
                               max_seconds_without_durable=self.max_seconds_without_durable,
                               retry_delay=self.retry.max_delay)
            with self._lock:
                self._tiers[durable.url] = tiers
        self._wire(tiers)
        return tiers

    # -- the nodes of a job (a local tier on several processes: io/replicas.py) -------------------------------------
    def join_nodes(self, trainer: Any) -> None:
        """A fit of ``trainer`` starts (the fit-start check's ``setup``, on every rank): with a local tier and
        several processes, learn which node each process is on, make the groups the job's local tiers use, and
        start the copies of local commits between nodes. Every rank of the job calls it at the same point."""
        self.nodes_for(getattr(trainer, "strategy", None), fresh=True)

    def nodes_for(self, strategy: Any, *, fresh: bool = False, sharded: bool = False) -> Nodes | None:
        """The job's nodes (joined now if not yet: a collective of every rank); None without a local tier, or for a
        single process that is not ``sharded``. ``fresh``: join anew (a new fit)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.local_tier is None or not (sharded or (distributed and torch.distributed.get_world_size() > 1)):
            return None
        if self._nodes is not None and not fresh:
            return self._nodes
        self._stop_replicator()
        if not distributed:
            self._nodes = Nodes.solo()
            return self._nodes
        nodes = Nodes.join(int(getattr(strategy, "node_rank", 0)), int(getattr(strategy, "local_rank", 0)),
                           timeout=self.collective_timeout)
        replicas = self.tier_settings.resolved_replicas(nodes.count)
        if self.replicas is not None and self.replicas > nodes.count and nodes.rank == 0:
            log.warning("replicas=%d but the job runs on %d node(s): each local commit is held by all of them",
                        self.replicas, nodes.count)
        self._nodes = nodes
        self._replicator = Replicator(nodes, Access(self.tiers), replicas)
        self._replicator.start()
        with self._lock:
            tiers = list(self._tiers.values())
        for tier in tiers:
            self._wire(tier)
        return nodes

    def _wire(self, tiers: TieredRoot) -> None:
        """Hand ``tiers``'s local commits to the copies between nodes (global rank 0 starts each), and persist a
        sharded commit written across nodes with every node's part."""
        replicator = self._replicator
        if replicator is None or replicator.nodes.background is None or replicator.nodes.rank != 0:
            tiers.on_commit = tiers.copier = None
            return
        tiers.on_commit = lambda entry: replicator.replicate(tiers, entry, save_key(entry))
        tiers.copier = lambda manifest: replicator.persist_parts(tiers, manifest) if spans_nodes(manifest) else None

    def _stop_replicator(self) -> None:
        replicator, self._replicator = self._replicator, None
        if replicator is not None:
            replicator.stop()

    # -- Lightning's CheckpointIO API --------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        wrapped = self._wrapped
        with wrapped.saving() if wrapped is not None else contextlib.nullcontext():
            self._save_checkpoint(checkpoint, path, storage_options)

    def _save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None) -> None:
        if not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
        url = normalize(_fspath(path))
        name = paths.basename(url)
        if not name:
            raise ValueError(f"checkpoint path {url!r} names no checkpoint (it ends at a folder or bucket)")
        if _is_handover(name):
            # Lightning's own transfer, not a checkpoint: ddp_spawn hands the trained weights to the main process as
            # <default_root_dir>/.temp.ckpt, the tuner saves .lr_find_*/.scale_batch_size_* and restores them. Each
            # stays one plain file, as stock, instead of making the working folder a checkpoint root.
            _save_plain_file(checkpoint, url, self._options(storage_options))
            return
        if name.startswith("."):
            raise ValueError(f"checkpoint name {name!r} starts with '.': such names are hidden from the root's listing"
                             " (find_latest_checkpoint and retention would never see it). Use a ModelCheckpoint"
                             " filename that does not start with '.'.")
        _check_not_nested(url, checkpoint, self._fit_dirpaths)
        root: CheckpointRoot | TieredRoot = (self.root(paths.dirname(url), storage_options) if self.local_tier is None
                                             else self.tiers(paths.dirname(url), storage_options))
        self._continue_outside(root if isinstance(root, CheckpointRoot) else root.durable)
        reported = self._reported_by_trainer(root.url) if reported_in(checkpoint, root.url) is None else None
        started = time.perf_counter()
        stats = self.save_stats_for(name, checkpoint)
        if self._async is not None:
            self._async.save(root, checkpoint, name, stats,  # type: ignore[arg-type]  # a TieredRoot quacks alike
                             reported=reported)
        else:
            root.save(checkpoint, name, reported=reported)
            stats.upload = time.perf_counter() - started
            stats.committed = True
        stats.blocked = time.perf_counter() - started

    def _loader(self, root: CheckpointRoot) -> Callable[..., Loaded]:
        """How this process reads a commit of ``root``: through the node cache when several processes share it."""
        shared = (self.node_cache and not isinstance(root.store, (LocalStore, MemoryStore))
                  and torch.distributed.is_available() and torch.distributed.is_initialized()
                  and torch.distributed.get_world_size() > 1)
        if not shared:
            return root.load
        cache = NodeCache(self.node_cache_dir, root.url)

        def local_root(path: str) -> CheckpointRoot:
            return open_root(path, settings=self.settings, retry=self.retry, executor=self._executor)

        return lambda commit, **kwargs: cache.load(root, commit, local_root, **kwargs)

    def _reopen(self, root: CheckpointRoot) -> CheckpointRoot:
        root.settle()  # (the fresh one would not wait for what the old one still writes)
        fresh = CheckpointRoot(root.store, root.settings, self._executor)
        with self._lock:
            for key, value in self._roots.items():
                if value is root:
                    self._roots[key] = fresh
        return fresh

    def save_stats_for(self, name: str, checkpoint: dict[str, Any]) -> SaveStats:
        stats = SaveStats(name=name, step=step_of(checkpoint.get("global_step")))
        self.save_stats.append(stats)
        return stats

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        given = _fspath(path)  # messages name the path as the caller gave it
        url = normalize(given)
        self._drain_wrapper()  # a load never races a save in flight (of Lightning's AsyncCheckpointIO, or ours)
        if self._async is not None:
            self._async.wait()  # a load never races the save in flight
            self._async.raise_error()
        trainer = _trainer_loading()
        url = self.resolve_last(url, trainer)
        kwargs = {"map_location": map_location, "weights_only": weights_only,
                  "pin_memory": self.pin_memory and _targets_cuda(map_location)}
        together = _together(trainer)
        if self.local_tier is not None:
            tiered = self._load_tiered(url, trainer, together, kwargs, shown=given)
            if tiered is not None:
                return tiered
        # Under a strategy, every rank of the job loads the commit rank 0 resolved.
        done = load_resolved(url, self.root, fallback=self.settings.fallback_on_corruption, load_for=self._loader,
                             together=together or ALONE, shown=given, **kwargs)
        if done is None:
            return _load_plain_file(url, self._options(None), map_location, weights_only)
        found, loaded = done
        self.last_load = loaded.stats
        root = found.root
        resumed = next((e for e in [found.entry, *found.fallbacks] if e.commit == loaded.entry_commit), found.entry)
        root = self._continue_from(root, resumed, trainer)
        root.remember_loaded(loaded)
        if trainer is not None and _fn(trainer) == "fit":
            mark_resumed_step_saved(trainer, loaded.checkpoint)
        return loaded.checkpoint

    def resolve_last(self, url: str, trainer: Any) -> str:
        """What a resuming fit's checkpoint ``url`` means: ``<dirpath>/last.ckpt`` (or ``last-v1.ckpt``, ...) of one of
        the fit's ModelCheckpoints, which is what Lightning makes of ``ckpt_path="last"`` on local disk, means the
        newest committed checkpoint of that root's run (the root's URL); any other ``url`` is returned as it is.

        Stock Lightning's ``last.ckpt`` is the newest save by construction. In a root of this plugin the name may lag
        behind the root's latest: an emergency save of ``PreemptionCheckpoint``, a save of another callback into the
        same folder, or a rollback whose run has not saved ``last.ckpt`` yet (the catalog's ``last.ckpt`` is then the
        abandoned branch's). Other loads (validate, test, a script) read the name as it is."""
        if trainer is None or _fn(trainer) != "fit":
            return url
        name, dirpath = paths.basename(url), paths.dirname(url)
        if not any(_names_last(callback, name) and self.root(str(callback.dirpath)).url == self.root(dirpath).url
                   for callback in getattr(trainer, "checkpoint_callbacks", []) if getattr(callback, "dirpath", None)):
            return url
        pointer, _ = self.root(dirpath).read_pointer()
        candidates = pointer.candidates() if pointer is not None else []
        if not candidates:
            return url  # no run of ours there (stock files), or none of the current run yet: the name as it is
        named = pointer.checkpoints.get(name) if pointer is not None else None
        if named is None or named.commit != candidates[0].commit:
            log.info("%s: resuming %s, the newest committed checkpoint of the run in %s (step %d), not %s", url,
                     candidates[0].commit, dirpath, candidates[0].step,
                     f"{name} (step {named.step})" if named is not None else name)
        return dirpath

    def _continue_from(self, root: CheckpointRoot, entry: Entry, trainer: Any, *,
                       elsewhere: bool = False) -> CheckpointRoot:
        """What loading ``entry`` of ``root`` means for writing (``elsewhere``: only the local tier holds it);
        returns the root this process writes from now on.

        A fit claims the roots it writes (its checkpoint folders, see :func:`fit_roots`), and only those: ``root``
        with ``entry`` as the origin of its lineage when the fit writes it, any other with ``entry`` as the checkpoint
        of another root it was forked from. A fit that forks a run into a folder of its own so never fences the job
        still writing the run it forked from, nor abandons that run's later checkpoints.

        Outside a Trainer (Lightning Fabric, a script) a load claims nothing (unless ``claim_on_load=True``): it is
        noted, and a later save of this plugin continues it (see :meth:`_continue_outside`)."""
        fit = trainer is not None and _fn(trainer) == "fit"
        if fit:
            self._forget_outside()  # a fit is a job of its own: what it loads is its origin
        if fit and root.writer_epoch is not None:
            # This plugin already wrote this root in an earlier fit (a notebook, an in-process retry); a fit that
            # resumes is a new job: it claims anew, with what it loaded as its origin (a rollback stays a rollback).
            root = self._reopen(root)
        if trainer is None and not self.claim_on_load:
            self._note_outside(root, entry, elsewhere)
            return root  # read-only until this plugin saves (a process that only loads never fences anyone)
        if not (fit or self.claim_on_load):
            return root  # validate/test/predict are read-only: they never fence anyone
        # The origin of this root's lineage if this process writes it (at its first save, if not claimed below).
        root.resumed(entry, elsewhere=elsewhere)
        targets = [root]
        if fit:
            targets = []
            for other in (self.root(url) for url in fit_roots(trainer)):
                if other.url == root.url:
                    targets.append(root)
                    continue
                if other.writer_epoch is not None:
                    other = self._reopen(other)  # a new job of this plugin: it claims anew
                other.forked(entry, root.url)
                targets.append(other)
        claim_now = self.claim_on_load if self.claim_on_load is not None else fit
        if claim_now and _global_rank() == 0:
            # Now, on the writing rank: the job each replaces is stopped before it can retire this checkpoint.
            for target in targets:
                if target.writer_epoch is None:
                    target.claim()
        return root

    def _note_outside(self, root: CheckpointRoot, entry: Entry, elsewhere: bool) -> None:
        """A load of ``entry`` from ``root`` outside a Trainer: what a later save of this plugin continues. A load
        made while a fit of this plugin runs (a callback reading a checkpoint) is that fit's business, not noted. A
        root this plugin writes already keeps its writer and lineage (loading one of its checkpoints again, to
        evaluate it, is no rollback), but the load is still what a save into another root forks from."""
        if self._fitting:
            return
        load = _OutsideLoad(root.url, entry, elsewhere)
        self._last_outside = load
        if root.writer_epoch is None:
            self._outside[root.url] = load

    def _continue_outside(self, root: CheckpointRoot) -> None:
        """Before a save (or a removal) that may claim ``root``, outside a Trainer's fit: the loads of this plugin
        outside a Trainer (Lightning Fabric's ``fabric.load``, a script's ``load_checkpoint``) give the origin of its
        claim, as a Trainer's resume would, so that ``fabric.load(find_latest_checkpoint(root), state)`` followed by
        ``fabric.save`` continues that run instead of abandoning it. The last load of ``root`` itself makes it a
        resume of that checkpoint (a rollback when it is an older one); with none, the last load of another root
        makes it a fork of that root's checkpoint; with no load at all, it is a fresh start. The claim happens at the
        save, never at a load: a process that only loads (an evaluation script) never fences the training job, and
        under DDP only the rank that saves (Fabric's rank 0) claims."""
        if root.writer_epoch is not None or self._fitting:
            return
        own = self._outside.get(root.url)
        last = self._last_outside
        if own is not None:
            root.resumed(own.entry, elsewhere=own.elsewhere)
        elif last is not None and last.root != root.url:
            root.forked(last.entry, last.root)

    def _forget_outside(self) -> None:
        self._outside = {}
        self._last_outside = None

    def _load_tiered(self, url: str, trainer: Any, together: Together | None,
                     kwargs: dict[str, Any], *, shown: str) -> dict[str, Any] | None:
        """Load across the local and the durable tier (see ``io/tiered.py``); None when neither tier knows ``url``
        (a plain file, a stock checkpoint: the single-tier path handles it)."""
        assert self.local_tier is not None
        if together is not None and self._nodes is not None:
            return self._load_across_nodes(url, trainer, kwargs, shown=shown)
        found: TieredResolved | None = None
        if together is None or together.rank == 0:
            try:
                found = resolve_tiered(url, self.local_tier, self.root, shown=shown)
            except Exception as exc:
                if together is None:
                    raise
                together.broadcast({"error": exc})
                raise
        if together is not None:
            plan = together.broadcast({"found": found})
            if "error" in plan:
                raise plan["error"]
            found = plan["found"]
        if found is None:
            return None
        entry, source, loaded = load_tiered(found, self.local_tier, self.root, self._loader,
                                            fallback=self.settings.fallback_on_corruption, together=together,
                                            **kwargs)
        durable = self.root(found.durable_url)
        self.last_load = replace(loaded.stats, tier="durable" if source is durable else "local") \
            if loaded.stats is not None else None
        self._continue_from(durable, entry, trainer,
                            elsewhere=not durable.store.exists(f"{entry.commit}/{MANIFEST_NAME}"))
        if source is not durable:  # (saves go to the local tier: only its own bytes may be shared)
            source.remember_loaded(loaded)
        if trainer is not None and _fn(trainer) == "fit":
            mark_resumed_step_saved(trainer, loaded.checkpoint)
        return loaded.checkpoint

    def _load_across_nodes(self, url: str, trainer: Any, kwargs: dict[str, Any], *,
                           shown: str) -> dict[str, Any] | None:
        """Under DDP with the job's nodes known: one decision across every node's local tier, restoring a node's
        copy from a peer where it lacks it (``io/replicas.py``)."""
        assert self.local_tier is not None and self._nodes is not None

        def load(entry: Entry, manifest: Manifest, sources: Sources, failed: set[CheckpointRoot]) -> Loaded:
            root = sources.local if sources.local is not None else sources.durable
            assert root is not None
            try:
                if root is sources.local:
                    return root.load(entry.commit, manifest=manifest, **kwargs)
                return self._loader(root)(entry.commit, **kwargs)
            except CheckpointCorruptedError:
                failed.add(root)
                raise

        done = load_across_nodes(url, shown=shown, nodes=self._nodes, local_tier=self.local_tier,
                                 root_for=self.root, replicas=self.tier_settings.resolved_replicas(self._nodes.count),
                                 fallback=self.settings.fallback_on_corruption, load=load)
        if done is None:
            return None
        loaded, durable = done.loaded, done.durable
        self.last_load = replace(loaded.stats, tier="local" if done.sources.local is not None else "durable") \
            if loaded.stats is not None else None
        self._continue_from(durable, done.entry, trainer,
                            elsewhere=not durable.store.exists(f"{done.entry.commit}/{MANIFEST_NAME}"))
        if done.sources.local is not None:
            done.sources.local.remember_loaded(loaded)
        if trainer is not None and _fn(trainer) == "fit":
            mark_resumed_step_saved(trainer, loaded.checkpoint)
        return loaded.checkpoint

    def load_sharded_tiered(self, url: str, strategy: Any, load_shards: Callable[[AtomicStorageReader], None], *,
                            shown: str, weights_only: bool | None) -> dict[str, Any] | None:
        """A sharded strategy's resume with a local tier (``AtomicModelParallelStrategy``, ``AtomicFSDPStrategy``):
        one decision across every node's local tier, each rank reading its shards from its node's tier (restored
        from a peer's replica where the node lacks them) or the durable root. ``load_shards(reader)`` loads the
        strategy's shards through ``reader``. Returns the checkpoint's rest, or None when no tier knows ``url``."""
        assert self.local_tier is not None
        nodes = self.nodes_for(strategy, sharded=True)
        assert nodes is not None

        def load(entry: Entry, manifest: Manifest, sources: Sources, failed: set[CheckpointRoot]) -> Loaded:
            roots = sources.roots()
            reader = AtomicStorageReader(roots[0], entry.commit, manifest=manifest, weights_only=weights_only,
                                         sources=roots)
            try:
                load_shards(reader)
            except CheckpointCorruptedError:
                failed.update(reader.failed)
                raise
            error: CheckpointCorruptedError | None = None
            for root in roots:  # the rest (loops, callbacks, RNG): from the first copy that verifies
                try:
                    return root.load(entry.commit, map_location=None, weights_only=weights_only, sharded_rest=True,
                                     manifest=manifest)
                except CheckpointCorruptedError as exc:
                    failed.add(root)
                    error = exc
            assert error is not None
            raise error

        done = load_across_nodes(url, shown=shown, nodes=nodes, local_tier=self.local_tier, root_for=self.root,
                                 replicas=self.tier_settings.resolved_replicas(nodes.count),
                                 fallback=self.settings.fallback_on_corruption, load=load)
        if done is None:
            return None
        trainer = getattr(strategy, "lightning_module", None)
        trainer = getattr(trainer, "trainer", None)
        durable, entry = done.durable, done.entry
        self.last_load = replace(done.loaded.stats, tier="local" if done.sources.local is not None else "durable") \
            if done.loaded.stats is not None else None
        fit = trainer is not None and _fn(trainer) == "fit"
        if fit or self.claim_on_load:
            durable.resumed(entry, elsewhere=not durable.store.exists(f"{entry.commit}/{MANIFEST_NAME}"))
            claim_now = self.claim_on_load if self.claim_on_load is not None else fit
            if claim_now and nodes.rank == 0 and durable.writer_epoch is None:
                durable.claim()
        if fit:
            mark_resumed_step_saved(trainer, done.loaded.checkpoint)
        return done.loaded.checkpoint

    def save_sharded_tiered(self, state: dict[str, Any], path: str, rest: dict[str, Any] | None,
                            strategy: Any) -> Entry:
        """A sharded strategy's save with a local tier: every rank's shards into its node's local tier, one commit
        across the job's nodes (``io/replicas.py``); every rank calls it."""
        assert self.local_tier is not None
        nodes = self.nodes_for(strategy, sharded=True)
        assert nodes is not None
        root, name = root_and_name(self, path)
        return save_sharded_tiered(state, self.tiers(root.url), name, rest, nodes)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        url = normalize(_fspath(path))
        name = paths.basename(url)
        root: CheckpointRoot | TieredRoot = (self.root(paths.dirname(url)) if self.local_tier is None
                                             else self.tiers(paths.dirname(url)))
        self._continue_outside(root if isinstance(root, CheckpointRoot) else root.durable)  # (a removal may claim)

        def remove() -> None:
            # A stock file or link (a run from before this plugin, a save_last="link" link) goes as stock Lightning
            # would delete it: that object alone. Our checkpoint of that name (on an object store the two can
            # coexist) is retired by the protocol; a name the pointer does not know costs no claim and no write.
            root.forget_stock(name)
            root.remove(name)

        def after_save() -> None:
            if self._async is not None:
                # Lightning removes the checkpoint a new save replaces right after starting that save: only once
                # the new one is committed may the old one go.
                self._async.after_pending(remove, f"removal of {url}")
            else:
                remove()

        wrapped = self._wrapped
        if wrapped is not None:
            # Lightning's AsyncCheckpointIO runs our saves on its worker thread, and hands us this removal on the
            # Trainer's thread at once: it goes behind the saves that wrapper was given before it (WrappedSaves).
            wrapped.after_saves(after_save, f"removal of {url}")
        else:
            after_save()

    @override
    def teardown(self) -> None:
        """Wait for the save in flight (async saves) and raise its error, if any; with ``local_tier``, persist the
        newest local checkpoint (the last save of a fit) of every root and wait for every persist. Then delete what
        the fit retired since its last commit (Lightning's last top-k removal, the last ``keep_last`` drop), which
        otherwise waits for a later commit that this job will not make: the root then holds what Lightning kept
        (see ``Retention.end_of_writer`` for why readers stay safe)."""
        self._fitting = False  # (a fit that failed ends here: Lightning tears the strategy down)
        self._settle_roots()
        try:
            self._each_tier(lambda tier: tier.close(), first=self._close_background)
        finally:
            # After the last persist (a sharded one written across nodes needs every node's part): every node's
            # copying thread ends, and the other nodes' processes may end their fit.
            self._stop_replicator()
        with self._lock:
            written = [root for root in self._roots.values() if root.writer_epoch is not None]
            down = {tiers.durable.url for tiers in self._tiers.values() if tiers.unreachable}
        for root in written:
            if root.url in down:  # (each request would wait out the retries: the next commit or gc deletes them)
                log.info("not deleting what the fit retired under %s now: the store does not answer", root.url)
                continue
            try:
                root.end_of_writer()
            except Exception as exc:  # what was retired stays until the next commit or gc: nothing is lost
                log.warning("could not delete the folders retired under %s at the end of the fit: %s", root.url, exc)

    def wait(self) -> None:
        """Block until the async save in flight (if any) has committed and, with ``local_tier``, the persists
        queued so far are done (and, on global rank 0 of a job on several nodes, the copies of local commits to the
        other nodes); raise their error."""
        self._settle_roots()

        def tier_wait(tier: TieredRoot) -> None:
            tier.wait()
            tier.raise_failure()

        self._each_tier(tier_wait, first=self._wait_async)
        if self._replicator is not None:
            self._replicator.flush()

    def persist_latest(self) -> None:
        """With ``local_tier``: wait for the save in flight, then persist the newest local checkpoint of every root
        (if it is not there yet) and wait until it is committed there. ``PreemptionCheckpoint`` calls it after an
        emergency save: the node may not come back. Without a local tier: :meth:`wait`."""
        self._settle_roots()
        self._each_tier(lambda tier: tier.persist_latest(), first=self._wait_async)

    def _settle_roots(self) -> None:
        """Wait for what a resume left to finish in a root (a replaced node's copy restored from a peer, written to
        its local tier behind training: ``CheckpointRoot.finish_later``)."""
        with self._lock:
            roots = list(self._roots.values())
        for root in roots:
            root.settle()

    def _wait_async(self) -> None:
        self._drain_wrapper()
        if self._async is not None:
            self._async.wait()
            self._async.raise_error()
        if self._wrapped is not None:
            self._wrapped.raise_error()

    def _close_background(self) -> None:
        """Teardown's first step: what Lightning's AsyncCheckpointIO was handed has run (its own teardown waited for
        it already, unless this is the teardown of a fit that failed), then the async save in flight; raise their
        errors."""
        self._drain_wrapper()
        try:
            if self._async is not None:
                self._async.close()
        finally:
            if self._wrapped is not None:
                self._wrapped.raise_error()

    def _drain_wrapper(self) -> None:
        if self._wrapped is not None:
            self._wrapped.drain()

    def wrapped_by(self, wrapper: Any) -> None:
        """``wrapper`` (Lightning's ``AsyncCheckpointIO``) holds this plugin, or None: the plugin is the strategy's own.
        Called by the fit-start check in every ``setup``. Wrapped, the saves run on the wrapper's worker thread and
        the removals reach the plugin on the Trainer's: each removal is then queued behind the saves handed to the
        wrapper before it (see ``async_save.WrappedSaves``); and the wrapper's ``teardown`` does not call this
        plugin's, which the fit-start check calls in the callback ``teardown`` that follows it."""
        if wrapper is None:
            self._wrapped = None
        elif self._wrapped is None or not self._wrapped.wraps_for(wrapper):
            self._wrapped = WrappedSaves(wrapper)

    @property
    def wrapped(self) -> bool:
        """Whether a Lightning wrapper (``AsyncCheckpointIO``) holds this plugin (see :meth:`wrapped_by`)."""
        return self._wrapped is not None

    def _each_tier(self, action: Callable[[TieredRoot], Any], *, first: Callable[[], None] | None) -> None:
        """``first()``, then ``action`` on every root's tiers, each whatever the others raised; then the first error."""
        errors: list[BaseException] = []
        for step in ([first] if first is not None else []):
            try:
                step()
            except BaseException as exc:
                errors.append(exc)
        with self._lock:
            tiers = list(self._tiers.values())
        for tier in tiers:
            try:
                action(tier)
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def begin_fit(self, *, resumed: bool, trainer: Any = None, pl_module: Any = None) -> None:
        """A ``fit`` of ``trainer`` on ``pl_module`` starts (called by the fit-start check callback).

        One that resumed a checkpoint claimed what it writes when it loaded. One that continues the previous fit of
        this plugin from its state in memory (the same Trainer and LightningModule objects, at the global step that
        fit ended at: ``trainer.fit`` called again with a higher ``max_steps``) is the same job: it goes on with that
        fit's writer epoch and lineage. Any other fit is a new job: the roots an earlier fit of this plugin claimed
        are claimed anew at its first save (it starts a new lineage, as a new process would) instead of continuing
        the earlier fit's writer epoch with another model's steps, or with steps from 0."""
        last, self._last_fit = self._last_fit, None
        # What this plugin loaded outside a Trainer before is no origin of the fit: only what the fit resumes is.
        self._forget_outside()
        self._fitting = True
        if trainer is not None:
            self._fit_dirpaths = [normalize(d) for d in fit_roots(trainer)]
            self._fit_trainer = weakref.ref(trainer)
        self._continuing = last is not None and trainer is not None and last.continued_by(trainer, pl_module)
        if resumed or self._continuing:
            return
        with self._lock:
            claimed = [root for root in self._roots.values() if root.writer_epoch is not None]
        for root in claimed:
            self._reopen(root)

    def end_fit(self, trainer: Any, pl_module: Any) -> None:
        """A ``fit`` of ``trainer`` on ``pl_module`` ended normally (called by the fit-start check callback): a next
        fit of the same two that starts where this one ended continues this job (see :meth:`begin_fit`)."""
        self._last_fit = _FitEnd(weakref.ref(trainer), weakref.ref(pl_module), int(getattr(trainer, "global_step", 0)))
        self._fitting = False

    # -- extras ------------------------------------------------------------------------------------------------
    def check_root(self, root: str) -> None:
        """Raise now, naming what to fix, when ``root`` cannot hold checkpoints: it is not a URL a store reads as
        meant (``StoreURLError``), its bucket does not exist, it is a file, this process may not list or write it
        (a probe object is written and deleted: ``StorePermissionError`` about the folder's permissions on local
        disk, ``StoreCredentialsError`` on a cloud store), or the store ignores conditional writes
        (``UnfencedStoreError``, unless ``allow_unfenced_store``). The fit-start check calls it for every checkpoint
        folder of the fit, so any of these stops the run before its first step rather than at its first save."""
        checked = self.root(root)
        check_bucket(checked.store)
        check_not_a_file(checked.store, root)
        checked.store.list_dir("")  # credentials that can name the bucket but not list it fail here
        probe_write(checked.store)
        checked.check_fencing()

    def check_retention(self, trainer: Any) -> None:
        """Warn, once when a fit of ``trainer`` starts, for each of its checkpoint folders where ``keep_last`` is
        smaller than what the ModelCheckpoints writing it keep (``save_top_k`` plus ``last``): retention never deletes
        a checkpoint a ModelCheckpoint still reports (``best_model_path``, ``best_k_models``, ``last_model_path``, see
        ``io/reported.py``), so those older than the ``keep_last`` newest are kept besides them, and the folder holds
        more than ``keep_last`` checkpoints."""
        keep = self.settings.keep_last
        if keep is None:
            return
        by_root: dict[str, list[Any]] = {}
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            dirpath = getattr(callback, "dirpath", None)
            if isinstance(dirpath, (str, os.PathLike)) and str(dirpath):
                by_root.setdefault(self.root(str(dirpath)).url, []).append(callback)
        for url, callbacks in by_root.items():
            kept = sum(kept_by(c) for c in callbacks)
            if keep >= kept:
                continue
            settings = ", ".join(_keeps(c) for c in callbacks if kept_by(c))
            if kept == math.inf:
                bound = "every checkpoint a save_top_k=-1 with a monitor ranks stays, whatever keep_last says"
                fix = "give it a save_top_k >= 0, or set keep_last=None"
            else:
                bound = f"{url} may hold up to {keep} + {int(kept)} checkpoints"
                fix = f"lower save_top_k, or set keep_last to at least {int(kept)} (or None)"
            warn(f"AtomicCheckpointIO(keep_last={keep}) is smaller than what the ModelCheckpoint(s) writing {url} keep"
                 f" ({settings}). Retention never deletes a checkpoint a ModelCheckpoint still reports"
                 " (best_model_path, best_k_models, last_model_path): keep_last keeps the newest checkpoints, and those"
                 " reported ones"
                 f" older than them besides, so {bound}. To settle it, {fix}.", RuntimeWarning, rank_zero=True)

    def _reported_by_trainer(self, folder: str) -> list[str] | None:
        """The names in ``folder`` that the ModelCheckpoints of this plugin's fit report now, read from the Trainer (a
        weights-only save carries no callback state); None without a Trainer, or one with no ModelCheckpoint."""
        trainer = self._fit_trainer() if self._fit_trainer is not None else None
        if trainer is None:
            return None
        return reported_names([c.state_dict() for c in getattr(trainer, "checkpoint_callbacks", [])
                               if callable(getattr(c, "state_dict", None))], folder)

    def check_new_run(self, trainer: Any) -> None:
        """Refuse, when a fit of ``trainer`` starts, a fit that loads no checkpoint into a checkpoint folder that holds
        a committed run (:class:`~lightning_resilient.RunExistsError`, naming the checkpoint to resume): trained
        from step 0, it would leave that run behind as an abandoned branch. Not refused: a fit that resumed a
        checkpoint (``trainer.ckpt_path``), one that continues the previous fit of this plugin in memory, one whose
        folders hold no run of ours (empty, or stock files), and any fit with ``new_run=True``.

        Rank 0 decides and every rank raises the same error (one that raised alone would leave the others waiting at
        the next collective). The fit-start check calls it once the checkpoint is loaded: in ``on_fit_start``, or in
        ``on_train_start`` for strategies that restore after setup (FSDP, model parallel)."""
        if self.new_run or self._continuing or getattr(trainer, "ckpt_path", None) is not None:
            return
        together = _together(trainer)
        verdict: list[tuple[str, str]] | BaseException = []
        if together is None or together.rank == 0:
            try:
                verdict = [(root, latest) for root in fit_roots(trainer)
                           if (latest := self._committed_latest(root)) is not None]
            except Exception as exc:  # every rank raises what rank 0 found
                verdict = exc
        if together is not None:
            verdict = together.broadcast(verdict)
        if isinstance(verdict, BaseException):
            raise verdict
        if verdict:
            raise RunExistsError(_run_exists_message(verdict))

    def _committed_latest(self, root: str) -> str | None:
        """The newest committed checkpoint of the run in ``root`` (either tier); None when it holds none of ours."""
        latest = self.find_latest_checkpoint(root)
        return latest if latest is not None and writer_epoch_of(paths.basename(latest)) is not None else None

    def knows_checkpoint(self, path: str | os.PathLike[str]) -> bool:
        """Whether a committed checkpoint ``path`` (``<dirpath>/<name>``) exists: with ``local_tier``, answered without
        waiting for the store, from the local tier's catalog and the durable one as this plugin last saw it
        (:meth:`TieredRoot.knows`); without, from the root's pointer. ``ModelCheckpoint.file_exists`` asks it at every
        save (see ``io/fit_check.py``): with a local tier a store outage would otherwise stop training at the first
        save, and without one a save cut off earlier would count as a checkpoint of its name."""
        url = normalize(_fspath(path))
        if self.local_tier is None:
            # The root's catalog: a folder a save left without its manifest (killed, or cut off by an outage) is no
            # checkpoint, though the store lists objects under its name (Lightning would name the next save "-v1").
            pointer, _ = self.root(paths.dirname(url)).read_pointer()
            return pointer is not None and paths.basename(url) in pointer.checkpoints
        return self.tiers(paths.dirname(url)).knows(paths.basename(url))

    def find_latest_checkpoint(self, root: str | os.PathLike[str]) -> str | None:
        """Like :func:`find_latest_checkpoint`, with this plugin's storage options and local tier."""
        return find_latest_checkpoint(root, self.storage_options, local_tier=self.local_tier)

    def collect_garbage(self, root: str | os.PathLike[str], *, dry_run: bool = False,
                        abandoned: bool = False) -> list[str]:
        """Delete (or, with ``dry_run``, list) what no committed checkpoint under ``root`` needs: folders of crashed
        saves of fenced writers, retired folders whose time has come and, with ``abandoned``, checkpoints of
        branches a rollback left behind. Returns the URLs."""
        return [url for url, _ in self.root(root).collect_garbage(dry_run=dry_run, abandoned=abandoned)]


@dataclass(frozen=True)
class _OutsideLoad:
    """A load outside a Trainer: the URL of the root it read, the commit it loaded, and whether only the local tier
    held it."""

    root: str
    entry: Entry
    elsewhere: bool


@dataclass(frozen=True)
class _FitEnd:
    """Where the last fit of a plugin ended: its Trainer and LightningModule (weakly held) and its global step."""

    trainer: weakref.ref[Any]
    module: weakref.ref[Any]
    step: int

    def continued_by(self, trainer: Any, pl_module: Any) -> bool:
        """Whether a fit of ``trainer`` on ``pl_module`` starts where this one ended, from its state in memory."""
        return (self.step > 0 and self.trainer() is trainer and self.module() is pl_module
                and int(getattr(trainer, "global_step", -1)) == self.step)


def _run_exists_message(found: list[tuple[str, str]]) -> str:
    root, latest = found[0]
    also = "".join(f"; {other} also holds one (latest: {url})" for other, url in found[1:])
    return (f"this fit loads no checkpoint, but its checkpoint folder {root} holds a committed run (latest: {latest})"
            f"{also}: it would train from step 0 and leave that run behind. To resume it, pass"
            f" ckpt_path=find_latest_checkpoint({root!r}) to trainer.fit (ckpt_path=\"last\" finds no last.ckpt on"
            " S3/GCS, where Lightning lists it without its protocol, Lightning issue #18261, nor without"
            " ModelCheckpoint(save_last=True); with LightningCLI, lightning-resilient train resumes by itself). To"
            " start a new run there instead, keeping the old one as an abandoned branch until `lightning-resilient gc"
            " --abandoned`, pass AtomicCheckpointIO(new_run=True); or give the new run a ModelCheckpoint dirpath of its"
            " own.")


def _keeps(callback: Any) -> str:
    """What a ModelCheckpoint keeps, in its own settings (for messages)."""
    top_k = getattr(callback, "save_top_k", 1)
    kept = [f"save_top_k={top_k}" + ("" if getattr(callback, "monitor", None) is not None else " without a monitor")]
    if not top_k:
        kept = []
    if getattr(callback, "save_last", None):
        kept.append("save_last")
    return f"{type(callback).__name__}({', '.join(kept)})"


def _names_last(callback: Any, name: str) -> bool:
    """Whether ``name`` is one of ``callback``'s ``save_last`` names (``last.ckpt``, ``last-v1.ckpt``, ...)."""
    last = getattr(callback, "CHECKPOINT_NAME_LAST", None)
    if not isinstance(last, str):
        return False
    join = re.escape(str(getattr(callback, "CHECKPOINT_JOIN_CHAR", "-")))
    extension = re.escape(str(getattr(callback, "FILE_EXTENSION", ".ckpt")))
    return re.fullmatch(f"{re.escape(last)}({join}v\\d+)?{extension}", name) is not None


def fit_roots(trainer: Any) -> list[str]:
    """The checkpoint folders a ``fit`` of ``trainer`` writes: every ``ModelCheckpoint`` dirpath and a
    ``PreemptionCheckpoint``'s own ``dirpath`` (each once, in the order of the callbacks). Lightning resolves a
    ModelCheckpoint's dirpath in its ``setup``, before a resume loads."""
    from lightning_resilient.preemption import PreemptionCheckpoint

    found: list[str] = []
    for callback in getattr(trainer, "callbacks", []):
        dirpath = getattr(callback, "dirpath", None)
        writes = callback in getattr(trainer, "checkpoint_callbacks", []) or isinstance(callback, PreemptionCheckpoint)
        if writes and isinstance(dirpath, (str, os.PathLike)) and str(dirpath) and str(dirpath) not in found:
            found.append(str(dirpath))
    return found


def _check_storage_options(value: Any, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{field} must be a dict of fsspec options with str keys or None, got {value!r}")
    return dict(value)


def _fspath(path: Any) -> str:
    if isinstance(path, str):
        return path
    fspath = os.fspath(path) if isinstance(path, os.PathLike) else None
    if isinstance(fspath, str):
        return fspath
    raise TypeError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}")


def _trainer_loading() -> Any:
    """The Trainer whose checkpoint connector is loading (up the call stack), or None outside a Trainer.

    The CheckpointIO is handed neither why it loads (to resume a fit, or to validate, test or predict) nor whether
    every rank of the job is loading too; both are facts of that Trainer."""
    return trainer_on_stack("_CheckpointConnector")


def _fn(trainer: Any) -> Any:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return getattr(fn, "value", fn)


def _together(trainer: Any) -> Together | None:
    """How the ranks of ``trainer``'s job decide together, when there are several (Lightning's resume loads on every
    rank); None for a single process, or a load outside a Trainer (which may run on one rank alone)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or getattr(trainer, "world_size", 1) <= 1 or not (
            torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    rank = int(strategy.global_rank)
    bound = "each wait bounded by the job's process-group timeout (the strategy's timeout=)"

    def broadcast(obj: Any) -> Any:
        with named("the resume decision (the checkpoint every rank loads)", rank, bound):
            return strategy.broadcast(obj, src=0)

    def reduce(flag: bool, *, all: bool) -> bool:
        with named("the resume decision (whether every rank loaded it)", rank, bound):
            return bool(strategy.reduce_boolean_decision(flag, all=all))

    return Together(rank=rank, broadcast=broadcast, all_true=lambda flag: reduce(flag, all=True),
                    any_true=lambda flag: reduce(flag, all=False))


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def _targets_cuda(map_location: Any) -> bool:
    if map_location is None or callable(map_location):
        return False
    targets = map_location.values() if isinstance(map_location, dict) else [map_location]
    try:
        return any(torch.device(t).type == "cuda" for t in targets)
    except (TypeError, RuntimeError):
        return False


def _load_plain_file(url: str, options: dict[str, Any], map_location: Any,
                     weights_only: bool | None) -> dict[str, Any]:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **options)
    with fs.open(path, "rb") as f:
        kwargs: dict[str, Any] = {"map_location": map_location}
        if weights_only is not None:
            kwargs["weights_only"] = weights_only
        checkpoint: dict[str, Any] = torch.load(f, **kwargs)
        return checkpoint


def _is_handover(name: str) -> bool:
    """Lightning's hidden hand-over files (ddp_spawn's weights, the tuner's saved state), not checkpoints."""
    return name == ".temp.ckpt" or name.startswith((".lr_find_", ".scale_batch_size_"))


def _save_plain_file(checkpoint: dict[str, Any], url: str, options: dict[str, Any]) -> None:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **options)
    fs.makedirs(paths.dirname(path) or ".", exist_ok=True)
    with fs.open(path, "wb") as f:
        torch.save(checkpoint, f)


def mark_resumed_step_saved(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """The step a fit resumes from is saved already: no ModelCheckpoint saves it again.

    ModelCheckpoint skips a save only when its ``_last_global_step_saved`` equals the global step, and that counter is
    not part of its state, so after a resume it is 0. Under gradient accumulation the first batches after the resume
    end at the resumed step (no optimizer step yet), and ``every_n_train_steps`` would save that step once more."""
    step = checkpoint.get("global_step")
    if not isinstance(step, int) or step <= 0:
        return
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if hasattr(callback, "_last_global_step_saved"):
            callback._last_global_step_saved = step


def _check_not_nested(url: str, checkpoint: dict[str, Any], fit_dirpaths: list[str]) -> None:
    """Refuse a save into a sub-folder of a ModelCheckpoint's dirpath (``filename="{epoch}/{step}"``).

    The checkpoint root is the folder a checkpoint is saved in; a sub-folder would be a root of its own, with its
    own pointer, fencing and retention, and ``find_latest_checkpoint(dirpath)`` would find nothing. The dirpaths are
    those of the fit (``fit_dirpaths``) and those the checkpoint's callback state names (a full checkpoint's; a
    weights-only one has none).
    """
    dirpaths = list(fit_dirpaths)
    for state in (checkpoint.get("callbacks") or {}).values():  # ModelCheckpoint's, or a subclass's (keyed by its name)
        dirpath = state.get("dirpath") if isinstance(state, dict) else None
        if isinstance(dirpath, str) and dirpath:
            dirpaths.append(normalize(dirpath))
    parent = paths.dirname(url)
    for root in dirpaths:
        if parent != root and parent.startswith(root.rstrip("/") + "/"):
            raise ValueError(
                f"checkpoint {url!r} would be saved in a sub-folder of the ModelCheckpoint dirpath {root!r} (its"
                f" filename contains '/'): with AtomicCheckpointIO every folder is a separate checkpoint root, so the"
                f" run would be split across roots and find_latest_checkpoint({root!r}) would not see it. Use a"
                " filename without '/', e.g. ModelCheckpoint(filename='{epoch}-{step}').")


def check_filenames(trainer: Any) -> None:
    """Refuse, when a fit starts, a checkpoint callback whose ``filename`` has a folder in it (``"{epoch}/{step}"``):
    each of its saves would go to a sub-folder of the dirpath, a separate checkpoint root (see
    :func:`_check_not_nested`, which also refuses such a save; this stops the fit before its first step)."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        filename = getattr(callback, "filename", None)
        if isinstance(filename, str) and ("/" in filename or os.sep in filename):
            dirpath = getattr(callback, "dirpath", None)
            raise ValueError(
                f"{type(callback).__name__}(filename={filename!r}) would save each checkpoint in a sub-folder of its"
                f" dirpath {str(dirpath)!r}: with AtomicCheckpointIO every folder is a separate checkpoint root, so"
                " the run would be split across roots and find_latest_checkpoint(dirpath) would not see it. Use a"
                " filename without '/', e.g. ModelCheckpoint(filename='{epoch}-{step}').")
