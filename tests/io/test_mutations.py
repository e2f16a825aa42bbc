"""The mutation table (``tests/io/mutations.py``) stays in step with the code it breaks.

Running the table takes minutes per mutation, so it is run by hand; these checks run in the fast suite: each
mutation still finds its original line exactly once (a change to that line makes the mutation apply to nothing, and
its row in ``docs/development.md`` goes stale), the line it puts there still parses, and a run reports a mutation
that no longer applies instead of stopping at it.
"""

from __future__ import annotations

import ast
import sys

import pytest

from tests.io import mutations
from tests.io.mutations import MUTATIONS, ROOT, Mutation


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_every_mutation_applies_to_the_current_code(mutation):
    # If this fails, the code under the mutation changed: find the line that now carries the rule it names (its
    # ``rule``), point the mutation at it, and rerun the table (docs/development.md says how).
    assert mutations.stale(mutation) is None, mutations.stale(mutation)
    changed = mutations.mutated(mutation)
    assert changed != (ROOT / mutation.path).read_text()
    ast.parse(changed, filename=mutation.path)  # a mutant that does not import would be "caught" by every test
    assert all((ROOT / related).is_file() for related in mutation.related), mutation.related


def test_the_mutation_names_are_unique():
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)


def test_a_run_reports_a_mutation_that_does_not_apply_and_goes_on(monkeypatch, capsys):
    # Two out-of-date mutations: both are reported (the run used to stop at the first one) and the run fails.
    # Neither starts pytest: an out-of-date mutation is known before anything is copied or run.
    gone = [Mutation(name, "a rule", "lightning_resilient/io/retention.py", "a line no longer there", "pass")
            for name in ("first-gone", "second-gone")]
    monkeypatch.setattr(mutations, "MUTATIONS", gone)
    monkeypatch.setattr(sys, "argv", ["mutations.py", "--no-baseline"])
    assert mutations.main() == 1
    out = capsys.readouterr().out
    assert "first-gone: DOES NOT APPLY: the original line occurs 0 times" in out
    assert "second-gone: DOES NOT APPLY" in out
    assert "| `first-gone` | a rule | **does not apply** |" in out
    assert "| `second-gone` | a rule | **does not apply** |" in out
