"""The benchmarks' own modules import each other without a circle (read with `ast`, nothing imported).

`benchmarks/` is no package: its scripts put the folder on `sys.path` and import their helpers by file name
(`from _common import ...`), at the top of a file or inside a function. Every such import of another
`benchmarks/*.py` is an edge; a cycle among them is a failure that names the cycle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Cycles known and being removed elsewhere, each as the set of modules it runs through (its strongly connected
# component, so a module that joins it still fails the test).


@functools.cache
def import_graph(folder: Path = BENCHMARKS) -> dict[str, set[str]]:
    """`{module: the benchmarks modules it imports}` over `folder/*.py`, at any depth of each file."""
    sources = {path.stem: path for path in sorted(folder.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        graph[name] = {other for other in found if other in sources}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of `graph` that hold a cycle (two modules or more, or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph has a few dozen nodes
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
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
            if len(component) > 1 or node in graph[node]:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def a_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> str:
    """One cycle through `component`, as `a.py -> b.py -> a.py` (the shortest back to its first module), followed by
    the component's other modules when the cycle does not pass through all of them."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    line = " -> ".join(f"{m}.py" for m in [*paths[node], start])
                    others = sorted(component - set(paths[node]))
                    return line + (f" (and through {', '.join(f'{m}.py' for m in others)})" if others else "")
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {sorted(component)}")


def test_the_graph_sees_the_benchmarks_imports():
    graph = import_graph()
    assert "_common" in graph["dkm"] and "_fragments" in graph["report"]
    assert "_fragment_registry" in graph["_dkm_real_report"]  # `from X import` at the top of a file
    assert "_inference_worker" in graph["_inference_runner"]


def test_the_benchmarks_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among benchmarks/*.py:\n" + "\n".join(a_cycle(graph, c) for c in found)


def test_a_cycle_is_found_and_named(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import x\n")  # a function-level import counts
    (tmp_path / "c.py").write_text("from a import y\nimport os\n")
    (tmp_path / "d.py").write_text("import a\n")  # imports the cycle, is not part of it
    graph = import_graph(tmp_path)
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert a_cycle(graph, frozenset({"a", "b", "c"})) == "a.py -> b.py -> c.py -> a.py"
