"""The package's imports run downward only, and no files import each other in a circle.

Read from the source (``ast``), every import counts: those at the top of a file and those inside
functions (a lazy import is still a dependency, it only runs later). An import names the module it
reaches: ``from fasttrain.bench import tables`` reaches ``fasttrain.bench.tables`` when that is a module,
``from fasttrain.engines import registry`` reaches the package ``fasttrain.engines`` (its __init__).
The packages a module sits in are not counted as its imports (Python runs their __init__ first, but
that is the package's business, not a dependency the file chose). A module named in full in a string
(``importlib.import_module("fasttrain.lab.api")``, a table of subcommands to load) counts too: the file
loads it, only by name.

Two sets of floors: the package's (FLOORS) and, inside the lab's room, the lab's own (LAB_FLOORS): its core
pieces, the wings ``hf/`` and ``parallel/`` that only the doors of the core (WING_DOORS) ask, the core that
trains, the experiments and tune above it, and the lab's command line on top.
"""

from __future__ import annotations

import ast
import re
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

# Inside the lab's room, its own floors, lowest first (the same rules). The core is cut in two around the
# wings: its pieces (settings, the models, the corpus) sit below hf/ and parallel/, which build on them; the
# core that trains sits above the wings and asks them for a model or a wrapper, only through its doors.
LAB_FLOORS: list[dict[str, list[str]]] = [
    {"core pieces": ["fasttrain.lab.config", "fasttrain.lab.overrides", "fasttrain.lab.outputs",
                     "fasttrain.lab.model_options", "fasttrain.lab.model", "fasttrain.lab.models",
                     "fasttrain.lab.tokenizer", "fasttrain.lab.data", "fasttrain.lab.adapters", "fasttrain.lab.noise",
                     "fasttrain.lab.progress", "fasttrain.lab.resume"]},
    {"hf wing": ["fasttrain.lab.hf.*"]},
    # parallel/ asks hf/ for a family's tensor-parallel plan, so it stands on it
    {"parallel wing": ["fasttrain.lab.parallel.*"]},
    {"core": ["fasttrain.lab.build", "fasttrain.lab.parallelize", "fasttrain.lab.trainer", "fasttrain.lab.train",
              "fasttrain.lab.measure", "fasttrain.lab.optim", "fasttrain.lab.checkpoint", "fasttrain.lab.record",
              "fasttrain.lab.preflight", "fasttrain.lab.estimate", "fasttrain.lab.evaluate", "fasttrain.lab.sample",
              "fasttrain.lab.batchsize", "fasttrain.lab.api", "fasttrain.lab.loggers", "fasttrain.lab.defaults",
              "fasttrain.lab.settings", "fasttrain.lab.fit"]},
    # an experiment is rows of configuration over the core's one trainer
    {"experiments": ["fasttrain.lab.experiments.*"]},
    # tune's search ranks its candidates as experiment rows (experiments/experiment.py's Experiment)
    {"tune": ["fasttrain.lab.tune.*"]},
    # the command lines and the package's lazy front door (fasttrain.lab.run: api, record, ...)
    {"lab front": ["fasttrain.lab", "fasttrain.lab.cli", "fasttrain.lab.tune.cli"]},
]
LAB = "fasttrain.lab"
WINGS = ("fasttrain.lab.hf", "fasttrain.lab.parallel")

# The doors: the only modules of the core that ask a wing for something, each for its reason. Any other core
# module that needs a model or a wrapper gets it through these.
WING_DOORS: dict[str, str] = {
    "fasttrain.lab.fit": "the per-GPU peak of each strategy (the estimator's view of a world)",
    "fasttrain.lab.defaults": "a transformers model's own defaults (its positions, whether its folder holds weights)",
    "fasttrain.lab.build": "a Hugging Face model as a LabModel",
    "fasttrain.lab.parallelize": "the techniques, applied in one order (tensor parallel, FSDP, DDP)",
    "fasttrain.lab.trainer": "the strategy's wrapper and this rank's share of the work",
    "fasttrain.lab.train": "the world of processes, a HF checkpoint's save",
    "fasttrain.lab.measure": "the optimizer state of this rank, liger's patches undone after a run",
    "fasttrain.lab.optim": "the parameter groups a sharded optimizer steps",
    "fasttrain.lab.preflight": "the estimator's setup of a HF model",
    "fasttrain.lab.evaluate": "a HF checkpoint scored again",
    "fasttrain.lab.sample": "a HF checkpoint generating",
    "fasttrain.lab.record": "is_hf: the rerun command of a HF model's run",
}

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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("fasttrain.") \
                and node.value in known:
            targets = [node.value]        # a module loaded by its name: importlib.import_module("fasttrain.x")
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


def _inside(name: str, member: str) -> bool:
    return name == member or (member.endswith(".*") and (name == member[:-2] or name.startswith(member[:-1])))


def place(name: str, floors: list[dict[str, list[str]]] = FLOORS) -> tuple[int, str]:
    """(floor, room) of a module; every module of the package has one (of the lab, one of LAB_FLOORS too).
    The most particular entry wins: a module named by itself over the package it sits in."""
    found = [(len(member), floor, room) for floor, rooms in enumerate(floors) for room, members in rooms.items()
             for member in members if _inside(name, member)]
    if found:
        _, floor, room = max(found)
        return floor, room
    raise AssertionError(f"{name} is on no floor: add it to {'LAB_FLOORS' if floors is LAB_FLOORS else 'FLOORS'} "
                         f"in tests/test_imports.py")


