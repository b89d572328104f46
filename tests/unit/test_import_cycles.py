"""asyncrl's parts import one another without a cycle.

A part is what sits directly in `src/asyncrl`: a subpackage (`config`, `trainer`, ...) or a module
(`launcher`, `placement`, ...). Part A depends on part B when any module of A imports any module of B,
wherever the import stands: at the top of the module or inside a function, since an import moved into a
function to dodge a cycle is still that cycle, deferred. Imports under `if TYPE_CHECKING:` do not count (they
never run). `asyncrl` itself (`__init__`, `__main__`, `errors`, the package every part lives in) is left out
of the graph: `__main__` and `cli` start everything, and `errors` imports nothing. The graph is read from the
source with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "asyncrl"
ENTRY_POINTS = {"__init__", "__main__", "cli"}  # they import every part to start it; nothing imports them


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, except those under `if TYPE_CHECKING:`."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The asyncrl modules an import statement names (`from asyncrl import x` names asyncrl.x)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def part_of(module: str) -> str | None:
    names = module.split(".")
    if names[0] != "asyncrl" or len(names) < 2 or names[1] in ENTRY_POINTS | {"errors"}:
        return None
    return names[1]


def is_part(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def dependencies() -> dict[str, dict[str, str]]:
    """part -> {part it imports: where, as 'path:line'}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        source = part_of(module)
        if source is None:
            continue
        graph.setdefault(source, {})
        for node in imports(ast.parse(path.read_text(), str(path))):
            for name in imported_modules(node, module, path.name == "__init__.py"):
                target = part_of(name)
                if target is not None and target != source and is_part(target):
                    graph[source].setdefault(target, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The shortest cycle through the first of each group of parts that reach one another (Tarjan's strongly
    connected components), as the parts in import order, the first again at the end. A group may hold more
    cycles than the one named: the test names them all once this one is broken."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(part: str) -> None:
        index[part] = low[part] = len(index)
        stack.append(part)
        for target in graph.get(part, {}):
            if target not in index:
                connect(target)
                low[part] = min(low[part], low[target])
            elif target in stack:
                low[part] = min(low[part], index[target])
        if low[part] == index[part]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == part:
                    break
            if len(group) > 1:
                groups.append(group)

    for part in sorted(graph):
        if part not in index:
            connect(part)
    return [shortest_cycle(graph, min(group), group) for group in groups]


def shortest_cycle(graph: dict[str, dict[str, str]], start: str, group: set[str]) -> list[str]:
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        part = frontier.pop(0)
        for target in sorted(graph[part]):
            if target == start:
                return [*paths[part], start]
            if target in group and target not in paths:
                paths[target] = [*paths[part], target]
                frontier.append(target)
    raise AssertionError(f"no cycle through {start}")


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    steps = [f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_no_part_of_asyncrl_imports_itself_through_another():
    graph = dependencies()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(cycle, graph) for cycle in found)


def test_a_cycle_is_found_and_named_with_the_imports_that_make_it():
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:2"}, "c": {"a": "c.py:3"}, "d": {"a": "d.py:4"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert describe(["a", "b", "c", "a"], graph).splitlines()[1:] == [
        "  a -> b  (a.py:1)",
        "  b -> c  (b.py:2)",
        "  c -> a  (c.py:3)",
    ]


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking_ones():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from asyncrl.trainer import rl\n"
        "def f():\n    from asyncrl.orchestrator.client import InferenceClient\n"
    )
    names = [name for node in imports(tree) for name in imported_modules(node, "asyncrl.evals.run", False)]
    assert "asyncrl.orchestrator.client" in names and "asyncrl.trainer" not in names
