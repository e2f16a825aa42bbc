"""Nineteen one-line breakages of the storage protocol's safety rules, and which tests catch each.

Not collected by pytest (no ``test_`` prefix). Run from the repository root::

    python tests/io/mutations.py                       # every mutation, against tests/io/test_protocol_random.py
    python tests/io/mutations.py --related             # ... and the test files of the rule each one breaks
    python tests/io/mutations.py --tests tests/io -x    # against the io suite, stopping at the first failure
    python tests/io/mutations.py --only commit-fallback gc-protections

For each mutation it copies the working tree (without ``.git``) into a temporary folder, applies the one edit there
(the original line must occur exactly once, so a mutation never silently applies to nothing), runs pytest in the
copy with ``PYTHONPATH`` pointing at it (subprocesses the tests start load the mutated package too), and reports
which tests failed: a mutation no test catches *survived*. A mutation whose original line is no longer in its module
(the code changed under it) *does not apply*: it is reported, the run goes on with the others, and it fails the run
like a survivor (``tests/io/test_mutations.py`` catches that in the fast suite already). The real tree is never
touched. The table of the last run is in ``docs/development.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    rule: str  # the safety rule it breaks
    path: str  # the module, relative to the repository root
    before: str  # the original line (stripped of its indentation), exactly once in the module
    after: str  # what replaces it (same indentation)
    related: tuple[str, ...] = ()  # the test files of that rule's module (run with ``--related``)


MUTATIONS = [
    Mutation("commit-fallback", "fallback of a commit URL ignoring lineage", "lightning_resilient/io/catalog.py",
             "return [e for e in Lineage.below(origins, entry).members(pointer.entries()) if e.commit != entry.commit]",
             "return [e for e in sorted(pointer.entries(), key=lambda e: e.order, reverse=True)"
             " if e.commit != entry.commit]",
             related=("tests/io/test_lineage.py",)),
    Mutation("root-fallback", "fallback of a root URL ignoring lineage", "lightning_resilient/io/catalog.py",
             "return Resolved(as_root, candidates[0], candidates[1:], pinned=False)\n"
             "\n    parent = root_for(paths.dirname(url))",
             "return Resolved(as_root, candidates[0], [e for e in sorted(root_pointer.entries(), key=lambda e: e.order,"
             " reverse=True) if e.commit != candidates[0].commit], pinned=False)\n"
             "\n    parent = root_for(paths.dirname(url))",
             related=("tests/io/test_lineage.py",)),
    Mutation("gc-protections", "GC's live set ignoring holds and protections",
             "lightning_resilient/io/retention.py",
             "head, live, due = pointer.writer_epoch, pointer.live_folders(), pointer.retired_due()",
             "head, live, due = pointer.writer_epoch, {f for e in pointer.entries() for f in e.folders},"
             " pointer.retired_due()",
             related=("tests/io/test_gc.py",)),
    Mutation("gc-in-flight", "GC collecting the current writer's in-flight saves",
             "lightning_resilient/io/retention.py",
             "if epoch >= head:", "if epoch > head:",
             related=("tests/io/test_gc.py",)),
    Mutation("stray-protection", "a claim or adopt dropping the protection of a stray a job of the lineage resumed",
             "lightning_resilient/io/fencing.py",
             'kept[commit] = f"{_IN_LINEAGE} (resumed by {writer})"', "continue",
             related=("tests/io/test_gc.py", "tests/io/test_lineage.py")),
    Mutation("adopt-resumed", "a local tier's adopt not protecting the local-only stray its job resumed",
             "lightning_resilient/io/fencing.py",
             "protect(p, resumed, self.writer)", "pass",
             related=("tests/io/test_tiered.py",)),
    Mutation("gc-reread", "gc deleting from the pointer it read first (a stray a claim or a rebuild made live since)",
             "lightning_resilient/io/retention.py",
             "if not dry_run and (partial or committed):", "if False:",
             related=("tests/io/test_gc.py",)),
    Mutation("pointer-rebuild", "a missing pointer not rebuilt before an update", "lightning_resilient/io/fencing.py",
             "base = scan.pointer()", "base = Pointer()",
             related=("tests/io/test_gc.py", "tests/io/test_protocol.py")),
    Mutation("keep-last-resumed", "keep_last dropping the resumed-from checkpoint",
             "lightning_resilient/io/retention.py",
             "return [e for e in beyond if not (p.latest is not None and e.commit == p.latest.commit) and not"
             " is_resumed(p, e)]",
             "return [e for e in beyond if not (p.latest is not None and e.commit == p.latest.commit)]",
             related=("tests/io/test_protocol.py",)),
    Mutation("stored-check", "no stored-objects check before the manifest", "lightning_resilient/io/writer.py",
             "self._check_stored(manifest.objects if held is None else held, folder)", "pass",
             related=("tests/io/test_gc.py",)),
    Mutation("gc-abandoned", "plain gc dropping abandoned branches", "lightning_resilient/io/retention.py",
             "if abandoned:\n            dropped = self.drop_abandoned(dry_run=dry_run)",
             "if True:\n            dropped = self.drop_abandoned(dry_run=dry_run)",
             related=("tests/io/test_gc.py", "tests/io/test_lineage.py")),
    Mutation("origin-chain", "a claim's origin not listing the chain it continues", "lightning_resilient/io/fencing.py",
             "recorded[0] = p.origins[p.writer_epoch] = origin.with_ancestors(p.origins)",
             "recorded[0] = p.origins[p.writer_epoch] = origin",
             related=("tests/io/test_lineage.py",)),
    Mutation("live-references", "the live set dropping the folders a commit references (shared objects)",
             "lightning_resilient/io/pointer.py",
             "folders = {f for e in self.entries() for f in e.folders}",
             "folders = {e.commit for e in self.entries()}",
             related=("tests/io/test_incremental.py",)),
    Mutation("dedup-fingerprint", "an incremental save trusting the version counter alone (a .data write unseen)",
             "lightning_resilient/io/incremental.py",
             "and prints.get(i) == m.print for m, i in zip(stored.members, idx, strict=True)]",
             "and True for m, i in zip(stored.members, idx, strict=True)]",
             related=("tests/io/test_incremental.py",)),
    Mutation("persist-digest", "a tier's persist copying the base again instead of referencing the durable copy",
             "lightning_resilient/io/tiered.py",
             "elif (held := self.durable.writer.stored_like(obj, live) if self.durable.settings.dedup else None):",
             "elif (held := None):",
             related=("tests/io/test_incremental.py",)),
    Mutation("dedup-live-guard", "an incremental save referencing objects of folders the pointer no longer keeps",
             "lightning_resilient/io/incremental.py",
             "return folder in live and epoch is not None and writer_epoch_of(folder) == epoch",
             "return True",
             related=("tests/io/test_incremental.py",)),
    Mutation("claim-stored-view", "a claim protecting a resumed local commit with the local tier's folders",
             "lightning_resilient/io/fencing.py",
             "return Entry.from_manifest(manifest), manifest.reported",
             "return entry, manifest.reported",
             related=("tests/io/test_incremental.py",)),
    Mutation("record-create", "a claim's origin record overwriting another claim's record of the same epoch",
             "lightning_resilient/io/origin_records.py",
             "if self.store.create(name, origin.record(epoch, writer, root_id)):",
             "if self.store.write(name, origin.record(epoch, writer, root_id)) is None:",
             related=("tests/io/test_protocol.py", "tests/io/test_origin_records.py")),
    Mutation("replica-lacking", "a copy between nodes taking a referenced object as held where its folder is not live",
             "lightning_resilient/io/replicas.py",
             "return [i for i in indices if i not in outside or outside[i].path.rsplit(\"/\", 1)[0] not in live\n"
             "            or stored.get(outside[i].path, -1) != outside[i].size]",
             "return [i for i in indices if i not in outside]",
             related=("tests/io/test_replicas.py",)),
]


def stale(mutation: Mutation, tree: Path = ROOT) -> str | None:
    """Why ``mutation`` does not apply to ``tree`` (its original line is not in its module exactly once), else None."""
    module = tree / mutation.path
    count = module.read_text().count(mutation.before) if module.is_file() else 0
    if count == 1:
        return None
    return (f"the original line occurs {count} times in {mutation.path}, not once: the mutation is out of date"
            f" (find the line that now carries the rule)\n  {mutation.before}")


def mutated(mutation: Mutation, tree: Path = ROOT) -> str:
    """The text of ``mutation``'s module in ``tree`` with the mutation applied (it must apply: see :func:`stale`)."""
    text = (tree / mutation.path).read_text()
    return text.replace(mutation.before, mutation.after, 1)


