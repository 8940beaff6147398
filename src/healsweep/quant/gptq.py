"""``quantizer: gptq``: each routed expert quantized with error feedback over its own inputs.

Per expert ``e`` of a layer the input second moment ``H_e = Σ x xᵀ`` is summed over the
calibration tokens routed to it (gate/up: the FFN input x; down: ``h = silu(x·Wgᵀ)·(x·Wuᵀ)`` of
that teacher expert), damped to ``H + λ·mean(diag H)·I`` (λ = knob ``gptq_damp``) and factored
on the host in float64 as ``H = V·D·Vᵀ`` (``V`` unit upper; one Cholesky, no inverse; Metal has
no Cholesky), and handed with the expert's weights to :func:`healsweep.kernels.gptq.quantize`
as the feedback ``V − I`` and the inverses of ``V``'s diagonal 64-blocks. Each 64-block's scale
search weighs its columns by the diagonal of the damped ``H_e`` (the expert's own ``Σx²``, i.e.
``act`` importance from this expert's tokens alone): that is the diagonal part of the error GPTQ
minimizes, so the block scale and the error feedback serve one objective. The ``importance``
knobs therefore act only on the experts that fall back to ``search``: those with fewer than
``min_tokens_per_expert`` routed tokens, and any whose damped ``H`` fails to factor (both
counted in the stage's report).

``gptq_refine`` (rounds, default 0) then improves each expert's result under the same damped
``H_e``: per round, exact coordinate descent over the codes (scales fixed), then the closed-form
block scales of every row (codes fixed; the small ``nb × nb`` systems solved here on the host, in
float64), each row keeping its lowest-objective state (:mod:`healsweep.kernels.gptq_refine`).

An expert with few routed rows (``n ≤ LOWRANK_SHARE·in``, as with small calibration budgets)
takes the low-rank path instead: its ``H = c·I + XᵀX`` has the feedback ``V − I = triu(Xᵀ·U)``
in terms of its ``n`` rows ``X`` (:func:`factor_rows`, ``O(in·n²)`` host work instead of a
``in³/3`` Cholesky; a group's experts batched in each numpy call, :func:`factor_row_stack`)
and :func:`healsweep.kernels.gptq.quantize_lowrank` gathers each block's
errors through the rows (``2·P`` products per weight for ``P`` padded rows instead of up to
``in``): the same codes up to float rounding.

Experts are processed in groups of at most ``GROUP`` (a path's last group padded with inert
repeats to a power of two: at most half of it is inert, and few shapes compile),
most-routed first so that a group's routed rows pad to a similar count; the host holds a few
``[n, n]`` matrices at a time and each kernel compiles once per shape. The host factors the next
group (dense: one matrix per thread, :mod:`healsweep.quant._lapack`; low-rank: the group's
experts batched, split over the same threads) while the device quantizes this one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels import gptq as gptq_kernel
from healsweep.kernels import gptq_refine as refine_kernel
from healsweep.kernels._precision import healing_jit
from healsweep.quant._lapack import cholesky_lower, one_blas_thread, threads_for_factoring

GROUP = 8  # experts per kernel call
LOWRANK_SHARE = 0.25  # low-rank path up to this many routed rows per input channel (docs/sizing.md)
_MIN_ROWS = 64  # routed rows are padded to a power of two of at least this many: few compiles
_HIGHEST = jax.lax.Precision.HIGHEST
SWEEPS = 2  # code-descent passes over the columns per refine round
_SYSTEM_FLOATS = 1 << 26  # bound on the [E, rows, in, nb] buffer of one scale_system call
QK = gptq_kernel.QK


@healing_jit
def _grams(x_rows: jax.Array) -> jax.Array:
    """``xᵀx`` [G, D, D] of each expert's (zero-padded) rows ``x_rows`` [G, P, D]."""
    return jnp.einsum("gpd,gpe->gde", x_rows, x_rows, precision=_HIGHEST)


def hidden_rows(x_rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, experts) -> jax.Array:
    """``h = silu(x·Wg[e]ᵀ)·(x·Wu[e]ᵀ)`` [G, P, F] of each expert ``e`` of ``experts`` [G] on its
    rows ``x_rows`` [G, P, D] (traced inside a caller's jit); zero rows give h = 0."""
    g = jnp.einsum("gpd,gfd->gpf", x_rows, w_gate[experts], precision=_HIGHEST)
    return jax.nn.silu(g) * jnp.einsum("gpd,gfd->gpf", x_rows, w_up[experts], precision=_HIGHEST)


