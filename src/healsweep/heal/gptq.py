"""``quantizer: gptq``: each routed expert quantized with error feedback over its own inputs.

Per expert ``e`` of a layer the input second moment ``H_e = Σ x xᵀ`` is summed over the
calibration tokens routed to it (gate/up: the FFN input x; down: ``h = silu(x·Wgᵀ)·(x·Wuᵀ)`` of
that teacher expert), damped to ``H + λ·mean(diag H)·I`` (λ = knob ``gptq_damp``), inverted and
factored on the host in float64 (``H⁻¹ = uᵀu``, ``u`` upper; Metal has no Cholesky), and handed
with the expert's weights to :func:`healsweep.kernels.gptq.quantize`. Each 64-block's scale search
weighs its columns by the diagonal of the damped ``H_e`` (the expert's own ``Σx²``, i.e. ``act``
importance from this expert's tokens alone): that is the diagonal part of the error GPTQ
minimizes, so the block scale and the error feedback serve one objective. The ``importance``
knobs therefore act only on the experts that fall back to ``search``: those with fewer than
``min_tokens_per_expert`` routed tokens, and any whose damped ``H`` fails to factor (both
counted in the stage's report).

``gptq_refine`` (rounds, default 0) then improves each expert's result under the same damped
``H_e``: per round, exact coordinate descent over the codes (scales fixed), then the closed-form
block scales of every row (codes fixed; the small ``nb × nb`` systems solved here on the host, in
float64), each row keeping its lowest-objective state (:mod:`healsweep.kernels.gptq_refine`).

Experts are processed in groups of at most ``GROUP`` (the last group padded with inert experts),
so the host holds a few ``[n, n]`` matrices at a time and the kernel compiles once per shape.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels import gptq as gptq_kernel
from healsweep.kernels import gptq_refine as refine_kernel
from healsweep.kernels._precision import healing_jit

GROUP = 8  # experts per kernel call
_MIN_ROWS = 256  # routed rows are padded to a power of two of at least this many: few compiles
_HIGHEST = jax.lax.Precision.HIGHEST
SWEEPS = 2  # code-descent passes over the columns per refine round
_SYSTEM_FLOATS = 1 << 26  # bound on the [E, rows, in, nb] buffer of one scale_system call


@healing_jit
def _grams(x_rows: jax.Array) -> jax.Array:
    """``xᵀx`` [G, D, D] of each expert's (zero-padded) rows ``x_rows`` [G, P, D]."""
    return _symmetric(jnp.einsum("gpd,gpe->gde", x_rows, x_rows, precision=_HIGHEST))


@healing_jit
def _hidden_grams(x_rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, experts) -> jax.Array:
    """``hᵀh`` [G, F, F] with ``h = silu(x·Wg[e]ᵀ)·(x·Wu[e]ᵀ)`` per expert ``e`` of ``experts``
    [G]; zero rows give h = 0."""
    g = jnp.einsum("gpd,gfd->gpf", x_rows, w_gate[experts], precision=_HIGHEST)
    h = jax.nn.silu(g) * jnp.einsum("gpd,gfd->gpf", x_rows, w_up[experts], precision=_HIGHEST)
    return _symmetric(jnp.einsum("gpf,gpk->gfk", h, h, precision=_HIGHEST))


def _symmetric(g: jax.Array) -> jax.Array:
    """``(G + Gᵀ)/2`` per matrix: exactly symmetric, as the host's factorization and the refine
    objective take it (done here, where the transpose is free; on the host it cost ~30 ms per
    2048² matrix)."""
    return 0.5 * (g + jnp.swapaxes(g, 1, 2))


