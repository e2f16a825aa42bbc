"""Finding checkpoints in a root: what a URL names, the newest of the lineage, what to fall back to, repair.

Everything here reads; the only write is :func:`repair_pointer`'s. The order is lineage order
(:mod:`~lightning_resilient.io.lineage`): a checkpoint of an abandoned branch is never what a resume picks or
falls back to. A root whose pointer is missing is read from its manifests (with a warning); a damaged pointer
is an error that names the repair.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from lightning_resilient._warnings import warn
from lightning_resilient.errors import BucketNotFoundError, CheckpointCorruptedError, CheckpointError
from lightning_resilient.io import paths
from lightning_resilient.io.folders import REPLACED_DIR, writer_epoch_of
from lightning_resilient.io.lineage import Lineage, Origin
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import POINTER_NAME, Entry, Pointer
from lightning_resilient.io.root import INSPECTING, CheckpointRoot, Loaded, open_root
from lightning_resilient.io.store import Store, check_url

__all__ = ["ALONE", "NOT_FOUND", "Resolved", "Together", "as_str", "check_bucket", "check_not_a_file", "latest_in_root",
           "load_resolved", "normalize", "reader", "repair_pointer", "resolve", "stock_checkpoints", "was_retired"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# A reader whose checkpoint was retired (deleted by retention) while it read resolves the URL again this often.
_RESOLVE_ATTEMPTS = 5


def as_str(url: str | os.PathLike[str]) -> str:
    """A checkpoint path or URL as a string (a ``pathlib.Path`` as its path); anything else is a ``TypeError``."""
    text = os.fspath(url) if isinstance(url, (str, os.PathLike)) else url
    if not isinstance(text, str):
        raise TypeError(f"a checkpoint path or URL must be a str or a pathlib.Path, got {url!r}")
    return text


def normalize(url: str | os.PathLike[str]) -> str:
    """A local path made absolute (``~`` expanded); any other URL without its trailing slash. A URL no store would
    read as meant (``s3:/bucket`` with one slash, ``S3://``, ``s4://``) raises ``StoreURLError`` naming the one
    most likely meant (``check_url``). A ``pathlib.Path`` is taken as its path (Lightning's paths are ``str |
    Path``)."""
    url = as_str(url)
    check_url(url)
    protocol, rest = paths.split_protocol(url)
    if protocol in (None, "file", "local"):
        return os.path.abspath(os.path.expanduser(rest))
    return paths.strip_trailing(url)


# Lightning's own words for a missing ckpt_path (scripts and people search for them); ours follow.
NOT_FOUND = "Checkpoint file not found: "


def _follow_local_link(url: str) -> str:
    """Where a local symlink points (``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` to the checkpoint it
    saved last, a name folder of the same root); any other URL as it is."""
    if paths.split_protocol(url)[0] not in (None, "file", "local"):
        return url
    for _ in range(8):  # a chain of links, never a loop
        if not os.path.islink(url):
            return url
        url = os.path.normpath(os.path.join(os.path.dirname(url), os.readlink(url)))
    return url


def stock_checkpoints(store: Store) -> list[tuple[str, float]]:
    """Plain ``.ckpt`` files directly in the root (stock Lightning's, written before this plugin was added), and those
    a save of the same name moved aside and never replaced (it died), with their modification times by the store's
    clock, newest first. Names are relative to the root."""
    found = [(name, info.modified or 0.0) for name, info in store.list_detail("").items()
             if name.endswith(".ckpt") and not name.startswith(".")]
    found += [(f"{REPLACED_DIR}/{name}", info.modified or 0.0)
              for name, info in store.list_detail(REPLACED_DIR).items()]
    return sorted(found, key=lambda item: item[1], reverse=True)


def check_bucket(store: Store) -> None:
    """Raise ``FileNotFoundError`` naming the bucket when an S3/GCS root's bucket does not exist."""
    protocol = paths.split_protocol(store.root_url)[0]
    if protocol in ("s3", "s3a", "gs", "gcs"):
        bucket = store.root_path.split("/", 1)[0]
        if not store.bucket_exists(bucket):
            raise BucketNotFoundError(f"bucket {bucket!r} does not exist (looking for checkpoints in"
                                    f" {store.root_url}): create it, fix the checkpoint dirpath, or use"
                                    " credentials that can see it")


def check_not_a_file(store: Store, shown: str) -> None:
    """Raise ``NotADirectoryError`` naming ``shown`` (the root as the caller gave it) when the root is a file: a
    checkpoint root is the folder a ModelCheckpoint saves into."""
    if store.root_is_file():
        raise NotADirectoryError(f"{shown!r} is a file, not a checkpoint root: pass the folder that holds the"
                                 " checkpoints (the ModelCheckpoint dirpath); a checkpoint file itself is loaded with"
                                 " load_checkpoint(path)")


def reader(root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> CheckpointRoot:
    """A root opened outside any plugin (find_latest_checkpoint, repair_pointer): default retries, serial I/O."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict of fsspec options or None, got {storage_options!r}")
    # Falls back past a damaged checkpoint as the plugin does by default: what a resume would load. A collection
    # through it (tests, tools that pass their own grace) is the caller's explicit request: no grace period.
    return open_root(normalize(root), storage_options,
                     settings=replace(INSPECTING, orphan_grace_seconds=0.0, fallback_on_corruption=True))


@dataclass
class Resolved:
    """What a URL names: the root, the checkpoint to load, and what to fall back to if it fails verification."""

    root: CheckpointRoot
    entry: Entry
    fallbacks: list[Entry]
    pinned: bool  # the URL named this very commit (not "the latest of a root" or "the newest of a name")


def _pointer_or_scan(root: CheckpointRoot) -> Pointer | None:
    pointer, _ = root.read_pointer()
    if pointer is None:
        scan = root.scan()
        if scan.manifests:
            pointer = scan.pointer()
    return pointer


def older(pointer: Pointer, entry: Entry, origin: Origin | None = None) -> list[Entry]:
    """What a load of ``entry`` falls back to: the checkpoints of the lineage ``entry`` continues, newest first."""
    origins = dict(pointer.origins)
    if origin is not None:
        origins.setdefault(entry.writer_epoch, origin)
    return [e for e in Lineage.below(origins, entry).members(pointer.entries()) if e.commit != entry.commit]


def resolve(url: str, root_for: Callable[[str], CheckpointRoot], *, shown: str | None = None) -> Resolved | None:
    """What ``url`` names: a commit folder, a root (its latest), or a name in a root; None for a plain file.

    A root or a commit folder (what :func:`find_latest_checkpoint` returns) costs one pointer read: the load then
    reads the manifest and the data, and nothing else. ``shown``: the path as the caller gave it, for messages
    (``url`` is normalized: a relative path made absolute).
    """
    shown = url if shown is None else shown
    url = _follow_local_link(url)
    name = paths.basename(url)
    if writer_epoch_of(name) is not None:
        # <root>/<name>/<commit>: what resuming passes. The root's pointer knows the commit and its lineage.
        root = root_for(paths.dirname(paths.dirname(url)))
        commit = f"{paths.basename(paths.dirname(url))}/{name}"
        pointer = _pointer_or_scan(root) or Pointer()
        known = {e.commit: e for e in pointer.entries()}
        if commit in known:
            return Resolved(root, known[commit], older(pointer, known[commit]), pinned=True)
        if root.store.exists(f"{commit}/{MANIFEST_NAME}"):  # committed, no longer (or never) in the catalog
            try:
                manifest = root.read_manifest(commit)
            except CheckpointCorruptedError:
                if root.store.exists(f"{commit}/{MANIFEST_NAME}"):
                    raise
                manifest = None  # retired in between: its manifest went first
            if manifest is not None:
                entry = Entry.from_manifest(manifest)
                return Resolved(root, entry, older(pointer, entry, manifest.origin), pinned=True)
        if pointer.writer_epoch:
            latest = pointer.candidates()
            raise FileNotFoundError(
                f"{NOT_FOUND}{shown}. It no longer exists: {root.url} holds no commit {commit!r} (retention deletes the"
                " checkpoints keep_last or a top-k rotation drop, a save later; a save that never committed leaves"
                " no manifest; a checkpoint of a local tier that was not persisted is only on the node that wrote it:"
                " pass that plugin's local_tier)."
                + (f" The root's latest is {root.store.url(latest[0].commit)}." if latest else ""))

    as_root = root_for(url)
    root_pointer, _ = as_root.read_pointer()
    if root_pointer is not None:
        candidates = root_pointer.candidates()
        if not candidates:
            raise FileNotFoundError(f"checkpoint root {shown} has a pointer but no committed checkpoint of its current"
                                    " run yet")
        return Resolved(as_root, candidates[0], candidates[1:], pinned=False)

    parent = root_for(paths.dirname(url))
    parent_pointer, _ = parent.read_pointer()
    if parent_pointer is not None:
        named = parent_pointer.checkpoints.get(name)
        if named is None and parent_pointer.latest is not None and parent_pointer.latest.name == name:
            named = parent_pointer.latest
        if named is not None:
            return Resolved(parent, named, older(parent_pointer, named), pinned=False)
    if parent.store.is_file(name):
        return None  # a plain file
    if parent_pointer is None and parent.store.list_dir(name):  # a name in a root whose pointer is missing (or moving)
        scanned_parent = parent.scan().pointer()
        named = scanned_parent.checkpoints.get(name)
        if named is not None:
            return Resolved(parent, named, older(scanned_parent, named), pinned=False)
    if parent_pointer is not None:
        raise FileNotFoundError(f"{NOT_FOUND}{shown}. No committed checkpoint is named {name!r} under {parent.url}:"
                                f" committed names are {sorted(parent_pointer.checkpoints)}")
    scanned = as_root.scan().pointer() if as_root.store.list_dir("") else None
    if scanned is not None and scanned.candidates():
        candidates = scanned.candidates()
        warn(f"{as_root.store.url(POINTER_NAME)} is missing; loading the newest committed checkpoint found"
             f" by scanning, {candidates[0].commit}. lightning_resilient.repair_pointer({url!r}) restores"
             " the pointer.", RuntimeWarning)
        return Resolved(as_root, candidates[0], candidates[1:], pinned=False)
    raise FileNotFoundError(f"{NOT_FOUND}{shown}. It is not a checkpoint root (no {POINTER_NAME}), not a committed"
                            f" name in its parent's pointer, not a checkpoint folder (no {MANIFEST_NAME}), and not a"
                            " file")


def was_retired(root: CheckpointRoot, entry: Entry) -> bool:
    """Whether ``entry`` failed to read because retention deleted it meanwhile (not because it is damaged)."""
    # Retention deletes a folder's manifest first, and only once the pointer no longer references it: a
    # checkpoint whose manifest is gone and that the pointer has let go of was retired, not damaged.
    try:
        pointer, _ = root.read_pointer()
        return (pointer is not None and entry.commit not in pointer.live_folders()
                and not root.store.exists(f"{entry.commit}/{MANIFEST_NAME}"))
    except (CheckpointError, OSError):
        return False


@dataclass(frozen=True)
class Together:
    """The processes of one job deciding together (a Lightning strategy's collectives): who decides, and how.

    :data:`ALONE` is the one process of a job that has no collectives (or of a tool outside any job)."""

    rank: int
    broadcast: Callable[[Any], Any]  # rank 0's object, on every rank
    all_true: Callable[[bool], bool]
    any_true: Callable[[bool], bool]
    alone: bool = False  # one process: messages speak of it, not of "every rank"


def _same(value: Any) -> Any:
    return value


ALONE = Together(rank=0, broadcast=_same, all_true=_same, any_true=_same, alone=True)


@dataclass(frozen=True)
class _Plan:
    """What rank 0 resolved, as every rank receives it."""

    root: str
    candidates: list[Entry]  # what to load, in order: the entry, then its fallbacks (when falling back)
    fallbacks: list[Entry]
    pinned: bool


def load_resolved(url: str, root_for: Callable[[str], CheckpointRoot], *, fallback: bool,
                  load_for: Callable[[CheckpointRoot], Callable[..., Loaded]], together: Together = ALONE,
                  shown: str | None = None, **load_kwargs: Any) -> tuple[Resolved, Loaded] | None:
    """Resolve ``url`` and load it, falling back when ``fallback``; None when it names a plain file.

    With several processes (``together``), rank 0 resolves ``url`` (whatever each rank was given) and every rank
    loads exactly that commit. After each candidate the ranks agree: all loaded it, or they all move on together to
    the same older commit (a rank whose part is damaged makes every rank fall back). Every rank must call this
    (Lightning's resume does, on every rank).

    A checkpoint retired by retention while it was read is not reported as corrupted: the URL is resolved again
    (the root's latest has moved on), or, for a URL naming that very commit, a ``FileNotFoundError`` says so.
    ``shown``: ``url`` as the caller gave it, for messages.
    """
    shown = url if shown is None else shown
    for _ in range(_RESOLVE_ATTEMPTS):
        plan: _Plan | BaseException | None = None
        if together.rank == 0:
            try:
                found = resolve(url, root_for, shown=shown)
            except Exception as exc:  # every rank raises what rank 0 found
                plan = exc
            else:
                plan = None if found is None else _Plan(
                    found.root.url, [found.entry, *(found.fallbacks if fallback else [])], found.fallbacks,
                    found.pinned)
        plan = together.broadcast(plan)
        if isinstance(plan, BaseException):
            raise plan
        if plan is None:
            return None
        root = root_for(plan.root)
        done = _load_first_valid(root, plan, load_for(root), together, load_kwargs)
        if done is not None:
            return done
        log.info("a checkpoint resolved from %s was retired while it was read: resolving it again", url)
    raise FileNotFoundError(f"every checkpoint resolved from {shown} was retired while it was being read"
                            f" ({_RESOLVE_ATTEMPTS} times): the job writing it saves faster than it can be read")


def _load_first_valid(root: CheckpointRoot, plan: _Plan, load: Callable[..., Loaded], together: Together,
                      load_kwargs: dict[str, Any]) -> tuple[Resolved, Loaded] | None:
    """Load the first of ``plan.candidates`` that verifies (on every rank); None when one was retired meanwhile
    (resolve again). The catalog's one fallback loop (a tiered load has its own, over two roots): a damaged checkpoint
    is reported loudly, never loaded."""
    first_error: CheckpointCorruptedError | None = None
    error: CheckpointCorruptedError | None = None
    tried: list[str] = []
    every = "" if together.alone else " on every rank"
    for candidate in plan.candidates:
        url = root.store.url(candidate.commit)
        error = None
        try:
            loaded = load(candidate.commit, **load_kwargs)
        except CheckpointCorruptedError as exc:
            error = exc
        if together.all_true(error is None):
            if tried and together.rank == 0:
                _loud(f"loaded the previous committed checkpoint {url} (step {candidate.step}){every} instead of"
                      f" {tried[0]}, which failed verification")
            return Resolved(root, candidate, plan.fallbacks, plan.pinned), loaded
        if together.any_true(error is not None and was_retired(root, candidate)):
            if plan.pinned:
                raise FileNotFoundError(f"{url} was deleted by retention (keep_last or a top-k rotation of the job"
                                        f" writing {root.url}) while it was being read; load the root's latest"
                                        " instead") from error
            return None
        tried.append(url)
        first_error = first_error or error
        if error is not None:  # the ranks that failed say why; all of them move on together
            _loud(f"checkpoint {url} is corrupted and was NOT loaded: {error}" if together.alone else
                  f"checkpoint {url} is corrupted and was NOT loaded (rank {together.rank}: {error}); every rank"
                  " falls back to the previous committed one")
    if together.alone and first_error is not None:
        raise CheckpointCorruptedError(
            f"no valid checkpoint to load: {first_error}" + (f" (also tried {', '.join(tried[1:])})"
                                                              if len(tried) > 1 else ""), object=first_error.object)
    # Under a strategy, what this rank found wrong with the last one tried (another rank may have failed it instead).
    last = plan.candidates[-1]
    raise CheckpointCorruptedError(f"no valid checkpoint to load under {root.url}: the last one tried,"
                                   f" {root.store.url(last.commit)}, failed on at least one rank"
                                   + (f" ({error})" if error is not None else ""),
                                   object=error.object if error is not None else None)


def _loud(message: str) -> None:
    log.error(message)
    warn(message, RuntimeWarning)


def latest_in_root(checkpoint_root: CheckpointRoot, shown: str) -> str | None:
    """The newest committed checkpoint of the current run in one root (see :func:`~lightning_resilient.io.latest.
    find_latest_checkpoint`, which also looks in a local tier), read again while retention retires the candidates.
    ``shown``: the root as the caller gave it, for messages."""
    for _ in range(_RESOLVE_ATTEMPTS):
        found = _find_latest(checkpoint_root, shown)
        if found is not _RETIRED:
            return found  # type: ignore[return-value]
    raise FileNotFoundError(f"every checkpoint found under {checkpoint_root.url} was retired while it was being read"
                            f" ({_RESOLVE_ATTEMPTS} times): the job writing it saves faster than it can be read")


_RETIRED = object()


def _find_latest(checkpoint_root: CheckpointRoot, shown: str) -> str | object | None:
    """One attempt of latest_in_root; ``_RETIRED`` when retention retired the candidates meanwhile."""
    store = checkpoint_root.store
    pointer, _ = checkpoint_root.read_pointer()
    unreadable: dict[str, str] = {}
    if pointer is None:
        # Only here: a root with a pointer is a folder, and a resume pays one pointer and one manifest read, no more.
        check_not_a_file(store, shown)
        check_bucket(store)
        scan = checkpoint_root.scan()
        unreadable = dict(scan.unreadable)
        if scan.manifests:
            pointer = scan.pointer()
            warn(f"{store.url(POINTER_NAME)} is missing but {len(scan.manifests)} committed checkpoint(s)"
                 f" exist under {store.root_url}; using the newest of the current run. Call"
                 f" lightning_resilient.repair_pointer({store.root_url!r}) to restore the pointer.", RuntimeWarning)
    for entry in pointer.candidates() if pointer is not None else []:
        try:
            checkpoint_root.read_manifest(entry.commit)
        except CheckpointCorruptedError as exc:
            if was_retired(checkpoint_root, entry):
                return _RETIRED  # not damaged: the pointer has moved on, read it again
            unreadable[entry.commit] = str(exc)
            warn(f"skipping {store.url(entry.commit)}: {exc}", RuntimeWarning)
            continue
        return store.url(entry.commit)
    if pointer is not None and not unreadable and pointer.abandoned():
        log.info("no checkpoint of the current run under %s; %d of an abandoned branch (a later job started fresh or"
                 " resumed an earlier checkpoint): pass one as ckpt_path to go back to it", store.root_url,
                 len(pointer.abandoned()))
    if unreadable:
        first = next(iter(unreadable))
        raise CheckpointCorruptedError(
            f"no committed checkpoint under {store.root_url} has a valid manifest ({len(unreadable)} damaged:"
            f" {', '.join(sorted(unreadable))}; first: {unreadable[first]}). Training would restart from step 0"
            f" over a root that holds a run: check the store (`lightning-resilient ls {store.root_url}`) before"
            " deleting it or choosing another dirpath.", object=store.url(first))
    if pointer is None or not pointer.checkpoints:
        # Only a root that never committed a checkpoint of ours: one whose run was abandoned (a fresh start over it)
        # is not resumed from an older stock file either.
        stock = stock_checkpoints(store)
        if stock:
            # A run that used stock Lightning checkpointing before this plugin was added: resume it where stock
            # Lightning would (its newest file), rather than silently from step 0.
            from lightning.fabric.utilities import rank_zero_info  # the protocol imports no Lightning

            url = store.url(stock[0][0])
            rank_zero_info(f"lightning_resilient: no committed checkpoint under {store.root_url}; resuming from the"
                           f" newest stock Lightning checkpoint {url} ({len(stock)} stock file(s), not verified:"
                           " stock checkpoints carry no checksums)")
            return url
    return None


def repair_pointer(root: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """Rebuild a missing or damaged pointer from the committed manifests under ``root``.

    The lineage comes from the manifests (each records where its run came from); each name catalogs its newest
    commit, latest is the newest checkpoint of the current lineage, and the writer epoch is the highest any commit
    folder carries, so a job still writing with that epoch continues. Returns the new latest's URL.
    """
    checkpoint_root = reader(root, storage_options)
    store = checkpoint_root.store
    check_not_a_file(store, root)
    pointer = checkpoint_root.scan().pointer()
    pointer.txn = "repaired"
    current = store.read_versioned(POINTER_NAME)
    if not store.write_if(POINTER_NAME, pointer.to_bytes(), current[1] if current else None):
        raise RuntimeError(f"{store.url(POINTER_NAME)} changed while it was being repaired: a writer is active."
                           " Run the repair again once it has stopped.")
    return store.url(pointer.latest.commit) if pointer.latest else None
