"""The package's imports run downward only, and no files import each other in a circle.

Read from the source (``ast``), every import counts: those at the top of a file and those inside
functions (a lazy import is still a dependency, it only runs later). An import names the module it
reaches: ``from fasttrain.bench import tables`` reaches ``fasttrain.bench.tables`` when that is a module,
``from fasttrain.engines import registry`` reaches the package ``fasttrain.engines`` (its __init__).
The packages a module sits in are not counted as its imports (Python runs their __init__ first, but
that is the package's business, not a dependency the file chose).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "fasttrain"

# The floors, lowest first. A floor holds rooms side by side; a module may import from its own room
# and from any room of a lower floor, never from a higher floor nor from another room of its floor
# (the lab and the MNIST driver live side by side: neither imports the other). A room is a list of
# module names; a name ending in ".*" is a package and everything under it.
FLOORS: list[dict[str, list[str]]] = [
    {"base": ["fasttrain.errors", "fasttrain.files", "fasttrain.timing"]},
    {"data and contract": ["fasttrain.data.*", "fasttrain.contract", "fasttrain.reference"]},
    # environment: the machine and the registered engines' library versions, for every run record
    {"engines": ["fasttrain.engines.*", "fasttrain.environment"], "memory estimator": ["fasttrain.memory.*"]},
    {"MNIST driver": ["fasttrain.training", "fasttrain.sweep", "fasttrain.sweep_report", "fasttrain.parity"],
     "lab": ["fasttrain.lab.*"]},
    {"bench": ["fasttrain.bench.*"]},
    {"front": ["fasttrain", "fasttrain.__main__", "fasttrain.cli"]},
]

# Allowed exceptions to the two rules: none. An exception would be named here, with its reason; an entry
# that no longer occurs fails the test, so the lists only ever shrink.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CIRCLES: set[frozenset[str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` reaches: itself, else the nearest package above it that exists."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from a.b import c`: c is a module of a.b or a name inside it
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "fasttrain" or target.startswith("fasttrain."):
                reached = _resolve(target, known)
                if reached and reached != name:
                    out.add(reached)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def place(name: str) -> tuple[int, str]:
    """(floor, room) of a module; every module of the package has one."""
    for floor, rooms in enumerate(FLOORS):
        for room, members in rooms.items():
            for member in members:
                if name == member or (member.endswith(".*") and (name == member[:-2] or
                                                                 name.startswith(member[:-1]))):
                    return floor, room
    raise AssertionError(f"{name} is on no floor: add it to FLOORS in tests/test_imports.py")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    bad = set()
    for name, targets in graph.items():
        floor, room = place(name)
        for target in targets:
            target_floor, target_room = place(target)
            if target_floor > floor or (target_floor == floor and target_room != room):
                bad.add((name, target))
    return bad


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_on_a_floor():
    for name in modules():
        place(name)


def test_imports_run_downward_only():
    upward = upward_imports(import_graph())
    assert upward - KNOWN_UPWARD == set(), "imports from a lower floor to a higher one (or across rooms)"
    assert KNOWN_UPWARD - upward == set(), "fixed: remove these from KNOWN_UPWARD"


def test_no_files_import_each_other_in_a_circle():
    found = set(circles(import_graph()))
    assert found - KNOWN_CIRCLES == set(), "modules that import each other in a circle"
    assert KNOWN_CIRCLES - found == set(), "fixed: remove these from KNOWN_CIRCLES"


def test_the_checks_catch_what_they_look_for():
    # a made-up graph: an engine importing the bench, and two bench files importing each other
    graph = {"fasttrain.engines.x": {"fasttrain.bench.y"}, "fasttrain.bench.y": {"fasttrain.bench.z"},
             "fasttrain.bench.z": {"fasttrain.bench.y"}, "fasttrain.lab.a": {"fasttrain.training"}}
    assert upward_imports(graph) == {("fasttrain.engines.x", "fasttrain.bench.y"),
                                     ("fasttrain.lab.a", "fasttrain.training")}
    assert circles(graph) == [frozenset({"fasttrain.bench.y", "fasttrain.bench.z"})]