def _routed_rows(x: np.ndarray, ids: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """[len(experts), P, D]: each expert's routed rows of ``x``, zero-padded to one power of two
    P of at least ``_MIN_ROWS`` (few compiles)."""
    rows = [np.nonzero(np.any(ids == e, axis=1))[0] for e in experts]
    size = max(_MIN_ROWS, 1 << max(max(map(len, rows)) - 1, 0).bit_length())
    out = np.zeros((len(experts), size, x.shape[1]), np.float32)
    for o, r in zip(out, rows, strict=True):
        o[: len(r)] = x[r]
    return out


def second_moments(
    x: np.ndarray, ids: np.ndarray, experts: np.ndarray, gate_up: tuple | None = None
) -> np.ndarray:
    """``H_e = Σ x xᵀ`` [len(experts), n, n] float32, exactly symmetric, over the tokens routed
    to each expert (one device call for all of ``experts``).

    ``x`` [T, D] (the FFN input), ``ids`` [T, k]. With ``gate_up = (Wg [E, F, D], Wu [E, F, D])``
    the moments are those of the down projection's input ``h`` of each expert instead.
    """
    x_rows = _routed_rows(np.asarray(x), np.asarray(ids), np.asarray(experts))
    if gate_up is None:
        return np.asarray(_grams(x_rows))
    return np.asarray(_hidden_grams(x_rows, *gate_up, jnp.asarray(experts, jnp.int32)))


def inverse_factor(h: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """Upper ``u`` with ``uᵀu = (H + damp·mean(diag H)·I)⁻¹`` per matrix of ``h`` [G, n, n].

    Host float64, two triangular LAPACK calls (2n³/3 flops): with ``J`` the reversal and
    ``J·H·J = L̃L̃ᵀ``, ``H = RRᵀ`` for the upper ``R = J·L̃·J``, so ``H⁻¹ = R⁻ᵀR⁻¹`` and
    ``u = R⁻¹ = J·L̃⁻¹·J``. Returns ``(u [G, n, n] float32, ok [G] bool)``; a matrix that does
    not factor (not positive definite even after damping) has ``ok`` False and ``u = I``.
    """
    return _inverse_factor(_damped64(h, damp))


def _inverse_factor(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`inverse_factor` of the already damped float64 ``h`` [G, n, n].

    LAPACK works in place on a reversed copy read as a Fortran array (the transpose of a
    symmetric matrix is itself), in its ``upper`` mode: ``J·H·J = UᵀU`` with ``U = L̃ᵀ``, and
    ``U⁻¹`` read back in C order is ``L̃⁻¹``; no transposing copies.
    """
    from scipy.linalg import lapack

    u = np.zeros(h.shape, np.float32)
    ok = np.zeros(h.shape[0], bool)
    for g, hg in enumerate(h):
        if not np.all(np.isfinite(hg)):
            continue
        reversed_h = hg[::-1, ::-1].copy()
        upper, info = lapack.dpotrf(reversed_h.T, lower=0, clean=1, overwrite_a=1)
        if info != 0:
            continue
        upper_inv, info = lapack.dtrtri(upper, lower=0, overwrite_c=1)
        lower_inv = upper_inv.T  # L̃⁻¹; its upper part stays clean's zeros
        if info != 0 or not np.all(np.isfinite(lower_inv)):
            continue
        u[g] = lower_inv[::-1, ::-1]
        ok[g] = True
    u[~ok] = np.eye(h.shape[-1], dtype=np.float32)
    return u, ok


def _damped64(h: np.ndarray, damp: float) -> np.ndarray:
    """``H + damp·mean(diag H)·I`` per matrix of the symmetric ``h`` [G, n, n], float64 (the
    damping added in place on the diagonal: no [n, n] temporaries)."""
    out = np.array(h, np.float64)
    for m in out:
        np.einsum("ii->i", m)[...] += damp * (np.einsum("ii->", m) / len(m))
    return out


def damped(h: np.ndarray, damp: float) -> np.ndarray:
    """``H + damp·mean(diag H)·I`` per matrix of the symmetric ``h`` [G, n, n], float32."""
    return _damped64(h, damp).astype(np.float32)


class Prepared(NamedTuple):
    """What GPTQ needs of one group's second moments, computed once for every stack that reads
    the same input: the factor ``u`` with ``ok``, the damped diagonal as block importance, and
    the damped ``H`` for :func:`refine`."""

    u: np.ndarray  # [G, n, n] float32
    ok: np.ndarray  # [G] bool
    importance: np.ndarray  # [G, n] float32
    damped: np.ndarray  # [G, n, n] float64 (refine takes it to the device as float32)


def prepare(hessians: np.ndarray, damp: float) -> Prepared:
    """:class:`Prepared` of ``hessians`` [G, n, n] at ``damp`` (host, float64 inside)."""
    h = _damped64(hessians, damp)
    importance = np.einsum("gii->gi", h)  # the damped H's diagonal
    top = importance.max(axis=1, keepdims=True)
    importance = np.maximum(importance, np.where(top > 0, top * 1e-6, 1.0))
    return Prepared(*_inverse_factor(h), importance.astype(np.float32), h)


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
    p = prepared if prepared is not None else prepare(hessians, damp)
    d, q = gptq_kernel.quantize(jnp.asarray(w), p.u, p.importance, jnp.float32(gain))
    d, q = np.asarray(d), np.asarray(q)
    if rounds:
        d, q = refine(w, p.damped, d, q, rounds)
    return d, q, p.ok


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
    """
    out = [
        (
            np.zeros((len(experts), w.shape[1], w.shape[2] // 64), np.float16),
            np.zeros((len(experts), w.shape[1], w.shape[2]), np.int8),
        )
        for w in stacks
    ]
    ok = np.zeros(len(experts), bool)
    for a in range(0, len(experts), GROUP):
        group = np.asarray(experts[a : a + GROUP])
        h = second_moments(x, ids, group, gate_up)
        pad = GROUP - len(group) if len(experts) > GROUP else 0
        idx = np.concatenate([group, np.repeat(group[:1], pad)])  # inert repeats: one shape
        h = np.concatenate([h, np.repeat(h[:1], pad, axis=0)])
        prepared = prepare(h, damp)
        n = len(group)
        ok[a : a + n] = prepared.ok[:n]
        for w, (d, q) in zip(stacks, out, strict=True):
            d_g, q_g, _ = quantize_stack(w[idx], h, gain, damp, rounds, prepared)
            d[a : a + n], q[a : a + n] = d_g[:n], q_g[:n]
    return out, ok