def _in_lab(name: str) -> bool:
    return name == LAB or name.startswith(LAB + ".")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports from a floor to a higher one or across rooms: the package's floors, then the lab's inside its
    room, then a core module asking a wing without being one of its doors."""
    bad = set()
    for name, targets in graph.items():
        floor, room = place(name)
        for target in targets:
            target_floor, target_room = place(target)
            if target_floor > floor or (target_floor == floor and target_room != room):
                bad.add((name, target))
            elif _in_lab(name) and _in_lab(target):
                lab_floor, lab_room = place(name, LAB_FLOORS)
                target_lab_floor, target_lab_room = place(target, LAB_FLOORS)
                if target_lab_floor > lab_floor or (target_lab_floor == lab_floor and target_lab_room != lab_room):
                    bad.add((name, target))
                elif (lab_room == "core" and name not in WING_DOORS
                      and any(_inside(target, wing + ".*") for wing in WINGS)):
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
        if _in_lab(name):
            place(name, LAB_FLOORS)


def test_every_door_to_a_wing_is_a_core_module_that_asks():
    graph = import_graph()
    for door in WING_DOORS:
        assert place(door, LAB_FLOORS)[1] == "core", door
        if door in graph:           # (parallelize.py and loggers.py are being written beside this test)
            assert any(_inside(t, wing + ".*") for t in graph[door] for wing in WINGS), \
                f"{door} asks no wing any more: remove it from WING_DOORS"


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
             "fasttrain.bench.z": {"fasttrain.bench.y"}, "fasttrain.lab.config": {"fasttrain.training"}}
    assert upward_imports(graph) == {("fasttrain.engines.x", "fasttrain.bench.y"),
                                     ("fasttrain.lab.config", "fasttrain.training")}
    assert circles(graph) == [frozenset({"fasttrain.bench.y", "fasttrain.bench.z"})]


def test_the_lab_floors_catch_what_they_look_for():
    ok = {
        "fasttrain.lab.hf.model": {"fasttrain.lab.config", "fasttrain.lab.models"},     # a wing on the core's pieces
        "fasttrain.lab.parallel.distributed": {"fasttrain.lab.hf.tp_plan"},             # parallel stands on hf
        "fasttrain.lab.build": {"fasttrain.lab.hf.model"},                              # a door asks a wing
        "fasttrain.lab.tune.search": {"fasttrain.lab.experiments.experiment", "fasttrain.lab.trainer"},
        "fasttrain.lab.cli": {"fasttrain.lab.experiments.scaling", "fasttrain.lab.parallel.launch"},
        "fasttrain.bench.lab": {"fasttrain.lab.train"},
    }
    assert upward_imports(ok) == set()
    wrong = {
        "fasttrain.lab.config": {"fasttrain.lab.hf.config"},            # a piece of the core asks a wing
        "fasttrain.lab.hf.model": {"fasttrain.lab.parallel.distributed", "fasttrain.lab.trainer"},
        "fasttrain.lab.parallel.launch": {"fasttrain.lab.experiments.scaling"},   # `lab dist`'s old home
        "fasttrain.lab.checkpoint": {"fasttrain.lab.hf.save"},          # core, but not a door
        "fasttrain.lab.trainer": {"fasttrain.lab.tune.space"},          # the core asks what sits above it
        "fasttrain.lab.experiments.speedrun": {"fasttrain.lab.tune.run", "fasttrain.lab.cli"},
        "fasttrain.lab.tune.run": {"fasttrain.lab.tune.cli"},
        "fasttrain.lab.train": {"fasttrain.bench.lab"},                 # the lab never imports bench
    }
    assert upward_imports(wrong) == {(name, target) for name, targets in wrong.items() for target in targets}


def test_a_module_named_in_a_string_is_an_import(tmp_path):
    source = tmp_path / "front.py"
    source.write_text('import importlib\nSUBCOMMANDS = ("fasttrain.lab.tune.cli", "not.a.module")\n'
                      'importlib.import_module("fasttrain.lab.api")\n')
    known = {"fasttrain.lab.tune.cli": source, "fasttrain.lab.api": source, "fasttrain.lab.config": source}
    assert imports_of("fasttrain.lab.config", source, known) == {"fasttrain.lab.tune.cli", "fasttrain.lab.api"}


# --- one answer each ------------------------------------------------------------------------------

# "Is this a Hugging Face model?" has one answer, lab/hf/config.py's is_hf; a getattr with a default on a field
# every LabConfig has hides a typo. The places left are in files other work is rewriting now (and lab/config.py,
# below the hf wing, cannot ask it): each names its count, which only ever shrinks.
ONE_ANSWER = re.compile(r'(?:model|spec|source|name)\)?\.startswith\("hf:"\)|getattr\(cfg, "\w+"')
KNOWN_SECOND_ANSWERS: dict[str, int] = {}


def second_answers() -> dict[str, int]:
    found = {name: len(ONE_ANSWER.findall(path.read_text())) for name, path in modules().items()}
    return {name: count for name, count in found.items() if count}


def test_is_hf_and_the_config_fields_have_one_answer():
    found = second_answers()
    grown = {name: count for name, count in found.items() if count > KNOWN_SECOND_ANSWERS.get(name, 0)}
    assert grown == {}, "use fasttrain.lab.hf.config.is_hf, and cfg.field for a field LabConfig has"
    shrunk = {name: count for name, count in KNOWN_SECOND_ANSWERS.items() if found.get(name, 0) < count}
    assert shrunk == {}, "fixed: lower these in KNOWN_SECOND_ANSWERS"
    assert ONE_ANSWER.findall('if cfg.model.startswith("hf:") or getattr(cfg, "bf16", False):') == \
        ['model.startswith("hf:")', 'getattr(cfg, "bf16"']
