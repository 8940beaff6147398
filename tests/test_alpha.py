"""Part A alpha against a float64 numpy re-implementation, and its defining properties."""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.conformance import backend_violations
from healsweep.conformance import references as ref
from healsweep.kernels.alpha import (
    alpha_from_outputs,
    alpha_gaussian,
    alpha_mse,
    expert_outputs,
    gaussian_probe_experts,
    gaussian_probe_inputs,
    residual_fraction,
)


def _pair(rng, t=96, d=48, noise=0.4, scale=1.1):
    y_ref = rng.standard_normal((t, d)).astype(np.float32)
    y_q = (y_ref / scale + noise * rng.standard_normal((t, d))).astype(np.float32)
    return y_ref, y_q


@pytest.mark.parametrize("gamma", [0.0, 0.25, 0.75, 1.0])
def test_alpha_matches_float64_reference(gamma):
    rng = np.random.default_rng(1)
    for noise, scale in [(0.1, 1.0), (0.5, 1.3), (2.0, 0.7)]:
        y_ref, y_q = _pair(rng, noise=noise, scale=scale)
        got = float(alpha_mse(y_ref, y_q, gamma))
        assert got == pytest.approx(ref.alpha(y_ref, y_q, gamma), rel=2e-5)


def test_gamma_zero_is_the_mse_optimal_scalar_and_gamma_one_matches_norms():
    rng = np.random.default_rng(2)
    y_ref, y_q = _pair(rng)
    a, b = y_ref.astype(np.float64), y_q.astype(np.float64)
    assert float(alpha_mse(y_ref, y_q, 0.0)) == pytest.approx(
        np.sum(a * b) / np.sum(b * b), rel=2e-5
    )
    assert float(alpha_mse(y_ref, y_q, 1.0)) == pytest.approx(
        np.linalg.norm(a) / np.linalg.norm(b), rel=2e-5
    )
    assert alpha_from_outputs is alpha_mse


def test_in_sample_mse_alpha_never_loses_to_alpha_one():
    rng = np.random.default_rng(3)
    for trial in range(40):
        y_ref, y_q = _pair(
            rng, t=24, d=16, noise=float(rng.uniform(0, 3)), scale=float(rng.uniform(0.3, 3))
        )
        if trial % 5 == 0:
            y_q = -y_q  # anti-correlated outputs: the optimum is negative
        best = float(alpha_mse(y_ref, y_q, 0.0))
        at_best = float(residual_fraction(y_ref, y_q, best))
        for other in (1.0, best * 0.97, best * 1.03, 0.0):
            assert at_best <= float(residual_fraction(y_ref, y_q, other)) + 1e-6


def test_residual_fraction_matches_numpy():
    rng = np.random.default_rng(4)
    y_ref, y_q = _pair(rng)
    for alpha in (0.5, 1.0, 1.234):
        r = y_ref.astype(np.float64) - alpha * y_q.astype(np.float64)
        want = np.sum(r * r) / np.sum(y_ref.astype(np.float64) ** 2)
        assert float(residual_fraction(y_ref, y_q, alpha)) == pytest.approx(want, rel=1e-5)
    assert float(residual_fraction(np.zeros((3, 4), np.float32), y_q[:3, :4], 1.0)) == 0.0


def test_degenerate_outputs_give_alpha_one_and_no_nan():
    zeros = np.zeros((5, 8), np.float32)
    ones = np.ones((5, 8), np.float32)
    for y_ref, y_q in [(ones, zeros), (zeros, ones), (zeros, zeros)]:
        assert float(alpha_mse(y_ref, y_q, 0.75)) == 1.0


def test_expert_outputs_match_float64_ffn():
    rng = np.random.default_rng(5)
    n, t, d, f = 3, 7, 32, 24
    x = rng.standard_normal((t, d)).astype(np.float32)
    gate, up = (rng.standard_normal((n, f, d)).astype(np.float32) * 0.2 for _ in range(2))
    down = rng.standard_normal((n, d, f)).astype(np.float32) * 0.2
    got = np.asarray(expert_outputs(x, gate, up, down))
    np.testing.assert_allclose(got, ref.expert_ffn(x, gate, up, down), rtol=1e-4, atol=1e-5)


def test_alpha_gaussian_pools_dense_vs_quantized_over_probed_experts():
    rng = np.random.default_rng(6)
    n, d, f = 4, 64, 32
    scale = rng.uniform(0.2, 2.0, d).astype(np.float32)
    x = gaussian_probe_inputs(scale)
    dense = [rng.standard_normal((n, f, d)).astype(np.float32) * 0.1 for _ in range(2)]
    dense.append(rng.standard_normal((n, d, f)).astype(np.float32) * 0.1)
    noisy = [w + 0.01 * rng.standard_normal(w.shape).astype(np.float32) for w in dense]
    noisy[2] = noisy[2] * np.float32(0.8)  # a shrunken down projection: alpha must exceed 1
    y_ref, y_q = ref.expert_ffn(x, *dense), ref.expert_ffn(x, *noisy)
    for gamma in (0.0, 0.75):
        want = ref.alpha(y_ref.reshape(-1, d), y_q.reshape(-1, d), gamma)
        got = float(alpha_gaussian(x, tuple(dense), tuple(noisy), gamma))
        assert got == pytest.approx(want, rel=1e-4)
        assert got > 1.0
    assert float(alpha_gaussian(x, tuple(dense), tuple(dense), 0.75)) == pytest.approx(
        1.0, abs=1e-5
    )


def test_probe_experts_and_inputs_follow_the_shipped_recipe():
    assert gaussian_probe_experts(256) == (0, 32, 64, 128)
    assert gaussian_probe_experts(16) == (0, 2, 4, 8)
    assert gaussian_probe_experts(2) == (0, 1)
    assert gaussian_probe_experts(1) == (0,)
    scale = np.linspace(0.1, 3.0, 40).astype(np.float32)
    x = gaussian_probe_inputs(scale)
    assert x.shape == (16, 40) and x.dtype == np.float32
    np.testing.assert_array_equal(x, gaussian_probe_inputs(scale))
    z = np.random.default_rng(0).standard_normal((16, 40), dtype=np.float32)
    np.testing.assert_allclose(x, z * scale)
    assert not np.array_equal(x, gaussian_probe_inputs(scale, seed=1))


def test_alpha_kernels_stay_inside_the_metal_rules():
    rng = np.random.default_rng(7)
    y_ref, y_q = _pair(rng)
    assert backend_violations(lambda a, b: alpha_mse(a, b, 0.75), y_ref, y_q) == []
    w = [rng.standard_normal(s).astype(np.float32) for s in [(2, 8, 16), (2, 8, 16), (2, 16, 8)]]
    x = rng.standard_normal((4, 16)).astype(np.float32)
    assert backend_violations(lambda *a: alpha_gaussian(a[0], a[1:4], a[4:], 0.75), x, *w, *w) == []
