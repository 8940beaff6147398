"""The NVIDIA Q2_0 kernel (``healsweep.kernels.q2_0_gpu``) on a machine without a GPU.

Its arithmetic is checked in Pallas' interpreter, where it must equal the CPU kernel bit for bit
(same float32 operations in the same order); its compiled form is checked by lowering it for
CUDA, which needs no GPU. Its speed and its agreement on a real GPU are measured by
``benchmarks/bench_quant.py`` (docs/q2-gpu-kernel.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from healsweep.kernels import q2_0, q2_0_gpu


def _hard_rows(rng, n_rows: int, n_in: int) -> np.ndarray:
    """Random rows whose first blocks are the adversarial cases of the codec tests."""
    w = rng.standard_normal((n_rows, n_in)).astype(np.float32)
    w[1, :64] = 0.0  # all zero
    w[2, :64] = -0.37  # constant: every seed ties
    w[3, :64] *= 1e-30  # tiny magnitudes
    w[4, :64] = 1e-3 * np.sign(w[4, :64])
    w[4, 17] = 40.0  # one outlier
    w[5, :64] = -np.abs(w[5, :64])  # all negative
    w[6, :64] = np.float32(2.0) ** -149  # subnormal (may be flushed to zero by a backend)
    return w


@pytest.mark.parametrize(
    ("n_in", "per_row"),
    [(512, False), (192, True)],  # 8 blocks a program (grouped importance); 1 (per row)
)
def test_interpreted_kernel_equals_the_cpu_kernel_bit_for_bit(n_in, per_row):
    rng = np.random.default_rng(n_in)
    w = _hard_rows(rng, 32, n_in)
    n_imp = 32 if per_row else 32 // q2_0.LANES
    imp = rng.uniform(0.1, 4.0, (n_imp, n_in)).astype(np.float32)
    assert q2_0_gpu.blocks_per_program(n_in) == (8 if n_in == 512 else 1)
    d_cpu, q_cpu = q2_0.quantize_rows(w, imp, 0.3, options={"tiles": True})
    d, q = q2_0.quantize_rows(w, imp, 0.3, options={"pallas": True, "interpret": True})
    assert d.dtype == np.float16 and q.dtype == np.int8
    np.testing.assert_array_equal(q, q_cpu)
    np.testing.assert_array_equal(d, d_cpu)
    assert d[1, 0] == 0 and not q[1, :64].any()  # the all-zero block


def test_kernel_lowers_for_cuda_with_explicit_fma_and_rounding():
    assert q2_0_gpu.lowers()
    spec = jax.ShapeDtypeStruct
    args = (spec((32, 512), jnp.float32), spec((2, 512), jnp.float32), spec((), jnp.float32))
    text = q2_0_gpu._call.trace(*args, 8, False).lower(lowering_platforms=("cuda",)).as_text()
    assert "q2_0_search" in text
    assert "fma.rn.f32" in text and "cvt.rni.f32.f32" in text


def test_cpu_backend_never_picks_the_gpu_kernel():
    assert not q2_0_gpu.on_cuda()
    assert "pallas" not in q2_0._backend_options()


def test_flops_per_weight_counts_the_formulation():
    # Per magnitude: a shared first pass (w*step, round; per sign: clip, a*q, 2 FMA) and two
    # second passes (w*step, 2 clips, round, a*q, 2 FMA); then the final pass and the maxima.
    assert q2_0_gpu.flops_per_weight() == 4 + 5 * ((2 + 2 * 6) + 2 * 9) + 13


def test_bad_shapes_raise_value_error_naming_the_function():
    w = np.zeros((16, 100), np.float32)
    with pytest.raises(ValueError, match="q2_0_gpu.quantize_rows"):
        q2_0_gpu.quantize_rows(w, np.ones((1, 100), np.float32), 0.3, interpret=True)
    w = np.zeros((32, 128), np.float32)
    with pytest.raises(ValueError, match="neither per row nor per group"):
        q2_0_gpu.quantize_rows(w, np.ones((3, 128), np.float32), 0.3, interpret=True)
