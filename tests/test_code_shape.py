"""The shape of the code outside the CLI (issue 48): functions that read in a screen, and
healsweep's own modules imported at the top of a module, not inside its functions.

Both checks read the source (AST), so they need no import. The import budget counts each
function-level import statement of a healsweep module once (a statement in a nested function
is not counted twice); those left defer jax, gguf-py or a quantizer's jax machinery from a
module that must import without it, and each says why (tests/test_imports.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import healsweep

PACKAGE = Path(healsweep.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_LOCAL_IMPORTS = 20  # issue 48's bound; 8 when it closed


def _outside_cli(package: Path) -> list[Path]:
    return [p for p in sorted(package.rglob("*.py")) if p.relative_to(package).parts[0] != "cli"]


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def long_functions(package: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (lines)`` of each function outside ``cli/`` longer than ``limit``
    lines, its ``def`` line to its last line."""
    found = []
    for path in _outside_cli(package):
        for fn in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(package)}:{fn.lineno} {fn.name} ({lines})")
    return found


def _names_ours(node: ast.AST, package: str) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == package
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == package for alias in node.names)
    return False


def local_imports(package: Path) -> list[str]:
    """``file:line`` of each import of the package's own modules inside a function, outside
    ``cli/`` (the CLI imports a command's work when the command runs, so ``--help`` is fast)."""
    found = set()
    for path in _outside_cli(package):
        for fn in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            for node in ast.walk(fn):
                if _names_ours(node, package.name):
                    found.add(f"{path.relative_to(package)}:{node.lineno}")
    return sorted(found)


def test_no_function_outside_the_cli_is_over_80_lines():
    assert long_functions(PACKAGE) == []


def test_imports_of_healsweep_modules_inside_functions_stay_within_the_budget():
    found = local_imports(PACKAGE)
    assert len(found) <= MAX_LOCAL_IMPORTS, "\n".join(found)


def test_both_checks_find_what_they_look_for(tmp_path):
    package = tmp_path / "healsweep"
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    files = {
        "__init__.py": "",
        "long.py": f"def long():\n{body}\ndef short():\n    return 1\n",
        "lazy.py": "import os\n"
        "def f():\n"
        "    from healsweep import long\n"
        "    from . import long as again\n"
        "    import json\n"  # not ours: not counted
        "    def g():\n"
        "        import healsweep.long\n"
        "    return long, again, json, g\n",
        "cli/__init__.py": "def command():\n    from healsweep import lazy\n" + body,
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert long_functions(package) == [f"long.py:1 long ({MAX_FUNCTION_LINES + 1})"]
    assert local_imports(package) == ["lazy.py:3", "lazy.py:4", "lazy.py:7"]
