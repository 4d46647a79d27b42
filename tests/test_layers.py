"""The package's imports only look down: errors < data < tasks < models < trainer < logging / evaluation < the
run's parts (config, inference, prediction) < run < the package and its CLI. The walk reads every import of
every module under src/vlmtrain with ast (function-level and TYPE_CHECKING ones too), so a new upward import,
a cycle between modules or a trainer/ import of the rest of vlmtrain fails here, naming the edge.

A string that names a module of the package ("vlmtrain.tasks.shapes_source", or "module:function") is a lazy
import by name (a registry line, an importlib call): it must look down too, but it is no cycle (the registry
pattern: a kind's module imports the registry that names it)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "src" / "vlmtrain"

# Each module or subpackage of vlmtrain and its layer (higher imports lower; equal ranks may import each other
# as long as there is no cycle). A new top-level module has no layer until it gets a line here.
LAYERS: dict[str, int] = {
    "vlmtrain.errors": 0,
    "vlmtrain.data": 1,
    "vlmtrain.tasks": 2,
    "vlmtrain.models": 3,
    "vlmtrain.trainer": 4,
    "vlmtrain.logging": 5,
    "vlmtrain.evaluation": 5,
    "vlmtrain.compat": 5,
    "vlmtrain.parallel": 5,
    "vlmtrain.checkpointing": 5,
    "vlmtrain.checkpoint_paths": 5,
    # what a run is made of, below the orchestrator that runs them
    "vlmtrain.config_checks": 6,
    "vlmtrain.config": 6,
    "vlmtrain.config_objective": 6,
    "vlmtrain.config_grpo": 6,
    "vlmtrain.compose": 6,
    "vlmtrain.memory": 6,
    "vlmtrain.inference": 6,
    "vlmtrain.prediction": 6,
    "vlmtrain.run": 7,
    "vlmtrain.launch": 7,
    "vlmtrain.torchrun_errors": 7,
    # the public faces: the package's names (vlmtrain/__init__), the command line on top of them
    "vlmtrain": 8,
    "vlmtrain.cli": 9,
    "vlmtrain.cli_help": 9,
    "vlmtrain.cli_inference": 9,
    "vlmtrain.__main__": 10,
}
# trainer/ is the generic engine: what it needs from the rest arrives through the interfaces it defines.
TRAINER = "vlmtrain.trainer"
TRAINER_MAY_IMPORT = ("vlmtrain.errors", TRAINER)
# The orchestrator is what the command line runs; nothing else imports it (not even the package's __init__).
ORCHESTRATOR = "vlmtrain.run"
ORCHESTRATOR_IMPORTED_BY = ("vlmtrain.cli", "vlmtrain.__main__")


MODULE_NAME = re.compile(r"vlmtrain(\.\w+)+(:\w+)?")


@dataclass(frozen=True, order=True)
class Edge:
    """``importer`` imports ``imported`` at file:line (``by_name``: a string that names the module)."""

    file: str
    line: int
    importer: str
    imported: str
    by_name: bool = False

    def __str__(self) -> str:
        how = ", by name" if self.by_name else ""
        return f"{self.importer} -> {self.imported} ({self.file}:{self.line}{how})"


def module_files() -> dict[str, Path]:
    """Module name -> its file, for every module of the package (a package is its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("vlmtrain",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int, bool]]:
    """(imported vlmtrain module, line, by name) for each import in the module: ``from pkg import name`` where
    name is a submodule imports that submodule, otherwise the package (or module) it names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        named_by_string = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if named_by_string and MODULE_NAME.fullmatch(node.value):
            dotted = node.value.partition(":")[0].split(".")  # module, or module.attribute (a class path)
            prefixes = (".".join(dotted[:n]) for n in range(len(dotted), 0, -1))
            named = next((prefix for prefix in prefixes if prefix in modules), None)
            if named is not None:
                yield named, node.lineno, True
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, "vlmtrain"):
                    yield alias.name, node.lineno, False
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _within(source, "vlmtrain"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield (sub if sub in modules else source), node.lineno, False


def package_edges() -> list[Edge]:
    """Every import edge between two modules of vlmtrain, in file and line order (a module naming itself is
    left out)."""
    modules = module_files()
    edges = set()
    for name, path in modules.items():
        for imported, line, by_name in _imports(name, path, modules):
            if imported != name:
                edges.add(Edge(str(path.relative_to(PACKAGE_DIR.parents[1])), line, name, imported, by_name))
    return sorted(edges)


def layer(module: str) -> int | None:
    """The layer of ``module``: the entry of the longest LAYERS prefix (the entry "vlmtrain" is the package's
    __init__ alone, no prefix), None where there is none."""
    owners = [prefix for prefix in LAYERS
              if module == prefix or (prefix != "vlmtrain" and module.startswith(prefix + "."))]
    return LAYERS[max(owners, key=len)] if owners else None


def cycles(edges: list[Edge]) -> list[tuple[list[Edge], list[str]]]:
    """For each group of modules that import each other in a circle (a strongly connected component of the
    import graph, lazy imports by name left out): one shortest cycle as its edges, and the group's modules."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        if not edge.by_name:
            graph.setdefault(edge.importer, {}).setdefault(edge.imported, edge)
    found = []
    for group in _strongly_connected(graph):
        if len(group) > 1:
            start = min(group)
            inside = {node: {nxt: e for nxt, e in graph[node].items() if nxt in group} for node in group}
            found.append((_shortest_cycle(inside, start), sorted(group)))
    return sorted(found, key=lambda item: item[1])


