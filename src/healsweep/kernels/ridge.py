"""Part B: a ridge correction of the shared expert's down projection, in an eigenbasis of G.

The shared expert adds ``gate_t * (z_t · W_downᵀ)`` to the layer output, where ``z_t`` [Fs] is its
down input and ``gate_t = sigmoid(x_t · w_gate_inp_shexp)``. With ``Z' = z * gate`` [T, Fs], a
change ``W_down += eta * dWᵀ`` moves the layer output by ``eta * Z' dW``, so the least-squares
fit of the remaining routed residual ``dY = y_ref - alpha * y_q`` [T, D] is

    G = Z'ᵀ Z'  [Fs, Fs],  lambda = rho * tr(G) / Fs,  dW = (G + lambda I)^-1 Z'ᵀ dY  [Fs, D].

lambda is rho times the mean eigenvalue of G (the audit's ``ridge_rel * tr(G)/D``, where its D
was G's dimension). G is factored once per layer and trace, ``G = V diag(sigma) Vᵀ`` (on the host
CPU, see ``healsweep.heal.ridge``); after that every rho costs two matrix products,
``dW = V diag(1/(sigma + lambda)) Vᵀ B``, and every eta none. The kernels here are those products
and the normal equations, float32 jnp on whatever device is the default (no solve, no eigh).
Diagnostics follow the audit (§1.3): rank(G), effective degrees of freedom
``sum sigma / (sigma + lambda)``, and residual changes (negative = the ridge removes residual).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels._precision import healing_jit


def gated_design(shexp_down_input: jax.Array, shexp_gate: jax.Array) -> jax.Array:
    """Z' [T, Fs] = the shared expert's down input times its sigmoid gate (per token)."""
    z = jnp.asarray(shexp_down_input, jnp.float32)  # [T, Fs]
    return z * jnp.asarray(shexp_gate, jnp.float32)[:, None]


@healing_jit
def normal_equations(z_gated: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """G = Z'ᵀZ' [Fs, Fs] and B = Z'ᵀ dY [Fs, D] (float32, on the default device)."""
    z_gated = jnp.asarray(z_gated, jnp.float32)  # [T, Fs]
    target = jnp.asarray(target, jnp.float32)  # [T, D]
    gram = jnp.einsum("tf,tg->fg", z_gated, z_gated)  # [Fs, Fs]
    rhs = jnp.einsum("tf,td->fd", z_gated, target)  # [Fs, D]
    return gram, rhs


def ridge_lambda(trace_g: float, width: int, rho: float) -> float:
    """lambda = rho * tr(G) / Fs (rho times G's mean eigenvalue)."""
    return float(np.float32(rho) * np.float32(trace_g) / np.float32(width))


def shrink(sigma: jax.Array, lam: float) -> jax.Array:
    """The ridge's eigenvalue weights 1 / (sigma + lambda) [Fs], float32."""
    sigma = jnp.asarray(sigma, jnp.float32)
    return 1.0 / (jnp.maximum(sigma, 0.0) + jnp.float32(lam))


@healing_jit
def eigen_solve(basis: jax.Array, weights: jax.Array, rhs: jax.Array) -> jax.Array:
    """dW = V diag(weights) Vᵀ B [Fs, D]: the ridge solve as two matrix products (float32)."""
    return _weighted_back(basis, coefficients(basis, rhs), weights)


def _weighted_back(basis: jax.Array, coef: jax.Array, weights: jax.Array) -> jax.Array:
    """V diag(weights) C [Fs, D] (V's columns are G's eigenvectors)."""
    coef = jnp.asarray(coef, jnp.float32) * jnp.asarray(weights, jnp.float32)[:, None]
    return jnp.asarray(basis, jnp.float32) @ coef


@healing_jit
def coefficients(basis: jax.Array, rhs: jax.Array) -> jax.Array:
    """Vᵀ B [Fs, D]: the right-hand side in G's eigenbasis (float32), the same for every rho."""
    return jnp.einsum("fk,fd->kd", jnp.asarray(basis, jnp.float32), jnp.asarray(rhs, jnp.float32))


