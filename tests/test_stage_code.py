"""Stage keys cover the code a stage runs: traced against the digest's module set (issue 31)."""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
import pytest

import healsweep
from _heal_fixtures import heal_setup
from healsweep._code import code_digest, module_closure
from healsweep.cache import StageCache
from healsweep.data.windows import Window
from healsweep.errors import CacheError
from healsweep.heal import stages, student_trace, trace
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.score import teacher_cache
from healsweep.score.teacher_cache import teacher_outputs
from healsweep.stage_names import VERSIONS, Stage
from healsweep.sweep import sensitivity

setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
PACKAGE = Path(healsweep.__file__).parent


@functools.cache
def _module_of(filename: str) -> str | None:
    path = Path(filename)
    if not path.is_relative_to(PACKAGE) or path.suffix != ".py":
        return None
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("healsweep", *parts)).removesuffix(".__init__")


class TracingCache(StageCache):
    """A real stage cache whose computations run under ``sys.settrace``: ``executed[stage]`` is
    every healsweep module with a frame executed while that stage computed (in any thread that
    computes it; a stage computed inside another counts for both)."""

    def __init__(self, root):
        super().__init__(root)
        self.executed: dict[str, set[str]] = defaultdict(set)
        self._active = threading.local()

    def _tracer(self, frame, event, arg):
        if event == "call":
            module = _module_of(frame.f_code.co_filename)
            if module is not None:
                for stage in self._active.stages:
                    self.executed[stage].add(module)
        return None

    def get_or_compute(self, stage, key, compute):
        def traced():
            active = getattr(self._active, "stages", None)
            if active is None:
                active = self._active.stages = []
            previous = sys.gettrace() if not active else None
            active.append(stage)
            if len(active) == 1:
                sys.settrace(self._tracer)
            try:
                return compute()
            finally:
                active.pop()
                if not active:
                    sys.settrace(previous)

        return super().get_or_compute(stage, key, traced)


# Cache stage name -> the name its key is built under, per quantizer.
QUANTIZE_KEY = {"search": "quantize", "gptq": "quantize_gptq", "plain": "quantize_plain"}
CONFIGS = {
    "act-mse-ridge": Knobs(importance="act", importance_down="act", alpha="mse", gamma=0.0),
    "gptq-refine": Knobs(quantizer="gptq", gptq_refine=1),
    "plain": Knobs(quantizer="plain", alpha="gaussian"),
    "expert-mse": Knobs(alpha="mse", alpha_granularity="expert"),
    "expert-gaussian": Knobs(alpha="gaussian", alpha_granularity="expert", ridge=False),
}


# Cache stage name -> the modules whose import closure its keys digest.
ROOTS_OF = {
    trace.STAGE: trace.CODE_ROOTS,
    trace.LAYER_STAGE: trace.CODE_ROOTS,
    student_trace.STAGE: student_trace.CODE_ROOTS,
    student_trace.LAYER_STAGE: student_trace.CODE_ROOTS,
    teacher_cache.STAGE: teacher_cache.CODE_ROOTS,
    sensitivity.STAGE: sensitivity.CODE_ROOTS,
    **dict.fromkeys(
        set(VERSIONS) - {trace.STAGE, trace.LAYER_STAGE, student_trace.STAGE,
                         student_trace.LAYER_STAGE}, stages.CODE_ROOTS,
    ),  # fmt: skip
}


def digest_modules(key_stage: str) -> frozenset[str]:
    """The modules whose source a key of ``key_stage`` covers."""
    return module_closure(ROOTS_OF[key_stage])


def _missing(executed: dict[str, set[str]], knobs: Knobs | None) -> dict[str, list[str]]:
    missing = {}
    for stage, modules in executed.items():
        key_stage = stage
        if stage == "quantize" and knobs is not None:
            key_stage = QUANTIZE_KEY[knobs.quantizer]
        outside = sorted(modules - digest_modules(key_stage))
        if outside:
            missing[key_stage] = outside
    return missing


@pytest.fixture(scope="module")
def traced_runs(setup, tmp_path_factory):
    """Every cached stage computed once per knob setting (and the teacher cache in both
    formats), from cold caches and with JAX's traces cleared, so that the Python of every
    jitted function runs again."""
    model, corpus = setup
    jax.clear_caches()
    runs = {}
    for name, knobs in CONFIGS.items():
        cache = TracingCache(tmp_path_factory.mktemp(name))
        build_student(model, knobs, CAL, cache, corpus=corpus)
        runs[name] = (knobs, dict(cache.executed))
    tokens = np.arange(5, 60, dtype=np.int32)
    window = Window("w0", "d0", "s", 1, "a", "dev", "text", tokens, 20, 30)
    cache = TracingCache(tmp_path_factory.mktemp("teacher"))
    for fmt in ("exact", "compact"):
        teacher_outputs(model, [window], cache, fmt)
    runs["teacher"] = (None, dict(cache.executed))
    return runs


