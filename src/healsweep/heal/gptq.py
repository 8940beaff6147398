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

Experts are processed in groups of at most ``GROUP`` (the last group padded with inert repeats),
most-routed first so that a group's routed rows pad to a similar count; the host holds a few
``[n, n]`` matrices at a time and each kernel compiles once per shape. The host factors the next
group (one matrix per thread, :mod:`healsweep.heal._lapack`) while the device quantizes this one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.heal._lapack import cholesky_lower, one_blas_thread, threads_for_factoring
from healsweep.kernels import gptq as gptq_kernel
from healsweep.kernels import gptq_refine as refine_kernel
from healsweep.kernels._precision import healing_jit

GROUP = 8  # experts per kernel call
_MIN_ROWS = 64  # routed rows are padded to a power of two of at least this many: few compiles
_HIGHEST = jax.lax.Precision.HIGHEST
SWEEPS = 2  # code-descent passes over the columns per refine round
_SYSTEM_FLOATS = 1 << 26  # bound on the [E, rows, in, nb] buffer of one scale_system call
QK = gptq_kernel.QK


@healing_jit
def _grams(x_rows: jax.Array) -> jax.Array:
    """``xᵀx`` [G, D, D] of each expert's (zero-padded) rows ``x_rows`` [G, P, D]."""
    return jnp.einsum("gpd,gpe->gde", x_rows, x_rows, precision=_HIGHEST)


@healing_jit
def _hidden_grams(x_rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, experts) -> jax.Array:
    """``hᵀh`` [G, F, F] with ``h = silu(x·Wg[e]ᵀ)·(x·Wu[e]ᵀ)`` per expert ``e`` of ``experts``
    [G]; zero rows give h = 0."""
    g = jnp.einsum("gpd,gfd->gpf", x_rows, w_gate[experts], precision=_HIGHEST)
    h = jax.nn.silu(g) * jnp.einsum("gpd,gfd->gpf", x_rows, w_up[experts], precision=_HIGHEST)
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


def _by_routed_rows(ids: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """Positions into ``experts``, the most-routed expert first (stable among equals)."""
    counts = _routed_mask(ids, experts).sum(axis=1)
    return np.argsort(-counts, kind="stable")


def quantize_experts(
    stacks,
    x: np.ndarray,
    ids: np.ndarray,
    experts: np.ndarray,
    gain: float,
    damp: float,
    gate_up: tuple | None = None,
    rounds: int = 0,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """GPTQ Q2_0 of the ``experts`` of each stack [E, out, in] of ``stacks`` (stacks that read
    the same input, as gate and up do: one ``H_e`` and one factorization serve all of them), in
    groups of ``GROUP``, each refined by ``rounds`` of :func:`refine`.

    Returns per stack ``(d [len(experts), out, in/64] float16, q [len(experts), out, in] int8)``,
    and ``ok`` [len(experts)] (the expert's ``H`` factored).

    A pipeline: the next group's second moments are dispatched to the device before this
    group's kernel, then factored on the host (one matrix per thread) while the device runs it.
    """
    experts = np.asarray(experts)
    out = [
        (
            np.zeros((len(experts), w.shape[1], w.shape[2] // QK), np.float16),
            np.zeros((len(experts), w.shape[1], w.shape[2]), np.int8),
        )
        for w in stacks
    ]
    ok = np.zeros(len(experts), bool)
    order = _by_routed_rows(ids, experts)
    groups = [order[a : a + GROUP] for a in range(0, len(order), GROUP)]
    if not groups:
        return out, ok

    def padded(group: np.ndarray) -> np.ndarray:  # inert repeats: one shape for every group
        pad = GROUP - len(group) if len(experts) > GROUP else 0
        return np.concatenate([group, np.repeat(group[:1], pad)])

    with ThreadPoolExecutor(threads_for_factoring(GROUP), initializer=one_blas_thread) as pool:

        def factored(moments: jax.Array, group: np.ndarray) -> tuple[list, np.ndarray]:
            h = np.asarray(moments)
            slots = np.empty((len(padded(group)), *h.shape[1:]), np.float32)
            own = zip(h, slots[: len(h)], strict=True)
            return [pool.submit(factor, m, damp, rounds > 0, s) for m, s in own], slots

        moments = _moments_on_device(x, ids, experts[groups[0]], gate_up)
        factors, slots = factored(moments, groups[0])
        for i, group in enumerate(groups):
            if i + 1 < len(groups):  # queued ahead of this group's kernel
                moments = _moments_on_device(x, ids, experts[groups[i + 1]], gate_up)
            done = [f.result() for f in factors]
            slots[len(group) :] = slots[0]  # the inert repeats
            p = _stacked(done + done[:1] * (len(slots) - len(group)), slots)
            idx = experts[padded(group)]
            found = [
                gptq_kernel.quantize(w, p.feedback, p.block_inverse, p.importance, gain, idx)
                for w in stacks
            ]
            if i + 1 < len(groups):
                factors, slots = factored(moments, groups[i + 1])
            n = len(group)
            ok[group] = p.ok[:n]
            for w, (d, q), result in zip(stacks, out, found, strict=True):
                d_g, q_g = (np.asarray(a) for a in result)
                if rounds:
                    d_g, q_g = refine(w[idx], p.damped, d_g, q_g, rounds)
                d[group], q[group] = d_g[:n], q_g[:n]
    return out, ok