def apply(mutation: Mutation, tree: Path) -> None:
    """Apply ``mutation`` to the copy ``tree`` (the original must occur exactly once)."""
    if (why := stale(mutation, tree)) is not None:
        raise ValueError(f"{mutation.name}: {why}")
    (tree / mutation.path).write_text(mutated(mutation, tree))


def copy_tree(into: Path, root: Path = ROOT) -> Path:
    tree = into / "tree"
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache",
                                                              ".mypy_cache", ".ruff_cache", "*.egg-info"))
    return tree


def run(tree: Path, tests: list[str], extra: list[str], timeout: float,
        verbose: bool = False) -> tuple[int | None, list[str], float]:
    """Run pytest in ``tree``; returns (exit status, None if it ran past ``timeout``; failed test ids; seconds)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *tests, "-q", "-rf", "-p", "no:cacheprovider",
                               "-p", "no:randomly", *extra], cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, [], time.monotonic() - started
    if verbose:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    # A strict xfail that passes under a mutation (XPASS) fails the run without catching anything: not counted.
    failed = sorted({m.group(1) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)(.*)$", proc.stdout, flags=re.MULTILINE)
                     if "XPASS" not in m.group(2)})
    return proc.returncode, failed, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", nargs="+", default=["tests/io/test_protocol_random.py"],
                        help="what pytest runs against each mutation (default: the randomized protocol tests)")
    parser.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS], help="run these mutations only")
    parser.add_argument("--related", action="store_true",
                        help="also run, per mutation, the test files of the rule it breaks (its 'related')")
    parser.add_argument("-x", action="store_true", help="stop each run at its first failure (faster, names one test)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the unmutated tree")
    parser.add_argument("--keep", action="store_true", help="print where each mutated copy is, and keep it")
    parser.add_argument("--verbose", action="store_true", help="print pytest's output of each run")
    parser.add_argument("--root", type=Path, default=ROOT, help="the working tree to mutate (default: this one)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    extra = (["-x"] if args.x else []) + args.pytest_args
    rows: list[tuple[Mutation, str, list[str], float]] = []  # (mutation, outcome, failed tests, seconds)
    # Said first, before the minutes of the baseline run: the code under these changed, so they break nothing.
    out_of_date = {m.name: why for m in chosen if (why := stale(m, args.root)) is not None}
    for name, why in out_of_date.items():
        print(f"{name}: DOES NOT APPLY: {why}", flush=True)
    scratch = tempfile.mkdtemp(prefix="mutations-")
    try:
        if not args.no_baseline:
            baseline = copy_tree(Path(scratch) / "baseline", args.root)
            status, failed, seconds = run(baseline, args.tests, extra, args.timeout, args.verbose)
            print(f"unmutated: exit {'(timed out)' if status is None else status}, {len(failed)} failed,"
                  f" {seconds:.0f} s", flush=True)
            if status != 0:
                print("the unmutated tree fails already:", *failed, sep="\n  ")
                return 2
            shutil.rmtree(baseline)
        for mutation in chosen:
            if mutation.name in out_of_date:
                rows.append((mutation, "does not apply", [], 0.0))
                continue
            tree = copy_tree(Path(scratch) / mutation.name, args.root)
            apply(mutation, tree)
            tests = args.tests + [t for t in mutation.related if args.related and t not in args.tests]
            status, failed, seconds = run(tree, tests, extra, args.timeout, args.verbose)
            # A run past --timeout names no test: reported as such (not as caught), and the run goes on.
            outcome = "caught" if failed else "timed out" if status is None else "survived"
            rows.append((mutation, outcome, failed, seconds))
            print(f"{mutation.name}: {outcome if failed else outcome.upper()} ({seconds:.0f} s)"
                  + "".join(f"\n  {f}" for f in failed) + (f"\n  copy kept in {tree}" if args.keep else ""),
                  flush=True)
            if not args.keep:
                shutil.rmtree(tree)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print("\n| mutation | rule broken | caught by |\n|---|---|---|")
    for mutation, outcome, failed, _ in rows:
        by = ", ".join(f.split("::", 1)[-1] for f in failed) if outcome == "caught" else f"**{outcome}**"
        print(f"| `{mutation.name}` | {mutation.rule} | {by} |")
    return 0 if all(outcome == "caught" for _, outcome, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