@pytest.mark.parametrize("run", [*CONFIGS, "teacher"])
def test_every_module_a_stage_executes_is_in_its_digest(traced_runs, run):
    knobs, executed = traced_runs[run]
    assert executed, "nothing was computed: the run did not exercise any stage"
    missing = _missing(executed, knobs)
    assert not missing, "executed but outside the digest:\n" + "\n".join(
        f"  {stage}: {', '.join(modules)}" for stage, modules in sorted(missing.items())
    )


# The stage helper passes its caller's stage name through: its callers are the call sites.
_PASS_THROUGH = {"healsweep.cache", "healsweep.heal._runner"}
_CALLS = ("get_or_compute", "put", "value", "lazy", "stored")  # the cache's, StageRunner's


def _call_sites() -> list[tuple[str, str]]:
    """``(module, stage)`` of every call in the package that computes or stores a cache entry
    (``get_or_compute`` / ``put``, or :class:`~healsweep.heal._runner.StageRunner`'s ``value``
    / ``lazy``, with a stage name), the cache and the stage helper themselves left out."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(str(path))
        if module in _PASS_THROUGH:
            continue
        for node in ast.walk(ast.parse(path.read_bytes())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _CALLS
                and node.args
            ):
                continue
            arg = node.args[0]
            named = isinstance(arg, ast.Attribute) and ast.unparse(arg.value) == "Stage"
            if node.func.attr in ("value", "lazy", "stored") and not (
                isinstance(arg, ast.Constant) or named
            ):
                continue  # another object's value()/lazy(), not a stage
            if isinstance(arg, ast.Constant):
                sites.append((module, arg.value))
            elif named:  # a member of the stage vocabulary
                sites.append((module, Stage[arg.attr]))
            else:  # a module constant such as STAGE
                assert isinstance(arg, ast.Name), f"{module}: stage name is {ast.dump(arg)}"
                sites.append((module, getattr(importlib.import_module(module), arg.id)))
    return sites


def test_every_module_that_computes_a_stage_entry_is_in_its_digest():
    # A computation handed to the cache runs code of the module that defines it (a closure of
    # pipeline.py runs as part of part_a): that module must be inside the stage's digest too.
    sites = _call_sites()
    assert {stage for _, stage in sites} >= {"quantize", "part_b", "calib_trace", "teacher_logits"}
    for module, stage in sites:
        assert stage in ROOTS_OF, f"{module} caches stage {stage!r}, which no key digest names"
        assert module in digest_modules(stage), (module, stage)


ROOT_SETS = {
    "heal": stages.CODE_ROOTS,
    "trace": trace.CODE_ROOTS,
    "student_trace": student_trace.CODE_ROOTS,
    "teacher": teacher_cache.CODE_ROOTS,
    "sensitivity": sensitivity.CODE_ROOTS,
}


def _copy_package(destination: Path) -> Path:
    """A copy of the installed package's files (what a non-editable install lays out)."""
    shutil.copytree(
        PACKAGE, destination / "healsweep", ignore=shutil.ignore_patterns("__pycache__")
    )
    return destination / "healsweep"


def _edit_one_byte(path: Path) -> bytes:
    """Replace the file's last byte (its final newline) by a space, or give an empty file one
    newline: the same program, another source. Returns the original bytes."""
    original = path.read_bytes()
    path.write_bytes(original[:-1] + b" " if original.endswith(b"\n") else original + b"\n")
    return original


