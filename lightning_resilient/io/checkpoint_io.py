"""``AtomicCheckpointIO``: Lightning's CheckpointIO, made atomic, verified and fenced on any fsspec store.

The plugin is a thin adapter: it keeps the settings (checked when made) and routes Lightning's calls, and those of
the fit-start check (``io/fit_check.py``) and the sharded strategies, to collaborators with one job each:

- ``plugin_roots.py``: ``OpenRoots``, the roots and tiers it opened (one per URL), the node cache, the end of a fit
  over every root;
- ``plugin_saves.py``: ``PluginSaves``, the save and removal paths, in the background (``async_save``) or behind
  Lightning's ``AsyncCheckpointIO``, and the order they run in;
- ``plugin_loads.py``: ``PluginLoads``, the load paths (one root, two tiers, across nodes, sharded across nodes);
- ``load_claims.py``: ``LoadClaims``, what a load claims, and the loads outside a Trainer a later save continues;
- ``fit_lifecycle.py``: ``FitLifecycle``, where the plugin stands between fits (a fit running, continuing the last);
- ``plugin_checks.py``: ``FitChecks``, the checks of the fit's checkpoint folders when it starts, and whether a
  checkpoint exists;
- ``plugin_nodes.py``: ``NodesLink``, the job's nodes and the copies of local commits between them.

What the plugin reads of the Trainer calling it is in ``calling_trainer.py``.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

from lightning_resilient._checks import check_bool, check_number, check_optional_bool
from lightning_resilient._namespaces import register_checkpoint_io
from lightning_resilient.errors import SettingTypeError
from lightning_resilient.io.async_save import AsyncSaver, SaveStats
from lightning_resilient.io.calling_trainer import fit_roots, mark_resumed_step_saved
from lightning_resilient.io.catalog import repair_pointer
from lightning_resilient.io.fit_lifecycle import FitLifecycle
from lightning_resilient.io.latest import find_latest_checkpoint
from lightning_resilient.io.load_claims import LoadClaims
from lightning_resilient.io.local_tier import TierSettings
from lightning_resilient.io.plugin_checks import FitChecks, check_filenames
from lightning_resilient.io.plugin_loads import PluginLoads
from lightning_resilient.io.plugin_nodes import NodesLink
from lightning_resilient.io.plugin_roots import OpenRoots, check_storage_options
from lightning_resilient.io.plugin_saves import PluginSaves
from lightning_resilient.io.pointer import Entry
from lightning_resilient.io.replicas import DEFAULT_TIMEOUT, Nodes, save_sharded_tiered
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.root import CheckpointRoot, Loaded, LoadStats, RootSettings
from lightning_resilient.io.sharded import AtomicStorageReader, root_and_name
from lightning_resilient.io.tiered import TieredRoot
from lightning_resilient.io.writer import step_of

__all__ = ["AtomicCheckpointIO", "check_filenames", "find_latest_checkpoint", "fit_roots", "mark_resumed_step_saved",
           "repair_pointer"]

# The collaborators (see the module docstring): made by _build, anew for a copy (see __getstate__).
_RUNTIME = ("_opened", "_link", "_claims", "_saves", "_loads", "_checks")


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
            limit). The default, 8 MiB, keeps every connection of a save busy to its end: a cloud store serves
            one connection far slower than its aggregate. On S3 an object above 16 MiB is a multipart upload
            whose parts go up in parallel.
        chunk_size: bytes per checksummed chunk, which is also the unit of ranged reads on load: every chunk of
            every object is read and verified in parallel.
        max_concurrency: parallel object uploads and ranged downloads per save or load (connections to an
            object store; a local disk is written by fewer threads, see ``docs/fast-checkpoints.md``).
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
        dedup: incremental saves (docs/incremental.md): a save writes only the objects of tensors that changed since
            this process's last commit into the root; those of unchanged tensors (a frozen base) are referenced from
            the commit that stored them, which the pointer then keeps alive (``keep_last``, removals and ``gc`` delete
            a folder only once no live checkpoint references it). Every commit still lists each object it needs with
            its checksums, so it loads, verifies and exports alone. "Unchanged" is told without copying the bytes:
            the same tensor storage with the same torch version counter, confirmed by a fingerprint of its bytes
            taken on its own device (so a change through ``tensor.data`` or a numpy view, which the counter misses,
            is saved: see the docs). With ``async_save`` only the tensors of the objects a save writes are copied
            into its snapshot; with ``local_tier`` the local commits are incremental and a persist copies to the
            store only the objects it does not hold yet; on several nodes each peer is sent only what its tier
            lacks. A sharded strategy's saves are incremental per rank (each rank's unchanged shards referenced).
            False (the default in this release): every save writes everything.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        shard_size: int = 8 * 2**20,
        chunk_size: int = 16 * 2**20,
        max_concurrency: int = 16,
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
        dedup: bool = False,
    ) -> None:
        super().__init__()
        register_checkpoint_io(type(self))  # pytorch_lightning.Trainer accepts it too
        self.storage_options = check_storage_options(storage_options, "storage_options")
        # Checked in the order of the signature, each by the object that keeps it.
        self.settings = RootSettings(keep_last=keep_last, shard_size=shard_size, chunk_size=chunk_size,
                                     max_concurrency=max_concurrency, orphan_grace_seconds=orphan_grace_seconds,
                                     fallback_on_corruption=fallback_on_corruption,
                                     allow_unfenced_store=allow_unfenced_store, dedup=dedup)
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
        self.dedup = self.settings.dedup
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
        if node_cache_dir is not None and not isinstance(node_cache_dir, str):
            raise SettingTypeError(f"node_cache_dir must be a local folder path or None, got {node_cache_dir!r}")
        self.node_cache = node_cache
        self.node_cache_dir = node_cache_dir
        #: Timings of the most recent saves (what the training loop was blocked for, waits, uploads).
        self.save_stats: deque[SaveStats] = deque(maxlen=1000)
        #: What the most recent load read and allocated.
        self.last_load: LoadStats | None = None
        self._fit = FitLifecycle()  # where the plugin stands between fits (a copy keeps it: see FitLifecycle)
        self._build()

    def _build(self) -> None:
        """Make the collaborators from the settings. They reach the plugin's overridable methods (``root``, ``tiers``,
        ``_loader``, ...) through the plugin, so that a subclass that wraps one wraps it for all of them."""
        self._opened = OpenRoots(storage_options=self.storage_options, settings=self.settings, tier=self.tier_settings,
                                 retry=self.retry, max_concurrency=self.max_concurrency, node_cache=self.node_cache,
                                 node_cache_dir=self.node_cache_dir, root_for=self.root)
        # With a local tier on several processes: the job's nodes, and the copies between them (io/replicas.py).
        self._link = NodesLink(self.tier_settings, self.collective_timeout, tiers_for=self.tiers,
                               open_tiers=self._opened.tier_list)
        self._claims = LoadClaims(root_for=self.root, reopen=self._opened.reopen, fit=self._fit)
        self._saves = PluginSaves(local_tier=self.local_tier, async_save=self.async_save, pin_memory=self.pin_memory,
                                  root_for=self.root, tiers_for=self.tiers, stats_for=self.save_stats_for,
                                  options=self._opened.options, claims=self._claims, fit=self._fit)
        self._loads = PluginLoads(settings=self.settings, tier=self.tier_settings, pin_memory=self.pin_memory,
                                  root_for=self.root, loader_for=self._loader, options=self._opened.options,
                                  claims=self._claims, nodes=self._link, settle=self._saves.before_load,
                                  loaded=self._loaded)
        self._checks = FitChecks(settings=self.settings, local_tier=self.local_tier, root_for=self.root,
                                 tiers_for=self.tiers, find_latest=self.find_latest_checkpoint, fit=self._fit)

    # -- pickling ----------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # ``ddp_spawn`` pickles the Trainer's plugins into every process, ``torch.save(trainer)`` and ``deepcopy`` of
        # objects that hold the Trainer copy them: a copy keeps the settings and starts with no open roots, no
        # claimed writer epoch, no save in flight and no wrapper (those belong to the original; a copy that saves
        # claims anew, and finds its own wrapper when its fit starts).
        state = self.__dict__.copy()
        for runtime in _RUNTIME:
            state.pop(runtime, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build()

    # The runtime state tests and benchmarks look at: the open roots and tiers, and the async saver.
    @property
    def _roots(self) -> dict[tuple[str, str], CheckpointRoot]:
        return self._opened.roots

    @property
    def _tiers(self) -> dict[str, TieredRoot]:
        return self._opened.tiered

    @property
    def _async(self) -> AsyncSaver | None:
        return self._saves.async_saver

    # -- roots, tiers and nodes (plugin_roots.py, plugin_nodes.py) ------------------------------------------------
    def root(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> CheckpointRoot:
        """The protocol object of the checkpoint root ``url`` (one per root, shared by saves and loads)."""
        return self._opened.open(url, storage_options)

    def tiers(self, url: str, storage_options: dict[str, Any] | None = None) -> TieredRoot:
        """The durable root ``url`` and its local tier, as this plugin saves to them (needs ``local_tier``)."""
        tiers = self._opened.tiers(url, storage_options)
        self._link.wire(tiers)
        return tiers

    def _loader(self, root: CheckpointRoot) -> Callable[..., Loaded]:
        """How this process reads a commit of ``root``: through the node cache when several processes share it."""
        return self._opened.loader(root)

    def join_nodes(self, trainer: Any) -> None:
        """A fit of ``trainer`` starts (the fit-start check's ``setup``, on every rank): with a local tier and
        several processes, learn which node each process is on, make the groups the job's local tiers use, and
        start the copies of local commits between nodes. Every rank of the job calls it at the same point."""
        self.nodes_for(getattr(trainer, "strategy", None), fresh=True)

    def nodes_for(self, strategy: Any, *, fresh: bool = False, sharded: bool = False) -> Nodes | None:
        """The job's nodes (joined now if not yet: a collective of every rank); None without a local tier, or for a
        single process that is not ``sharded``. ``fresh``: join anew (a new fit)."""
        return self._link.nodes_for(strategy, fresh=fresh, sharded=sharded)

    # -- Lightning's CheckpointIO API (saves: plugin_saves.py; loads: plugin_loads.py) -------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self._saves.save(checkpoint, path, storage_options)

    def save_stats_for(self, name: str, checkpoint: dict[str, Any]) -> SaveStats:
        stats = SaveStats(name=name, step=step_of(checkpoint.get("global_step")))
        self.save_stats.append(stats)
        return stats

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return self._loads.load(path, map_location, weights_only, claim_on_load=self.claim_on_load)

    def _loaded(self, stats: LoadStats | None) -> None:
        self.last_load = stats

    def resolve_last(self, url: str, trainer: Any) -> str:
        """What a resuming fit's checkpoint ``url`` means: ``<dirpath>/last.ckpt`` (or ``last-v1.ckpt``, ...) of one of
        the fit's ModelCheckpoints, which is what Lightning makes of ``ckpt_path="last"`` on local disk, means the
        newest committed checkpoint of that root's run (the root's URL); any other ``url`` is returned as it is.

        Stock Lightning's ``last.ckpt`` is the newest save by construction. In a root of this plugin the name may lag
        behind the root's latest: an emergency save of ``PreemptionCheckpoint``, a save of another callback into the
        same folder, or a rollback whose run has not saved ``last.ckpt`` yet (the catalog's ``last.ckpt`` is then the
        abandoned branch's). Other loads (validate, test, a script) read the name as it is."""
        return self._loads.resolve_last(url, trainer)

    def load_sharded_tiered(self, url: str, strategy: Any, load_shards: Callable[[AtomicStorageReader], None], *,
                            shown: str, weights_only: bool | None) -> dict[str, Any] | None:
        """A sharded strategy's resume with a local tier (``AtomicModelParallelStrategy``, ``AtomicFSDPStrategy``):
        one decision across every node's local tier, each rank reading its shards from its node's tier (restored
        from a peer's replica where the node lacks them) or the durable root. ``load_shards(reader)`` loads the
        strategy's shards through ``reader``. Returns the checkpoint's rest, or None when no tier knows ``url``."""
        return self._loads.load_sharded(url, strategy, load_shards, shown=shown, weights_only=weights_only,
                                        claim_on_load=self.claim_on_load)

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
        self._saves.remove(path)

    @override
    def teardown(self) -> None:
        """Wait for the save in flight (async saves) and raise its error, if any; with ``local_tier``, persist the
        newest local checkpoint (the last save of a fit) of every root and wait for every persist. Then delete what
        the fit retired since its last commit (Lightning's last top-k removal, the last ``keep_last`` drop), which
        otherwise waits for a later commit that this job will not make: the root then holds what Lightning kept
        (see ``Retention.end_of_writer`` for why readers stay safe)."""
        self._fit.torn_down()
        self._opened.settle()
        try:
            self._opened.each_tier(lambda tier: tier.close(), first=self._saves.close)
        finally:
            # After the last persist (a sharded one written across nodes needs every node's part): every node's
            # copying thread ends, and the other nodes' processes may end their fit.
            self._link.stop()
        self._opened.end_of_writers()

    def wait(self) -> None:
        """Block until the async save in flight (if any) has committed and, with ``local_tier``, the persists
        queued so far are done (and, on global rank 0 of a job on several nodes, the copies of local commits to the
        other nodes); raise their error."""
        self._opened.settle()

        def tier_wait(tier: TieredRoot) -> None:
            tier.wait()
            tier.raise_failure()

        self._opened.each_tier(tier_wait, first=self._saves.wait)
        self._link.flush()

    def persist_latest(self) -> None:
        """With ``local_tier``: wait for the save in flight, then persist the newest local checkpoint of every root
        (if it is not there yet) and wait until it is committed there. ``PreemptionCheckpoint`` calls it after an
        emergency save: the node may not come back. Without a local tier: :meth:`wait`."""
        self._opened.settle()
        self._opened.each_tier(lambda tier: tier.persist_latest(), first=self._saves.wait)

    def wrapped_by(self, wrapper: Any) -> None:
        """``wrapper`` (Lightning's ``AsyncCheckpointIO``) holds this plugin, or None: the plugin is the strategy's own.
        Called by the fit-start check in every ``setup``. Wrapped, the saves run on the wrapper's worker thread and
        the removals reach the plugin on the Trainer's: each removal is then queued behind the saves handed to the
        wrapper before it (see ``async_save.WrappedSaves``); and the wrapper's ``teardown`` does not call this
        plugin's, which the fit-start check calls in the callback ``teardown`` that follows it."""
        self._saves.wrapped_by(wrapper)

    @property
    def wrapped(self) -> bool:
        """Whether a Lightning wrapper (``AsyncCheckpointIO``) holds this plugin (see :meth:`wrapped_by`)."""
        return self._saves.wrapped is not None

    # -- the fit (fit_lifecycle.py, plugin_checks.py) -----------------------------------------------------------------
    def begin_fit(self, *, resumed: bool, trainer: Any = None, pl_module: Any = None) -> None:
        """A ``fit`` of ``trainer`` on ``pl_module`` starts (called by the fit-start check callback).

        One that resumed a checkpoint claimed what it writes when it loaded. One that continues the previous fit of
        this plugin from its state in memory (the same Trainer and LightningModule objects, at the global step that
        fit ended at: ``trainer.fit`` called again with a higher ``max_steps``) is the same job: it goes on with that
        fit's writer epoch and lineage. Any other fit is a new job: the roots an earlier fit of this plugin claimed
        are claimed anew at its first save (it starts a new lineage, as a new process would) instead of continuing
        the earlier fit's writer epoch with another model's steps, or with steps from 0."""
        # What this plugin loaded outside a Trainer before is no origin of the fit: only what the fit resumes is.
        self._claims.forget()
        if self._fit.begin(resumed=resumed, trainer=trainer, pl_module=pl_module):
            for root in self._opened.claimed():
                self._opened.reopen(root)

    def end_fit(self, trainer: Any, pl_module: Any) -> None:
        """A ``fit`` of ``trainer`` on ``pl_module`` ended normally (called by the fit-start check callback): a next
        fit of the same two that starts where this one ended continues this job (see :meth:`begin_fit`)."""
        self._fit.end(trainer, pl_module)

    def check_root(self, root: str) -> None:
        """Raise now, naming what to fix, when ``root`` cannot hold checkpoints (see ``FitChecks.check_root``): the
        fit-start check calls it for every checkpoint folder of the fit, so the run stops before its first step."""
        self._checks.check_root(root)

    def check_retention(self, trainer: Any) -> None:
        """Warn, once when a fit of ``trainer`` starts, for each of its checkpoint folders where ``keep_last`` is
        smaller than what the ModelCheckpoints writing it keep (see ``FitChecks.check_retention``)."""
        self._checks.check_retention(trainer)

    def check_new_run(self, trainer: Any) -> None:
        """Refuse, when a fit of ``trainer`` starts, a fit that loads no checkpoint into a checkpoint folder that holds
        a committed run (:class:`~lightning_resilient.RunExistsError`, naming the checkpoint to resume), unless
        ``new_run=True`` (see ``FitChecks.check_new_run``)."""
        self._checks.check_new_run(trainer, new_run=self.new_run)

    def knows_checkpoint(self, path: str | os.PathLike[str]) -> bool:
        """Whether a committed checkpoint ``path`` (``<dirpath>/<name>``) exists; with ``local_tier``, answered without
        waiting for the store (see ``FitChecks.knows_checkpoint``). ``ModelCheckpoint.file_exists`` asks it."""
        return self._checks.knows_checkpoint(path)

    # -- extras ------------------------------------------------------------------------------------------------
    def find_latest_checkpoint(self, root: str | os.PathLike[str]) -> str | None:
        """Like :func:`find_latest_checkpoint`, with this plugin's storage options and local tier."""
        return find_latest_checkpoint(root, self.storage_options, local_tier=self.local_tier)

    def collect_garbage(self, root: str | os.PathLike[str], *, dry_run: bool = False,
                        abandoned: bool = False) -> list[str]:
        """Delete (or, with ``dry_run``, list) what no committed checkpoint under ``root`` needs: folders of crashed
        saves of fenced writers, retired folders whose time has come and, with ``abandoned``, checkpoints of
        branches a rollback left behind. Returns the URLs."""
        return [url for url, _ in self.root(root).collect_garbage(dry_run=dry_run, abandoned=abandoned)]
