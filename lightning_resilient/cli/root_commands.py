"""``lightning-resilient ls | verify | gc | export | goodput``: look at, check and clean a checkpoint root, and add up
what its training run's attempts cost, without writing Python.

This module owns these five commands, their options and their messages (``_guarded``: bad input exits 2 with one
line). It drives the storage protocol (``io/``) and reads the attempt records and goodput ledger the training run
keeps beside its checkpoints (``state/attempts.py``, ``state/goodput.py``); both sit below the command line, so
neither imports this module. The protocol's modules that import torch are imported inside the commands.

Exit status: 0 when all is well, 1 when a checkpoint fails verification (or the pointer is damaged), 2 for bad
input (a URL no filesystem knows, a missing bucket, missing credentials, a checkpoint that does not exist, a file
where a root should be), always as one line naming the fix.

A checkpoint is named the same way everywhere: a root (its latest), ``ROOT/NAME`` (``last.ckpt``, a top-k name) or a
commit folder ``ROOT/NAME/c...`` (what ``find_latest_checkpoint`` returns), as ``export`` and ``load_checkpoint`` take
it; ``verify ROOT NAME`` also takes the name apart from its root. ``ls`` and ``gc`` work on a root, and say which
when given a checkpoint in one. Their hints name the command that acts on what they describe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightning_resilient.errors import CheckpointCorruptedError, CheckpointError, StoreSetupError
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import LEGACY_NAMES, POINTER_NAME, Entry, Pointer

if TYPE_CHECKING:
    from lightning_resilient.io.root import CheckpointRoot

__all__ = ["add_commands"]

_CONCURRENCY = 8
# PreemptionCheckpoint's default filename is preemption.ckpt: ls marks saves so named as emergency saves.
PREEMPTION_PREFIX = "preemption"


def add_commands(subparsers: Any) -> None:
    """Register ``ls``, ``verify``, ``gc``, ``export`` and ``goodput`` on the ``lightning-resilient`` parser."""
    ls = subparsers.add_parser("ls", help="the pointer and every committed checkpoint of a root",
                               description="Show the pointer (latest, writer epoch) and each committed checkpoint"
                                           " with its step, size, age and whether it verifies, then each attempt of"
                                           " the training run with its resume audit.")
    ls.add_argument("root", help="the checkpoint root (ModelCheckpoint dirpath): s3://..., gs://..., a path")
    ls.add_argument("--quick", action="store_true",
                    help="check manifests and object sizes only, instead of every byte's checksum")
    _local_tier_option(ls)
    _storage_option(ls)
    ls.set_defaults(func=_guarded(_ls))

    verify = subparsers.add_parser("verify", help="check every checksum of a checkpoint (default: the latest)",
                                   description="Read every object of a checkpoint and check every checksum, with a"
                                               " progress bar. Exit status 1 on any failure.")
    verify.add_argument("root", help="the checkpoint root (its latest), a checkpoint in it (ROOT/last.ckpt) or a commit"
                                     " folder (ROOT/NAME/c...)")
    verify.add_argument("checkpoint", nargs="?", default=None,
                        help="a checkpoint name (last.ckpt), commit folder or URL under ROOT; default: what ROOT names")
    verify.add_argument("--all", action="store_true", help="verify every committed checkpoint of the root")
    verify.add_argument("--no-progress", action="store_true", help="no progress bar")
    _storage_option(verify)
    verify.set_defaults(func=_guarded(_verify))

    gc = subparsers.add_parser("gc", help="delete what no committed checkpoint needs (or show it: --dry-run)",
                               description="Collect folders of crashed saves of fenced-off jobs (never a save of the"
                                           " job writing the root, whatever --grace), retired folders whose time has"
                                           " come and incomplete multipart uploads; with --keep-last N, also drop"
                                           " all but the N newest checkpoints of the current run (never the latest,"
                                           " never one a job resumed from); with --abandoned, the checkpoints of"
                                           " branches a rollback left behind. Never a checkpoint a ModelCheckpoint of"
                                           " the run still reports (best_model_path, best_k_models, last_model_path)."
                                           " Safe beside a running job.")
    gc.add_argument("root", help="the checkpoint root")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    # Named as the plugin's setting (AtomicCheckpointIO(orphan_grace_seconds=...)); --grace is the short form.
    gc.add_argument("--orphan-grace-seconds", "--grace", dest="grace", type=float, default=3600.0, metavar="SECONDS",
                    help="seconds a crashed save of a fenced-off job is left alone, by the store's clock (default"
                         " 3600); a save of the current job is never collected")
    gc.add_argument("--keep-last", type=int, default=None,
                    help="retention: keep only the N newest checkpoints of the current run")
    gc.add_argument("--abandoned", action="store_true",
                    help="also delete checkpoints outside the current run's lineage (a branch a rollback left)")
    _local_tier_option(gc)
    _storage_option(gc)
    gc.set_defaults(func=_guarded(_gc))


    export = subparsers.add_parser("export", help="write a committed checkpoint as one stock .ckpt file",
                                   description="Verify a committed checkpoint and write it as one stock Lightning .ckpt"
                                               " file (torch.load-able, loadable by stock Lightning without this"
                                               " package), for tools that need a file. Read-only on the root.")
    export.add_argument("checkpoint", help="a commit folder, a name (<root>/last.ckpt) or a root (its latest)")
    export.add_argument("out", help="the .ckpt file to write (a path or an fsspec URL)")
    _storage_option(export)
    export.set_defaults(func=_guarded(_export))

    goodput = subparsers.add_parser(
        "goodput", help="what each attempt of the training run cost: productive time, lost steps, goodput",
        description="Add up the goodput ledger that ResumeStateCallback keeps beside the checkpoints: per attempt"
                    " (each run of the training command) when it started, what it resumed, the steps it reached, how"
                    " it ended, its restore time, save stalls, the steps the next attempt recomputed and its"
                    " productive time; then the totals, goodput as a fraction of the wall time, the measured MTBF"
                    " and checkpoint cost, and the Young/Daly interval they give. Read-only.")
    goodput.add_argument("root", help="the checkpoint root (ModelCheckpoint dirpath): s3://..., gs://..., a path")
    goodput.add_argument("--json", action="store_true",
                         help='print JSON instead: {"attempts": [...], "lost_steps": int, "goodput": float, ...}')
    _storage_option(goodput)
    goodput.set_defaults(func=_guarded(_goodput))


def _local_tier_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local-tier", default=None, metavar="DIR",
                        help="the plugin's local_tier folder on this node: also show (ls) or clean (gc) this root's"
                             " local tier")


def _storage_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help='fsspec options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\''
                             " (credentials and endpoints also come from the usual environment variables)")


class _Usage(Exception):
    """Bad input: printed, exit status 2."""


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except _Usage as exc:
            print(f"lightning-resilient {args.command}: {exc}", file=sys.stderr)
            return 2
        except StoreSetupError as exc:
            print(f"lightning-resilient {args.command}: {exc.cli_message}", file=sys.stderr)
            return 2
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
            print(f"lightning-resilient {args.command}: {exc}", file=sys.stderr)
            return 2
        except CheckpointError as exc:
            print(f"lightning-resilient {args.command}: {exc}", file=sys.stderr)
            return 1

    return run


def _open(args: argparse.Namespace, *, grace: float = 3600.0) -> CheckpointRoot:
    # The protocol's modules import torch: only a command that runs needs them, `--help` answers without.
    from lightning_resilient.io.catalog import check_bucket, check_not_a_file, normalize
    from lightning_resilient.io.root import INSPECTING, open_root

    # A URL no filesystem knows raises StoreURLError here.
    root = open_root(normalize(args.root), _options(args), settings=replace(INSPECTING, orphan_grace_seconds=grace),
                     executor=_cli_pool)
    check_bucket(root.store)
    check_not_a_file(root.store, args.root)
    return root


def _open_root_only(args: argparse.Namespace, *, grace: float = 3600.0) -> CheckpointRoot:
    """The root ``args.root`` names, for a command that works on a whole root (``ls``, ``gc``): a checkpoint in one
    (``ROOT/NAME`` or a commit folder) is refused with the command that would work."""
    from lightning_resilient.io import paths
    from lightning_resilient.io.folders import writer_epoch_of
    from lightning_resilient.io.root import INSPECTING, open_root

    root = _open(args, grace=grace)
    given, name = args.root.rstrip("/") or args.root, paths.basename(root.url)
    if writer_epoch_of(name) is not None:  # a commit folder, ROOT/NAME/c...
        parent = paths.dirname(paths.dirname(given)) or "."
    else:
        if _pointer(root) is not None:
            return root
        around = _pointer(open_root(paths.dirname(root.url), _options(args), settings=INSPECTING))
        if around is None or name not in around.checkpoints:
            return root
        parent = paths.dirname(given) or "."  # a name the root above it catalogs, ROOT/NAME
    raise _Usage(f"{args.root} is a checkpoint in the root {parent}, not a root: run"
                 f" `lightning-resilient {args.command} {parent}`")


def _cli_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_CONCURRENCY, thread_name_prefix="lightning_resilient-cli")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    if not args.storage_options:
        return {}
    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise _Usage(f"--storage-options is not valid JSON ({exc})") from None
    if not isinstance(options, dict):
        raise _Usage(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    return options


def _export(args: argparse.Namespace) -> int:
    from lightning_resilient.io.loading import export_checkpoint

    written = export_checkpoint(args.checkpoint, args.out, storage_options=_options(args))
    print(f"wrote {written} ({_size(os.path.getsize(written)) if os.path.exists(written) else 'remote'})")
    return 0


def _goodput(args: argparse.Namespace) -> int:
    # The ledger is exact resume's records (state/goodput.py), which import neither torch nor Lightning.
    from lightning_resilient.state.goodput import measure

    root = _open_root_only(args)
    ledger = measure(root.store)
    if args.json:
        print(json.dumps(ledger.to_json(), indent=1))
    elif not ledger.attempts and not ledger.skipped:
        print(f"no attempts recorded under {root.url}: ResumeStateCallback (ledger=True, the default) keeps the"
              " ledger of a training run in the ModelCheckpoint dirpath")
    else:
        print(ledger.table())
    return 0


def _pointer(root: CheckpointRoot) -> Pointer | None:
    pointer, _ = root.read_pointer()
    return pointer


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _age(created: float) -> str:
    seconds = max(0.0, time.time() - created)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.1f} {unit}"
    return f"{seconds:.0f} s"


def _check(root: CheckpointRoot, entry: Entry, quick: bool) -> str:
    try:
        if quick:
            root.reader.check_sizes(entry.commit)
            return "sizes ok"
        root.verify(entry.commit)
        return "yes"
    except CheckpointCorruptedError as exc:
        return f"NO: {exc}"


def _stored_here(root: CheckpointRoot, entry: Entry) -> int | None:
    """The bytes of ``entry``'s objects in its own folder (the rest it references: another commit stored them);
    None when its manifest does not load (the verifies column says why)."""
    try:
        manifest = root.read_manifest(entry.commit)
    except CheckpointError:
        return None
    return sum(o.size for o in manifest.objects if o.path.rsplit("/", 1)[0] == entry.commit)


def _ls(args: argparse.Namespace) -> int:
    from lightning_resilient.io.catalog import stock_checkpoints
    from lightning_resilient.io.fencing import RESUMED
    from lightning_resilient.io.folders import writer_epoch_of

    root = _open_root_only(args)
    pointer = _pointer(root)
    print(f"root:    {root.url}")
    scanned = pointer is None
    stock = stock_checkpoints(root.store)
    if pointer is None:
        scan = root.scan()
        if not scan.manifests and not scan.unreadable:
            if stock:
                print("no committed checkpoint (no pointer); stock Lightning checkpoints only:")
                _print_stock(root, stock)
            else:
                print("no checkpoints (no pointer, no committed checkpoint)")
            _print_attempts(root)
            return 0
        pointer = scan.pointer()
        print(f"pointer: MISSING ({POINTER_NAME}); {len(scan.manifests)} committed checkpoint(s) found by scanning."
              f" Rebuild it with: python -c \"import lightning_resilient as lr; lr.repair_pointer({root.url!r})\"")
    else:
        latest = f"{pointer.latest.name} (step {pointer.latest.step})" if pointer.latest else "none"
        print(f"pointer: {POINTER_NAME}, writer epoch {pointer.writer_epoch} ({pointer.writer or 'unknown'}),"
              f" latest {latest}")
    members = pointer.candidates()
    abandoned = pointer.abandoned()
    rows = [(e, _check(root, e, args.quick)) for e in members + abandoned]
    latest_commit = pointer.latest.commit if pointer.latest else None
    print()
    print("| name | step | epoch | writer epoch | size | stored here | age | commit | verifies |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    sharing = 0
    for e, status in rows:
        marks = (" (latest)" if e.commit == latest_commit and not scanned else "") + (
            " (resumed from)" if pointer.protected.get(e.commit, "").startswith(RESUMED) else "") + (
            " (abandoned branch)" if e in abandoned else "") + (
            " (emergency save: preemption)" if e.name.startswith(PREEMPTION_PREFIX) else "")
        here = _stored_here(root, e)
        sharing += here is not None and len(set(e.folders) - {e.commit}) > 0
        print(f"| {e.name}{marks} | {e.step} | {e.epoch} | {e.writer_epoch} | {_size(e.size)} |"
              f" {'?' if here is None else _size(here)} | {_age(e.created)} | {e.commit} | {status} |")
    if sharing:
        print(f"\n{sharing} checkpoint(s) reference objects another commit stored (last.ckpt saved at a top-k save's"
              " step, or unchanged tensors with dedup=True): 'size' is what a load reads, 'stored here' what the"
              " commit wrote itself. Each is still complete; copy one elsewhere with `lightning-resilient export`.")
    # What `gc` would delete now (default grace), so that every hint below says what acts on what it describes.
    collectable = {url for url, _ in root.collect_garbage(dry_run=True)} if not scanned else set()
    gc_root = f"`lightning-resilient gc {args.root}`"
    if abandoned:
        with_abandoned = {url for url, _ in root.collect_garbage(dry_run=True, abandoned=True)}
        going = [e for e in abandoned if any(root.store.url(f) in with_abandoned for f in e.folders)]
        kept = len(abandoned) - len(going)
        print(f"\n{len(abandoned)} checkpoint(s) belong to an abandoned branch (a later job started fresh or resumed"
              f" an earlier checkpoint): never resumed; `lightning-resilient gc {args.root} --abandoned` deletes"
              + (" them" if not kept else f" {len(going)} of them ({kept} kept: the latest, or what a job resumed"
                                           " from)"))
    live = pointer.live_folders()
    retired, others, uncommitted = [], [], []
    for name in root.store.list_dir(""):
        if name in LEGACY_NAMES or name.startswith("."):
            continue
        for child in root.store.list_dir(name):
            folder = f"{name}/{child}"
            if writer_epoch_of(child) is None or folder in live:
                continue
            if folder in pointer.retired:
                retired.append(folder)
            elif MANIFEST_NAME in root.store.list_detail(folder):
                others.append(folder)
            else:
                uncommitted.append(folder)
    if retired:
        print(f"\n{len(retired)} folder(s) retired by retention (no longer checkpoints; deleted at the next commit of"
              " the job writing the root, or when its fit ends): "
              + _gc_hint(retired, root, collectable, gc_root, "are deleted by gc once the pointer has not changed for"
                         " --grace seconds (default: an hour)"))
    if others and not scanned:
        print(f"\n{len(others)} committed folder(s) the pointer does not reference (a job died between a save's"
              " manifest and its pointer update, or a rebuilt pointer named only the newest commit of a name): "
              + _gc_hint(others, root, collectable, gc_root, "are saves of the job writing the root (never"
                         " collected while it writes) or younger than --grace (default: an hour)"))
    if uncommitted:
        print(f"\n{len(uncommitted)} folder(s) without a manifest (interrupted saves, or a save in progress; never"
              " loadable): "
              + _gc_hint(uncommitted, root, collectable, gc_root, "are saves of the job writing the root (never"
                         " collected while it writes) or younger than --grace (default: an hour)"))
    if stock:
        print(f"\n{len(stock)} stock Lightning checkpoint file(s) (written without this plugin; resumed from only when"
              " no"
              " committed checkpoint exists):")
        _print_stock(root, stock)
    _print_attempts(root)
    bad = [e for e, status in rows if status.startswith("NO")]
    if args.local_tier:
        bad += _ls_local_tier(args, root)
    if bad:
        print(f"\n{len(bad)} checkpoint(s) FAIL verification", file=sys.stderr)
        return 1
    return 0


def _gc_hint(folders: list[str], root: CheckpointRoot, collectable: set[str], gc_root: str, rest: str) -> str:
    """What ``gc`` does with ``folders``: those in ``collectable`` (its dry run) it deletes now; ``rest`` says what
    becomes of the others."""
    now = sum(root.store.url(f) in collectable for f in folders)
    if now == len(folders):
        return f"{gc_root} deletes them now"
    if now:
        return f"{gc_root} deletes {now} of them now; the others {rest}"
    return f"they {rest}"


def _local_root(args: argparse.Namespace, root: CheckpointRoot) -> CheckpointRoot | None:
    from lightning_resilient.io.local_tier import local_tier_url
    from lightning_resilient.io.root import INSPECTING, open_root

    path = local_tier_url(args.local_tier, root.url)
    if not os.path.isdir(path):
        return None
    return open_root(path, settings=replace(INSPECTING, orphan_grace_seconds=getattr(args, "grace", 3600.0)),
                     executor=_cli_pool)


def _ls_local_tier(args: argparse.Namespace, root: CheckpointRoot) -> list[Entry]:
    """The local tier's checkpoints beside the durable root's: which are durable too, which only local (and which
    of those are being persisted), which are outside the durable lineage (never resumed). Returns the failing ones."""
    from lightning_resilient.io.tier_view import TierView

    local = _local_root(args, root)
    if local is None:
        print(f"\nlocal tier: nothing for this root under {args.local_tier} on this node")
        return []
    view = TierView.read(root, local)
    local_pointer = view.local_pointer
    print(f"\nlocal tier: {local.url}")
    if local_pointer is None:
        try:
            own = local.read_pointer()[0]
        except CheckpointError as exc:
            print(f"its pointer is unreadable ({exc}): never resumed; the next job that saves sets it aside")
            return []
        print("no committed checkpoint in the local tier" if own is None else
              f"{len(own.entries())} checkpoint(s) of another incarnation of this root (it was deleted and written"
              " again since): never resumed; the next job that saves sets them aside, `gc --local-tier` deletes them")
        return []
    durable = {e.commit for e in view.durable_pointer.entries()} if view.durable_pointer is not None else set()
    lineage = view.lineage
    print()
    print("| name | step | writer epoch | size | age | where | verifies (local copy) |")
    print("|---|---:|---:|---:|---:|---|---|")
    bad: list[Entry] = []
    usable = {e.commit for e in view.candidates()}
    for e in sorted(local_pointer.entries(), key=lambda e: e.order, reverse=True):
        if not lineage.contains(e) or e.commit not in usable:
            where = "local only, outside the durable lineage (a fenced job or an abandoned branch: never resumed)"
        elif e.commit in durable:
            where = "local + durable"
        elif e.commit in local_pointer.protected:
            where = "local only, being persisted"
        else:
            where = "local only"
        status = _check_local(local, e, args.quick)
        if status.startswith("NO"):
            bad.append(e)
        print(f"| {e.name} | {e.step} | {e.writer_epoch} | {_size(e.size)} | {_age(e.created)} | {where} | {status} |")
    newest = view.candidates()
    if newest:
        tier = "the local tier" if newest[0].commit not in durable else "the local tier, else the durable tier"
        print(f"\na resume on this node tries {newest[0].name} (step {newest[0].step}) first, from {tier} (a copy that"
              " fails verification is skipped); on another node, the durable root's newest (or, in a job on several"
              " nodes, the newest any node holds: each node's local tier holds its copy, or its part and replicas)")
    _print_persist_status(local)
    return bad


def _check_local(local: CheckpointRoot, entry: Entry, quick: bool) -> str:
    """:func:`_check` of a local tier's commit: of a sharded commit written across nodes, the parts this node holds
    (the others are on other nodes)."""
    from lightning_resilient.io import parts

    try:
        manifest = local.read_manifest(entry.commit)
    except CheckpointCorruptedError as exc:
        return f"NO: {exc}"
    if not parts.spans_nodes(manifest):
        return _check(local, entry, quick)
    held = parts.held(local, manifest)
    if not held:
        return "NO: holds none of its parts"
    paths = {o.path for o in parts.held_objects(manifest, held)}
    only = [i for i, o in enumerate(manifest.objects) if o.path in paths]
    try:
        if quick:
            local.reader.check_sizes(entry.commit, manifest, only=only)
        else:
            local.reader.verify(entry.commit, only=only)
    except CheckpointCorruptedError as exc:
        return f"NO: {exc}"
    which = ", ".join(str(p) for p in sorted(held))
    return f"{'sizes ok' if quick else 'yes'} (part(s) {which} of {parts.part_count(manifest)})"


def _print_persist_status(local: CheckpointRoot) -> None:
    """The last persist of the job writing this local tier: done, pending, or failing (since when, and why)."""
    from lightning_resilient.io.persist_health import read_status

    status = read_status(local)
    if status is None:
        return
    state, step = status.get("state"), status.get("step")
    when = _age(float(status.get("at") or 0.0))
    if status.get("failures"):
        since = status.get("failing_since")
        now = (f"step {step} being retried ({when} ago)" if state == "pending"
               else f"the last, of step {step}, {when} ago")
        print(f"\npersist: FAILING ({status.get('failures')} failed in a row"
              + (f", since {_age(float(since))} ago" if since else "") + f"); {now}: {status.get('error')}. Training"
              " goes on from the local tier; later saves retry with backoff")
    elif state == "pending":
        print(f"\npersist: step {step} queued or in progress ({when} ago)")
    else:
        print(f"\npersist: ok, step {step} durable ({when} ago)")


def _print_attempts(root: CheckpointRoot) -> None:
    """Each attempt of the training run (a run of the training command) recorded under the root, with its resume
    audit, oldest first. A record that cannot be read (damaged, forged, newer) is named and skipped; what a record
    says is printed escaped (``printable``: no record adds a row)."""
    # The attempt records are exact resume's (state/attempts.py), which imports neither torch nor Lightning; the
    # goodput command reads them the same way (state/goodput.py).
    from lightning_resilient.state.attempts import read_attempts
    from lightning_resilient.state.goodput import printable

    try:
        attempts = list(read_attempts(root.store))
    except (OSError, CheckpointError) as exc:
        print(f"\nattempts: cannot be listed ({exc})")
        return
    if not attempts:
        return
    print("\nattempts of the training run (oldest first), with the resume audit of each resume:")
    print()
    print("| attempt | started | ranks | resumed from | last step | ended | resume audit |")
    print("|---|---:|---:|---|---:|---|---|")
    for attempt, record in attempts:
        if isinstance(record, Exception):
            print(f"| {printable(attempt)} | | | | | | unreadable, skipped: {printable(record)} |")
            continue
        # The global step reached: the ledger's progress (every optimizer step; kept whole in a finished record, whose
        # step digests are pruned to the last saves, and recorded with the audit off); else the last recorded step.
        last = record.progress.step if record.progress is not None else (
            record.last_step.step if record.last_step is not None else None)
        resumed = "fresh start" if record.resumed_step is None else f"step {record.resumed_step}"
        audit = "-" if record.audit is None else printable(_audit_summary(record.audit.outcome, record.audit.line))
        started = _age(record.started) + " ago" if record.started == record.started else "?"
        reached = "-" if last is None else last
        print(f"| {printable(attempt)} | {started} | {record.world_size} | {resumed} | {reached} |"
              f" {printable(record.ended or 'killed (or running)')} | {audit} |")


def _audit_summary(outcome: str, line: str) -> str:
    text = line.removeprefix("resume audit: ")
    if outcome == "identical":
        return "identical: " + text.split(" were identical", 1)[0].removeprefix("the ")
    if outcome == "differs":
        return "DIFFER " + text.split(": first ", 1)[-1].split(";", 1)[0]
    return text


def _print_stock(root: CheckpointRoot, stock: list[tuple[str, float]]) -> None:
    sizes = root.store.list_detail("")
    print()
    print("| name | size | age | verifies |")
    print("|---|---:|---:|---|")
    for name, modified in stock:
        size = sizes[name].size if name in sizes else None
        print(f"| {name} | {'?' if size is None else _size(size)} | {_age(modified)} | stock (unverified) |")


def _verify(args: argparse.Namespace) -> int:
    from lightning_resilient.io import paths
    from lightning_resilient.io.catalog import resolve, was_retired
    from lightning_resilient.io.folders import writer_epoch_of
    from lightning_resilient.io.root import INSPECTING, open_root

    opened = _open(args)
    roots = {opened.url: opened}

    def root_for(url: str) -> CheckpointRoot:
        if url not in roots:
            roots[url] = open_root(url, _options(args), settings=INSPECTING, executor=_cli_pool)
        return roots[url]

    def pick() -> tuple[CheckpointRoot, Entry]:
        """The root and the checkpoint the arguments name (what load_checkpoint would load)."""
        if args.checkpoint is not None or _pointer(opened) is not None:
            return opened, _target(opened, args.checkpoint)
        try:
            found = resolve(opened.url, root_for, shown=args.root)  # ROOT/NAME, or a commit folder
        except FileNotFoundError:
            if not opened.store.list_dir("") and _pointer(root_for(paths.dirname(opened.url))) is None:
                raise _Usage(f"no committed checkpoint under {args.root} (no {POINTER_NAME}); name one to verify"
                             ) from None
            raise
        if found is None:
            raise _Usage(f"{args.root} is a plain file (a stock checkpoint?), not a committed checkpoint: it carries"
                         " no checksums to verify")
        return found.root, found.entry

    root, first = pick()
    if args.all:
        pointer = _pointer(root)
        if pointer is None:
            raise _Usage(f"no pointer under {root.url}: nothing committed to verify")
        targets = pointer.candidates() + pointer.abandoned()
    else:
        targets = [first]
    # The arguments named one commit: if retention deletes it meanwhile there is nothing else to verify.
    named = writer_epoch_of(paths.basename(args.checkpoint if args.checkpoint is not None else args.root)) is not None
    failed = 0
    attempts = 0
    while targets:
        entry = targets.pop(0)
        url = root.store.url(entry.commit)
        bar = None if args.no_progress else _progress(entry.size, entry.name)
        try:
            manifest = root.verify(entry.commit, progress=bar.update if bar is not None else None)
        except CheckpointCorruptedError as exc:
            if was_retired(root, entry):
                # Retention of the job writing the root deleted it while it was read: nothing is damaged.
                print(f"RETIRED {url}: deleted by retention while it was verified (not a failure)")
                if args.all:
                    continue
                if named:
                    raise _Usage(f"{url} no longer exists: retention deleted it while it was being verified") from exc
                if attempts < 5:
                    attempts += 1
                    root, again = pick()  # the latest (or the name) moved on: verify what it names now
                    targets.append(again)
                continue
            failed += 1
            print(f"FAILED {url}: {exc}")
            continue
        finally:
            if bar is not None:
                bar.close()
        print(f"OK     {url}: {len(manifest.objects)} objects, {_size(manifest.total_bytes)}, every"
              f" {manifest.hash} checksum matches")
    return 1 if failed else 0


def _target(root: CheckpointRoot, checkpoint: str | None) -> Entry:
    """The entry ``checkpoint`` names: a name (last.ckpt), a commit folder, either relative to the root or as a
    URL under it; the latest of the current run when None."""
    from lightning_resilient.io.catalog import normalize
    from lightning_resilient.io.folders import writer_epoch_of

    pointer = _pointer(root)
    if checkpoint is None:
        candidates = pointer.candidates() if pointer is not None else []
        if not candidates:
            raise _Usage(f"no committed checkpoint under {root.url} (no {POINTER_NAME}); name one to verify")
        return candidates[0]
    rel = checkpoint.strip("/")
    prefix = root.url.rstrip("/") + "/"
    if normalize(checkpoint).startswith(prefix):
        rel = normalize(checkpoint)[len(prefix):]
    known = {e.commit: e for e in pointer.entries()} if pointer is not None else {}
    if rel in known:
        return known[rel]
    if writer_epoch_of(rel.rsplit("/", 1)[-1]) is not None:
        try:
            return Entry.from_manifest(root.read_manifest(rel))
        except CheckpointCorruptedError as exc:
            raise _Usage(f"{root.store.url(rel)} is not a committed checkpoint: {exc}") from None
    if pointer is not None:
        entry = pointer.checkpoints.get(rel) or (pointer.latest if pointer.latest and pointer.latest.name == rel
                                                 else None)
        if entry is not None:
            return entry
    names = sorted(pointer.checkpoints) if pointer is not None else []
    raise _Usage(f"no committed checkpoint {checkpoint!r} under {root.url}; committed names: {names}")


def _progress(total: int, name: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"verify {name}", leave=False, file=sys.stderr)


def _gc(args: argparse.Namespace) -> int:
    if args.grace < 0:
        raise _Usage(f"--orphan-grace-seconds/--grace must be >= 0 seconds, got {args.grace}")
    if args.keep_last is not None and args.keep_last < 1:
        raise _Usage(f"--keep-last must be >= 1, got {args.keep_last}")
    root = _open_root_only(args, grace=args.grace)
    if _pointer(root) is None and root.scan().manifests:
        raise _Usage(f"{root.store.url(POINTER_NAME)} is missing: nothing is deleted under a root whose pointer is lost"
                     " (its checkpoints are all kept). Rebuild it first: python -c \"import lightning_resilient as lr;"
                     f" lr.repair_pointer({root.url!r})\"")
    verb = "would delete" if args.dry_run else "deleted"
    dropped = root.retain(args.keep_last, dry_run=args.dry_run) if args.keep_last is not None else []
    for entry in dropped:
        print(f"{verb} checkpoint {entry.name} (step {entry.step}): beyond --keep-last {args.keep_last}")
    doomed = root.collect_garbage(dry_run=args.dry_run, abandoned=args.abandoned)
    dropped_folders = {root.store.url(f) for e in dropped for f in e.folders}
    for url, why in doomed:
        if url not in dropped_folders:
            print(f"{verb} {url}: {why}")
    local = _local_root(args, root) if args.local_tier else None
    if local is not None:
        # The local tier's checkpoints that no resume can take (outside the durable lineage: a fenced job's, an
        # abandoned branch's, another incarnation of the root's), then its debris (crashed saves, retired folders).
        # The job keeps it at the plugin's local_keep, so --keep-last applies to the durable root only.
        from lightning_resilient.io.tier_view import TierView

        view = TierView.read(root, local)
        usable = {e.commit for e in view.candidates()}
        try:
            everything = local.read_pointer()[0]
        except CheckpointError:
            everything = None
        outside = {e.commit for e in everything.entries()} - usable if everything is not None else set()
        for entry in local.drop(outside, dry_run=args.dry_run):
            doomed += [(local.store.url(f), "") for f in entry.folders]
            print(f"{verb} local {entry.name} (step {entry.step}): outside the durable lineage, never resumed")
        for url, why in local.collect_garbage(dry_run=args.dry_run, abandoned=args.abandoned):
            doomed.append((url, why))
            print(f"{verb} {url}: {why}")
    if not dropped and not doomed:
        print(f"nothing to delete under {root.url}" + (f" or its local tier {local.url}" if local is not None else ""))
    return 0
