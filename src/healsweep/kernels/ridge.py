"""Part B: a ridge correction of the shared expert's down projection.

The shared expert adds ``gate_t * (z_t · W_downᵀ)`` to the layer output, where ``z_t`` [Fs] is its
down input and ``gate_t = sigmoid(x_t · w_gate_inp_shexp)``. With ``Z' = z * gate`` [T, Fs], a
change ``W_down += eta * dWᵀ`` moves the layer output by ``eta * Z' dW``, so the least-squares
fit of the remaining routed residual ``dY = y_ref - alpha * y_q`` [T, D] is

    G = Z'ᵀ Z'  [Fs, Fs],  lambda = rho * tr(G) / Fs,  dW = (G + lambda I)^-1 Z'ᵀ dY  [Fs, D].

lambda is rho times the mean eigenvalue of G (the audit's ``ridge_rel * tr(G)/D``, where its D
was G's dimension). G and Z'ᵀ dY are built with jnp on whatever device is the default; the solve
(and the eigenvalues for the report) run on the CPU device, in float32, because accelerator
plugins cannot lower linear solves. Diagnostics follow the audit (§1.3): rank(G), effective
degrees of freedom ``sum sigma / (sigma + lambda)``, the in-sample change of the residual and the
leave-one-block-out held-out change (negative = the ridge removes residual).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

LOBO_BLOCKS = 4


class RidgeFit(NamedTuple):
    """A fitted correction and its diagnostics (changes are relative: -0.04 = 4% less residual)."""

    delta: np.ndarray  # [Fs, D] float32: dW before the eta step
    lam: float
    rank: int
    dof: float
    in_sample_change: float
    heldout_change: float
    fold_changes: tuple[float, ...]
    n_tokens: int
    warning: str | None


def gated_design(shexp_down_input: jax.Array, shexp_gate: jax.Array) -> jax.Array:
    """Z' [T, Fs] = the shared expert's down input times its sigmoid gate (per token)."""
    z = jnp.asarray(shexp_down_input, jnp.float32)  # [T, Fs]
    return z * jnp.asarray(shexp_gate, jnp.float32)[:, None]


@jax.jit
def normal_equations(z_gated: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """G = Z'ᵀZ' [Fs, Fs] and B = Z'ᵀ dY [Fs, D] (float32, on the default device)."""
    z_gated = jnp.asarray(z_gated, jnp.float32)  # [T, Fs]
    target = jnp.asarray(target, jnp.float32)  # [T, D]
    gram = jnp.einsum("tf,tg->fg", z_gated, z_gated)  # [Fs, Fs]
    rhs = jnp.einsum("tf,td->fd", z_gated, target)  # [Fs, D]
    return gram, rhs


def ridge_lambda(gram: jax.Array, rho: float) -> jax.Array:
    """lambda = rho * tr(G) / Fs (rho times G's mean eigenvalue)."""
    return jnp.float32(rho) * jnp.trace(gram) / gram.shape[0]


@jax.jit
def _solve(gram: jax.Array, rhs: jax.Array, lam: jax.Array) -> jax.Array:
    eye = jnp.eye(gram.shape[0], dtype=jnp.float32)
    return jnp.linalg.solve(gram + lam * eye, rhs)  # [Fs, D]


def solve_ridge(gram: jax.Array, rhs: jax.Array, rho: float) -> tuple[np.ndarray, float]:
    """dW = (G + lambda I)^-1 B on the CPU device, float32; returns (dW [Fs, D], lambda)."""
    cpu = jax.devices("cpu")[0]
    gram = jax.device_put(jnp.asarray(gram, jnp.float32), cpu)
    rhs = jax.device_put(jnp.asarray(rhs, jnp.float32), cpu)
    lam = ridge_lambda(gram, rho)
    if not float(lam) > 0.0:  # Z' is all zeros: there is nothing to fit
        return np.zeros(rhs.shape, np.float32), 0.0
    return np.asarray(_solve(gram, rhs, lam)), float(lam)