@healing_jit
def eigen_fit(
    basis: jax.Array, sigma: jax.Array, weights: jax.Array, coef: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dW = V diag(weights) C [Fs, D], <B, dW>, tr(dWᵀ G dW)) from C = VᵀB: one matrix product.

    V is square and orthonormal, so B = V C, ``<B, dW> = Σ_k w_k |C_k|²`` and
    ``tr(dWᵀGdW) = Σ_k sigma_k w_k² |C_k|²`` need no product (:func:`eigen_solve` and
    :func:`gram_quadratic` compute the same from B with three)."""
    weights = jnp.asarray(weights, jnp.float32)
    coef = jnp.asarray(coef, jnp.float32)
    energy = jnp.einsum("kd,kd->k", coef, coef)  # [Fs]
    sigma = jnp.maximum(jnp.asarray(sigma, jnp.float32), 0.0)
    delta = _weighted_back(basis, coef, weights)
    return delta, jnp.sum(weights * energy), jnp.sum(sigma * weights * weights * energy)


@healing_jit
def gram_quadratic(basis: jax.Array, sigma: jax.Array, delta: jax.Array) -> jax.Array:
    """tr(Δᵀ G Δ) = |diag(sigma)^½ Vᵀ Δ|² for Δ [Fs, D], float32 (= |Z' Δ|² without Z')."""
    coef = coefficients(basis, delta)  # [Fs, D]
    energy = jnp.einsum("kd,kd->k", coef, coef)  # [Fs]
    return jnp.sum(jnp.maximum(jnp.asarray(sigma, jnp.float32), 0.0) * energy)


def spectrum_stats(sigma: np.ndarray, lam: float) -> tuple[int, float]:
    """(rank(G), effective dof sum sigma/(sigma+lambda)) from G's eigenvalues (float32 tolerance)."""
    sigma = np.asarray(sigma, np.float64)
    top = float(sigma.max(initial=0.0))
    tol = top * sigma.shape[0] * float(np.finfo(np.float32).eps)
    sigma = np.clip(sigma, 0.0, None)
    rank = int(np.sum(sigma > tol)) if top > 0 else 0
    dof = float(np.sum(sigma / (sigma + lam))) if lam > 0 else float(rank)
    return rank, dof


def residual_change(z_gated: jax.Array, target: jax.Array, delta: jax.Array, eta: float) -> float:
    """(|dY - eta Z' dW|^2 - |dY|^2) / |dY|^2 over the given tokens (0 when dY = 0)."""
    before, after = _residual_sums(z_gated, target, delta, jnp.float32(eta))
    return float((after - before) / before) if float(before) > 0 else 0.0


@healing_jit
def _residual_sums(z_gated, target, delta, eta) -> tuple[jax.Array, jax.Array]:
    target = jnp.asarray(target, jnp.float32)  # [T, D]
    fitted = eta * jnp.asarray(z_gated, jnp.float32) @ jnp.asarray(delta, jnp.float32)  # [T, D]
    left = target - fitted  # [T, D]
    before = jnp.sum(jnp.einsum("td,td->t", target, target))
    after = jnp.sum(jnp.einsum("td,td->t", left, left))
    return before, after


def eta_change(sums: tuple[float, float, float], eta: float) -> float:
    """Relative change ``(|Y - eta P|² - |Y|²) / |Y|²`` from the sums (|Y|², <Y, P>, |P|²).

    Any eta costs nothing once the fit's prediction P and these three sums are known.
    """
    yy, yp, pp = sums
    return (-2.0 * eta * yp + eta * eta * pp) / yy if yy > 0 else 0.0


@healing_jit
def fold_residual(
    u_fold: jax.Array, weights: jax.Array, coef: jax.Array, target: jax.Array
) -> jax.Array:
    """One block's residual ``e = Y - U (w∘C)`` [n, D] under the fit on all tokens.

    ``u_fold = Z'_k V`` [n, Fs], ``weights = 1/(sigma + lambda_k)``, ``coef = Vᵀ B`` [Fs, D].
    The block's residual under the fit without it is ``(I - U diag(w) Uᵀ)^-1 e``.
    """
    fitted = jnp.asarray(u_fold, jnp.float32) @ (
        jnp.asarray(coef, jnp.float32) * jnp.asarray(weights, jnp.float32)[:, None]
    )
    return jnp.asarray(target, jnp.float32) - fitted


@healing_jit
def fold_leverage(u_fold: jax.Array, weights: jax.Array) -> jax.Array:
    """The block's leverage ``H = U diag(w) Uᵀ`` [n, n] (used when n <= Fs)."""
    u = jnp.asarray(u_fold, jnp.float32)
    return (u * jnp.asarray(weights, jnp.float32)[None, :]) @ u.T


@healing_jit
def fold_moments(u_fold: jax.Array, resid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(UᵀU [Fs, Fs], Uᵀe [Fs, D])`` of a block (used when n > Fs, by Woodbury)."""
    u = jnp.asarray(u_fold, jnp.float32)
    return u.T @ u, u.T @ jnp.asarray(resid, jnp.float32)


@jax.jit
def apply_ridge(down_shexp: jax.Array, delta: jax.Array, eta) -> jax.Array:
    """W_new = W + eta * dWᵀ in GGUF's [D, Fs] layout (float32, on the default device)."""
    w = jnp.asarray(down_shexp, jnp.float32)
    return w + jnp.float32(eta) * jnp.asarray(delta, jnp.float32).T


@healing_jit
def step_moments(basis, sigma, rhs, old, new) -> tuple[jax.Array, ...]:
    """What Part B reports of a realized update ``new - old`` ([D, Fs], GGUF layout), with
    Δ = (new - old)ᵀ: (tr(ΔᵀGΔ), <B, Δ>, |new - old|, |old|), float32, without Z'."""
    old = jnp.asarray(old, jnp.float32)
    moved = jnp.asarray(new, jnp.float32) - old
    step = moved.T  # [Fs, D]
    return (
        gram_quadratic(basis, sigma, step),
        jnp.vdot(jnp.asarray(rhs, jnp.float32), step),
        jnp.sqrt(jnp.sum(moved * moved)),
        jnp.sqrt(jnp.sum(old * old)),
    )
