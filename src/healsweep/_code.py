"""The code a cached stage can run, read from healsweep's source: the digest in its cache key.

A stage's code is the import closure of the modules that define its computation: every healsweep
module named by an ``import`` or ``from ... import`` anywhere in one of them (at module level or
inside a function; relative imports resolved), transitively, with each package ``__init__`` that
Python runs on the way. A module that imports by a name computed at run time
(``importlib.import_module``, ``__import__``) brings in every module of its package. The set is
coarse (a module may be imported and never called) but never misses a module an import reaches,
and no list is kept by hand. The digest is sha256 over the set's names and source bytes, so any
edit to any module in it changes the keys of the stages that name it.

Sources are read from the installed package (editable or not: a wheel installs the ``.py``
files); each closure is computed once per process. ``source_root`` points the same computation at
another copy of the package (tests edit such a copy).
"""

from __future__ import annotations

import ast
import hashlib
import threading
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from healsweep.errors import CacheError
from healsweep.runtime import current

PACKAGE = "healsweep"
_DYNAMIC_IMPORTS = frozenset({"import_module", "__import__"})


def package_root() -> Path:
    """The directory of the installed ``healsweep`` package."""
    return Path(__file__).resolve().parent


def _source_file(name: str, root: Path) -> Path | None:
    """The file of module ``name`` (``healsweep.a.b``) under ``root``, None if there is none."""
    path = root.joinpath(*name.split(".")[1:])
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


@cache
def _imports(
    name: str, is_package: bool, source: bytes
) -> tuple[tuple[tuple[str, bool], ...], bool]:
    """``(names, dynamic)``: the healsweep names ``source`` (module ``name``) imports, each as a
    module that must exist (``True``) or may be a plain attribute (``False``), and whether it
    imports by a run-time name. Memoized by content, so an unchanged file is parsed once."""
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, bool]] = []
    dynamic = False
    # One parse at a time in a process: CPython 3.11's AST constructor counts its recursion
    # depth per interpreter, so two threads parsing at once (a trial's stage keys beside the
    # teacher's records ahead of scoring) fail with "AST constructor recursion depth mismatch"
    # (gh-106905). The lock is the runtime's.
    with current().memo(("healsweep._code", "parsing"), threading.Lock):
        tree = ast.parse(source, filename=name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, True) for alias in node.names if _ours(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if _ours(module):
                found.append((module, True))
                found += [(f"{module}.{alias.name}", False) for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            called = getattr(func, "id", None) or getattr(func, "attr", None)
            dynamic = dynamic or called in _DYNAMIC_IMPORTS
    return tuple(found), dynamic


def _closure_sources(roots: Iterable[str], root: Path) -> dict[str, bytes]:
    """``{module: source bytes}`` of the import closure of ``roots`` in the package at ``root``."""
    sources: dict[str, bytes] = {}
    todo = [(name, True) for name in roots]
    while todo:
        name, must = todo.pop()
        if name in sources:
            continue
        path = _source_file(name, root)
        if path is None:
            if must:
                raise CacheError(
                    f"{name} has no Python source under {root}: stage cache keys are digests "
                    "of healsweep's sources, so install the package with its .py files"
                )
            continue  # a name imported from a module, not a module itself
        source = sources[name] = path.read_bytes()
        parts = name.split(".")
        todo += [(".".join(parts[:i]), True) for i in range(1, len(parts))]  # parents run first
        imported, dynamic = _imports(name, path.name == "__init__.py", source)
        todo += imported
        if dynamic:
            package_dir = path.parent
            prefix = ".".join(parts if path.name == "__init__.py" else parts[:-1])
            for file in package_dir.rglob("*.py"):
                relative = file.relative_to(package_dir).with_suffix("").parts
                module = ".".join((prefix, *relative)).removesuffix(".__init__")
                todo.append((module, True))
    return sources


def _digest(sources: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + hashlib.sha256(sources[name]).digest())
    return digest.hexdigest()[:16]


@cache
def _installed(roots: tuple[str, ...]) -> tuple[frozenset[str], str]:
    sources = _closure_sources(roots, package_root())
    return frozenset(sources), _digest(sources)


def module_closure(roots: Iterable[str], source_root: Path | None = None) -> frozenset[str]:
    """The healsweep modules that the modules ``roots`` can run (see the module docstring)."""
    if source_root is None:
        return _installed(tuple(sorted(roots)))[0]
    return frozenset(_closure_sources(roots, Path(source_root)))


def code_digest(roots: Iterable[str], source_root: Path | None = None) -> str:
    """16 hex digits of sha256 over the names and sources of :func:`module_closure` of ``roots``:
    it changes with any byte of any module a stage defined in ``roots`` can run."""
    if source_root is None:
        return _installed(tuple(sorted(roots)))[1]
    return _digest(_closure_sources(roots, Path(source_root)))
