"""Facts about the Python standard library that the demo corpus is written from.

Everything here ships with Python itself: each listed module's public functions, classes and
methods (own docstring, ``inspect.signature``, ``inspect.getsource``) and the reference topics of
``pydoc_data.topics``. No network, no third-party text.

Objects are grouped into *partition units* (a module family such as ``json`` + ``json.decoder``,
or one pydoc topic) so that code and prose that one module copies from a sibling never lands in
two pools: :func:`partition` hands out whole units.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import re
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pydoc_data.topics import topics

# (partition unit, modules). Sibling modules that share code or docstrings share a unit.
MODULE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("abc", ("abc",)),
    ("argparse", ("argparse", "optparse", "getopt")),
    ("ast", ("ast",)),
    ("asyncio", ("asyncio.queues", "asyncio.locks", "asyncio.tasks")),
    ("base64", ("base64", "quopri")),
    ("bisect", ("bisect", "heapq")),
    ("calendar", ("calendar",)),
    ("cmd", ("cmd",)),
    ("codecs", ("codecs", "stringprep")),
    ("collections", ("collections",)),
    ("colorsys", ("colorsys",)),
    ("compression", ("bz2", "lzma", "gzip")),
    ("concurrent", ("concurrent.futures",)),
    ("configparser", ("configparser",)),
    ("contextlib", ("contextlib",)),
    ("copy", ("copy",)),
    ("csv", ("csv",)),
    ("dataclasses", ("dataclasses",)),
    ("datetime", ("datetime",)),
    ("decimal", ("_pydecimal",)),
    ("difflib", ("difflib",)),
    ("dis", ("dis",)),
    ("doctest", ("doctest",)),
    ("email", ("email.utils", "email.message", "email.headerregistry", "email.policy")),
    ("enum", ("enum",)),
    ("filecmp", ("filecmp",)),
    ("fileinput", ("fileinput",)),
    ("fnmatch", ("fnmatch", "glob")),
    ("fractions", ("fractions", "numbers")),
    ("ftplib", ("ftplib",)),
    ("functools", ("functools",)),
    ("gettext", ("gettext",)),
    ("graphlib", ("graphlib",)),
    ("hashing", ("hashlib", "hmac", "secrets")),
    ("html", ("html", "html.parser")),
    ("http", ("http.client", "http.cookies")),
    ("imaplib", ("imaplib",)),
    ("inspect", ("inspect",)),
    ("io", ("_pyio",)),
    ("ipaddress", ("ipaddress",)),
    ("json", ("json", "json.decoder", "json.encoder")),
    ("linecache", ("linecache", "traceback")),
    ("locale", ("locale",)),
    ("logging", ("logging", "logging.handlers")),
    ("mailbox", ("mailbox",)),
    ("mimetypes", ("mimetypes",)),
    ("netrc", ("netrc",)),
    ("operator", ("operator",)),
    ("pathlib", ("pathlib",)),
    ("pickle", ("pickle", "pickletools")),
    ("plistlib", ("plistlib",)),
    ("poplib", ("poplib", "smtplib")),
    ("pprint", ("pprint",)),
    ("profile", ("profile", "cProfile", "pstats")),
    ("queue", ("queue", "sched")),
    ("random", ("random",)),
    ("re", ("re",)),
    ("reprlib", ("reprlib",)),
    ("selectors", ("selectors",)),
    ("shelve", ("shelve",)),
    ("shlex", ("shlex",)),
    ("shutil", ("shutil", "tempfile")),
    ("socketserver", ("socketserver",)),
    ("sqlite3", ("sqlite3",)),
    ("statistics", ("statistics",)),
    ("string", ("string",)),
    ("subprocess", ("subprocess",)),
    ("tabnanny", ("tabnanny",)),
    ("textwrap", ("textwrap",)),
    ("threading", ("threading",)),
    ("timeit", ("timeit",)),
    ("tokenize", ("tokenize", "token", "keyword")),
    ("tomllib", ("tomllib",)),
    ("trace", ("trace",)),
    ("types", ("types",)),
    ("typing", ("typing",)),
    ("unittest", ("unittest.case", "unittest.mock")),
    ("urllib", ("urllib.parse", "urllib.request")),
    ("uuid", ("uuid",)),
    ("warnings", ("warnings",)),
    ("wave", ("wave",)),
    ("weakref", ("weakref",)),
    ("wsgiref", ("wsgiref.util", "wsgiref.headers")),
    ("xml", ("xml.dom.minidom", "xml.etree.ElementTree")),
    ("xmlrpc", ("xmlrpc.client",)),
    ("archives", ("tarfile", "zipfile", "zipapp")),
    ("zoneinfo", ("zoneinfo",)),
)

MAX_SOURCE_LINES = 40
MAX_SOURCE_CHARS = 1600
_PUBLIC_HOME = {"_pydecimal": "decimal", "_pyio": "io"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class Param:
    """One parameter of a signature; ``default`` is its repr, or None if it has none."""

    name: str
    kind: str
    default: str | None


@dataclass(frozen=True)
class StdlibObject:
    """A documented function, class or method of the standard library."""

    qualname: str  # "json.JSONEncoder.encode"
    module: str  # "json.encoder" is shown as its public home when it has one
    name: str  # "JSONEncoder.encode"
    kind: str  # "function" | "class" | "method"
    signature: str | None  # "(self, o)"; None when inspect cannot give one
    params: tuple[Param, ...]
    doc: str
    source: str | None  # dedented source when it is short enough to show
    unit: str

    @property
    def short_name(self) -> str:
        """The last component of the name (``encode``)."""
        return self.name.rsplit(".", 1)[-1]

    def public_params(self) -> tuple[Param, ...]:
        """Parameters without ``self``/``cls``."""
        return tuple(p for p in self.params if p.name not in ("self", "cls"))


@dataclass(frozen=True)
class Topic:
    """One reference topic of ``pydoc_data.topics``."""

    key: str
    title: str
    paragraphs: tuple[str, ...]
    unit: str  # "topic:<first key>" of the topics that share text with this one


def collect_objects(
    groups: Sequence[tuple[str, Sequence[str]]] = MODULE_GROUPS,
) -> list[StdlibObject]:
    """Every documented public function, class and method of the listed modules, sorted."""
    # Touching deprecated aliases (typing.io, typing.re) warns; the text is still what we want.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _collect_objects(groups)


def _collect_objects(groups: Sequence[tuple[str, Sequence[str]]]) -> list[StdlibObject]:
    found: dict[str, StdlibObject] = {}
    for unit, modules in groups:
        for module_name in modules:
            module = importlib.import_module(module_name)
            for name, obj in sorted(vars(module).items()):
                if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                    continue
                if inspect.isfunction(obj):
                    _add(found, _describe(obj, module_name, name, "function", unit))
                elif inspect.isclass(obj):
                    _add(found, _describe(obj, module_name, name, "class", unit))
                    for member_name, member in sorted(vars(obj).items()):
                        if not member_name.startswith("_") and inspect.isfunction(member):
                            described = _describe(
                                member, module_name, f"{name}.{member_name}", "method", unit
                            )
                            _add(found, described)
    return [found[key] for key in sorted(found)]


def _add(found: dict[str, StdlibObject], obj: StdlibObject | None) -> None:
    if obj is not None and obj.qualname not in found:
        found[obj.qualname] = obj


def _describe(obj: object, module: str, name: str, kind: str, unit: str) -> StdlibObject | None:
    raw_doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    if not raw_doc:
        return None
    doc = inspect.cleandoc(raw_doc).strip()
    if len(doc) < 40 or "<|im_" in doc:
        return None
    signature, params = _signature(obj)
    public_module = _PUBLIC_HOME.get(module, module)
    return StdlibObject(
        qualname=f"{public_module}.{name}",
        module=public_module,
        name=name,
        kind=kind,
        signature=signature,
        params=params,
        doc=doc,
        source=_short_source(obj),
        unit=unit,
    )


def _signature(obj: object) -> tuple[str | None, tuple[Param, ...]]:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None, ()
    text = str(sig)
    # Reprs with addresses or of live objects differ between runs and machines.
    if _ADDRESS.search(text) or "<" in text:
        return None, ()
    params = tuple(
        Param(
            name=p.name,
            kind=p.kind.name.lower(),
            default=None if p.default is inspect.Parameter.empty else repr(p.default),
        )
        for p in sig.parameters.values()
    )
    return text, params


def _short_source(obj: object) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(obj))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    source = source.replace("\t", "    ").rstrip() + "\n"
    lines = source.count("\n")
    if not 3 <= lines <= MAX_SOURCE_LINES or len(source) > MAX_SOURCE_CHARS or "<|im_" in source:
        return None
    return source


def collect_topics() -> list[Topic]:
    """The pydoc reference topics, split into paragraphs, sorted by key.

    Several topics repeat each other's text (``compound`` holds ``if``, ``try``, ``with``...;
    ``specialnames`` holds ``customization``...). Topics that share a line of 60+ characters
    form one partition unit, so no repeated passage can land in two pools.
    """

    parsed = []
    for key in sorted(topics):
        lines = topics[key].strip().split("\n")
        title = lines[0].strip()
        underlined = len(lines) > 1 and set(lines[1].strip()) <= {"*", "=", "-"}
        body = lines[2:] if underlined else lines[1:]
        paragraphs = tuple(p.strip("\n") for p in "\n".join(body).split("\n\n") if p.strip())
        if paragraphs:
            parsed.append((key, title, paragraphs))
    units = _shared_text_units({key: paragraphs for key, _, paragraphs in parsed})
    return [Topic(key, title, paragraphs, units[key]) for key, title, paragraphs in parsed]


def _shared_text_units(texts: dict[str, tuple[str, ...]], min_line: int = 60) -> dict[str, str]:
    parent = {key: key for key in texts}

    def root(key: str) -> str:
        while parent[key] != key:
            key = parent[key]
        return key

    owner: dict[str, str] = {}
    for key in sorted(texts):
        for paragraph in texts[key]:
            for line in paragraph.split("\n"):
                line = " ".join(line.split())
                if len(line) < min_line:
                    continue
                if line in owner:
                    a, b = sorted((root(owner[line]), root(key)))
                    parent[b] = a
                else:
                    owner[line] = key
    return {key: f"topic:{root(key)}" for key in texts}


def unit_rank(seed: int, unit: str) -> str:
    """A seeded, stable sort key for a partition unit."""
    return hashlib.sha256(f"healsweep-demo:{seed}:{unit}".encode()).hexdigest()


def partition(
    units: Sequence[str], sizes: Sequence[int], weights: dict[str, int], seed: int
) -> list[set[str]]:
    """Deal whole units into parts in seeded order: part i fills until its weight reaches sizes[i].

    The last part takes every remaining unit. ``weights[unit]`` is how many usable items a unit
    brings (its object count), so parts are sized by content, not by unit count.
    """
    parts: list[set[str]] = [set() for _ in range(len(sizes) + 1)]
    filled = [0] * len(sizes)
    for unit in sorted(units, key=lambda u: unit_rank(seed, u)):
        target = next((i for i, size in enumerate(sizes) if filled[i] < size), len(sizes))
        parts[target].add(unit)
        if target < len(sizes):
            filled[target] += weights.get(unit, 1)
    return parts


def code_facts(source: str) -> dict[str, list[str] | bool]:
    """What a reader notices in a function body: calls, raised exceptions, return/yield."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {"calls": [], "raises": [], "returns": False, "yields": False}
    calls: list[str] = []
    raises: list[str] = []
    returns = yields = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node.func)
            if name and name not in calls:
                calls.append(name)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = _call_name(target)
            if name and name not in raises:
                raises.append(name)
        elif isinstance(node, ast.Return) and node.value is not None:
            returns = True
        elif isinstance(node, ast.Yield | ast.YieldFrom):
            yields = True
    return {"calls": calls[:6], "raises": raises[:4], "returns": returns, "yields": yields}


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _call_name(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return None