def spectrum_stats(gram: np.ndarray, lam: float) -> tuple[int, float]:
    """(rank(G), effective dof sum sigma/(sigma+lambda)) from G's eigenvalues, float32 on host."""
    sigma = np.linalg.eigvalsh(np.asarray(gram, np.float32)).astype(np.float32)
    top = float(sigma.max(initial=0.0))
    tol = top * gram.shape[0] * float(np.finfo(np.float32).eps)
    sigma = np.clip(sigma, 0.0, None)
    rank = int(np.sum(sigma > tol)) if top > 0 else 0
    dof = float(np.sum(sigma / (sigma + lam))) if lam > 0 else float(rank)
    return rank, dof


def residual_change(z_gated: jax.Array, target: jax.Array, delta: jax.Array, eta: float) -> float:
    """(|dY - eta Z' dW|^2 - |dY|^2) / |dY|^2 over the given tokens (0 when dY = 0)."""
    before, after = _residual_sums(z_gated, target, delta, jnp.float32(eta))
    return float((after - before) / before) if float(before) > 0 else 0.0


@jax.jit
def _residual_sums(z_gated, target, delta, eta) -> tuple[jax.Array, jax.Array]:
    target = jnp.asarray(target, jnp.float32)  # [T, D]
    fitted = eta * jnp.asarray(z_gated, jnp.float32) @ jnp.asarray(delta, jnp.float32)  # [T, D]
    left = target - fitted  # [T, D]
    before = jnp.sum(jnp.einsum("td,td->t", target, target))
    after = jnp.sum(jnp.einsum("td,td->t", left, left))
    return before, after


def fit_ridge(
    shexp_down_input: np.ndarray,
    shexp_gate: np.ndarray,
    target: np.ndarray,
    rho: float,
    eta: float,
    n_blocks: int = LOBO_BLOCKS,
) -> RidgeFit:
    """Fit dW on all tokens and report rank, dof, in-sample and leave-one-block-out changes.

    ``target`` is dY = y_ref - alpha * y_q [T, D]. The T tokens are cut into ``n_blocks``
    contiguous blocks (calibration documents are contiguous, so a block is roughly a domain); each
    fold refits on the other blocks (G and B minus that block's share) and is scored on its block.
    """
    z_gated = gated_design(shexp_down_input, shexp_gate)  # [T, Fs]
    n_tokens, width = z_gated.shape
    bounds = np.linspace(0, n_tokens, min(n_blocks, n_tokens) + 1).astype(int)
    blocks = list(zip(bounds[:-1], bounds[1:], strict=True))
    parts = [normal_equations(z_gated[a:b], target[a:b]) for a, b in blocks]
    gram = sum(p[0] for p in parts)
    rhs = sum(p[1] for p in parts)
    delta, lam = solve_ridge(gram, rhs, rho)
    rank, dof = spectrum_stats(np.asarray(gram), lam)
    in_sample = residual_change(z_gated, target, delta, eta)

    folds, before_total, after_total = [], 0.0, 0.0
    if len(parts) > 1:
        for fold, (a, b) in enumerate(blocks):
            # Summing the other blocks (not G minus this one) avoids float32 cancellation.
            rest = [p for i, p in enumerate(parts) if i != fold]
            gram_rest = sum(p[0] for p in rest)
            rhs_rest = sum(p[1] for p in rest)
            delta_out, _ = solve_ridge(gram_rest, rhs_rest, rho)
            before, after = _residual_sums(z_gated[a:b], target[a:b], delta_out, jnp.float32(eta))
            before_total += float(before)
            after_total += float(after)
            folds.append(float((after - before) / before) if float(before) > 0 else 0.0)
    heldout = (after_total - before_total) / before_total if before_total > 0 else 0.0

    warning = None
    if n_tokens < width:
        warning = (
            f"ridge fitted on T={n_tokens} calibration tokens < Fs={width} shared-expert inputs: "
            f"G is rank-deficient (rank {rank}); use more calibration tokens (T >> Fs)"
        )
    return RidgeFit(delta, lam, rank, dof, in_sample, heldout, tuple(folds), n_tokens, warning)


def apply_ridge(down_shexp: np.ndarray, delta: np.ndarray, eta: float) -> np.ndarray:
    """W_new = W + eta * dWᵀ in GGUF's [D, Fs] layout (float32)."""
    return (np.asarray(down_shexp, np.float32) + np.float32(eta) * np.asarray(delta).T).astype(
        np.float32
    )
