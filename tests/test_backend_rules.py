"""Backend rules: every kernel stays inside what the Metal plugins can lower, and agrees with CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from healsweep.kernels.conformance import backend_violations, kernel_cases, run_case

CASES = kernel_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_jaxpr_has_no_float64_complex_or_unlowerable_primitives(case):
    inputs = case.make_inputs(np.random.default_rng(0))
    assert backend_violations(case.fn, *inputs, cpu_placed=case.cpu_placed) == []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_on_default_backend_matches_cpu(case):
    result = run_case(case)
    assert result.ok, result


def test_registry_covers_every_kernel_module():
    names = {c.name.split(".")[0] for c in CASES}
    assert {"q2_0", "iq4_nl", "kld", "alpha", "ridge"} <= names


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
        problems = backend_violations(lambda x: (x.astype(jnp.float64) * 2).astype(jnp.float32), np.ones(4, np.float32))
    assert any("float64" in p for p in problems)
    problems = backend_violations(lambda x: jnp.abs(jnp.fft.fft(x)), np.ones(8, np.float32))
    assert any("complex" in p for p in problems)
