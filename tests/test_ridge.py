"""Part B ridge in the eigenbasis of G against a float64 numpy direct solve, plus its properties."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from healsweep.conformance import backend_violations
from healsweep.heal import ridge
from healsweep.kernels import ridge as kr


def _problem(rng, t=200, fs=24, d=16, noise=0.5, decay=0.0):
    """Random Z, gate, dY; ``decay`` > 0 makes Z's columns span many orders of magnitude."""
    z = rng.standard_normal((t, fs)) * np.exp(-decay * np.arange(fs))[None, :]
    z = z.astype(np.float32)
    gate = (1 / (1 + np.exp(-rng.standard_normal(t)))).astype(np.float32)
    true_dw = rng.standard_normal((fs, d)).astype(np.float32) * 0.3
    dy = (z * gate[:, None]) @ true_dw + noise * rng.standard_normal((t, d))
    return z, gate, dy.astype(np.float32)


def _fit(z, gate, dy, rho, eta):
    """The stages' arithmetic on given arrays: basis, fit at rho, figures at eta (step eta*dW)."""
    zg = z * gate[:, None]
    design = lambda a, b: jnp.asarray(zg[a:b])  # noqa: E731
    basis = ridge.basis_from_design(design, len(z))
    rhs = ridge.rhs_from_design(design, dy, basis)
    fit = ridge.fit_from_rhs(rhs, basis, rho)
    folds = ridge.heldout_from_design(design, dy, basis, rhs, fit)
    stats = ridge.ridge_stats(basis, rhs, fit, eta, eta * fit.delta, folds)
    return fit.delta, stats


def _ref_fit(z, gate, dy, rho, eta, n_blocks=4):
    """float64 direct solve: ridge, rank, dof, in-sample and leave-one-block-out changes."""
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


@pytest.mark.parametrize(
    ("t", "rho", "eta"), [(200, 6.0, 0.15), (200, 0.25, 1.0), (64, 1.0, 0.5), (40, 0.05, 1.0)]
)
def test_eigen_path_matches_float64_direct_solve(t, rho, eta):
    # t=40, 4 blocks of 10 < Fs=24 tokens: the held-out solve takes the n×n branch; t=200 the Fs×Fs.
    rng = np.random.default_rng(t)
    z, gate, dy = _problem(rng, t=t)
    delta, stats = _fit(z, gate, dy, rho, eta)
    dw, lam, rank, dof, in_sample, heldout = _ref_fit(z, gate, dy, rho, eta)
    np.testing.assert_allclose(delta, dw, rtol=2e-4, atol=2e-5 * np.abs(dw).max())
    assert stats["lambda"] == pytest.approx(lam, rel=1e-5)
    assert stats["rank"] == rank
    assert stats["dof"] == pytest.approx(dof, rel=1e-4)
    assert stats["in_sample_change"] == pytest.approx(in_sample, rel=1e-3, abs=1e-6)
    assert stats["heldout_change"] == pytest.approx(heldout, rel=1e-3, abs=1e-6)
    # The realized change of the step eta*dW, from B and the basis alone, is the in-sample one.
    assert stats["realized_in_sample_change"] == pytest.approx(in_sample, rel=1e-3, abs=1e-6)
    assert len(stats["fold_changes"]) == 4 and stats["n_tokens"] == t
    assert delta.dtype == np.float32


@pytest.mark.parametrize("rho", [0.01, 0.3, 6.0, 100.0])
def test_eigen_path_on_an_ill_conditioned_gram(rho):
    # Column scales over e^-0.5*23 ≈ 1e-5: cond(G) ≈ 1e10, far past float32's 1/eps.
    z, gate, dy = _problem(np.random.default_rng(7), t=300, fs=24, decay=0.5)
    delta, stats = _fit(z, gate, dy, rho, 1.0)
    dw, lam, _, dof, in_sample, heldout = _ref_fit(z, gate, dy, rho, 1.0)
    err = np.linalg.norm(delta - dw) / np.linalg.norm(dw)
    assert err < 1e-4, err
    assert stats["dof"] == pytest.approx(dof, rel=1e-4)
    assert stats["in_sample_change"] == pytest.approx(in_sample, rel=1e-3, abs=1e-6)
    assert stats["heldout_change"] == pytest.approx(heldout, rel=2e-3, abs=1e-6)


