"""`healsweep doctor` on this machine, and the conformance machinery it runs.

The CLI runs are subprocesses with ``HOME``/``RAY_TMPDIR`` in the test's folder and no ``RAY_*``
variable, so no Ray of another process is ever found. The comparison is checked against a float64
numpy re-implementation; a kernel that really disagrees between its two runs (an ``io_callback``
whose output changes with each execution) must be reported as not ok, and so must a kernel that
fails to lower (a primitive with no lowering rule for the platform) or to run (a callback that
raises): nothing runs such a kernel on the CPU instead, so doctor exits 1 and names it.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import mlir
from typer.testing import CliRunner

from healsweep.cli import _register
from healsweep.cli._apps import app
from healsweep.kernels import _cases
from healsweep.kernels.conformance import KernelCase, _max_rel_err, kernel_cases, run_case


@pytest.fixture(scope="module")
def doctor_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    (root / "home").mkdir()
    (root / "raytmp").mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {
        **clean,
        "HOME": str(root / "home"),
        "RAY_TMPDIR": str(root / "raytmp"),
        "HEALSWEEP_CACHE": str(root / "cache"),
        # The two doctor runs compile the same kernels: the second reuses the first's programs.
        "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _doctor(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "healsweep", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _conformance_rows(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    start = lines.index("kernel conformance (default backend vs CPU):") + 1
    return {line.split()[0]: line for line in lines[start:] if line.startswith("  ")}


def test_doctor_without_a_cluster_reports_none_and_every_kernel_conformant(doctor_env):
    done = _doctor(doctor_env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"jax {jax.__version__} (jaxlib ")
    assert lines[0].endswith("default backend: cpu")
    assert any(line.startswith("  device cpu:0") for line in lines)
    assert "ray cluster: none running here" in done.stdout
    rows = _conformance_rows(done.stdout)
    assert set(rows) == {case.name for case in kernel_cases()}
    for name, row in rows.items():
        assert row.split()[1] == "cpu" and row.rstrip().endswith(("ok", "CPU-placed by design"))
        assert " ok" in row, (name, row)
    assert lines[-1] == f"doctor: all {len(rows)} kernels conformant"


def test_doctor_no_ray_skips_the_cluster_check(doctor_env):
    done = _doctor(doctor_env, "--no-ray")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ray cluster" not in done.stdout
    assert done.stdout.splitlines()[-1].startswith("doctor: all ")


def _rel_err_f64(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, np.max(np.abs(a64 - b64)) / np.max(np.abs(b64)))
    return worst


def test_max_rel_err_matches_a_float64_reference_over_a_pytree():
    rng = np.random.default_rng(3)
    want = [rng.standard_normal((5, 7)).astype(np.float32) * 10**k for k in range(-2, 3)]
    got = [w + rng.standard_normal(w.shape).astype(np.float32) * 1e-3 for w in want]
    tree_got = {"a": (got[0], got[1]), "b": [got[2], {"c": got[3]}], "d": got[4]}
    tree_want = {"a": (want[0], want[1]), "b": [want[2], {"c": want[3]}], "d": want[4]}
    err = _max_rel_err(tree_got, tree_want)
    assert err == pytest.approx(_rel_err_f64(got, want), rel=1e-4)
    assert _max_rel_err(tree_want, tree_want) == 0.0
    half = np.asarray([1.0, -2.0, 4.0], np.float16)
    assert _max_rel_err(half + np.float16(0.5), half) == pytest.approx(0.5 / 4.0)


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)),  # shape
        (np.array([1, 2, 3], np.int8), np.array([1, 2, 4], np.int8)),  # integers are exact
        (np.array([1.0, np.nan], np.float32), np.array([1.0, 2.0], np.float32)),  # NaN vs number
        (np.array([1.0, 2.0], np.float32), np.array([1.0, np.nan], np.float32)),
        (np.array([np.inf, 1.0], np.float32), np.array([-np.inf, 1.0], np.float32)),
    ],
)
def test_max_rel_err_is_infinite_for_what_cannot_be_compared(got, want):
    assert _max_rel_err(got, want) == float("inf")


def test_max_rel_err_accepts_matching_non_finite_values_and_empty_leaves():
    want = np.array([np.nan, np.inf, -np.inf, 2.0], np.float32)
    got = np.array([np.nan, np.inf, -np.inf, 2.002], np.float32)
    assert _max_rel_err(got, want) == pytest.approx(0.001, rel=1e-3)
    assert _max_rel_err(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32)) == 0.0
    assert _max_rel_err(np.array([3, 4], np.int32), np.array([3, 4], np.int32)) == 0.0


def _drifting_kernel(step: float):
    """A kernel whose every execution scales its input by a growing factor (1, 1+step, ...)."""
    executions = itertools.count()

    def factor() -> np.ndarray:
        return np.float32(1.0 + step * next(executions))

    def kernel(x):
        scale = io_callback(factor, jax.ShapeDtypeStruct((), jnp.float32))
        return x * scale  # [N, D]

    return kernel


def test_a_kernel_whose_two_runs_disagree_is_reported_not_ok():
    inputs = lambda rng: (rng.standard_normal((8, 16)).astype(np.float32),)  # noqa: E731
    loose = run_case(KernelCase("drift.loose", _drifting_kernel(1e-3), inputs, rtol=1e-2))
    assert loose.ok and loose.lowered and loose.backend == "cpu"
    assert loose.max_rel_err == pytest.approx(1e-3, rel=1e-3)
    tight = run_case(KernelCase("drift.tight", _drifting_kernel(1e-3), inputs, rtol=1e-4))
    assert not tight.ok
    assert tight.max_rel_err == pytest.approx(1e-3, rel=1e-3)


def test_a_cpu_placed_kernel_is_run_once_and_says_so():
    inputs = lambda rng: (rng.standard_normal((4, 4)).astype(np.float32),)  # noqa: E731
    result = run_case(KernelCase("drift.cpu", _drifting_kernel(0.5), inputs, cpu_placed=True))
    assert result.ok and result.max_rel_err == 0.0
    assert result.note == "CPU-placed by design"


def _primitive(name: str, lower_on: tuple[str, ...] = ()) -> Primitive:
    """An elementwise identity primitive that lowers only on the platforms in ``lower_on``."""
    prim = Primitive(name)
    prim.def_abstract_eval(lambda x: x)
    for platform in lower_on:
        mlir.register_lowering(prim, mlir.lower_fun(lambda x: x, multiple_results=False), platform)
    return prim


_UNLOWERABLE = _primitive("healsweep_test_unlowerable")
_CPU_ONLY = _primitive("healsweep_test_cpu_only", lower_on=("cpu",))


def _square_inputs(rng):
    return (rng.standard_normal((8, 16)).astype(np.float32),)


def _unlowerable_kernel(x):
    return _UNLOWERABLE.bind(x) * 2.0  # [N, D]


def _failing_callback_kernel(x):
    def fail() -> np.ndarray:
        raise RuntimeError("the callback refuses")

    return x * io_callback(fail, jax.ShapeDtypeStruct((), jnp.float32))  # [N, D]


def test_a_kernel_that_fails_to_lower_is_reported_failing_not_compared_with_itself():
    result = run_case(KernelCase("broken.unlowerable", _unlowerable_kernel, _square_inputs))
    assert not result.ok and not result.lowered
    assert result.max_rel_err == float("inf")
    assert result.note == "fails to lower on cpu"
    assert "healsweep_test_unlowerable" in result.error


def test_a_kernel_that_fails_at_run_time_is_reported_failing():
    result = run_case(KernelCase("broken.callback", _failing_callback_kernel, _square_inputs))
    assert not result.ok and not result.lowered
    assert result.note == "fails to run on cpu"


@pytest.mark.device
def test_a_kernel_that_lowers_on_cpu_only_fails_on_the_default_device():
    assert jax.default_backend() != "cpu", "a device test: run it where JAX has an accelerator"
    result = run_case(KernelCase("broken.cpu_only", lambda x: _CPU_ONLY.bind(x), _square_inputs))
    assert not result.ok and not result.lowered
    assert result.note == f"fails to lower on {jax.default_backend()}"


def test_doctor_exits_1_with_one_line_naming_a_kernel_that_fails_to_lower(monkeypatch):
    good = next(case for case in _cases.CASES if case.name == "q2_0.dequantize")
    broken = KernelCase("broken.unlowerable", _unlowerable_kernel, _square_inputs)
    monkeypatch.setattr(_cases, "CASES", (good, broken))
    _register()
    done = CliRunner().invoke(app, ["doctor", "--no-ray"])
    assert done.exit_code == 1, done.output
    rows = _conformance_rows(done.stdout)
    assert " ok" in rows["q2_0.dequantize"]
    assert "FAILS  fails to lower on cpu" in rows["broken.unlowerable"]
    assert "conformant" not in done.output
    assert done.stderr.splitlines() == [
        "doctor: 1 of 2 kernel(s) failing: broken.unlowerable (fails to lower on cpu)"
    ]
