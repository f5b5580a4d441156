"""The package's modules stand on each other in one direction: records → store → history → tools → loop →
coordinator → runtime → faces. Read from the source with ``ast`` (every import counts: module level,
inside functions, and under ``TYPE_CHECKING``), so a cycle that only a type checker would follow fails here
too."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import threadline

PACKAGE = pathlib.Path(threadline.__file__).parent

LAYERS: dict[str, int] = {
    # the base: nothing of threadline below them
    "_evolve": 0,
    "_logging": 0,
    "errors": 0,
    "jsonvalue": 0,
    "usage": 0,
    # records and what only describes them
    "records": 1,
    "approvals": 1,
    "events": 1,
    "delivery": 1,
    "inputs": 1,
    "models": 1,
    "protocol": 1,
    "output": 1,
    "failures": 1,
    "following": 1,
    "store": 2,
    "ledger": 2,
    "history": 3,
    "tools": 4,
    "durability": 4,
    "loop": 5,
    "coordinator": 6,
    "config": 6,
    "runtime": 7,
}
FACES = 8
"""The command line, the test doubles, the package facade and every leaf: nothing in the core imports them."""

CYCLE_ALLOWED = "threadline.store.postgres"
"""The PostgreSQL driver's private modules form one unit (a package): cycles inside it are its own affair."""


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["threadline", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                for alias in node.names:
                    candidate = f"{target}.{alias.name}"
                    deps.add(candidate if candidate in modules else target)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return FACES  # the package facade re-exports everything
    return LAYERS.get(parts[1], FACES)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_must_see() -> None:
    graph = _graph()
    # a module-level import, a TYPE_CHECKING one and one inside a function are all edges
    assert "threadline.loop" in graph["threadline.coordinator"]
    assert "threadline.durability" in graph["threadline.tools"]
    assert "threadline.coordinator" in graph["threadline.runtime"]


def test_no_import_cycles_between_modules() -> None:
    cycles = [sorted(c) for c in _strongly_connected(_graph()) if not all(m.startswith(CYCLE_ALLOWED) for m in c)]
    assert cycles == []


def test_every_import_points_down_the_layers() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {dep} (layer {_layer(dep)})"
        for module, deps in sorted(_graph().items())
        for dep in sorted(deps)
        if _layer(dep) > _layer(module)
    ]
    assert upward == []


def test_each_end_of_the_former_cycles_imports_first() -> None:
    """Each module of the two cycles there were (runtime ↔ coordinator, tools ↔ durability), imported first
    in a fresh interpreter, loads: neither depends on the other having been imported ahead of it."""
    script = "import importlib, sys\nimportlib.import_module(sys.argv[1])\n"
    for module in ("threadline.coordinator", "threadline.runtime", "threadline.durability", "threadline.tools"):
        done = subprocess.run([sys.executable, "-c", script, module], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{module}: {done.stderr[-2000:]}"