def test_one_basis_serves_every_rho_and_eta():
    z, gate, dy = _problem(np.random.default_rng(8), t=150)
    zg = z * gate[:, None]
    design = lambda a, b: jnp.asarray(zg[a:b])  # noqa: E731
    basis = ridge.basis_from_design(design, len(z))
    rhs = ridge.rhs_from_design(design, dy, basis)
    for rho in (0.1, 2.0, 30.0):
        fit = ridge.fit_from_rhs(rhs, basis, rho)
        folds = ridge.heldout_from_design(design, dy, basis, rhs, fit)
        for eta in (0.15, 0.7, 2.0):
            stats = ridge.ridge_stats(basis, rhs, fit, eta, eta * fit.delta, folds)
            dw, _, _, _, in_sample, heldout = _ref_fit(z, gate, dy, rho, eta)
            np.testing.assert_allclose(fit.delta, dw, rtol=2e-4, atol=2e-5 * np.abs(dw).max())
            assert stats["in_sample_change"] == pytest.approx(in_sample, rel=1e-3, abs=1e-6)
            assert stats["heldout_change"] == pytest.approx(heldout, rel=1e-3, abs=1e-6)


def test_too_few_tokens_warns_and_rank_is_t():
    rng = np.random.default_rng(1)
    z, gate, dy = _problem(rng, t=10, fs=24)
    _, stats = _fit(z, gate, dy, rho=6.0, eta=0.15)
    assert stats["rank"] == 10
    assert stats["warning"] is not None and "T=10" in stats["warning"]
    assert "Fs=24" in stats["warning"] and 0 < stats["dof"] < stats["rank"]
    assert _fit(*_problem(rng, t=48, fs=24), rho=6.0, eta=0.15)[1]["warning"] is None


def test_in_sample_change_never_positive_for_eta_in_knob_range():
    # |dY - eta Z dW|^2 - |dY|^2 = eta (eta - 2) <B, (G+lam I)^-1 B> - eta^2 lam |dW|^2 <= 0.
    rng = np.random.default_rng(2)
    for _ in range(6):
        z, gate, dy = _problem(rng, t=120, noise=float(rng.uniform(0.1, 5)))
        for eta in (0.0, 0.15, 1.0, 2.0):
            stats = _fit(z, gate, dy, rho=float(rng.uniform(0.05, 50)), eta=eta)[1]
            assert stats["in_sample_change"] <= 1e-6


def test_more_shrinkage_means_fewer_degrees_of_freedom():
    z, gate, dy = _problem(np.random.default_rng(3))
    dofs = [_fit(z, gate, dy, rho=rho, eta=0.15)[1]["dof"] for rho in (0.1, 1.0, 6.0, 24.0)]
    assert all(a > b for a, b in zip(dofs[:-1], dofs[1:], strict=True))
    assert dofs[0] < 24


def test_applied_update_moves_the_layer_output_by_eta_z_dw():
    rng = np.random.default_rng(4)
    z, gate, dy = _problem(rng, t=50, fs=24, d=16)
    w = rng.standard_normal((16, 24)).astype(np.float32)  # GGUF [D, Fs]
    delta, _ = _fit(z, gate, dy, rho=6.0, eta=0.15)
    w_new = np.asarray(kr.apply_ridge(w, delta, 0.15))
    assert w_new.shape == w.shape and w_new.dtype == np.float32
    moved = (z * gate[:, None]) @ (w_new - w).T.astype(np.float64)
    want = 0.15 * (z * gate[:, None]).astype(np.float64) @ delta
    np.testing.assert_allclose(moved, want, rtol=1e-4, atol=1e-5)


