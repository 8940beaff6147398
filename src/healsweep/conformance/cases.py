"""The kernels of :mod:`healsweep.kernels` with small example inputs and their float64 references.

Shapes are small so the suite runs in seconds on any backend; values come from a seeded
generator, so every backend sees the same inputs. The Q2_0 search runs down the production
path: the host driver with the layout that ``q2_0._backend_options`` (the selector production
calls) picks for the platform: Pallas on NVIDIA, blocks in place on other accelerators, tiles on
a CPU.
"""

from __future__ import annotations

import numpy as np

from healsweep.conformance import references as ref
from healsweep.conformance.run import KernelCase
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
    requant,
    ridge,
    tail_draws,
)

GAIN = 0.3
Q2_TIE_ALLOWANCE = 0.01  # blocks at a near-tie, at most this fraction (measured: <= 0.3%)


def _f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _q8_rows(rng: np.random.Generator) -> tuple[np.ndarray]:
    """Rows of a shared-expert down projection in small, with an all-zero block and one whose
    codes fall on exact halves (where the rounding rule shows)."""
    values = _f32(rng, 24, 128, scale=0.02)
    values[0, :32] = 0.0
    values[1, :32] = (np.arange(32) - 15.5) / 15.5 * 0.03
    return (values,)


# --- Q2_0 search ---------------------------------------------------------------------------------


def _q2_rows_inputs(rng):
    """Rows [256, 256] of very different sizes, one importance row per weight row."""
    w = _f32(rng, 256, 256) * rng.uniform(0.01, 3.0, (256, 1)).astype(np.float32)
    return w, np.abs(_f32(rng, 256, 256)) + 0.1


