"""Part B ridge against a float64 numpy re-implementation, plus its provable properties."""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.kernels.conformance import backend_violations
from healsweep.kernels.ridge import (
    _solve,
    apply_ridge,
    fit_ridge,
    gated_design,
    normal_equations,
    solve_ridge,
)


def _problem(rng, t=200, fs=24, d=16, noise=0.5):
    z = rng.standard_normal((t, fs)).astype(np.float32)
    gate = (1 / (1 + np.exp(-rng.standard_normal(t)))).astype(np.float32)
    true_dw = rng.standard_normal((fs, d)).astype(np.float32) * 0.3
    dy = (z * gate[:, None]) @ true_dw + noise * rng.standard_normal((t, d))
    return z, gate, dy.astype(np.float32)


def _ref_fit(z, gate, dy, rho, eta, n_blocks=4):
    """float64 reference: ridge, rank, dof, in-sample and leave-one-block-out changes."""
    zg = z.astype(np.float64) * gate.astype(np.float64)[:, None]
    dy = dy.astype(np.float64)

    def solve(zs, ys):
        g = zs.T @ zs
        lam = rho * np.trace(g) / g.shape[0]
        return np.linalg.solve(g + lam * np.eye(g.shape[0]), zs.T @ ys), lam, g

    def change(zs, ys, dw):
        return np.sum((ys - eta * zs @ dw) ** 2), np.sum(ys**2)

    dw, lam, g = solve(zg, dy)
    s = np.linalg.svd(zg, compute_uv=False)
    rank = int(np.sum(s > s.max() * max(zg.shape) * 1e-6))
    sigma = np.clip(np.linalg.eigvalsh(g), 0, None)
    dof = float(np.sum(sigma / (sigma + lam)))
    after, before = change(zg, dy, dw)
    bounds = np.linspace(0, len(zg), n_blocks + 1).astype(int)
    after_out = before_out = 0.0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        keep = np.r_[0:a, b : len(zg)]
        dw_out, _, _ = solve(zg[keep], dy[keep])
        aft, bef = change(zg[a:b], dy[a:b], dw_out)
        after_out += aft
        before_out += bef
    return dw, lam, rank, dof, after / before - 1, after_out / before_out - 1


@pytest.mark.parametrize(("t", "rho", "eta"), [(200, 6.0, 0.15), (200, 0.25, 1.0), (64, 1.0, 0.5)])
def test_fit_matches_float64_reference(t, rho, eta):
    rng = np.random.default_rng(t)
    z, gate, dy = _problem(rng, t=t)
    fit = fit_ridge(z, gate, dy, rho, eta)
    dw, lam, rank, dof, in_sample, heldout = _ref_fit(z, gate, dy, rho, eta)
    np.testing.assert_allclose(fit.delta, dw, rtol=2e-4, atol=2e-5 * np.abs(dw).max())
    assert fit.lam == pytest.approx(lam, rel=1e-5)
    assert fit.rank == rank
    assert fit.dof == pytest.approx(dof, rel=1e-4)
    assert fit.in_sample_change == pytest.approx(in_sample, rel=1e-3, abs=1e-6)
    assert fit.heldout_change == pytest.approx(heldout, rel=1e-3, abs=1e-6)
    assert len(fit.fold_changes) == 4 and fit.n_tokens == t
    assert fit.delta.dtype == np.float32


def test_too_few_tokens_warns_and_rank_is_t():
    rng = np.random.default_rng(1)
    z, gate, dy = _problem(rng, t=10, fs=24)
    fit = fit_ridge(z, gate, dy, rho=6.0, eta=0.15)
    assert fit.rank == 10
    assert fit.warning is not None and "T=10" in fit.warning and "Fs=24" in fit.warning
    assert 0 < fit.dof < fit.rank
    assert fit_ridge(*_problem(rng, t=48, fs=24), rho=6.0, eta=0.15).warning is None


def test_in_sample_change_never_positive_for_eta_in_knob_range():
    # |dY - eta Z dW|^2 - |dY|^2 = eta (eta - 2) <B, (G+lam I)^-1 B> - eta^2 lam |dW|^2 <= 0.
    rng = np.random.default_rng(2)
    for _ in range(6):
        z, gate, dy = _problem(rng, t=120, noise=float(rng.uniform(0.1, 5)))
        for eta in (0.0, 0.15, 1.0, 2.0):
            fit = fit_ridge(z, gate, dy, rho=float(rng.uniform(0.05, 50)), eta=eta)
            assert fit.in_sample_change <= 1e-6


def test_more_shrinkage_means_fewer_degrees_of_freedom():
    z, gate, dy = _problem(np.random.default_rng(3))
    dofs = [fit_ridge(z, gate, dy, rho=rho, eta=0.15).dof for rho in (0.1, 1.0, 6.0, 24.0)]
    assert all(a > b for a, b in zip(dofs[:-1], dofs[1:], strict=True))
    assert dofs[0] < 24


def test_applied_update_moves_the_layer_output_by_eta_z_dw():
    rng = np.random.default_rng(4)
    z, gate, dy = _problem(rng, t=50, fs=24, d=16)
    w = rng.standard_normal((16, 24)).astype(np.float32)  # GGUF [D, Fs]
    fit = fit_ridge(z, gate, dy, rho=6.0, eta=0.15)
    w_new = apply_ridge(w, fit.delta, 0.15)
    assert w_new.shape == w.shape and w_new.dtype == np.float32
    moved = (z * gate[:, None]) @ (w_new - w).T.astype(np.float64)
    want = 0.15 * (z * gate[:, None]).astype(np.float64) @ fit.delta
    np.testing.assert_allclose(moved, want, rtol=1e-4, atol=1e-5)


def test_zero_inputs_give_zero_update():
    z = np.zeros((30, 8), np.float32)
    fit = fit_ridge(z, np.ones(30, np.float32), np.ones((30, 4), np.float32), 6.0, 0.15)
    assert not fit.delta.any() and fit.rank == 0 and fit.in_sample_change == 0.0


def test_solve_runs_on_cpu_and_normal_equations_are_backend_clean():
    rng = np.random.default_rng(5)
    z, gate, dy = _problem(rng, t=40)
    zg = np.asarray(gated_design(z, gate))
    np.testing.assert_allclose(zg, z * gate[:, None], rtol=1e-6)
    assert backend_violations(normal_equations, zg, dy) == []
    gram, rhs = normal_equations(zg, dy)
    delta, lam = solve_ridge(gram, rhs, 6.0)
    assert isinstance(delta, np.ndarray) and lam > 0
    # The solve itself is CPU-placed by design: exempt from the primitive rule, not the dtype rule.
    assert backend_violations(lambda g, b: _solve(g, b, lam), gram, rhs, cpu_placed=True) == []
    np.testing.assert_allclose(np.asarray(gram), zg.T.astype(np.float64) @ zg, rtol=1e-4, atol=1e-3)
