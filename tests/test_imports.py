"""Imports (issue 42): no cycle among healsweep's modules, counting the imports inside functions,
and an import inside a function only where it defers a heavy or optional dependency, saying so.

Python tolerates a cycle whose back edge is an import inside a function; such an import hides
the cycle rather than breaking it. Both checks read the source (AST), so they need no import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import healsweep

PACKAGE = Path(healsweep.__file__).parent
MARK = "# lazy:"


def _modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in ``module`` names (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module if is_package else module.rpartition(".")[0]
    if node.level:
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    return [source, *(f"{source}.{alias.name}" for alias in node.names)]


def import_graph(package: Path) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over every import statement, in functions too; a
    module importing its own package face is not an edge (the face runs first anyway)."""
    modules = _modules(package)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(node, name, path.name == "__init__.py"):
                found = resolve(target) if target.startswith(package.name) else None
                if found and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycle_counting_imports_inside_functions():
    assert cycles(import_graph(PACKAGE)) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    package = tmp_path / "healsweep"
    files = {
        "__init__.py": "",
        "a.py": "from healsweep import b\n",
        "b.py": "def f():\n    from healsweep.a import g\n",
        "c/__init__.py": "from healsweep.c import d\n",  # a face importing its module: no cycle
        "c/d.py": "from healsweep.c import e\n",
        "c/e.py": "",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert cycles(import_graph(package)) == [["healsweep.a", "healsweep.b"]]


def face_names_imported_from_within(package: Path) -> list[str]:
    """``module: from FACE import name`` where a module takes a name its own package's face
    defines (not a submodule of it): the face imports its modules first, so that is a cycle
    the graph above does not count (a module importing its own package face is not an edge)."""
    modules = _modules(package)
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _imported(node, name, is_package)[0]
            if source not in modules or not name.startswith(source + "."):
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" not in modules:
                    found.append(f"{name}: from {source} import {alias.name}")
    return found


def test_no_module_takes_a_name_from_its_own_package_face():
    assert face_names_imported_from_within(PACKAGE) == []


def unmarked_local_imports(path: Path) -> list[str]:
    """``file:line import`` of each import inside a function that is not marked: neither its
    own first line nor the comment just above its run of imports says ``# lazy: <why>``."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    local = {
        node.lineno: node
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    ends = {node.end_lineno: node for node in local.values()}

    def says_why(line: str) -> bool:
        return MARK in line and line.split(MARK, 1)[1].strip() != ""

    found = []
    for lineno, node in sorted(local.items()):
        if says_why(lines[lineno - 1]):
            continue
        above = lineno - 1  # walk up over the imports of the same run
        while above in ends and ends[above].col_offset == node.col_offset:
            if says_why(lines[ends[above].lineno - 1]):
                break
            above = ends[above].lineno - 1
        marked = says_why(lines[above - 1]) if above >= 1 else False
        if not marked:
            found.append(f"{path.name}:{lineno} {ast.unparse(node)}")
    return found


def test_an_import_inside_a_function_says_why_it_is_there():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += unmarked_local_imports(path)
    assert found == [], "\n".join(found)


def test_the_marker_check_reads_runs_and_refuses_a_bare_marker(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "def f():\n"
        "    # lazy: heavy (jax)\n"
        "    import jax\n"
        "    from jax import numpy\n"  # the run's comment covers it
        "    import os  # lazy: optional (os)\n"
        "\n"
        "    import re\n"  # a new run, no comment
        "    import json  # lazy:\n"  # a marker without a reason
    )
    assert unmarked_local_imports(path) == ["m.py:7 import re", "m.py:8 import json"]
