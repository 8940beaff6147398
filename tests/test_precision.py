"""healing_jit: the healing statistics' jit (highest matmul precision, no GEMM autotuning on a
GPU) computes what a plain jit computes, outermost or nested, eager or under a transformation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from healsweep.kernels import _precision
from healsweep.kernels._precision import full_float32, healing_jit, matmul


@healing_jit
def _product_sum(a, b):
    return jnp.sum(a @ b, axis=0)


@healing_jit(static_argnums=(1,))
def _power(a, n: int):
    out = a
    for _ in range(n - 1):
        out = out @ a
    return out


def _inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal((48, 32), np.float32), rng.standard_normal((32, 16), np.float32)


def test_outermost_call_equals_a_plain_jit_and_float64():
    a, b = _inputs()
    got = np.asarray(_product_sum(a, b))
    want = np.asarray(jax.jit(full_float32(lambda x, y: jnp.sum(x @ y, axis=0)))(a, b))
    np.testing.assert_array_equal(got, want)
    ref = (a.astype(np.float64) @ b.astype(np.float64)).sum(axis=0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_nested_inside_another_jit_and_under_vmap():
    """JAX refuses compiler options on a nested jit; the wrapper traces as a plain jit there."""
    a, b = _inputs()
    outer = jax.jit(lambda x, y: _product_sum(x, y) * 2.0)
    np.testing.assert_allclose(
        np.asarray(outer(a, b)), 2.0 * np.asarray(_product_sum(a, b)), rtol=1e-6
    )
    batched = jax.vmap(_product_sum, in_axes=(0, None))(np.stack([a, a + 1.0]), b)
    np.testing.assert_allclose(
        np.asarray(batched[1]), np.asarray(_product_sum(a + 1.0, b)), rtol=1e-5
    )


def test_static_arguments_and_eager_matmul():
    a = np.eye(8, dtype=np.float32) * 2.0
    np.testing.assert_array_equal(np.asarray(_power(a, 3)), np.eye(8, dtype=np.float32) * 8.0)
    x, y = _inputs()
    np.testing.assert_allclose(
        np.asarray(matmul(x, y)), x.astype(np.float64) @ y, rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize(
    "backend, options", [("cpu", None), ("gpu", _precision.GPU_COMPILER_OPTIONS)]
)
def test_compiler_options_only_on_a_gpu_backend(monkeypatch, backend, options):
    """The options reach jax.jit exactly when the default backend is a GPU (read at first call)."""
    seen = []
    real_jit = jax.jit

    def recording_jit(fn, **kwargs):
        seen.append(kwargs.get("compiler_options", "absent"))
        return real_jit(fn, **kwargs)  # a CPU compiles with XLA's GPU options too (unused there)

    monkeypatch.setattr(_precision.jax, "jit", recording_jit)
    monkeypatch.setattr(_precision.jax, "default_backend", lambda: backend)
    fn = healing_jit(lambda x: x @ x)
    np.testing.assert_allclose(np.asarray(fn(np.eye(4, dtype=np.float32))), np.eye(4))
    assert seen == ["absent", options]  # the plain (nested) jit, then the outermost one
