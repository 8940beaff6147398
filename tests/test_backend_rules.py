"""Backend rules: every kernel stays inside what the Metal plugins can lower, and every
conformance case (kernels, in-graph decoders, a model layer) agrees with its float64 reference,
on this machine's CPU and, in the ``device`` tier, on its accelerator and with the CPU."""

from __future__ import annotations

import os
import pkgutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import healsweep.kernels
from healsweep.conformance import all_cases, backend_violations, run_case
from healsweep.conformance.cases import GAIN, _q2_grouped_inputs
from healsweep.kernels import q2_0

CASES = all_cases()
JITTED = [c for c in CASES if not c.driver]  # host drivers run jitted kernels, checked below

# The Q2_0 search in the layouts the production driver picks from (tiles on a CPU, blocks in
# place on other accelerators; the Pallas kernel is lowered for CUDA in test_q2_0_gpu.py).
Q2_LAYOUTS = {"tiles": {"tiles": True}, "blocks": {"tiles": False, "unroll": True}}


@pytest.mark.parametrize("case", JITTED, ids=[c.name for c in JITTED])
def test_kernel_jaxpr_has_no_float64_complex_or_unlowerable_primitives(case):
    inputs = case.make_inputs(np.random.default_rng(0))
    assert backend_violations(case.fn, *inputs, cpu_placed=case.cpu_placed) == []


@pytest.mark.parametrize("layout", list(Q2_LAYOUTS))
def test_q2_0_search_layouts_stay_inside_the_rules(layout):
    w, importance = _q2_grouped_inputs(np.random.default_rng(0))

    def search(w, importance):
        return q2_0._quantize_rows(w, importance, np.float32(GAIN), keep_extras=False,
                                   **Q2_LAYOUTS[layout])[:2]  # fmt: skip

    assert backend_violations(search, w, importance) == []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_agrees_with_its_float64_reference(case):
    # On a CPU-only machine (CI) this is the CPU against the references; with an accelerator,
    # also the device against them and against the CPU.
    result = run_case(case)
    assert result.ok, result


# Modules of healsweep.kernels that no conformance case needs to execute:
NOT_KERNELS = {
    "ggml_types": "the routed-expert type table: names, ids, block geometry (data, no arithmetic)",
}
# Kernels that run only where production picks them, so no case executes them on a CPU:
ON_THEIR_PLATFORM = {
    "q2_0_gpu": "the Pallas search, q2_0.quantize_rows's path on NVIDIA (the device tier); "
    "its interpreter equals the CPU kernel bit for bit in test_q2_0_gpu.py",
}


def _kernel_modules() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(healsweep.kernels.__path__)}


def test_cases_execute_every_kernel_module():
    # Which kernel modules' code runs while each case runs on the CPU (a sys.settrace of calls).
    package = str(Path(healsweep.kernels.__file__).parent) + os.sep
    files: set[str] = set()

    def tracer(frame, event, arg):  # on every call: kept cheap
        if event == "call" and frame.f_code.co_filename.startswith(package):
            files.add(frame.f_code.co_filename)

    jax.clear_caches()  # the Python of every jitted kernel runs again while tracing
    cpu = jax.devices("cpu")[0]
    sys.settrace(tracer)
    try:
        for case in CASES:
            inputs = case.make_inputs(np.random.default_rng(0))
            with jax.default_device(cpu):
                if case.driver:
                    case.fn(*inputs, platform="cpu")
                else:
                    jax.jit(case.fn).lower(*inputs)
    finally:
        sys.settrace(None)
    executed = {Path(f).stem for f in files if Path(f).parent == Path(package)}
    modules = _kernel_modules()
    assert set(NOT_KERNELS) | set(ON_THEIR_PLATFORM) <= modules  # the lists name real modules
    missing = modules - executed - {"__init__"} - set(NOT_KERNELS) - set(ON_THEIR_PLATFORM)
    assert not missing, f"kernel modules no conformance case runs: {sorted(missing)}"


@pytest.mark.device
def test_device_agrees_with_references_and_cpu_down_the_production_path():
    assert jax.default_backend() != "cpu", "a device test: run it where JAX has an accelerator"
    results = [run_case(case) for case in CASES]
    failing = [r for r in results if not r.ok]
    assert not failing, failing
    for r in results:
        assert r.backend == jax.default_backend() and r.lowered
        assert np.isfinite(r.cpu_err), r  # the CPU run was also checked against the reference
    compared = [r for r in results if not np.isnan(r.device_err)]
    assert len(compared) > len(results) // 2  # most cases compare the device with the CPU
    q2 = next(r for r in results if r.name == "q2_0.quantize_rows")
    from healsweep.kernels import q2_0_gpu

    expected = "pallas" if q2_0_gpu.on_cuda() and q2_0_gpu.lowers() else "xla blocks"
    assert q2.path == expected


def test_walker_flags_a_cholesky_inside_a_nested_jit():
    @jax.jit
    def inner(a):
        return jnp.linalg.cholesky(a @ a.T + jnp.eye(3, dtype=a.dtype))

    def outer(a):
        return jax.lax.map(inner, a[None])

    a = np.eye(3, dtype=np.float32)
    problems = backend_violations(outer, a)
    assert any("cholesky" in p for p in problems)
    assert backend_violations(outer, a, cpu_placed=True) == []


def _x64():
    """float64 on, whichever jax API this version has (jax.enable_x64 is newer than 0.5.0)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def test_walker_flags_float64_and_complex_values():
    with _x64():
        problems = backend_violations(
            lambda x: (x.astype(jnp.float64) * 2).astype(jnp.float32), np.ones(4, np.float32)
        )
    assert any("float64" in p for p in problems)
    problems = backend_violations(lambda x: jnp.abs(jnp.fft.fft(x)), np.ones(8, np.float32))
    assert any("complex" in p for p in problems)
