"""Benchmarks are outside every stage's code digest: editing one recomputes nothing (issue 42).

A stage key holds the digest of the modules its computation can import (``healsweep._code``).
The benchmark modules live in ``healsweep.bench``, which only the CLI imports; these tests edit
each of them in a copy of the package and check that no digest and no stage key moves, and that
no package face (a package's ``__init__``) reaches them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import healsweep
from _heal_fixtures import heal_setup
from healsweep._code import code_digest, module_closure
from healsweep.cache import StageCache
from healsweep.heal import stages, trace
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.score import teacher_cache

setup = heal_setup
PACKAGE = Path(healsweep.__file__).parent
# Every set of modules whose closure keys a stage: the heal stages, the trace, the teacher cache.
DIGESTS = {
    "heal": stages.CODE_ROOTS,
    "trace": trace.CODE_ROOTS,
    "teacher": teacher_cache.CODE_ROOTS,
}


def _bench_modules(root: Path) -> list[str]:
    return sorted(
        ".".join(("healsweep", *path.relative_to(root).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for path in (root / "bench").rglob("*.py")
    )


def _package_faces(root: Path) -> list[str]:
    """Every runtime package's ``__init__`` (the CLI's and the bench's own left out)."""
    return sorted(
        ".".join(("healsweep", *init.parent.relative_to(root).parts))
        for init in root.rglob("__init__.py")
        if init.parent.relative_to(root).parts[:1] not in (("bench",), ("cli",))
    )


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "healsweep", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "healsweep"


def _touch(path: Path) -> None:
    """Append a comment line: the same program, another source."""
    path.write_bytes(path.read_bytes() + b"# touched by test_bench_digest\n")


def test_the_bench_package_holds_the_benchmarks():
    found = _bench_modules(PACKAGE)
    for module in ("quant", "quant_gpu", "forward", "trial", "night", "localpool"):
        assert f"healsweep.bench.{module}" in found


def test_no_stage_digest_and_no_package_face_reaches_a_bench_module():
    bench = set(_bench_modules(PACKAGE))
    for name, roots in DIGESTS.items():
        assert not bench & module_closure(roots), name
    for face in _package_faces(PACKAGE):
        assert not bench & module_closure([face]), face


def test_touching_each_bench_module_changes_no_stage_digest(tmp_path):
    copy = _copy(tmp_path)
    before = {name: code_digest(roots, copy) for name, roots in DIGESTS.items()}
    assert before == {name: code_digest(roots) for name, roots in DIGESTS.items()}
    for module in _bench_modules(copy):
        path = copy.joinpath(*module.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        _touch(path)
        after = {name: code_digest(roots, copy) for name, roots in DIGESTS.items()}
        assert after == before, module
    # the check is live: a touched stage module does move its digest
    _touch(copy / "heal" / "quantize.py")
    assert code_digest(DIGESTS["heal"], copy) != before["heal"]


def test_touching_the_bench_modules_recomputes_nothing(setup, tmp_path, monkeypatch):
    """A student built, every bench module touched (in the installed source, restored after),
    the same student built again from the same cache: every stage is a hit."""
    model, corpus = setup
    cal = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
    knobs = Knobs(alpha="mse", importance="act")
    cache = StageCache(tmp_path / "cache")
    first = build_student(model, knobs, cal, cache, corpus=corpus)
    assert first.report["executed"], "the first build computed nothing"
    # The digests are memoized per process; a copy with the bench touched stands in for the
    # installed source, read afresh.
    copy = _copy(tmp_path / "site")
    for module in _bench_modules(copy):
        path = copy.joinpath(*module.split(".")[1:])
        _touch(path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
    from healsweep import _code

    monkeypatch.setattr(_code, "package_root", lambda: copy)
    _code._installed.cache_clear()
    try:
        again = build_student(model, knobs, cal, StageCache(tmp_path / "cache"), corpus=corpus)
    finally:
        _code._installed.cache_clear()
    assert again.key == first.key
    assert again.report["executed"] == {}
