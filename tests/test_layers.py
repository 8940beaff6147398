"""The package's layer order (docs/contracts.md): no module imports a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import healsweep

# Bottom to top. A module's layer is its subpackage (or top-level module) under healsweep.
ORDER = (
    "base",
    "kernels",
    "gguf_io",
    "model",
    "data",
    "quant",  # the quantizer registry: below the heal stages that ask it
    "score",  # the teacher cache and the window metrics: they name no heal module
    "heal",
    "results",
    "sweep",
    "confirm",
    "bench",  # benchmarks: above every runtime layer, so no stage digest covers one
    "cli",
)
LAYER_OF = {
    "": "base",  # the package root: its version and the error base class
    "errors": "base",
    "_atomic": "base",
    "_lru": "base",
    "_code": "base",
    "_cache_disk": "base",
    "settings_errors": "base",  # one translator of settings files' problems (specs, knob files)
    "_rss": "base",
    "_inputs": "base",  # bounded reading of a user's files, output paths checked first
    "_yaml_input": "base",  # the one bounded YAML loader of settings files
    "_malloc": "base",  # glibc arenas capped as the command line starts
    "profile": "base",
    "threads": "base",
    "cache": "base",
    "runtime": "base",
    "bundled": "base",
    "ray_orphans": "base",  # psutil only: the Ray processes a killed driver left
    "ledger": "data",
    "stage_names": "base",  # the stage vocabulary, beside the cache: heal and score name stages
    "cluster": "sweep",
    "conformance": "model",  # checks the forward, so it sits with it; only the CLI imports it
    "deliver": "confirm",
    "ledger_heads": "results",  # the heads a results root's sweeps recorded: reads results
    "__main__": "cli",
    "demo": "demo",  # the demo builder: outside the runtime, imported by the CLI alone
}


def layer(module: str) -> str | None:
    """The layer of a ``healsweep`` module name, None for other packages."""
    parts = module.split(".")
    if parts[0] != "healsweep":
        return None
    top = parts[1] if len(parts) > 1 else ""
    return LAYER_OF.get(top, top)


def upward_imports(root: Path) -> list[str]:
    """``module -> imported (line)`` for every import of a layer above the importer's, and of
    the demo builder from anywhere but the CLI, in the package at ``root``; imports inside
    functions count too."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join((root.name, *parts)).removesuffix(".__init__")
        mine = layer(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                theirs = layer(name)
                if theirs is None or theirs == mine:
                    continue
                if theirs == "demo":
                    wrong = mine != "cli"
                elif mine == "demo":
                    wrong = False  # the builder may use the runtime
                else:
                    if mine not in ORDER or theirs not in ORDER:
                        raise AssertionError(f"{module}: no layer for {mine!r}/{theirs!r}")
                    wrong = ORDER.index(theirs) > ORDER.index(mine)
                if wrong:
                    found.append(f"{module} -> {name} (line {node.lineno})")
    return found


def test_no_module_imports_upward():
    assert upward_imports(Path(healsweep.__file__).parent) == []


def test_a_planted_upward_import_is_found(tmp_path):
    package = tmp_path / "healsweep"
    for name, text in {
        "__init__.py": "",
        "errors.py": "",
        "kernels/__init__.py": "",
        "kernels/q.py": "def f():\n    from healsweep.model.forward import g\n",
        "model/__init__.py": "",
        "model/forward.py": "from healsweep.kernels import q\nimport numpy\n",
        "data/corpus.py": "from healsweep.demo.build import x\n",
        "cli/main.py": "import healsweep.demo.build\nfrom healsweep.confirm import c\n",
        "confirm.py": "from healsweep.sweep.driver import d\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert upward_imports(package) == [
        "healsweep.data.corpus -> healsweep.demo.build (line 1)",
        "healsweep.kernels.q -> healsweep.model.forward (line 2)",
    ]
