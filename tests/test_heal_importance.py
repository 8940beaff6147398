"""Importance statistics against float64 numpy loops, and the fallback for starved experts."""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.quant.expert_moments import expert_hidden_moments, expert_input_moments
from healsweep.quant.importance import (
    down_importance,
    gate_up_importance,
    gaussian_probe_scale,
    norm_proxy,
    pooled_means,
)


def _routing(rng, t, e, k):
    return np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)]).astype(np.int32)


def test_norm_proxy_is_the_mean_square_of_the_norm_gain():
    w = np.array([0.5, -2.0, 0.0, 1.5], np.float32)
    np.testing.assert_allclose(norm_proxy(w), w.astype(np.float64) ** 2)
    stacked = np.stack([w, 2 * w])  # several norms (the audit's architecture): mean over them
    np.testing.assert_allclose(norm_proxy(stacked), (w**2 + 4 * w**2) / 2, rtol=1e-6)
    np.testing.assert_allclose(gaussian_probe_scale(w), np.abs(w))


def test_expert_input_moments_match_a_loop():
    rng = np.random.default_rng(0)
    t, d, e, k = 50, 12, 6, 2
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = _routing(rng, t, e, k)
    sums, counts = expert_input_moments(x, ids, np.arange(e, dtype=np.int32))
    for expert in range(e):
        rows = [i for i in range(t) if expert in ids[i]]
        assert counts[expert] == len(rows)
        want = np.sum(x[rows].astype(np.float64) ** 2, axis=0)
        np.testing.assert_allclose(np.asarray(sums)[expert], want, rtol=1e-5, atol=1e-6)
    assert float(np.sum(counts)) == t * k


def test_expert_hidden_moments_match_the_teacher_expert_on_its_tokens():
    rng = np.random.default_rng(1)
    t, d, f, e, k = 70, 16, 8, 5, 2
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = _routing(rng, t, e, k)
    ids[:, 0] = np.where(ids[:, 0] == 4, 0, ids[:, 0])
    ids[:, 1] = np.where(ids[:, 1] == 4, np.where(ids[:, 0] == 1, 2, 1), ids[:, 1])  # expert 4 idle
    gate = rng.standard_normal((e, f, d)).astype(np.float32) * 0.3
    up = rng.standard_normal((e, f, d)).astype(np.float32) * 0.3
    sums, counts = expert_hidden_moments(x, ids, gate, up)
    for expert in range(e):
        rows = np.array([i for i in range(t) if expert in ids[i]], int)
        assert counts[expert] == len(rows)
        if not len(rows):
            assert not sums[expert].any()
            continue
        xr = x[rows].astype(np.float64)
        g, u = xr @ gate[expert].T.astype(np.float64), xr @ up[expert].T.astype(np.float64)
        h = g / (1 + np.exp(-g)) * u
        np.testing.assert_allclose(sums[expert], np.sum(h**2, axis=0), rtol=1e-4, atol=1e-6)
    assert counts[4] == 0


def test_starved_experts_fall_back_to_the_layer_wide_statistic():
    sums = np.array([[10.0, 20.0], [1.0, 1.0], [0.0, 0.0]], np.float32)
    counts = np.array([10, 1, 0], np.float32)
    means = pooled_means(sums, counts, min_tokens=5)
    layer = sums.sum(axis=0) / counts.sum()
    np.testing.assert_allclose(means[0], [1.0, 2.0])
    np.testing.assert_allclose(means[1], layer, rtol=1e-6)
    np.testing.assert_allclose(means[2], layer, rtol=1e-6)
    np.testing.assert_allclose(pooled_means(sums, counts, min_tokens=1)[1], [1.0, 1.0])


def test_importance_modes_and_positivity():
    norm = np.array([1.0, 0.0, -0.5, 2.0], np.float32)
    sums = np.abs(np.random.default_rng(2).standard_normal((3, 4))).astype(np.float32)
    sums[:, 1] = 0.0  # a dead channel
    counts = np.array([20, 20, 2], np.float32)
    assert gate_up_importance("none", norm, None, None, 16) is None
    proxy = gate_up_importance("norm_proxy", norm, None, None, 16)
    assert proxy.shape == (4,) and (proxy > 0).all()
    np.testing.assert_allclose(proxy[[0, 2, 3]], [1.0, 0.25, 4.0])
    act = gate_up_importance("act", norm, sums, counts, 16)
    assert act.shape == (3, 4) and (act > 0).all()
    np.testing.assert_allclose(act[0, [0, 2, 3]], sums[0, [0, 2, 3]] / 20, rtol=1e-6)
    assert down_importance("none", sums, counts, 16) is None
    down = down_importance("act", sums, counts, 16)
    assert down.shape == (3, 4) and (down > 0).all()
    with pytest.raises(ValueError, match="act"):
        gate_up_importance("act", norm, None, None, 16)
