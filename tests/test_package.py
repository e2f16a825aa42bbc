"""The package's shape: modules import each other in one direction only, and every ``__all__`` is sorted."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "lightning_resilient"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package modules ``name`` imports anywhere in its text (module level or inside a function; not under
    ``if TYPE_CHECKING``): a deferred import is still a dependency, and a circle through one is still a circle."""
    tree = ast.parse(MODULES[name].read_text())
    checking = {id(n) for node in ast.walk(tree)
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE.name:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                out.add(candidate if candidate in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in MODULES)
    out.discard(name)
    return out


def _circle() -> list[str] | None:
    graph = {name: _imports(name) for name in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_circles():
    # A circle hidden behind a function-level import still couples two modules both ways: every module depends on
    # the ones before it in CONTRIBUTING.md's module map, never on a later one.
    assert _circle() is None, " -> ".join(_circle() or [])


def test_the_circle_check_sees_a_deferred_import(tmp_path, monkeypatch):
    # The check above must be able to fail: a function-level import back into a module that imports this one.
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from lightning_resilient.b import x\n")
    b.write_text("def f():\n    from lightning_resilient.a import y\n")
    monkeypatch.setitem(MODULES, "lightning_resilient.a", a)
    monkeypatch.setitem(MODULES, "lightning_resilient.b", b)
    assert _circle() == ["lightning_resilient.a", "lightning_resilient.b", "lightning_resilient.a"]


@pytest.mark.parametrize("name", [n for n in MODULES if "__all__" in MODULES[n].read_text()])
def test_all_is_sorted(name):
    module = importlib.import_module(name)
    assert list(module.__all__) == sorted(module.__all__), name
