"""The package's shape: modules import each other in one direction only, no package uses another's private (``_``)
modules or names, and every ``__all__`` is sorted."""

from __future__ import annotations

import ast
import functools
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


@functools.cache
def _tree(path: Path) -> ast.Module:
    # Each check walks every module: parsed once per process (the checks took seconds each, parsing 1.4 MB again).
    return ast.parse(path.read_text())


def _imports(name: str, *, type_only: bool = False) -> set[str]:
    """The package modules ``name`` imports anywhere in its text (module level or inside a function; under ``if
    TYPE_CHECKING`` only with ``type_only``): a deferred import is still a dependency, and a circle through one is
    still a circle."""
    tree = _tree(MODULES[name])
    checking = set() if type_only else {
        id(n) for node in ast.walk(tree)
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


# The layers of CONTRIBUTING.md's module map, as what each package never imports: the storage protocol (io/) and the
# planning tools (planning/) stand side by side, neither importing the other; exact resume (state/) builds on both;
# the integrations and entry points (top-level modules, cli/, demo/) on all three. Nothing below points up, not even
# through a deferred import: the command line's handlers and CheckpointCadence, which read state/'s records, live
# above it (cli/, checkpoint_cadence.py).
_INTEGRATIONS = ("checkpoint_cadence", "cli", "demo", "strategies", "training_cli", "watchdog")
NEVER_IMPORTS = {
    "io": ("planning", "state", *_INTEGRATIONS),
    "planning": ("io", "state", *_INTEGRATIONS),
    "state": _INTEGRATIONS,
}


def _depends_on(name: str) -> set[str]:
    """The package modules ``name`` needs: those it imports (deferred and type-only imports included) and those it
    names in a string, as the lazy exports' ``_WHERE`` and ``importlib.import_module`` do."""
    named = {node.value for node in ast.walk(_tree(MODULES[name]))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES}
    return (_imports(name, type_only=True) | named) - {name}


def _points_up(target: str, above: list[str]) -> bool:
    # The package's own __init__ holds the public names of every layer: importing from it points up too.
    return target == PACKAGE.name or any(target == a or target.startswith(f"{a}.") for a in above)


def _upward() -> list[str]:
    out = []
    for name in MODULES:
        layer = name.split(".")[1] if "." in name else ""
        above = [f"{PACKAGE.name}.{package}" for package in NEVER_IMPORTS.get(layer, ())]
        if above:
            out.extend(f"{name} imports {target}" for target in _depends_on(name) if _points_up(target, above))
    return sorted(out)


def test_layers_only_point_down():
    # io/ and planning/ once reached up into state/ through imports inside functions (ls, goodput, cadence's
    # measured=True): each layer could then be neither read nor tested without the ones above it.
    assert _upward() == []


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The check above must be able to fail: a deferred import, a type-only import, a lazy export and the package's
    # public names, each pointing up, caught; an import down, allowed.
    def module(name: str, text: str) -> None:
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        monkeypatch.setitem(MODULES, name, path)

    module("lightning_resilient.io.x", "def f():\n    from lightning_resilient.state.goodput import measure\n"
           "from lightning_resilient.errors import CheckpointError\n")
    module("lightning_resilient.planning.x", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "    from lightning_resilient.cli import main\n"
           "_WHERE = {'CheckpointCadence': 'lightning_resilient.checkpoint_cadence'}\n")
    module("lightning_resilient.state.x", "from lightning_resilient import HangWatchdog\n"
           "from lightning_resilient.io import paths\nfrom lightning_resilient.planning import cadence\n")
    assert _upward() == [
        "lightning_resilient.io.x imports lightning_resilient.state.goodput",
        "lightning_resilient.planning.x imports lightning_resilient.checkpoint_cadence",
        "lightning_resilient.planning.x imports lightning_resilient.cli",
        "lightning_resilient.state.x imports lightning_resilient",
    ]


def _package_of(name: str) -> str:
    """The package module ``name`` belongs to: itself for a package (an ``__init__.py``), else the one holding it."""
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute chain on a plain name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _used(name: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every module and name of the package that module ``name`` imports, and of every
    attribute it reads through an imported module (``catalog._helper``), deferred and type-only imports included."""
    tree = _tree(MODULES[name])
    bound: dict[str, str] = {}  # local name -> the package's module it stands for
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per extra dot
                base = _package_of(name).split(".")
                module = ".".join(base[:len(base) - node.level + 1] + ([module] if module else []))
            if module.split(".")[0] != PACKAGE.name:
                continue
            for alias in node.names:
                used.append((node.lineno, f"{module}.{alias.name}"))
                if f"{module}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE.name:
                    used.append((node.lineno, alias.name))
                    bound[alias.asname or PACKAGE.name] = alias.name if alias.asname else PACKAGE.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (chain := _dotted(node)) is not None:
            head, _, rest = chain.partition(".")
            if head in bound:
                used.append((node.lineno, f"{bound[head]}.{rest}"))
    return used


def _private_outside(importer: str, used: str) -> tuple[str, str] | None:
    """The first private (``_``) module or name in ``used`` that belongs to a package ``importer`` is not inside, and
    that package; else None. A private module or name is private to the package that holds it, subpackages included:
    ``io/store/`` may use ``io/_sealed.py`` and every package the top level's ``_checks.py``, but ``state/`` may not
    use ``io/_lanes.py``; what another package needs is made public where it belongs."""
    parts = used.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            holder = ".".join(parts[:i])
            owner = _package_of(holder) if holder in MODULES else holder
            if importer != owner and not importer.startswith(f"{owner}."):
                return ".".join(parts[:i + 1]), owner
    return None


def _reaches() -> list[str]:
    return sorted({f"{name}:{line} uses {found[0]} (private to {found[1]})"
                   for name in MODULES for line, used in _used(name)
                   if (found := _private_outside(name, used)) is not None})


def test_no_module_uses_a_private_module_or_name_of_another_package():
    # A `_` module is an implementation detail of its package: another package reaching into it (state/ into
    # io/_paths.py, as it once did) ties the two together where no one looks. CONTRIBUTING.md's module map says
    # what each package makes public.
    assert _reaches() == []


def test_the_private_check_sees_each_way_to_reach_in(tmp_path, monkeypatch):
    # The check above must be able to fail: a private module, a private name and a private attribute of another
    # package, each caught; the same inside their own package (a subpackage included), allowed.
    def module(name: str, text: str) -> None:
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        monkeypatch.setitem(MODULES, name, path)

    module("lightning_resilient.state.x", "from lightning_resilient.io import _sealed\n"
           "def f():\n    from lightning_resilient.io.root import _helper\n"
           "from lightning_resilient.io import catalog\ncatalog._pointer_or_scan(None)\n"
           "import lightning_resilient.io._lanes\n")
    module("lightning_resilient.io.store.x", "from lightning_resilient.io import _sealed\n"
           "from lightning_resilient.io.root import _helper\nfrom lightning_resilient import _checks\n"
           "from lightning_resilient.io import paths as _paths\n_paths.join('a')\n")
    io = "(private to lightning_resilient.io)"
    assert _reaches() == [
        f"lightning_resilient.state.x:1 uses lightning_resilient.io._sealed {io}",
        f"lightning_resilient.state.x:3 uses lightning_resilient.io.root._helper {io}",
        f"lightning_resilient.state.x:5 uses lightning_resilient.io.catalog._pointer_or_scan {io}",
        f"lightning_resilient.state.x:6 uses lightning_resilient.io._lanes {io}",
    ]


@pytest.mark.parametrize("name", [n for n in MODULES if "__all__" in MODULES[n].read_text()])
def test_all_is_sorted(name):
    module = importlib.import_module(name)
    assert list(module.__all__) == sorted(module.__all__), name


MAX_CLASS_LINES = 450  # past it a class holds several jobs: split it into collaborators (CONTRIBUTING.md's module map)


def _long_classes(limit: int = MAX_CLASS_LINES) -> list[str]:
    return sorted(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
                  for name, path in MODULES.items() for node in ast.walk(_tree(path))
                  if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit)


def test_no_class_grows_past_its_bound():
    # ResumeStateCallback (1,242 lines) and AtomicCheckpointIO (757) were split into collaborators: a new capability
    # lands in a module of its own, not back in the adapter that routes Lightning's calls.
    assert _long_classes() == []


def test_the_class_bound_sees_a_long_class():
    assert "lightning_resilient.state.callback.ResumeStateCallback" in " ".join(_long_classes(100))
