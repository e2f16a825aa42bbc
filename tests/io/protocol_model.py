"""The model that ``test_protocol_random.py`` checks the store against: what the storage protocol promises, kept
apart from how the package implements it.

It knows every job (who claimed which root, in which order, and what its training continued: its *origin*) and every
commit (which job wrote it, at which step, under which name), and derives from those alone:

- the *lineage* of a job: its own commits, then its origin's job's up to the origin's step, and so on back to a fresh
  start (ordered by writer epoch, step, creation), and the lineage *below* a commit (what a load of it falls back to);
- which commits retention or ``gc`` *may* have deleted by now (``may_go``): a name saved again, ``keep_last`` beyond
  the newest states of the lineage (never the latest, never what the writing job resumed from), ``gc --abandoned``,
  a commit no pointer ever named (a stray) of a fenced writer that no job resumed or that lies outside the lineage,
  a damaged manifest no pointer names, a commit a rebuilt pointer no longer catalogs (another commit of its name
  outranks it);
- so which commits must still be whole (``must_keep``), and what a resume or a load must return.

The model never asks the package what the lineage is or what retention dropped: a package bug that changes either
is a difference between the two, which the test reports. Where the protocol's promise is weaker than "kept" (after
a pointer was lost, a name shared with another branch may be re-cataloged), the model says "may go", never "kept".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

INF = math.inf


@dataclass(eq=False)
class Job:
    """One training job: the root it writes, what its training continues, its writer epoch once it claimed."""

    tag: str
    root: RootModel
    origin: Commit | None  # the commit of this root it resumed (None: a fresh start here, or a fork)
    kind: str  # "sync", "async", "tier" or "proc" (a subprocess)
    incarnation: int  # the incarnation of the root it claimed (a root deleted and written again is a new one)
    step: int = 0  # the last step it saved (or resumed)
    epoch: int | None = None
    source: Commit | None = None  # a fork: the commit of another root its training continues
    elsewhere: bool = False  # its origin is a checkpoint only the node-local tier held when it claimed
    dead: bool = False  # killed: it never runs again (paused forever, or SIGKILLed)
    stopped: bool = False  # ended: it never saves again, but it did not die mid-operation

    def __repr__(self) -> str:
        return f"{self.tag}(e{self.epoch}@{self.root.label}.{self.incarnation})"


@dataclass(eq=False)
class Commit:
    """One checkpoint with a manifest: committed (the pointer moved to it), or a stray (its writer was stopped between
    the manifest and the pointer move)."""

    folder: str
    name: str
    step: int
    job: Job
    seq: int  # creation order (the protocol orders commits of one writer epoch and step by creation time)
    objects: dict[str, int] = field(default_factory=dict)  # root-relative path -> size, as its manifest names them
    durable: bool = True  # in the durable root (a tier job's commit is local until persisted)
    local: bool = False  # in the node-local tier
    cataloged: bool = False  # the pointer's catalog named it at some point
    stray: bool = False  # a manifest the pointer never moved to as a save
    may_go: bool = False  # retention or gc may have deleted it
    manifest_damaged: bool = False
    origin_record: Any = None  # the origin its manifest records (what a load of its URL reads)

    @property
    def epoch(self) -> int:
        assert self.job.epoch is not None
        return self.job.epoch

    @property
    def state(self) -> tuple[int, int]:
        return (self.epoch, self.step)

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.epoch, self.step, self.seq)

    def __repr__(self) -> str:
        flags = "".join(f for f, on in (("S", self.stray), ("C", self.cataloged), ("g", self.may_go),
                                        ("M", self.manifest_damaged), ("L", self.local), ("D", self.durable)) if on)
        return f"<{self.job.tag}:{self.name}@{self.step} {self.folder.rsplit('/', 1)[-1][-11:]} {flags}>"


class RootModel:
    """The model of one checkpoint root (and, for tier jobs, its node-local tier on one node)."""

    def __init__(self, label: str, url: str, keep: int | None) -> None:
        self.label, self.url, self.keep = label, url, keep
        self.incarnation = 0
        self.jobs: list[Job] = []  # every job that claimed this root, any incarnation, in claim order
        self.commits: dict[str, Commit] = {}  # folder -> commit, of the current incarnation, in creation order
        self.damaged: set[str] = set()  # objects whose bytes the test flipped (root-relative paths)
        self.seq = 0
        self.lost = False  # the pointer was deleted and not rebuilt yet
        # Strays a job resumed whose protection holds: each claim keeps those its lineage holds and adds what it
        # resumed when no catalog names it (a claim whose lineage leaves one out ends its protection for good).
        self.kept_strays: set[Commit] = set()

    # -- who writes ------------------------------------------------------------------------------------------------
    def claimed(self) -> list[Job]:
        return [j for j in self.jobs if j.epoch is not None and j.incarnation == self.incarnation]

    def head(self) -> Job | None:
        """The job that may write the root: the newest claim of its current incarnation."""
        claimed = self.claimed()
        return max(claimed, key=lambda j: j.epoch or 0) if claimed else None

    def fenced(self, job: Job) -> bool:
        return job is not self.head()

    def protected(self) -> Commit | None:
        """What the writing job resumed from: never dropped while it writes."""
        head = self.head()
        return head.origin if head is not None and not head.elsewhere else None

    # -- lineage ---------------------------------------------------------------------------------------------------
    @staticmethod
    def bounds(job: Job | None, bound: float = INF) -> dict[Job, float]:
        """Job -> the highest step of it in the lineage that ``job`` continues (up to ``bound`` for ``job`` itself)."""
        out: dict[Job, float] = {}
        while job is not None and job not in out:
            out[job] = bound
            if job.origin is None:
                break
            bound = min(bound, job.origin.step)
            job = job.origin.job
        return out

    def lineage(self, job: Job | None = None, bound: float = INF) -> list[Commit]:
        """The commits (either tier) of the lineage ``job`` (default: the writing job) continues, newest first."""
        within = self.bounds(job if job is not None else self.head(), bound)
        found = [c for c in self.commits.values() if c.job in within and c.step <= within[c.job]]
        return sorted(found, key=lambda c: c.order, reverse=True)

    def below(self, commit: Commit) -> list[Commit]:
        """What a load of ``commit`` falls back to: the lineage it continues, newest first, without it."""
        return [c for c in self.lineage(commit.job, commit.step) if c is not commit]

    def in_lineage(self, commit: Commit) -> bool:
        within = self.bounds(self.head())
        return commit.job in within and commit.step <= within[commit.job]

    def expected_latest(self, entries: set[str] | None = None) -> Commit | None:
        """The state the pointer's latest must hold: the writing job's newest commit, else what it resumed (else, for
        an origin only the local tier held, the newest commit of the lineage the pointer names, ``entries``)."""
        head = self.head()
        if head is None:
            return None
        own = [c for c in self.commits.values() if c.job is head and c.durable and not c.stray]
        if own:
            return max(own, key=lambda c: c.order)
        if head.elsewhere:
            older = [c for c in self.lineage() if c.durable and (c.folder in entries if entries is not None
                                                                  else c.cataloged and not c.may_go)]
            return older[0] if older else None
        return head.origin

    # -- what may be gone -------------------------------------------------------------------------------------------
    def replaced(self, commit: Commit) -> None:
        """``commit`` was committed: every other commit of its name leaves the catalog (Lightning's replace)."""
        for other in self.commits.values():
            if other is not commit and other.name == commit.name and other.durable:
                other.may_go = True

    def retain(self, keep: int) -> None:
        """Retention keeping the ``keep`` newest states of the lineage the catalog names (``keep_last`` at a commit,
        ``gc --keep-last``): beyond them, anything but the latest and what the writing job resumed from may go."""
        line = [c for c in self.lineage() if c.durable and c.cataloged]
        states: list[tuple[int, int]] = []
        for c in line:
            if c.state not in states:
                states.append(c.state)
        kept = set(states[:keep])
        latest = self.expected_latest()
        for c in line:
            if c.state not in kept and c is not latest and c is not self.protected():
                c.may_go = True

    def abandoned_dropped(self) -> None:
        """``gc --abandoned``: every commit outside the lineage may go (not the latest, not the resumed-from)."""
        for c in self.commits.values():
            if not self.in_lineage(c) and c is not self.protected() and c is not self.expected_latest():
                c.may_go = True

    def rebuilt(self) -> None:
        """The pointer was lost and rebuilt from the manifests: the rebuild catalogs one commit per name (the
        lineage's newest of that name, else an abandoned branch's newest), strays included. A commit that a newer
        commit of its name (or a lineage commit of its name, for one outside the lineage) outranks is no longer
        cataloged, so it may go."""
        for c in self.commits.values():
            if c.stray and c.durable:
                c.cataloged = True  # every manifest counts, retention included, from now on
            if c.manifest_damaged:
                c.may_go = True  # a manifest that does not load is no part of the rebuilt catalog
            for other in self.commits.values():
                if other is c or other.name != c.name or not other.durable:
                    continue
                mine, theirs = self.in_lineage(c), self.in_lineage(other)
                if (theirs and not mine) or (theirs == mine and other.order > c.order):
                    c.may_go = True

    def claimed_by(self, job: Job, previous: Job | None, catalog: set[str] | None) -> None:
        """``job`` claimed the root after ``previous``. What ``previous`` resumed from is no longer protected as
        such: if the catalog does not name it (a stray it resumed) and ``job``'s lineage does not hold it (a
        rollback below it, a fresh start), the claim retires it."""
        origin = previous.origin if previous is not None else None
        if origin is not None and origin.job.root is self and (catalog is None or origin.folder not in catalog) \
                and not self.in_lineage(origin):
            origin.may_go = True
        self.kept_strays = {c for c in self.kept_strays if self.in_lineage(c) and not c.cataloged}
        mine = job.origin
        if mine is not None and not job.elsewhere and mine.job.root is self and catalog is not None \
                and mine.folder not in catalog:
            self.kept_strays.add(mine)

    def settle(self, catalog: set[str] | None) -> None:
        """Apply the rules that hold whatever the last operation was (``catalog``: the commits the pointer's catalog
        names now, None when there is no pointer)."""
        if self.keep is not None:
            self.retain(self.keep)
        protected = self.protected()
        head = self.head()
        for c in self.commits.values():
            if c is protected:
                continue
            outside = not self.in_lineage(c)
            # A manifest no pointer ever moved to, of a fenced writer: gc collects it, unless a job resumed it and
            # every claim since kept that protection (each lineage since held it).
            if c.stray and not c.cataloged and c.job is not head and (outside or c not in self.kept_strays):
                c.may_go = True
            # A manifest that does not load, and that the pointer does not name: gc collects it.
            if c.manifest_damaged and (catalog is None or c.folder not in catalog):
                c.may_go = True

    def must_keep(self) -> list[Commit]:
        """The durable commits that must be whole now: what the writing job resumed from, every commit the catalog
        named that nothing may have dropped since, and every stray of the lineage a job resumed (or that a fenced
        writer may still be about to find refused: ``settle`` says which may go)."""
        protected = self.protected()
        out = []
        for c in self.commits.values():
            if not c.durable:
                continue
            if c is protected or (not c.may_go and (c.cataloged or (c.stray and self.in_lineage(c)))):
                out.append(c)
        return out

    def intact(self, commit: Commit) -> bool:
        """Whether a load of ``commit`` verifies (the test damaged neither its manifest nor an object it names)."""
        return not commit.manifest_damaged and not any(p in self.damaged for p in commit.objects)

    def describe(self) -> str:
        head = self.head()
        line = self.lineage()
        return (f"root {self.label} (incarnation {self.incarnation}): head {head}, origin"
                f" {head.origin if head else None}, lineage {line[:8]}, commits {list(self.commits.values())[-12:]}")
