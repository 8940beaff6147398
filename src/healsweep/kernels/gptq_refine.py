"""``gptq_refine``: improve a Q2_0 quantization under the objective GPTQ minimizes, in rounds.

The objective of a row ``w`` [in] with values ``v = q·d`` (``q`` codes, ``d`` one scale per
64-block) is ``(w − v)ᵀ H (w − v)``, ``H`` the damped input second moment of its expert. GPTQ
rounds each column once, greedily. A round here does two exact minimizations, each of which can
only lower the objective:

1. **code descent** (:func:`code_descent`): the scales fixed, every column in turn gets the
   code nearest to its one-dimensional optimum ``v_j + (H r)_j / H_jj`` (``r = w − v``) — the
   exact minimizer along that coordinate, since the grid ``{-1, 0, 1, 2}·d`` is uniform;
2. **scale refit** (:func:`scale_system`, solved on the host): the codes fixed, the output of a
   row is linear in its block scales, so the optimal ``d`` is the solution of the ``nb × nb``
   system ``(Qᵀ H Q) d = Qᵀ H w`` (``Q`` [in, nb] the codes placed in their blocks).

Float32 kernels; the ``nb × nb`` solves are the caller's, on the host CPU (Metal rule: no
factorization on the accelerator). The stored scale is fp16, so a refit can, in rare rows, land
above the rounded optimum; :func:`row_objective` lets the caller keep, per row, whichever is lower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from healsweep.kernels._precision import healing_jit
from healsweep.kernels.q2_0 import QK, round_code

_HIGHEST = jax.lax.Precision.HIGHEST


def _values(d: jax.Array, q: jax.Array) -> jax.Array:
    """``q·d`` [E, out, in] from ``d`` [E, out, in/64] and ``q`` [E, out, in]."""
    return q.astype(jnp.float32) * jnp.repeat(d.astype(jnp.float32), QK, axis=-1)


@healing_jit
def row_objective(w: jax.Array, h: jax.Array, d: jax.Array, q: jax.Array) -> jax.Array:
    """``(w − q·d)ᵀ H (w − q·d)`` per row: [E, out] float32. ``h`` [E, in, in]."""
    r = w - _values(d, q)
    hr = jnp.einsum("eoi,eij->eoj", r, h, precision=_HIGHEST)
    return jnp.sum(hr * r, axis=-1)


@healing_jit(static_argnames=("sweeps",))
def code_descent(w: jax.Array, h: jax.Array, d: jax.Array, q: jax.Array, sweeps: int) -> jax.Array:
    """``sweeps`` passes of exact coordinate descent over the codes, the scales ``d`` fixed.

    ``w`` [E, out, in], ``h`` [E, in, in] (damped, positive diagonal), ``d`` [E, out, in/64]
    (fp16 values), ``q`` [E, out, in] codes. Returns the new codes [E, out, in] int8; a column
    whose block scale is 0 keeps its code (any code gives the value 0).

    ``H r`` is kept for the whole row but updated lazily, as GPTQ does: inside a 64-column block
    only the block's own columns, then the block's changes reach every column in one product.
    """
    n_exp, n_out, n_in = w.shape
    d_full = jnp.repeat(d.astype(jnp.float32), QK, axis=-1)  # [E, out, in]
    v = q.astype(jnp.float32) * d_full
    hr = jnp.einsum("eoi,eij->eoj", w - v, h, precision=_HIGHEST)  # H r per row

    def one_block(k, carry):
        v, hr = carry
        start = (k % (n_in // QK)) * QK
        h_bb = jax.lax.dynamic_slice(h, (0, start, start), (n_exp, QK, QK))  # [E, 64, 64]
        diag = jnp.diagonal(h_bb, axis1=1, axis2=2)  # [E, 64]
        d_b = jax.lax.dynamic_slice_in_dim(d_full, start, QK, axis=2)  # [E, out, 64]
        zero = d_b == 0
        safe = jnp.where(zero, 1.0, d_b)

        def one_column(j, inner):
            v_b, hr_b = inner
            vj = jax.lax.dynamic_index_in_dim(v_b, j, axis=2, keepdims=False)  # [E, out]
            hj = jax.lax.dynamic_index_in_dim(hr_b, j, axis=2, keepdims=False)
            h_jj = jax.lax.dynamic_index_in_dim(diag, j, axis=1, keepdims=True)  # [E, 1]
            dj = jax.lax.dynamic_index_in_dim(d_b, j, axis=2, keepdims=False)
            sj = jax.lax.dynamic_index_in_dim(safe, j, axis=2, keepdims=False)
            zj = jax.lax.dynamic_index_in_dim(zero, j, axis=2, keepdims=False)
            new = jnp.where(zj, vj, round_code((vj + hj / h_jj) / sj) * dj)
            h_row = jax.lax.dynamic_index_in_dim(h_bb, j, axis=1, keepdims=False)  # [E, 64]
            hr_b = hr_b - (new - vj)[:, :, None] * h_row[:, None, :]  # r_j moved by -(new - vj)
            return jax.lax.dynamic_update_index_in_dim(v_b, new, j, axis=2), hr_b

        v_b0 = jax.lax.dynamic_slice_in_dim(v, start, QK, axis=2)
        hr_b0 = jax.lax.dynamic_slice_in_dim(hr, start, QK, axis=2)
        v_b, _ = jax.lax.fori_loop(0, QK, one_column, (v_b0, hr_b0))
        h_rows = jax.lax.dynamic_slice_in_dim(h, start, QK, axis=1)  # [E, 64, in]
        hr = hr - jnp.einsum("eoj,ejk->eok", v_b - v_b0, h_rows, precision=_HIGHEST)
        return jax.lax.dynamic_update_slice_in_dim(v, v_b, start, axis=2), hr

    v, _ = jax.lax.fori_loop(0, sweeps * (n_in // QK), one_block, (v, hr))
    codes = jnp.where(d_full == 0, q.astype(jnp.float32), v / jnp.where(d_full == 0, 1.0, d_full))
    return jnp.round(codes).astype(jnp.int8)


@healing_jit
def scale_system(w: jax.Array, h: jax.Array, q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The normal equations of the block scales of every row, the codes fixed.

    Returns ``(A [E, out, nb, nb], b [E, out, nb])`` float32 with ``A = Qᵀ H Q`` and
    ``b = Qᵀ H w`` (``Q`` [in, nb]: the row's codes, block ``c``'s in column ``c``).
    """
    n_exp, n_out, n_in = w.shape
    nb = n_in // QK
    qb = q.astype(jnp.float32).reshape(n_exp, n_out, nb, QK)
    hb = h.reshape(n_exp, nb, QK, nb, QK)
    hq = jnp.einsum("ebicj,eocj->eobic", hb, qb, precision=_HIGHEST)  # (H Q)[block b rows, c]
    a = jnp.einsum("eobi,eobic->eobc", qb, hq, precision=_HIGHEST)
    hw = jnp.einsum("eoi,eij->eoj", w, h, precision=_HIGHEST).reshape(n_exp, n_out, nb, QK)
    b = jnp.sum(qb * hw, axis=-1)
    return a, b
