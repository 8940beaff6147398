"""Example inputs for every kernel, for ``healsweep doctor`` and the backend-rule tests.

Shapes are small so the whole suite runs in seconds on any backend; values are drawn from a
seeded generator so CPU and accelerator see the same inputs.
"""

from __future__ import annotations

import numpy as np

from healsweep.kernels import (
    alpha,
    gptq,
    gptq_grid,
    gptq_refine,
    iq4_nl,
    kld,
    kld_compact,
    q2_0,
    q2_0_plain,
    ridge,
)
from healsweep.kernels.conformance import KernelCase


def _f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _q2_rows_inputs(rng):
    """Rows [32, 128] with one importance row per weight row."""
    return _f32(rng, 32, 128), np.abs(_f32(rng, 32, 128)) + 0.1


def _q2_grouped_inputs(rng):
    """Rows [32, 128] with one importance row per group of ``LANES`` rows (per expert)."""
    return _f32(rng, 32, 128), np.abs(_f32(rng, 32 // q2_0.LANES, 128)) + 0.1


def _q2_rows(w, importance):
    # q2_0.quantize / quantize_matrix are host-side drivers (numpy in and out, fixed-shape
    # chunks); the kernel that runs on the device, and so the one checked here, is this one.
    d, q, _ = q2_0._quantize_rows(w, importance, np.float32(0.3), keep_extras=False)
    return d, q


def _logits_pair(rng):
    teacher = _f32(rng, 24, 300, scale=3.0)
    student = teacher + _f32(rng, 24, 300, scale=0.3)
    return teacher, student, rng.integers(0, 300, 24).astype(np.int32)


def _compact_inputs(rng):
    """A compact record (top-16, 8 tail ids drawn at random: the kernel does not care how)."""
    teacher, student, next_ids = _logits_pair(rng)
    _, top_ids, top_logp, logp_next = kld_compact.teacher_top(teacher, next_ids, 16)
    tail_ids = rng.integers(16, 300, (24, 8)).astype(np.int32)
    logp = np.asarray(kld.log_softmax(teacher))
    tail_logp = np.take_along_axis(logp, tail_ids, axis=1)
    tail_mass = np.full(24, 0.3, dtype=np.float32)
    full = np.ones(24, dtype=bool)
    record = (np.asarray(top_ids), np.asarray(top_logp), tail_ids, tail_logp, tail_mass, full)
    return (*record, np.asarray(logp_next), student, next_ids)


def _outputs_pair(rng):
    y_ref = _f32(rng, 64, 32)
    return y_ref, 0.9 * y_ref + _f32(rng, 64, 32, scale=0.2)


def _experts(rng):
    x = _f32(rng, 16, 64)
    dense = (
        _f32(rng, 2, 64, 64, scale=0.1),
        _f32(rng, 2, 64, 64, scale=0.1),
        _f32(rng, 2, 64, 64, scale=0.1),
    )
    noisy = tuple(w + _f32(rng, *w.shape, scale=0.01) for w in dense)
    return x, dense, noisy


def _ridge_inputs(rng):
    return _f32(rng, 200, 32), _f32(rng, 200, 16)


def _ridge_eigen_inputs(rng):
    """(V, 1/(sigma + lambda), B): an orthonormal basis, ridge weights, a right-hand side."""
    z = _f32(rng, 200, 32)
    sigma, v = np.linalg.eigh(z.T.astype(np.float64) @ z)
    weights = 1.0 / (np.clip(sigma, 0, None) + 6.0 * sigma.mean())
    return v.astype(np.float32), weights.astype(np.float32), z.T @ _f32(rng, 200, 16)


def _ridge_coef_inputs(rng):
    v, _, rhs = _ridge_eigen_inputs(rng)
    return v, rhs


def _ridge_fit_inputs(rng):
    """(V, sigma + lambda as the spectrum, weights, VᵀB) of :func:`_ridge_eigen_inputs`."""
    v, weights, rhs = _ridge_eigen_inputs(rng)
    return v, (1.0 / weights).astype(np.float32), weights, (v.T @ rhs).astype(np.float32)


def _ridge_fold_inputs(rng):
    v, weights, rhs = _ridge_eigen_inputs(rng)
    return _f32(rng, 20, 32) @ v, weights, v.T @ rhs, _f32(rng, 20, 16)


def _q2_codes(rng, *shape: int) -> np.ndarray:
    return rng.integers(-1, 3, shape).astype(np.int8)  # q in {-1, 0, 1, 2}


def _q2_blocks(rng):
    """``(d [N] f16, q [N, 64] int8)``: signed scales (the mirrored grid too) and codes."""
    return _f32(rng, 96, scale=0.05).astype(np.float16), _q2_codes(rng, 96, 64)


def _q2_matrix(rng):
    """``(d [2, 32, 2] f16, q [2, 32, 128] int8)`` of a Q2Weight (two experts)."""
    return _f32(rng, 2, 32, 2, scale=0.05).astype(np.float16), _q2_codes(rng, 2, 32, 128)


def _q2_packed(rng):
    return (np.asarray(q2_0.pack(*_q2_blocks(rng))),)


def _iq4_blocks(rng):
    return (_f32(rng, 64, 32),)


def _iq4_weighted(rng):
    return _f32(rng, 64, 32), np.abs(_f32(rng, 64, 32)) + 0.1


def _iq4_codes(rng):
    """``(d [N] f16, idx [N, 32] int8)`` with indices 0..15 into the codebook."""
    return _f32(rng, 64, scale=0.01).astype(np.float16), rng.integers(0, 16, (64, 32)).astype(
        np.int8
    )


def _iq4_packed(rng):
    return (np.asarray(iq4_nl.pack(*_iq4_codes(rng))),)


def _gptq_inputs(rng):
    # u: upper Cholesky factor of the inverse of a well-conditioned SPD matrix (made on the host)
    w = _f32(rng, 2, 16, 128)
    x = rng.standard_normal((2, 400, 128)) @ (np.eye(128) + 0.1 * rng.standard_normal((128, 128)))
    h = np.einsum("eti,etj->eij", x, x) + 4.0 * np.eye(128)
    u = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1).astype(np.float32)
    return w, u, np.einsum("eii->ei", h).astype(np.float32)


def _grid_inputs(rng):
    # a Q2_K-like grid (one scale and offset per 16 weights) and _gptq_inputs' factor
    w, u, _ = _gptq_inputs(rng)
    scale = (np.abs(_f32(rng, 2, 16, 8)) + 0.2).astype(np.float32)
    return w, scale, np.abs(_f32(rng, 2, 16, 8)), u


def _refine_inputs(rng):
    # a damped second moment, a Q2_0 start (codes and fp16 scales) for 2 experts of 8 x 128
    x = rng.standard_normal((2, 300, 128)) * np.exp(rng.standard_normal(128))
    h = (np.einsum("eti,etj->eij", x, x) + 4.0 * np.eye(128)).astype(np.float32)
    d = (np.abs(_f32(rng, 2, 8, 2)) + 0.2).astype(np.float16)
    q = rng.integers(-1, 3, (2, 8, 128)).astype(np.int8)
    return _f32(rng, 2, 8, 128), h, d, q


def _jaccard_inputs(rng):
    a = np.stack([rng.permutation(8)[:2] for _ in range(20)]).astype(np.int32)
    b = np.stack([rng.permutation(8)[:2] for _ in range(20)]).astype(np.int32)
    return a, b


CASES: tuple[KernelCase, ...] = (
    KernelCase("q2_0.quantize_rows", _q2_rows, _q2_rows_inputs, rtol=0.0),
    KernelCase("q2_0.quantize_rows_grouped", _q2_rows, _q2_grouped_inputs, rtol=0.0),
    KernelCase(
        "q2_0_plain.quantize",
        q2_0_plain.quantize,
        lambda rng: (_f32(rng, 2, 16, 128),),
        rtol=0.0,
    ),
    KernelCase("q2_0.dequantize", q2_0.dequantize, _q2_blocks, rtol=0.0),
    KernelCase(
        "q2_0.Q2Weight.dequantize",
        lambda d, q: q2_0.Q2Weight(d, q).dequantize(),
        _q2_matrix,
        rtol=0.0,
    ),
    KernelCase(
        "gptq.quantize",
        lambda w, u, a: gptq.quantize(w, u, a, np.float32(0.3)),
        _gptq_inputs,
        rtol=0.0,
    ),
    KernelCase(
        "gptq_grid.quantize",
        lambda w, s, o, u: gptq_grid.quantize(w, s, o, u, 0, 4),
        _grid_inputs,
        rtol=0.0,
    ),
    KernelCase(
        "gptq_refine.code_descent",
        lambda w, h, d, q: gptq_refine.code_descent(w, h, d, q, sweeps=2),
        _refine_inputs,
        rtol=0.0,
    ),
    KernelCase(
        "gptq_refine.scale_system",
        lambda w, h, d, q: gptq_refine.scale_system(w, h, q),
        _refine_inputs,
        rtol=1e-4,
    ),
    KernelCase("gptq_refine.row_objective", gptq_refine.row_objective, _refine_inputs, rtol=1e-4),
    KernelCase("q2_0.pack", q2_0.pack, _q2_blocks, rtol=0.0),
    KernelCase("q2_0.unpack", q2_0.unpack, _q2_packed, rtol=0.0),
    KernelCase("iq4_nl.quantize", iq4_nl.quantize, _iq4_blocks, rtol=0.0),
    KernelCase("iq4_nl.quantize_weighted", iq4_nl.quantize, _iq4_weighted, rtol=0.0),
    KernelCase("iq4_nl.dequantize", iq4_nl.dequantize, _iq4_codes, rtol=0.0),
    KernelCase("iq4_nl.pack", iq4_nl.pack, _iq4_codes, rtol=0.0),
    KernelCase("iq4_nl.unpack", iq4_nl.unpack, _iq4_packed, rtol=0.0),
    KernelCase(
        "kld.token_stats",
        lambda t, s, n: kld.token_stats(t, s, n, chunk=128),
        _logits_pair,
        rtol=1e-5,
    ),
    KernelCase(
        "kld.log_softmax",
        lambda t: kld.log_softmax(t, 128),
        lambda rng: (_f32(rng, 8, 300),),
        rtol=1e-5,
    ),
    KernelCase("kld.topk_jaccard", kld.topk_jaccard, _jaccard_inputs, rtol=0.0),
    KernelCase(
        "kld_compact.teacher_top",
        lambda t, s, n: kld_compact.teacher_top(t, n, 16, chunk=128),
        _logits_pair,
        rtol=1e-5,
    ),
    KernelCase(
        "kld_compact.compact_token_stats",
        lambda *a: kld_compact.compact_token_stats(*a, chunk=128),
        _compact_inputs,
        rtol=1e-4,
    ),
    KernelCase(
        "alpha.alpha_mse", lambda r, q: alpha.alpha_mse(r, q, 0.75), _outputs_pair, rtol=1e-5
    ),
    KernelCase(
        "alpha.expert_outputs",
        alpha.expert_outputs,
        lambda rng: (_experts(rng)[0], *_experts(rng)[1]),
        rtol=1e-4,
    ),
    KernelCase(
        "alpha.alpha_gaussian",
        lambda x, d, q: alpha.alpha_gaussian(x, d, q, 0.75),
        _experts,
        rtol=1e-4,
    ),
    KernelCase("ridge.normal_equations", ridge.normal_equations, _ridge_inputs, rtol=1e-4),
    KernelCase("ridge.eigen_solve", ridge.eigen_solve, _ridge_eigen_inputs, rtol=1e-4),
    KernelCase("ridge.gram_quadratic", ridge.gram_quadratic, _ridge_eigen_inputs, rtol=1e-4),
    KernelCase("ridge.coefficients", ridge.coefficients, _ridge_coef_inputs, rtol=1e-4),
    KernelCase("ridge.eigen_fit", ridge.eigen_fit, _ridge_fit_inputs, rtol=1e-4),
    KernelCase("ridge.fold_residual", ridge.fold_residual, _ridge_fold_inputs, rtol=1e-4),
    KernelCase(
        "ridge.fold_leverage", lambda u, w, c, y: ridge.fold_leverage(u, w), _ridge_fold_inputs
    ),
    KernelCase(
        "ridge.fold_moments", lambda u, w, c, y: ridge.fold_moments(u, y), _ridge_fold_inputs
    ),
)