def test_one_byte_edited_in_any_module_of_a_digest_changes_that_digest(tmp_path):
    copy = _copy_package(tmp_path)
    for roots in ROOT_SETS.values():
        assert code_digest(roots, copy) == code_digest(roots)
        assert module_closure(roots, copy) == module_closure(roots)
    closures = {name: module_closure(roots) for name, roots in ROOT_SETS.items()}
    everything = sorted(set().union(*closures.values()))
    assert len(everything) > 40  # the forward, the kernels, gguf_io, the stages
    unrelated = "healsweep.results.report"  # reports read results; no stage runs them
    assert all(unrelated not in c for c in closures.values())
    for module in [*everything, unrelated]:
        path = copy.joinpath(*module.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        original = _edit_one_byte(path)
        try:
            for name, roots in ROOT_SETS.items():
                changed = code_digest(roots, copy) != code_digest(roots)
                assert changed == (module in closures[name]), (module, name)
        finally:
            path.write_bytes(original)


def test_closures_follow_function_local_relative_and_run_time_imports(tmp_path):
    package = tmp_path / "healsweep"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "a/__init__.py": "",
        "a/stage.py": "def f():\n    from .helper import g\n    return g()\n",
        "a/helper.py": "from ..b import table\nimport healsweep.c.deep\n",
        "b/__init__.py": "from importlib import import_module\n"
        "def __getattr__(n):\n    return import_module(f'healsweep.b.{n}')\n",
        "b/table.py": "",
        "b/other.py": "",
        "c/__init__.py": "",
        "c/deep.py": "from healsweep.errors import *\n",
        "d.py": "",  # imported by nobody
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert module_closure(["healsweep.a.stage"], package) == {
        "healsweep",
        "healsweep.errors",
        "healsweep.a",
        "healsweep.a.stage",
        "healsweep.a.helper",
        "healsweep.b",
        "healsweep.b.table",
        "healsweep.b.other",  # healsweep.b imports by a run-time name: all of b
        "healsweep.c",
        "healsweep.c.deep",
    }
    (package / "c/deep.py").unlink()
    with pytest.raises(CacheError, match=r"healsweep\.c\.deep has no Python source"):
        module_closure(["healsweep.a.stage"], package)


_KEYS_SCRIPT = """
import json, sys
import numpy as np
import healsweep
from healsweep._code import module_closure
from healsweep.data.windows import Window
from healsweep.model import open_model
from healsweep.heal import quantize, ridge, stages, trace
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.score.teacher_cache import teacher_key
model = open_model(sys.argv[1])
knobs = Knobs(quantizer="gptq")
q = quantize.layer_keys(model, knobs, "t", 0)
r = stages.routed_q_key(q, "t", 0)
a = stages.part_a_key(knobs, model, q, r, 0)
n = ridge.basis_key(model, "t", 0)
f = ridge.fit_key(knobs, n, ridge.rhs_key(n, a, r, 0), 0)
window = Window("w", "d", "s", 1, "a", "dev", "text", np.arange(9, dtype=np.int32), 3, 4)
print(json.dumps({
    "file": healsweep.__file__,
    "closure": sorted(module_closure(stages.CODE_ROOTS)),
    "keys": {
        "quantize": q["gu"], "quantize_d": q["d"], "routed_q": r, "part_a": a,
        "ridge_basis": n, "ridge_fit": f,
        "part_b": ridge.part_b_key(knobs, model, f, 0),
        "calib_trace": trace.trace_key(model, CalibrationConfig(), []),
        "teacher_logits": teacher_key(model, window),
    },
}))
"""


def _keys_of(site: Path, model: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _KEYS_SCRIPT, str(model)],
        env=env, capture_output=True, text=True, timeout=300, cwd=site,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_stage_keys_from_an_installed_copy_change_with_one_byte_of_its_code(setup, tmp_path):
    model = setup[0].path
    copy = _copy_package(tmp_path / "site")
    here = _keys_of(PACKAGE.parent, model)
    installed = _keys_of(copy.parent, model)
    assert Path(installed["file"]).parent == copy  # the copy ran, not the source tree
    assert installed["keys"] == here["keys"] and installed["closure"] == here["closure"]
    assert len(set(here["keys"].values())) == len(here["keys"])
    _edit_one_byte(copy / "kernels" / "_decode_legacy.py")  # the in-graph GGUF decoders
    edited = _keys_of(copy.parent, model)
    assert all(edited["keys"][k] != here["keys"][k] for k in here["keys"]), edited["keys"]


# The modules that write stage entries: the stage runner for every heal stage, the two
# streaming writers of their own stages (the traces' layers, the teacher's and the student's,
# and the teacher's windows), and the allocator's sensitivity pass (a config's dev scores, no
# heal stage: issue 39).
_WRITERS = {"healsweep.heal._runner", "healsweep.heal.trace", "healsweep.heal.student_trace",
            "healsweep.score.teacher_cache", "healsweep.sweep.sensitivity"}  # fmt: skip


def test_the_stage_runner_writes_every_heal_stage():
    """Issue 42: pipeline.py (ridge_heldout, the basis ahead) and evaluate.py (routed_q) wrote
    the cache themselves; every heal stage entry now goes through StageRunner."""
    writers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(str(path))
        if module in ("healsweep.cache", "healsweep._cache_disk"):
            continue
        for node in ast.walk(ast.parse(path.read_bytes())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get_or_compute", "put")
                and "cache" in ast.unparse(node.func.value)
            ):
                writers.add(module)
    assert writers <= _WRITERS, sorted(writers - _WRITERS)
    assert "healsweep.heal._runner" in writers