def test_step_moments_equal_the_float64_products_over_z():
    """What Part B reports of a realized update, from the basis only, equals the float64
    |Z'Δ|² and <Z'ᵀdY, Δ> computed with Z' itself."""
    rng = np.random.default_rng(6)
    z, gate, dy = _problem(rng, t=80, fs=24, d=16)
    zg = (z * gate[:, None]).astype(np.float32)
    basis = ridge.basis_from_design(lambda a, b: jnp.asarray(zg[a:b]), len(zg))
    old = rng.standard_normal((16, 24)).astype(np.float32)  # GGUF [D, Fs]
    new = old + 0.05 * rng.standard_normal((16, 24)).astype(np.float32)
    rhs = zg.T @ dy
    quad, lin, moved, size = (
        float(x) for x in kr.step_moments(basis.basis, basis.sigma, rhs, old, new)
    )
    step = (new.astype(np.float64) - old).T  # [Fs, D]
    z64 = zg.astype(np.float64)
    assert quad == pytest.approx(np.sum((z64 @ step) ** 2), rel=1e-4)
    assert lin == pytest.approx(np.sum((z64.T @ dy) * step), rel=1e-4)
    assert moved == pytest.approx(np.linalg.norm(step), rel=1e-5)
    assert size == pytest.approx(np.linalg.norm(old.astype(np.float64)), rel=1e-5)


def test_zero_inputs_give_zero_update():
    z = np.zeros((30, 8), np.float32)
    delta, stats = _fit(z, np.ones(30, np.float32), np.ones((30, 4), np.float32), 6.0, 0.15)
    assert not delta.any() and stats["rank"] == 0 and stats["in_sample_change"] == 0.0


def test_per_rho_and_per_eta_kernels_are_backend_clean():
    rng = np.random.default_rng(5)
    z, gate, dy = _problem(rng, t=40)
    zg = np.asarray(kr.gated_design(z, gate))
    np.testing.assert_allclose(zg, z * gate[:, None], rtol=1e-6)
    assert backend_violations(kr.normal_equations, zg, dy) == []
    gram, rhs = (np.asarray(a) for a in kr.normal_equations(zg, dy))
    np.testing.assert_allclose(gram, zg.T.astype(np.float64) @ zg, rtol=1e-4, atol=1e-3)
    v, sigma = ridge.eigen_basis(gram)
    assert v.dtype == sigma.dtype == np.float32
    np.testing.assert_allclose((v * sigma) @ v.T, gram, rtol=1e-4, atol=1e-4 * np.abs(gram).max())
    weights = np.asarray(kr.shrink(sigma, 1.5))
    # What runs per rho and per eta: matrix products only, no solve or eigh primitive.
    assert backend_violations(kr.eigen_solve, v, weights, rhs) == []
    assert backend_violations(kr.gram_quadratic, v, sigma, rhs) == []
    coef = np.asarray(kr.coefficients(v, rhs))
    assert backend_violations(kr.coefficients, v, rhs) == []
    assert backend_violations(kr.eigen_fit, v, sigma, weights, coef) == []
    # eigen_fit's one product and two sums = eigen_solve, <B, dW> and gram_quadratic, and float64
    delta, explained, quad = (
        np.asarray(a, np.float64) for a in kr.eigen_fit(v, sigma, weights, coef)
    )
    want = np.linalg.solve(
        gram.astype(np.float64) + 1.5 * np.eye(len(gram)), rhs.astype(np.float64)
    )
    scale = np.abs(want).max()
    np.testing.assert_allclose(
        delta, np.asarray(kr.eigen_solve(v, weights, rhs)), atol=1e-5 * scale
    )
    np.testing.assert_allclose(delta, want, atol=1e-3 * scale)
    assert explained == pytest.approx(np.vdot(rhs.astype(np.float64), want), rel=1e-3)
    assert quad == pytest.approx(float(kr.gram_quadratic(v, sigma, delta)), rel=1e-4)
    u = zg[:10] @ v
    assert backend_violations(kr.fold_residual, u, weights, v.T @ rhs, dy[:10]) == []
    assert backend_violations(kr.fold_leverage, u, weights) == []
    assert backend_violations(kr.fold_moments, u, dy[:10]) == []
    w = rng.standard_normal((dy.shape[1], zg.shape[1])).astype(np.float32)
    assert backend_violations(kr.apply_ridge, w, rhs, 0.5) == []
    assert backend_violations(kr.step_moments, v, sigma, rhs, w, w * 1.01) == []
