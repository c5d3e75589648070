"""The import graph of the project's own files, read from their source (no import is run).

Every `import` and `from ... import` counts, at module level, inside a function (a function-level
import is still an edge: hiding one there to dodge a cycle leaves the cycle) or under
`if TYPE_CHECKING:` (a type is a dependency too), relative imports resolved against the importing
module's package. An edge goes to the most specific project module
named: `from a.b import c` reaches `a.b.c` when that is a module, else `a.b`.

Rules kept here:
- no cycle among the project's modules;
- `flowmesh/` is the bottom floor: it imports none of the packages built on it;
- the worker imports nothing from the partitioner (what both need lives in `flowmesh.modelio`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The project's own code: its packages, its tests and its scripts.
TOP = (
    "flowmesh",
    "broker",
    "gpu_worker",
    "partitioner",
    "client_sdk",
    "gateway",
    "tests",
    "scripts",
)
ABOVE_FLOWMESH = ("broker", "gpu_worker", "partitioner", "client_sdk", "gateway")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported project module
    where: str  # path:line of the statement


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def project_files() -> dict[str, Path]:
    """Module name -> file, for every Python file of the project."""
    out = {}
    for top in TOP:
        for path in sorted((ROOT / top).rglob("*.py")):
            out[module_name(path)] = path
    return out


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a project module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


@cache
def edges() -> tuple[Edge, ...]:
    modules = project_files()
    out = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):  # every statement, function bodies included
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, module, is_package)
                # `from pkg import sub` imports the submodule when there is one.
                named = [f"{base}.{a.name}" if base else a.name for a in node.names]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for name in named:
                target = _project_module(name, modules)
                if target is not None and target != module:
                    out.append(Edge(module, target, where))
    return tuple(out)


def successors(graph_edges: tuple[Edge, ...]) -> dict[str, dict[str, Edge]]:
    """Module -> imported module -> the first statement importing it."""
    succ: dict[str, dict[str, Edge]] = {}
    for e in graph_edges:
        succ.setdefault(e.source, {}).setdefault(e.target, e)
    return succ


def cycles(graph_edges: tuple[Edge, ...]) -> dict[frozenset[str], list[Edge]]:
    """Each strongly connected component of more than one module, with one cycle through it
    (its edges, in order). Tarjan's algorithm, iterative."""
    succ = successors(graph_edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return {frozenset(c): _cycle_in(c, succ) for c in components}


def _cycle_in(component: list[str], succ: dict[str, dict[str, Edge]]) -> list[Edge]:
    """A shortest cycle through the component's first module (breadth-first within it)."""
    inside = set(component)
    start = component[0]
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child, edge in sorted(succ.get(node, {}).items()):
                if child not in inside:
                    continue
                if child == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if child not in came:
                    came[child] = edge
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its own component")


def describe(cycle: list[Edge]) -> str:
    return " -> ".join(f"{e.source} ({e.where})" for e in cycle) + f" -> {cycle[0].source}"


def test_the_graph_is_read():
    # The rules below pass vacuously on an empty graph; a few edges known to exist say it is not.
    found = {(e.source, e.target) for e in edges()}
    assert ("broker.service", "broker.core") in found
    assert ("flowmesh.modelio.stages", "flowmesh.modelio.plan") in found
    assert ("partitioner.service", "partitioner.stage_plans") in found


def test_no_import_cycle():
    found = cycles(edges())
    assert not found, "import cycles:\n" + "\n".join(describe(c) for c in found.values())


def test_flowmesh_imports_nothing_built_on_it():
    wrong = [
        f"{e.where}: {e.source} imports {e.target}"
        for e in edges()
        if e.source.split(".")[0] == "flowmesh" and e.target.split(".")[0] in ABOVE_FLOWMESH
    ]
    assert not wrong, "flowmesh/ is the bottom floor:\n" + "\n".join(wrong)


def test_the_worker_imports_nothing_from_the_partitioner():
    wrong = [
        f"{e.where}: {e.source} imports {e.target}"
        for e in edges()
        if e.source.split(".")[0] == "gpu_worker" and e.target.split(".")[0] == "partitioner"
    ]
    assert not wrong, "what the worker needs lives in flowmesh.modelio:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("source", "module", "is_package", "level", "name", "expected"),
    [
        ("from . import x", "a.b.c", False, 1, None, "a.b"),
        ("from .d import x", "a.b.c", False, 1, "d", "a.b.d"),
        ("from .. import x", "a.b.c", False, 2, None, "a"),
        ("from .d import x", "a.b", True, 1, "d", "a.b.d"),
    ],
)
def test_relative_imports_resolve(source, module, is_package, level, name, expected):
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ImportFrom) and node.level == level and node.module == name
    assert _resolve(node, module, is_package) == expected