@healing_jit
def _hidden_grams(x_rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, experts) -> jax.Array:
    """``hᵀh`` [G, F, F] of :func:`hidden_rows`."""
    h = hidden_rows(x_rows, w_gate, w_up, experts)
    return jnp.einsum("gpf,gpk->gfk", h, h, precision=_HIGHEST)


def _routed_mask(ids: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """[len(experts), T] bool: which tokens are routed to each expert."""
    return np.any(np.asarray(ids)[None, :, :] == np.asarray(experts)[:, None, None], axis=2)


def _routed_rows(x: np.ndarray, ids: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """[len(experts), P, D]: each expert's routed rows of ``x``, zero-padded to one power of two
    P of at least ``_MIN_ROWS`` (few compiles)."""
    rows = [np.nonzero(m)[0] for m in _routed_mask(ids, experts)]
    size = max(_MIN_ROWS, 1 << max(max(map(len, rows)) - 1, 0).bit_length())
    out = np.zeros((len(experts), size, x.shape[1]), np.float32)
    for o, r in zip(out, rows, strict=True):
        o[: len(r)] = x[r]
    return out


def _moments_on_device(x, ids, experts, gate_up) -> jax.Array:
    """:func:`second_moments` as a device array, dispatched without waiting."""
    x_rows = _routed_rows(np.asarray(x), np.asarray(ids), np.asarray(experts))
    if gate_up is None:
        return _grams(x_rows)
    return _hidden_grams(x_rows, *gate_up, jnp.asarray(experts, jnp.int32))


def second_moments(
    x: np.ndarray, ids: np.ndarray, experts: np.ndarray, gate_up: tuple | None = None
) -> np.ndarray:
    """``H_e = Σ x xᵀ`` [len(experts), n, n] float32 over the tokens routed to each expert (one
    device call for all of ``experts``). Symmetric up to the last bit: the factorization reads
    one triangle, and refine's damped ``H`` is symmetrized on the host (on the device the
    transposed read cost more than the product, ~0.85 s per group of 8 2048² matrices on a CPU).

    ``x`` [T, D] (the FFN input), ``ids`` [T, k]. With ``gate_up = (Wg [E, F, D], Wu [E, F, D])``
    the moments are those of the down projection's input ``h`` of each expert instead.
    """
    return np.asarray(_moments_on_device(x, ids, experts, gate_up))


class Factor(NamedTuple):
    """What GPTQ needs of one expert's second moment ``H`` [n, n] (see :func:`factor`)."""

    feedback: np.ndarray  # [n, n] float32, strictly upper: V − I
    block_inverse: np.ndarray  # [n/64, 64, 64] float32: inverses of V's diagonal 64-blocks
    importance: np.ndarray  # [n] float32: the damped H's diagonal, floored
    ok: bool  # the damped H factored
    damped: np.ndarray | None  # [n, n] float64, the damped H (for refine), when asked for


@cache
def _strict_upper(n: int) -> np.ndarray:
    return np.triu(np.ones((n, n), bool), 1)


def factor(
    h: np.ndarray, damp: float, keep_damped: bool = False, feedback: np.ndarray | None = None
) -> Factor:
    """:class:`Factor` of one symmetric ``h`` [n, n] damped to ``H + damp·mean(diag H)·I``.

    Host float64, one Cholesky (n³/3 flops, GIL-free, :func:`_lapack.cholesky_lower`, which
    reads the upper triangle of ``h``): with ``J`` the reversal and ``J·H·J = L̃L̃ᵀ``,
    ``H = RRᵀ`` for the upper ``R = J·L̃·J``, and ``V = R·diag(R)⁻¹``. A matrix that is not finite or not positive definite even after
    damping gives ``ok`` False, zero feedback and identity block inverses (the kernel then
    rounds as the plain search does; the caller falls back). ``feedback``: an [n, n] float32
    array to write the feedback into (a slice of the group's stack: no copies).
    """
    n = len(h)
    reversed_h = np.array(h[::-1, ::-1], np.float64)  # J·H·J, a C-contiguous copy
    diagonal = np.einsum("ii->i", reversed_h)
    diagonal += _damping(h, damp)  # in place, on the diagonal only
    importance = diagonal[::-1].copy()
    top = importance.max(initial=0.0)
    importance = np.maximum(importance, top * 1e-6 if top > 0 else 1.0).astype(np.float32)
    damped = None
    if keep_damped:  # exactly symmetric, as refine's objective takes it
        damped = reversed_h[::-1, ::-1].copy()
        damped += damped.T
        damped *= 0.5
    feedback = np.empty((n, n), np.float32) if feedback is None else feedback
    failed = Factor(
        feedback,
        np.broadcast_to(np.eye(QK, dtype=np.float32), (n // QK, QK, QK)),
        importance,
        False,
        damped,
    )
    if not np.all(np.isfinite(reversed_h)) or cholesky_lower(reversed_h) != 0:
        feedback[...] = 0.0
        return failed
    upper = reversed_h[::-1, ::-1]  # R in its upper triangle (below it: the input, unused)
    pivots = np.einsum("ii->i", upper).copy()
    np.divide(upper, pivots, out=feedback, casting="same_kind")  # V in float64, stored float32
    np.multiply(feedback, _strict_upper(n), out=feedback)  # V − I
    blocks = np.stack([np.triu(upper[a : a + QK, a : a + QK]) for a in range(0, n, QK)])
    block_inverse = np.linalg.inv(blocks / pivots.reshape(-1, 1, QK))  # of V's diagonal blocks
    if not (np.all(np.isfinite(feedback)) and np.all(np.isfinite(block_inverse))):
        feedback[...] = 0.0
        return failed
    return Factor(feedback, block_inverse.astype(np.float32), importance, True, damped)


class Prepared(NamedTuple):
    """The factors of one group's second moments, stacked, computed once for every stack that
    reads the same input (see :class:`Factor`)."""

    feedback: np.ndarray  # [G, n, n] float32
    block_inverse: np.ndarray  # [G, n/64, 64, 64] float32
    importance: np.ndarray  # [G, n] float32
    ok: np.ndarray  # [G] bool
    damped: np.ndarray | None  # [G, n, n] float64 (refine takes it to the device as float32)


def _stacked(factors: list[Factor], feedback: np.ndarray | None = None) -> Prepared:
    """The factors stacked; ``feedback``: the stack their feedback was written into."""
    damped = None if factors[0].damped is None else np.stack([f.damped for f in factors])
    return Prepared(
        np.stack([f.feedback for f in factors]) if feedback is None else feedback,
        np.stack([f.block_inverse for f in factors]),
        np.stack([f.importance for f in factors]),
        np.array([f.ok for f in factors]),
        damped,
    )


def prepare(hessians: np.ndarray, damp: float, keep_damped: bool = True) -> Prepared:
    """:class:`Prepared` of ``hessians`` [G, n, n] at ``damp`` (host, float64 inside)."""
    return _stacked([factor(h, damp, keep_damped) for h in hessians])


def _damping(h: np.ndarray, damp: float) -> float:
    """``damp·mean(diag H)`` of one matrix, in float64."""
    return damp * float(np.mean(np.einsum("ii->i", h), dtype=np.float64))


def damped(h: np.ndarray, damp: float) -> np.ndarray:
    """``H + damp·mean(diag H)·I`` per matrix of the symmetric ``h`` [G, n, n], float32."""
    out = np.array(h, np.float64)
    for m, source in zip(out, h, strict=True):
        np.einsum("ii->i", m)[...] += _damping(source, damp)
    return out.astype(np.float32)


class RowFactor(NamedTuple):
    """What the low-rank GPTQ needs of one expert whose ``H = XᵀX`` has fewer rows ``X``
    [m, n] than columns (see :func:`factor_rows`); from :func:`factor_row_stack`, every field
    has a leading axis of experts (``ok`` a bool array)."""

    u: np.ndarray  # [P, n] float32: column k is (c·I + Σ_{i≥k} x_i x_iᵀ)⁻¹ x_k, 0 below m
    block_feedback: np.ndarray  # [n/64, 64, 64] float32: V − I inside each diagonal 64-block
    block_inverse: np.ndarray  # [n/64, 64, 64] float32: inverses of V's diagonal 64-blocks
    importance: np.ndarray  # [n] float32: the damped H's diagonal, floored
    ok: bool  # the damped H factored
    damped: np.ndarray | None  # [n, n] float64, the damped H (for refine), when asked for


def _importance(diagonal: np.ndarray) -> np.ndarray:
    """The damped ``H``'s diagonal floored at 1e-6 of its largest entry (1 where all are 0)."""
    top = diagonal.max(initial=0.0)
    return np.maximum(diagonal, top * 1e-6 if top > 0 else 1.0).astype(np.float32)


def _unit_upper(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(V, diag D, ok)`` with ``a = V·D·Vᵀ``, ``V`` unit upper, of each symmetric ``a``
    [G, k, k] (float64, GIL-free LAPACK one matrix at a time); where a matrix does not
    factor, ``ok`` is False and its ``V`` and ``D`` are the identity's."""
    reversed_a = np.array(a[:, ::-1, ::-1], np.float64)  # J·A·J, C-contiguous
    ok = np.array([cholesky_lower(m) == 0 for m in reversed_a])
    upper = np.triu(reversed_a[:, ::-1, ::-1])  # R with A = R·Rᵀ
    upper[~ok] = np.eye(a.shape[1])
    pivots = np.einsum("gii->gi", upper)
    return upper / pivots[:, None, :], pivots * pivots, ok


def factor_row_stack(rows: np.ndarray, damp: float, keep_damped: bool = False) -> RowFactor:
    """:class:`RowFactor` of ``H_g = X_gᵀX_g`` for each expert's rows ``X_g`` of ``rows``
    [G, P, n] (zero rows are inert: pad each expert's with them), damped to ``H + c·I``,
    ``c = damp·mean(diag H)`` as :func:`factor` damps: the same ``V`` in factored form, in
    ``O(n·P²)`` host float64 work instead of :func:`factor`'s ``O(n³)``. Every field has a
    leading ``G`` axis (``ok`` [G] bool); ``u`` is [G, P, n].

    With ``M_k = c·I + Σ_{i>k} x_i x_iᵀ`` ([P, P], ``x_i`` column ``i`` of ``X``), the
    ``V`` of ``H + c·I = V·D·Vᵀ`` is ``V_jk = x_jᵀ u_k`` for ``j < k``, ``u_k =
    M_{k−1}⁻¹ x_k`` (the Schur complement of the columns after ``k`` is ``c·I + c·Xᵀ M_k⁻¹ X``).
    Blocks of 64 columns are taken from the last: for block ``b`` and ``M`` of the columns after
    it, ``S_b = c·(I + X_bᵀ M⁻¹ X_b)`` is the Schur complement whose factor ``V_bb·D_b·V_bbᵀ``
    is ``V``'s diagonal block, ``U_b = c·M⁻¹X_b·V_bb⁻ᵀ·D_b⁻¹``, and ``M⁻¹`` takes the block's
    columns by Woodbury, ``M⁻¹ − U_b·D_b·U_bᵀ/c`` (in exact arithmetic ``M`` only grows: its
    inverse stays between ``0`` and ``I/c``). Each step is a product of ``[P, P]`` and
    ``[P, 64]`` matrices and one 64² factorization per expert, the experts batched in each
    numpy call (one Python step per block for the whole group).
    """
    x = np.asarray(rows, np.float64)
    n_exp, size, n = x.shape
    column_sq = np.einsum("gij,gij->gj", x, x)  # diag(XᵀX)
    c = damp * column_sq.mean(axis=1)  # [G]
    importance = np.stack([_importance(sq + c_g) for sq, c_g in zip(column_sq, c, strict=True)])
    damped = None
    if keep_damped:
        damped = np.matmul(x.transpose(0, 2, 1), x)
        np.einsum("gii->gi", damped)[...] += c[:, None]
    ok = (c > 0) & np.isfinite(c)
    scale = np.where(ok, c, 1.0)[:, None, None]  # c, [G, 1, 1] (1 where it is unusable)
    nb = n // QK
    u = np.zeros((n_exp, size, n), np.float32)
    feedback = np.zeros((n_exp, nb, QK, QK), np.float32)
    identity = np.eye(QK)
    inverse = np.empty((n_exp, nb, QK, QK), np.float32)
    m_inverse = np.eye(size) / scale  # [G, P, P]
    with np.errstate(all="ignore"):  # an expert that fails is reported, its garbage dropped
        for b in range(nb - 1, -1, -1):
            x_b = np.ascontiguousarray(x[:, :, b * QK : (b + 1) * QK])  # [G, P, 64]
            y = m_inverse @ x_b
            schur = x_b.transpose(0, 2, 1) @ y
            schur += schur.transpose(0, 2, 1)  # symmetric to the last bit; c·(I + X_bᵀM⁻¹X_b)
            schur *= 0.5 * scale
            np.einsum("gii->gi", schur)[...] += scale[:, :, 0]
            v, pivots, factored = _unit_upper(schur)
            ok &= factored
            v_inverse = np.linalg.inv(v)
            u_b = (scale * y) @ v_inverse.transpose(0, 2, 1) / pivots[:, None, :]  # [G, P, 64]
            m_inverse -= (u_b * (pivots / scale[:, :, 0])[:, None, :]) @ u_b.transpose(0, 2, 1)
            u[:, :, b * QK : (b + 1) * QK] = u_b
            feedback[:, b] = v - identity
            inverse[:, b] = v_inverse
    ok &= np.all(np.isfinite(u), axis=(1, 2)) & np.all(np.isfinite(inverse), axis=(1, 2, 3))
    u[~ok], feedback[~ok], inverse[~ok] = 0.0, 0.0, identity
    return RowFactor(u, feedback, inverse, importance, ok, damped)


def factor_rows(rows: np.ndarray, damp: float, size: int, keep_damped: bool = False) -> RowFactor:
    """:func:`factor_row_stack` of one expert's rows ``X`` [m, n] (``m ≤ size``): ``u`` is
    [size, n], zero below row ``m``; ``ok`` a bool."""
    x = np.zeros((1, size, rows.shape[1]), np.float64)
    x[0, : len(rows)] = rows
    found = factor_row_stack(x, damp, keep_damped)
    fields = (None if f is None else f[0] for f in found)
    return RowFactor(*fields)._replace(ok=bool(found.ok[0]))


def solve_scales(a: np.ndarray, b: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The block scales [..., nb] float16 solving ``a·d = b`` per row (host, float64).

    ``a`` [..., nb, nb], ``b`` [..., nb] from :func:`scale_system`; a block whose codes are all 0
    has a zero row and column and keeps its scale ``d`` (it holds only zeros either way); a row
    whose solution is not finite in float16 keeps all of ``d``.
    """
    a = np.array(a, np.float64)
    b = np.array(b, np.float64)
    d = np.asarray(d)
    empty = np.einsum("...ii->...i", a) <= 0  # all-zero codes: Qᵀ H Q has a zero diagonal entry
    a[empty] = 0.0
    np.einsum("...ii->...i", a)[...] += empty
    b = np.where(empty, d.astype(np.float64), b)
    with np.errstate(all="ignore"):
        try:
            new = np.linalg.solve(a, b[..., None])[..., 0]
        except np.linalg.LinAlgError:
            return d
        new16 = new.astype(np.float16)
    bad = ~np.all(np.isfinite(new16.astype(np.float32)), axis=-1, keepdims=True)
    return np.where(bad, d, new16)


def refine(w, h: np.ndarray, d: np.ndarray, q: np.ndarray, rounds: int):
    """``rounds`` of code descent and scale refit of ``(d, q)`` under the damped ``h`` [G, in, in]
    (from :func:`damped` or :func:`prepare`; used in float32). Each row keeps its
    lowest-objective state, so no row ends above its start. Returns ``(d float16, q int8)`` of the shapes given."""
    w = jnp.asarray(w, jnp.float32)
    h_dev = jnp.asarray(h, jnp.float32)
    n_exp, n_out, n_in = w.shape
    rows = max(1, _SYSTEM_FLOATS // (n_exp * n_in * (n_in // 64)))
    best_d, best_q = np.array(d, np.float16), np.array(q, np.int8)
    best = np.array(refine_kernel.row_objective(w, h_dev, best_d, best_q))
    d, q = best_d.copy(), best_q.copy()
    for _ in range(rounds):
        q = np.array(refine_kernel.code_descent(w, h_dev, d, q, sweeps=SWEEPS))
        for a in range(0, n_out, rows):
            sys_a, sys_b = refine_kernel.scale_system(w[:, a : a + rows], h_dev, q[:, a : a + rows])
            d[:, a : a + rows] = solve_scales(
                np.asarray(sys_a), np.asarray(sys_b), d[:, a : a + rows]
            )
        found = np.asarray(refine_kernel.row_objective(w, h_dev, d, q))
        better = found < best
        best_d[better], best_q[better], best[better] = d[better], q[better], found[better]
    return best_d, best_q


def quantize_stack(
    w,
    hessians: np.ndarray,
    gain: float,
    damp: float,
    rounds: int = 0,
    prepared: Prepared | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ Q2_0 of ``w`` [G, out, in] (device or numpy) with second moments ``hessians``
    [G, in, in], then ``rounds`` of :func:`refine`. Returns ``(d [G, out, in/64] float16,
    q [G, out, in] int8, ok [G] bool)``; rows with ``ok`` False are not valid (their ``H`` did
    not factor; the caller falls back). ``prepared``: :func:`prepare` of ``hessians`` at
    ``damp`` when the caller has it already (stacks that share their input)."""
    p = prepared if prepared is not None else prepare(hessians, damp, keep_damped=rounds > 0)
    found = gptq_kernel.quantize(w, p.feedback, p.block_inverse, p.importance, gain)
    d, q = (np.asarray(a) for a in found)
    if rounds:
        d, q = refine(w, p.damped, d, q, rounds)
    return d, q, p.ok


def _by_routed_rows(ids: np.ndarray, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions into ``experts``, the most-routed expert first (stable among equals), and
    each one's routed-row count in that order."""
    counts = _routed_mask(ids, experts).sum(axis=1)
    order = np.argsort(-counts, kind="stable")
    return order, counts[order]


@healing_jit
def _hidden_rows(x_rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, experts) -> jax.Array:
    """``h = silu(x·Wg[e]ᵀ)·(x·Wu[e]ᵀ)`` [G, P, F] of each expert's rows ``x_rows`` [G, P, D];
    zero rows give h = 0."""
    g = jnp.einsum("gpd,gfd->gpf", x_rows, w_gate[experts], precision=_HIGHEST)
    return jax.nn.silu(g) * jnp.einsum("gpd,gfd->gpf", x_rows, w_up[experts], precision=_HIGHEST)


class RowsPrepared(NamedTuple):
    """The low-rank factors of one group, stacked (see :class:`RowFactor`)."""

    rows: jax.Array | np.ndarray  # [G, P, n] float32: each expert's routed rows, zero-padded
    u: np.ndarray  # [G, P, n] float32
    block_feedback: np.ndarray  # [G, n/64, 64, 64] float32
    block_inverse: np.ndarray  # [G, n/64, 64, 64] float32
    importance: np.ndarray  # [G, n] float32
    ok: np.ndarray  # [G] bool
    damped: np.ndarray | None  # [G, n, n] float64


def _dispatch(low_rank: bool, members, x, ids, gate_up):
    """A group's inputs: dense, its second moments (device); low-rank, its rows (the FFN
    input's on the host, the down projection's ``h`` on the device). Returns without waiting."""
    if not low_rank:
        return _moments_on_device(x, ids, members, gate_up)
    x_rows = _routed_rows(np.asarray(x), np.asarray(ids), members)
    if gate_up is None:
        return x_rows
    return _hidden_rows(x_rows, *gate_up, jnp.asarray(members, jnp.int32))


def _factor_jobs(pool, low_rank: bool, inputs, counts, damp: float, keep_damped: bool):
    """Host factorizations of a group's first ``len(counts)`` experts (the rest are inert
    repeats of the first), queued on ``pool``; returns a function that waits and stacks them
    (:class:`Prepared` or :class:`RowsPrepared`)."""
    host = np.asarray(inputs)
    n_slots, n = len(host), len(counts)
    if low_rank:  # the group's experts in one batched factorization per thread
        parts = np.array_split(np.arange(n), min(n, threads_for_factoring(GROUP)))
        jobs = [pool.submit(factor_row_stack, host[part], damp, keep_damped) for part in parts]

        def rows_done() -> RowsPrepared:
            done = [j.result() for j in jobs]
            repeats = np.zeros(n_slots - n, int)  # inert slots repeat the first expert

            def stacked(field: str):
                found = np.concatenate([getattr(f, field) for f in done])
                return np.concatenate([found, found[repeats]])

            damped = None if done[0].damped is None else stacked("damped")
            fields = (stacked(k) for k in RowFactor._fields[:5])
            return RowsPrepared(inputs, *fields, damped)

        return rows_done
    slots = np.empty(host.shape, np.float32)  # the feedback is written here: no copies
    own = zip(host[:n], slots[:n], strict=True)
    jobs = [pool.submit(factor, m, damp, keep_damped, s) for m, s in own]

    def dense_done() -> Prepared:
        done = [j.result() for j in jobs]
        slots[n:] = slots[0]
        return _stacked(done + done[:1] * (n_slots - n), slots)

    return dense_done


def _kernel(w, p: Prepared | RowsPrepared, gain: float, idx: np.ndarray):
    """The GPTQ kernel of ``w[idx]`` down ``p``'s path (device arrays, not waited for)."""
    if isinstance(p, RowsPrepared):
        return gptq_kernel.quantize_lowrank(
            w, p.rows, p.u, p.block_feedback, p.block_inverse, p.importance, gain, idx
        )
    return gptq_kernel.quantize(w, p.feedback, p.block_inverse, p.importance, gain, idx)


def quantize_experts(
    stacks,
    x: np.ndarray,
    ids: np.ndarray,
    experts: np.ndarray,
    gain: float,
    damp: float,
    gate_up: tuple | None = None,
    rounds: int = 0,
    low_rank_share: float | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """GPTQ Q2_0 of the ``experts`` of each stack [E, out, in] of ``stacks`` (stacks that read
    the same input, as gate and up do: one ``H_e`` and one factorization serve all of them), in
    groups of ``GROUP``, each refined by ``rounds`` of :func:`refine`.

    Returns per stack ``(d [len(experts), out, in/64] float16, q [len(experts), out, in] int8)``,
    and ``ok`` [len(experts)] (the expert's ``H`` factored).

    An expert with at most ``low_rank_share·in`` routed rows (default :data:`LOWRANK_SHARE`)
    takes the low-rank path (:func:`factor_rows`), the others the dense one (:func:`factor`):
    the same codes up to float rounding, at the cost of the smaller. A pipeline: the next
    group's inputs are dispatched to the device before this group's kernel, then factored on
    the host (dense: one expert per thread; low-rank: batched) while the device runs it.
    """
    experts = np.asarray(experts)
    share = LOWRANK_SHARE if low_rank_share is None else low_rank_share
    out = [
        (
            np.zeros((len(experts), w.shape[1], w.shape[2] // QK), np.float16),
            np.zeros((len(experts), w.shape[1], w.shape[2]), np.int8),
        )
        for w in stacks
    ]
    ok = np.zeros(len(experts), bool)
    order, counts = _by_routed_rows(ids, experts)
    low = counts <= share * stacks[0].shape[2]  # the most-routed first: dense, then low-rank
    groups = [
        (bool(low_rank), order[part][a : a + GROUP], counts[part][a : a + GROUP])
        for low_rank, part in ((False, ~low), (True, low))
        for a in range(0, int(part.sum()), GROUP)
    ]
    if not groups:
        return out, ok

    def padded(group: np.ndarray) -> np.ndarray:  # inert repeats: few shapes, little waste
        size = len(group) if len(experts) <= GROUP else 1 << (len(group) - 1).bit_length()
        return np.concatenate([group, np.repeat(group[:1], size - len(group))])

    def dispatched(i: int):
        low_rank, group, _ = groups[i]
        return _dispatch(low_rank, experts[padded(group)], x, ids, gate_up)

    with ThreadPoolExecutor(threads_for_factoring(GROUP), initializer=one_blas_thread) as pool:

        def queued(i: int, inputs):
            low_rank, _, group_counts = groups[i]
            return _factor_jobs(pool, low_rank, inputs, group_counts, damp, rounds > 0)

        pending = queued(0, dispatched(0))
        for i, (_, group, _) in enumerate(groups):
            if i + 1 < len(groups):  # queued ahead of this group's kernel
                inputs = dispatched(i + 1)
            p = pending()
            idx = experts[padded(group)]
            found = [_kernel(w, p, gain, idx) for w in stacks]
            if i + 1 < len(groups):
                pending = queued(i + 1, inputs)
            n = len(group)
            ok[group] = p.ok[:n]
            for w, (d, q), result in zip(stacks, out, found, strict=True):
                d_g, q_g = (np.asarray(a) for a in result)
                if rounds:
                    d_g, q_g = refine(w[idx], p.damped, d_g, q_g, rounds)
                d[group], q[group] = d_g[:n], q_g[:n]
    return out, ok