def _strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative, so no recursion limit applies)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def _shortest_cycle(graph: dict[str, dict[str, Edge]], start: str) -> list[Edge]:
    """The fewest edges from ``start`` back to itself (breadth-first; ``graph`` is one component)."""
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, edge in sorted(graph[node].items()):
                if nxt == start:
                    path = [edge]
                    while path[0].importer != start:
                        path.insert(0, came_by[path[0].importer])
                    return path
                if nxt not in came_by:
                    came_by[nxt] = edge
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in module_files() if layer(name) is None)
    if unplaced:
        pytest.fail(f"modules with no layer (give each a line in LAYERS, tests/test_layers.py): {unplaced}",
                    pytrace=False)


def test_no_import_from_a_higher_layer():
    upward = [edge for edge in package_edges()
              if None not in (layer(edge.importer), layer(edge.imported))
              and layer(edge.imported) > layer(edge.importer)]
    if upward:
        pytest.fail("imports from a higher layer (importer -> imported):\n  " + "\n  ".join(map(str, upward)),
                    pytrace=False)


def test_trainer_imports_nothing_of_vlmtrain_but_errors():
    outside = [edge for edge in package_edges() if _within(edge.importer, TRAINER)
               and not any(_within(edge.imported, allowed) for allowed in TRAINER_MAY_IMPORT)]
    if outside:
        pytest.fail("trainer/ imports the rest of vlmtrain (it may import vlmtrain.errors only):\n  "
                    + "\n  ".join(map(str, outside)), pytrace=False)


def test_only_the_command_line_imports_the_orchestrator():
    others = [edge for edge in package_edges() if _within(edge.imported, ORCHESTRATOR)
              and edge.importer not in ORCHESTRATOR_IMPORTED_BY]
    if others:
        pytest.fail(f"{ORCHESTRATOR} is imported by more than the command line {ORCHESTRATOR_IMPORTED_BY}:"
                    + "".join(f"\n  {edge}" for edge in others), pytrace=False)


def test_no_cycle_between_modules():
    found = cycles(package_edges())
    if found:
        pytest.fail("import cycles:\n" + "\n".join(
            "  " + " -> ".join([path[0].importer] + [edge.imported for edge in path])
            + (f"  (a circle of {len(group)} modules: {', '.join(group)})" if len(group) > len(path) else "")
            + "".join(f"\n      {edge}" for edge in path) for path, group in found), pytrace=False)


def test_importing_the_package_and_its_cli_loads_no_peft():
    """`import vlmtrain` (every torchrun rank and CLI process does) leaves peft unimported: transformers'
    trainer_utils imports it (about 1 s of CPU per process, a run without LoRA never needs it), so the package
    imports trainer_utils only where it is used."""
    import os
    import subprocess
    import sys

    code = "import sys, vlmtrain, vlmtrain.cli; print(sorted(m for m in ('peft', 'transformers.trainer_utils') " \
           "if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
