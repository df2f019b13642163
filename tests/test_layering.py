"""The package's layering, read from the source (every import, function-local ones included):

- the front end, the IR and the passes import nothing that runs programs (`api`, `backends`,
  `autograd`, `runtime`): tracing a spec runs no backend;
- no module imports itself back through others (no import cycle);
- outside `ssmc/backends/` (and the CLI's argument parsing) nothing compares a backend's name: what
  differs between backends is asked of their `Backend` object (backends/base.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ssmc"

TRACING = ("ssmc.frontend", "ssmc.ir", "ssmc.passes")
RUNNING = ("ssmc.api", "ssmc.backends", "ssmc.autograd", "ssmc.runtime")
BACKEND_NAMES = {"interpreter", "numba", "cuda"}

# Packages whose inner cycles would be tolerated while they are restructured: none (every cycle fails)
RESTRUCTURING: tuple[str, ...] = ()


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> set[str]:
    """The ssmc modules `module` imports anywhere in its source: for ``from X import name`` the
    module X.name where there is one, else X."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                if target == "ssmc" and a.name == "__version__":
                    continue  # the version string (a constant), not what the package root imports
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target)
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_tracing_imports_nothing_that_runs_programs():
    bad = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if _within(m, TRACING)
                 for t in targets if _within(t, RUNNING))
    assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    cycles = [c for c in _cycles(GRAPH) if not all(_within(m, RESTRUCTURING) for m in c)]
    assert not cycles, cycles


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _name_comparisons(path: Path) -> list[str]:
    """Comparisons of a value with a backend's name (``backend == "cuda"``, ``name in ("numba", ...)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(v, ast.Constant) and v.value in BACKEND_NAMES for v in values):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
                break
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _within(m, ("ssmc.backends", "ssmc.cli"))))
def test_no_backend_name_comparisons_outside_the_backends(module):
    assert not _name_comparisons(MODULES[module])


def test_the_name_check_finds_a_comparison(tmp_path):
    source = tmp_path / "example.py"
    source.write_text('if backend != "cuda" or name in ("numba", "x") or kind == "cpu":\n    pass\n')
    assert len(_name_comparisons(source)) == 2
