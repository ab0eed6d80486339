"""The benchmarks' own modules import each other without a circle (read with `ast`, nothing imported).

`benchmarks/` is no package: its scripts put the folder on `sys.path` and import the packages beside them by name
(`from harness.common import ...`, `from areas.dkm import peers`), at the top of a file or inside a function; a
module of a package may import its siblings relatively (`from .peers import ...`). Every such import of another
module of `benchmarks/` (at any depth: `benchmarks/*.py` and every package below it) is an edge, and so is one to each
package the import runs through (its `__init__.py` runs first); a cycle among them is a failure that names the cycle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def modules(folder: Path) -> dict[str, Path]:
    """`{dotted module name: file}` of `folder/*.py` and of every package below it (`pkg/__init__.py` is `pkg`)."""
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        packages = [folder.joinpath(*parts[:depth]) for depth in range(1, len(parts))]
        if all((package / "__init__.py").is_file() for package in packages):  # reachable by import from `folder`
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, name: str, path: Path) -> list[str]:
    """The dotted names an import statement of module `name` (file `path`) may load: the module, and for `from M
    import x` also `M.x` (a submodule, when it is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: against the package of the file (a package's own `__init__` is its package)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else []
        base = ".".join([*anchor, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" if base else alias.name for alias in node.names)]


@functools.cache
def import_graph(folder: Path = BENCHMARKS) -> dict[str, set[str]]:
    """`{module: the benchmarks modules it imports}` over `folder`'s modules and packages, at any depth of each file;
    importing `a.b.c` is an edge to `a`, `a.b` and `a.b.c` (each that is a module of `folder`)."""
    sources = modules(folder)
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for dotted in _imported(node, name, path):
                    parts = dotted.split(".")
                    found.update(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))
        graph[name] = {other for other in found if other in sources and other != name} | (
            {name} if _imports_itself(name, found, path) else set()
        )
    return graph


def _imports_itself(name: str, found: set[str], path: Path) -> bool:
    """A module that imports itself (a package's `__init__` importing its own name does not count: `from . import x`
    names the package it is)."""
    return name in found and path.name != "__init__.py"


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


def _file(module: str) -> str:
    """How a cycle names a module: its file under the benchmarks folder (`a.py`, `pkg/b.py`, `pkg/__init__.py`)."""
    path = module.replace(".", "/")
    return f"{path}/__init__.py" if (BENCHMARKS / path).is_dir() else f"{path}.py"


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
                    line = " -> ".join(_file(m) for m in [*paths[node], start])
                    others = sorted(component - set(paths[node]))
                    return line + (f" (and through {', '.join(_file(m) for m in others)})" if others else "")
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {sorted(component)}")


def test_the_graph_sees_the_benchmarks_imports():
    graph = import_graph()
    assert "harness.common" in graph["dkm"] and "areas.catalog" in graph["report"]
    assert "harness" in graph["dkm"]  # the package the import runs through
    assert "harness.registry" in graph["areas.dkm.real_report"]  # `from X import` at the top of a file
    assert "areas.inference.worker" in graph["areas.inference.runner"]  # `from package import module`
    assert "areas.dkm.real_report" in graph["areas.catalog"]
    assert not any(name.startswith("_") for name in graph), "helpers live in packages (benchmarks/README.md)"


def test_the_benchmarks_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among benchmarks' modules:\n" + "\n".join(a_cycle(graph, c) for c in found)


def test_the_harness_imports_no_area():
    graph = import_graph()
    harness = {name for name in graph if name == "harness" or name.startswith("harness.")}
    assert harness and all(other in harness for name in harness for other in graph[name]), {
        name: graph[name] - harness for name in harness if graph[name] - harness
    }


def test_a_cycle_is_found_and_named(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import x\n")  # a function-level import counts
    (tmp_path / "c.py").write_text("from a import y\nimport os\n")
    (tmp_path / "d.py").write_text("import a\n")  # imports the cycle, is not part of it
    graph = import_graph(tmp_path)
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert a_cycle(graph, frozenset({"a", "b", "c"})) == "a.py -> b.py -> c.py -> a.py"


def test_a_cycle_through_packages_and_relative_imports_is_found(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "one.py").write_text("from .sub import two\n")  # `from package import module`
    (tmp_path / "pkg" / "sub" / "two.py").write_text("def f():\n    from ..three import x\n")
    (tmp_path / "pkg" / "three.py").write_text("import pkg.one\n")
    (tmp_path / "pkg" / "four.py").write_text("from . import three\n")  # imports the cycle, is not part of it
    (tmp_path / "script.py").write_text("from pkg.four import y\n")
    (tmp_path / "loose").mkdir()  # no __init__.py: not importable as `loose.x`, not a module
    (tmp_path / "loose" / "x.py").write_text("import script\n")
    graph = import_graph(tmp_path)
    assert set(graph) == {"pkg", "pkg.sub", "pkg.one", "pkg.sub.two", "pkg.three", "pkg.four", "script"}
    assert graph["script"] == {"pkg", "pkg.four"} and graph["pkg.four"] == {"pkg", "pkg.three"}
    assert cycles(graph) == [frozenset({"pkg.one", "pkg.sub.two", "pkg.three"})]
    assert a_cycle(graph, frozenset({"pkg.one", "pkg.sub.two", "pkg.three"})) == (
        "pkg/one.py -> pkg/sub/two.py -> pkg/three.py -> pkg/one.py"
    )