def _q2_grouped_inputs(rng):
    """Rows [256, 256] with one importance row per group of ``LANES`` rows (per expert)."""
    w = _f32(rng, 256, 256) * rng.uniform(0.01, 3.0, (256, 1)).astype(np.float32)
    return w, np.abs(_f32(rng, 256 // q2_0.LANES, 256)) + 0.1


def _q2_production(w, importance, platform):
    """The host driver down the path production takes on ``platform``."""
    return q2_0.quantize_rows(w, importance, GAIN, options=q2_0._backend_options(platform))


def _q2_path(platform: str) -> str:
    return q2_0.kernel_path(q2_0._backend_options(platform))


def _q2_blocks(w, importance):
    """Blocks ``[N, 64]`` and their importance of rows ``w [R, in]``."""
    per_row = np.repeat(importance, w.shape[0] // importance.shape[0], axis=0)
    return w.reshape(-1, q2_0.QK), per_row.reshape(-1, q2_0.QK)


def _q2_reference(w, importance):
    """The float64 search of the blocks, with its near-tie margins."""
    return ref.q2_0_search(*_q2_blocks(w, importance), GAIN)


def _q2_check(got, want, inputs):
    """Every block with the float64 search's codes and fp16 scale, but where a near-tie explains
    the difference, and such blocks rare."""
    d, q = (np.asarray(leaf) for leaf in got)
    codes, scales, unexplained = ref.q2_0_disagreements(d.reshape(-1), q.reshape(-1, q2_0.QK), want)
    n = len(want[0])
    err = (codes + scales) / n
    if unexplained:
        return err, f"{unexplained} of {n} blocks differ from the float64 search, no near-tie"
    if err > Q2_TIE_ALLOWANCE:
        return err, f"{codes + scales} of {n} blocks at near-ties, more than expected"
    return err, None


def _q2_case(name, fn, inputs, **kwargs) -> KernelCase:
    return KernelCase(name, fn, inputs, _q2_reference, check=_q2_check, **kwargs)


def _exact(name, fn, inputs, reference) -> KernelCase:
    """A case whose result must equal its reference exactly, on every backend (codecs' bytes,
    codes and the products of small integers with fp16 scales)."""
    return KernelCase(name, fn, inputs, reference, rtol=0.0, device_rtol=0.0)


# --- Q2_0 codec ----------------------------------------------------------------------------------


def _q2_codes(rng, *shape: int) -> np.ndarray:
    return rng.integers(-1, 3, shape).astype(np.int8)  # q in {-1, 0, 1, 2}


def _q2_block_inputs(rng):
    """``(d [N] f16, q [N, 64] int8)``: signed scales (the mirrored grid too) and codes."""
    return _f32(rng, 96, scale=0.05).astype(np.float16), _q2_codes(rng, 96, 64)


def _q2_matrix(rng):
    """``(d [2, 32, 2] f16, q [2, 32, 128] int8)`` of a Q2Weight (two experts)."""
    return _f32(rng, 2, 32, 2, scale=0.05).astype(np.float16), _q2_codes(rng, 2, 32, 128)


def _q2_packed_matrix(rng):
    """``(d [2, 4, 4] f16, codes [2, 4, 64] uint8)`` of a Q2Packed: square [out, in/64], so a
    transposed scale has the right shape and the wrong values."""
    return _f32(rng, 2, 4, 4, scale=0.05).astype(np.float16), rng.integers(0, 256, (2, 4, 64))


def _q2_packed_bytes(rng):
    d, q = _q2_block_inputs(rng)
    return (ref.q2_0_block_bytes(d, q),)


def _q2_unpacked(packed):
    return packed[:, :2].copy().view("<f2")[:, 0], ref.q2_0_codes_from_bytes(packed[:, 2:])


# --- IQ4_NL --------------------------------------------------------------------------------------


def _iq4_blocks(rng):
    return (_f32(rng, 64, 32) * rng.uniform(0.01, 3.0, (64, 1)).astype(np.float32),)


def _iq4_weighted(rng):
    return _iq4_blocks(rng)[0], np.abs(_f32(rng, 64, 32)) + 0.1


def _iq4_reference(w, importance=None):
    """The smallest weighted SSE over the documented candidates, per block."""
    a = np.ones_like(w) if importance is None else importance
    return ref.iq4_best_sse(w, a, iq4_nl.MULTIPLIERS)[0]


def _iq4_check(got, want, inputs):
    """The weighted SSE of the result equals the best documented candidate's (and so never
    exceeds round-to-nearest's); indices in range."""
    d, idx = (np.asarray(leaf) for leaf in got)
    w = inputs[0]
    a = inputs[1] if len(inputs) > 1 else np.ones_like(w)
    if idx.min() < 0 or idx.max() > 15:
        return np.inf, "indices outside the codebook"
    sse = (a * (w.astype(np.float64) - ref.iq4_values(d, idx)) ** 2).sum(1)
    err = float(np.max((sse - want) / np.maximum(want, 1e-300)))
    if err <= 1e-4:
        return err, None
    return err, f"SSE {err:.2e} above the best documented candidate"


def _iq4_codes(rng):
    """``(d [N] f16, idx [N, 32] int8)`` with indices 0..15 into the codebook."""
    d = _f32(rng, 64, scale=0.01).astype(np.float16)
    return d, rng.integers(0, 16, (64, 32)).astype(np.int8)


def _iq4_packed(rng):
    return (ref.iq4_block_bytes(*_iq4_codes(rng)),)


def _iq4_unpacked(packed):
    body = packed[:, 2:].astype(np.int64)
    idx = np.concatenate([body & 15, body >> 4], 1).astype(np.int8)
    return packed[:, :2].copy().view("<f2")[:, 0], idx


# --- GPTQ ----------------------------------------------------------------------------------------


def _gptq_inputs(rng):
    # H = V·D·Vᵀ (V unit upper) of a well-conditioned SPD matrix, made on the host: the kernel
    # takes f = V − I and the inverses of V's diagonal 64-blocks, the reference u with uᵀu = H⁻¹
    w = _f32(rng, 2, 16, 128)
    x = rng.standard_normal((2, 400, 128)) @ (np.eye(128) + 0.1 * rng.standard_normal((128, 128)))
    h = np.einsum("eti,etj->eij", x, x) + 4.0 * np.eye(128)
    flip = slice(None, None, -1)
    r = np.linalg.cholesky(h[:, flip, flip])[:, flip, flip]  # upper, H = R·Rᵀ
    v = r / np.einsum("eii->ei", r)[:, None, :]
    blocks = np.stack([v[:, a : a + 64, a : a + 64] for a in (0, 64)], axis=1)
    f = (v - np.eye(128)).astype(np.float32)
    g = np.linalg.inv(blocks).astype(np.float32)
    u = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1).astype(np.float32)
    return w, f, g, np.einsum("eii->ei", h).astype(np.float32), u


def _gptq_lowrank_inputs(rng):
    # H = c·I + XᵀX of 40 rows (zero-padded to 64) of 128 columns, in the kernel's factored form:
    # u_k = (c·I + Σ_{i≥k} x_i x_iᵀ)⁻¹ x_k by a direct solve per column (not factor_rows's
    # block recursion), V's diagonal blocks and their inverses from numpy's Cholesky of H; the
    # last input is the reference's u with uᵀu = H⁻¹
    w = _f32(rng, 2, 16, 128)
    rows = rng.standard_normal((2, 40, 128)) * np.exp(rng.standard_normal((2, 1, 128)))
    x = np.concatenate([rows, np.zeros((2, 24, 128))], axis=1).astype(np.float32)
    x64 = x.astype(np.float64)
    u_rows = np.zeros_like(x64)
    h = np.einsum("epi,epj->eij", x64, x64)
    for e in range(2):
        c = 0.01 * np.trace(h[e]) / 128
        h[e] += c * np.eye(128)
        for k in range(128):
            tail = x64[e, :, k:]
            u_rows[e, :, k] = np.linalg.solve(c * np.eye(64) + tail @ tail.T, x64[e, :, k])
    flip = slice(None, None, -1)
    r = np.linalg.cholesky(h[:, flip, flip])[:, flip, flip]  # upper, H = R·Rᵀ
    v = r / np.einsum("eii->ei", r)[:, None, :]
    blocks = np.stack([v[:, a : a + 64, a : a + 64] for a in (0, 64)], axis=1)
    u = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1).astype(np.float32)
    return (
        w,
        x,
        u_rows.astype(np.float32),
        (blocks - np.eye(64)).astype(np.float32),
        np.linalg.inv(blocks).astype(np.float32),
        np.einsum("eii->ei", h).astype(np.float32),
        u,
    )


def _gptq_check(got, want, inputs):
    """Codes equal the float64 GPTQ's but for a few knife-edge roundings (one changes every
    later error of its row), and the objective GPTQ minimizes within 0.1% of the reference's."""
    d, q = (np.asarray(leaf) for leaf in got)
    d_ref, q_ref = want
    w, *_, u = inputs
    h = np.linalg.inv(np.einsum("eji,ejk->eik", u.astype(np.float64), u.astype(np.float64)))
    differ = float(np.mean(q != q_ref))
    objective = ref.h_objective(w, d, q, h).sum(1)
    expected = ref.h_objective(w, d_ref, q_ref, h).sum(1)
    gap = float(np.max(np.abs(objective - expected) / expected))
    if differ > 5e-3:
        return differ, f"{differ:.2%} of codes differ from the float64 GPTQ"
    if gap > 1e-3:
        return gap, f"objective {gap:.2e} (relative) off the float64 GPTQ's"
    return max(differ, gap), None


def _grid_inputs(rng):
    # a Q2_K-like grid (one scale and offset per 16 weights) and _gptq_inputs' factors
    w, f, _, _, u = _gptq_inputs(rng)
    scale = np.abs(_f32(rng, 2, 16, 8)) + 0.2
    return w, scale, np.abs(_f32(rng, 2, 16, 8)), f, u


def _grid_check(got, want, inputs):
    """Codes equal the float64 GPTQ's but for a few knife-edge roundings, and the objective
    within 0.5% of the reference's."""
    w, scale, offset, _, u = inputs
    h = np.linalg.inv(np.einsum("eji,ejk->eik", u.astype(np.float64), u.astype(np.float64)))
    values = np.repeat(ref.grid_values(scale, offset, 0, 4), 16, axis=2)

    def objective(codes):
        r = w - np.take_along_axis(values, np.asarray(codes)[..., None], axis=-1)[..., 0]
        return np.einsum("eoi,eij,eoj->e", r, h, r)

    differ = float(np.mean(np.asarray(got) != want))
    gap = float(np.max(np.abs(objective(got) - objective(want)) / objective(want)))
    if differ > 2e-2:
        return differ, f"{differ:.2%} of codes differ from the float64 GPTQ"
    if gap > 5e-3:
        return gap, f"objective {gap:.2e} (relative) off the float64 GPTQ's"
    return max(differ, gap), None


def _refine_inputs(rng):
    # a damped second moment, a Q2_0 start (codes and fp16 scales) for 2 experts of 8 x 128
    x = rng.standard_normal((2, 300, 128)) * np.exp(rng.standard_normal(128))
    h = (np.einsum("eti,etj->eij", x, x) + 4.0 * np.eye(128)).astype(np.float32)
    d = (np.abs(_f32(rng, 2, 8, 2)) + 0.2).astype(np.float16)
    q = rng.integers(-1, 3, (2, 8, 128)).astype(np.int8)
    return _f32(rng, 2, 8, 128), h, d, q


def _codes_check(got, want, inputs):
    """Codes of a float32 descent equal the float64 one's but at a few rounding ties."""
    differ = float(np.mean(np.asarray(got) != want))
    return differ, (f"{differ:.2%} of codes differ from float64" if differ > 5e-3 else None)


# --- KLD, alpha, ridge ---------------------------------------------------------------------------


def _logits_pair(rng):
    teacher = _f32(rng, 24, 300, scale=3.0)
    student = teacher + _f32(rng, 24, 300, scale=0.3)
    return teacher, student, rng.integers(0, 300, 24).astype(np.int32)


def _compact_inputs(rng):
    """A compact record (top-16, 8 tail ids drawn at random: the kernel does not care how)."""
    teacher, student, next_ids = _logits_pair(rng)
    logp, top_ids, top_logp, logp_next = ref.teacher_top(teacher, next_ids, 16)
    tail_ids = rng.integers(16, 300, (24, 8)).astype(np.int32)
    tail_ids = np.where(np.isin(tail_ids, top_ids), 0, tail_ids)  # not the top-K
    tail_logp = np.take_along_axis(logp, tail_ids, axis=1).astype(np.float32)
    tail_mass = (1 - np.exp(top_logp).sum(1)).astype(np.float32)
    full = np.ones(24, dtype=bool)
    record = (top_ids.astype(np.int32), top_logp.astype(np.float32), tail_ids, tail_logp)
    return (*record, tail_mass, full, logp_next.astype(np.float32), student, next_ids)


def _tail_inputs(rng):
    """A peaked teacher over three levels of the sampler's tree (64² + 500 tokens), its top-16
    and one stratified uniform per draw; one row with p = 0 past token 40, one without tail."""
    n_rows, n_vocab, n_draws = 12, 64 * 64 + 500, 32
    logits = rng.standard_normal((n_rows, n_vocab)) * 4
    logits[1, 40:] = -np.inf
    logits[2] = -np.inf
    logits[2, :16] = 0.0
    logp = ref.log_softmax(logits).astype(np.float32)
    top_ids = np.argsort(-logp, axis=1, kind="stable")[:, :16].astype(np.int32)
    strata = (np.arange(n_draws) + rng.random((n_rows, n_draws))) / n_draws
    return logp, top_ids, strata.astype(np.float32)


def _tail_check(got, want, inputs) -> tuple[float, str | None]:
    """Masses within 1e-5 of the float64 ones, flags and log-probs at the ids exact, and every
    draw the float64 inverse CDF's but for near-edge moves (at most 1%)."""
    ids, tail_logp, mass, full = (np.asarray(a) for a in got)
    logp, top_ids, strata = inputs
    moved, bad = ref.tail_edge_misses(ids, logp, top_ids, strata)
    mass_err = float(np.max(np.abs(mass - want[2]) / np.maximum(want[2], 1e-30)))
    exact = np.array_equal(full, want[3]) and np.array_equal(
        tail_logp, np.take_along_axis(logp, ids, 1)
    )
    if bad or moved > 0.01 or mass_err > 1e-5 or not exact:
        return max(moved, mass_err), (
            f"{bad} draw(s) off their token, {moved:.1%} moved, tail mass off by {mass_err:.1e}"
            + ("" if exact else ", flags or log-probs wrong")
        )
    return max(moved, mass_err), None


def _compact_reference(top_ids, top_logp, tail_ids, tail_logp, mass, full, t_next, student, ids):
    stats = ref.token_stats(student, student, ids)
    est = ref.compact_kld(top_ids, top_logp, tail_ids, tail_logp, mass, full, student, "adaptive")
    arg_t, arg_s = top_ids[:, 0], stats["student_argmax"]
    return est, arg_t == arg_s, arg_t, arg_s, t_next, stats["student_logp_next"]


def _outputs_pair(rng):
    y_ref = _f32(rng, 64, 32)
    return y_ref, 0.9 * y_ref + _f32(rng, 64, 32, scale=0.2)


def _experts(rng):
    x = _f32(rng, 16, 64)
    dense = tuple(_f32(rng, 2, 64, 64, scale=0.1) for _ in range(3))
    noisy = tuple(w + _f32(rng, *w.shape, scale=0.01) for w in dense)
    return x, dense, noisy


def _gaussian_reference(x, dense, noisy):
    y_ref, y_q = ref.expert_ffn(x, *dense), ref.expert_ffn(x, *noisy)
    return ref.alpha(y_ref, y_q, 0.75)


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


def _jaccard_inputs(rng):
    a = np.stack([rng.permutation(8)[:2] for _ in range(20)]).astype(np.int32)
    b = np.stack([rng.permutation(8)[:2] for _ in range(20)]).astype(np.int32)
    return a, b


KERNEL_CASES: tuple[KernelCase, ...] = (
    _q2_case(
        "q2_0.quantize_rows",  # production: Pallas / blocks / tiles, by the platform
        _q2_production,
        _q2_rows_inputs,
        device_rtol=None,
        driver=True,
        path=_q2_path,
    ),
    _q2_case(
        "q2_0.quantize_rows_grouped",  # one importance row per expert, as quantize_matrix
        _q2_production,
        _q2_grouped_inputs,
        device_rtol=None,
        driver=True,
        path=_q2_path,
    ),
    _exact(
        "q2_0_plain.quantize",
        q2_0_plain.quantize,
        lambda rng: (_f32(rng, 2, 16, 128),),
        ref.q2_0_plain,
    ),
    _exact(
        "q2_0.dequantize",
        q2_0.dequantize,
        _q2_block_inputs,
        lambda d, q: q.astype(np.float64) * d.astype(np.float64)[:, None],
    ),
    _exact(
        "q2_0.Q2Weight.dequantize",
        lambda d, q: q2_0.Q2Weight(d, q).dequantize(),
        _q2_matrix,
        ref.q2_0_values,
    ),
    _exact(
        "q2_0.Q2Packed.dequantize",  # what every student forward decodes in the graph
        lambda d, codes: q2_0.Q2Packed(d, codes.astype(np.uint8)).dequantize(),
        _q2_packed_matrix,
        lambda d, codes: ref.q2_0_values(d, ref.q2_0_codes_from_bytes(codes)),
    ),
    _exact("q2_0.pack", q2_0.pack, _q2_block_inputs, ref.q2_0_block_bytes),
    _exact("q2_0.unpack", q2_0.unpack, _q2_packed_bytes, _q2_unpacked),
    KernelCase(
        "gptq.quantize",
        lambda w, f, g, a, u: gptq.quantize(w, f, g, a, np.float32(GAIN)),
        _gptq_inputs,
        lambda w, f, g, a, u: ref.gptq(w, u, a, GAIN),
        check=_gptq_check,
        # the error feedback carries a knife-edge rounding into every later column, and a GPU
        # accumulates in another order: on an H200 the codes sat 3.3e-4 from the float64 GPTQ
        # (inside _gptq_check's bounds) but 5.9e-3 (max rel) from the CPU's, so the float64
        # reference judges each backend, as for the layer forward
        device_rtol=None,
    ),
    KernelCase(
        "gptq.quantize_lowrank",  # the path of experts with few routed rows
        lambda w, x, u, f, g, a, _: gptq.quantize_lowrank(w, x, u, f, g, a, np.float32(GAIN)),
        _gptq_lowrank_inputs,
        lambda w, x, u, f, g, a, u_ref: ref.gptq(w, u_ref, a, GAIN),
        check=_gptq_check,
        device_rtol=None,  # as gptq.quantize: knife-edge roundings differ by backend
    ),
    KernelCase(
        "gptq_grid.quantize",
        lambda w, s, o, f, u: gptq_grid.quantize(w, s, o, f, 0, 4),
        _grid_inputs,
        lambda w, s, o, f, u: ref.gptq_grid(w, s, o, u, 0, 4),
        check=_grid_check,
        device_rtol=0.0,
    ),
    KernelCase(
        "gptq_refine.code_descent",
        lambda w, h, d, q: gptq_refine.code_descent(w, h, d, q, sweeps=2),
        _refine_inputs,
        lambda w, h, d, q: ref.code_descent(w, h, d, q, 2),
        check=_codes_check,
        device_rtol=0.0,
    ),
    KernelCase(
        "gptq_refine.scale_system",
        lambda w, h, d, q: gptq_refine.scale_system(w, h, q),
        _refine_inputs,
        lambda w, h, d, q: ref.scale_system(w, h, q),
        rtol=1e-5,
        device_rtol=1e-4,
    ),
    KernelCase(
        "gptq_refine.row_objective",
        gptq_refine.row_objective,
        _refine_inputs,
        lambda w, h, d, q: ref.h_objective(w, d, q, h),
        rtol=1e-5,
        device_rtol=1e-4,
    ),
    *(
        KernelCase(name, iq4_nl.quantize, inputs, _iq4_reference, check=_iq4_check, device_rtol=0.0)
        for name, inputs in (
            ("iq4_nl.quantize", _iq4_blocks),
            ("iq4_nl.quantize_weighted", _iq4_weighted),
        )
    ),
    _exact("requant.encode_q8_0", requant.encode_q8_0, _q8_rows, ref.q8_0_encode),
    _exact("iq4_nl.dequantize", iq4_nl.dequantize, _iq4_codes, ref.iq4_values),
    _exact("iq4_nl.pack", iq4_nl.pack, _iq4_codes, ref.iq4_block_bytes),
    _exact("iq4_nl.unpack", iq4_nl.unpack, _iq4_packed, _iq4_unpacked),
    KernelCase(
        "kld.token_stats",
        lambda t, s, n: kld.token_stats(t, s, n, chunk=128),
        _logits_pair,
        lambda t, s, n: tuple(ref.token_stats(t, s, n).values()),
        rtol=2e-5,
    ),
    KernelCase(
        "kld.log_softmax",
        lambda t: kld.log_softmax(t, 128),
        lambda rng: (_f32(rng, 8, 300),),
        ref.log_softmax,
    ),
    KernelCase("kld.topk_jaccard", kld.topk_jaccard, _jaccard_inputs, ref.topk_jaccard),
    KernelCase(
        "kld_compact.teacher_top",
        lambda t, s, n: kld_compact.teacher_top(t, n, 16, chunk=128),
        _logits_pair,
        lambda t, s, n: ref.teacher_top(t, n, 16),
    ),
    KernelCase(
        "tail_draws.tail_draws",  # the compact record's draws: float32 on the device
        tail_draws.tail_draws,
        _tail_inputs,
        ref.tail_draws,
        check=_tail_check,
        device_rtol=None,  # a draw at a token's edge may move by backend: the reference judges
    ),
    KernelCase(
        "kld_compact.compact_token_stats",
        lambda *a: kld_compact.compact_token_stats(*a, chunk=128),
        _compact_inputs,
        _compact_reference,
        rtol=1e-4,
        device_rtol=1e-4,
    ),
    KernelCase(
        "alpha.alpha_mse",
        lambda r, q: alpha.alpha_mse(r, q, 0.75),
        _outputs_pair,
        lambda r, q: ref.alpha(r, q, 0.75),
    ),
    KernelCase(
        "alpha.expert_outputs",
        alpha.expert_outputs,
        lambda rng: (_experts(rng)[0], *_experts(rng)[1]),
        ref.expert_ffn,
        rtol=1e-5,
        device_rtol=1e-4,
    ),
    KernelCase(
        "alpha.alpha_gaussian",
        lambda x, d, q: alpha.alpha_gaussian(x, d, q, 0.75),
        _experts,
        _gaussian_reference,
        device_rtol=1e-4,
    ),
    KernelCase(
        "ridge.normal_equations",
        ridge.normal_equations,
        _ridge_inputs,
        ref.normal_equations,
        device_rtol=1e-4,
    ),
    KernelCase(
        "ridge.eigen_solve",
        ridge.eigen_solve,
        _ridge_eigen_inputs,
        ref.eigen_solve,
        device_rtol=1e-4,
    ),
    KernelCase(
        "ridge.gram_quadratic",
        ridge.gram_quadratic,
        _ridge_eigen_inputs,
        ref.gram_quadratic,
        device_rtol=1e-4,
    ),
    KernelCase(
        "ridge.coefficients",
        ridge.coefficients,
        _ridge_coef_inputs,
        ref.coefficients,
        device_rtol=1e-4,
    ),
    KernelCase(
        "ridge.eigen_fit", ridge.eigen_fit, _ridge_fit_inputs, ref.eigen_fit, device_rtol=1e-4
    ),
    KernelCase(
        "ridge.fold_residual",
        ridge.fold_residual,
        _ridge_fold_inputs,
        ref.fold_residual,
        device_rtol=1e-4,
    ),
    KernelCase(
        "ridge.fold_leverage",
        lambda u, w, c, y: ridge.fold_leverage(u, w),
        _ridge_fold_inputs,
        lambda u, w, c, y: ref.fold_leverage(u, w),
    ),
    KernelCase(
        "ridge.fold_moments",
        lambda u, w, c, y: ridge.fold_moments(u, y),
        _ridge_fold_inputs,
        lambda u, w, c, y: ref.fold_moments(u, y),
    ),
)

__all__ = ["GAIN", "KERNEL_CASES"]
