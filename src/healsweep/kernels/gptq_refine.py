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
    """
    n_in = w.shape[2]
    d_full = jnp.repeat(d.astype(jnp.float32), QK, axis=-1)  # [E, out, in]
    v = q.astype(jnp.float32) * d_full
    hr = jnp.einsum("eoi,eij->eoj", w - v, h, precision=_HIGHEST)  # H r per row
    diag = jnp.diagonal(h, axis1=1, axis2=2)  # [E, in]

    def one_column(k, carry):
        v, codes, hr = carry
        j = k % n_in
        dj = jax.lax.dynamic_index_in_dim(d_full, j, axis=2, keepdims=False)  # [E, out]
        vj = jax.lax.dynamic_index_in_dim(v, j, axis=2, keepdims=False)
        hj = jax.lax.dynamic_index_in_dim(hr, j, axis=2, keepdims=False)
        h_jj = jax.lax.dynamic_index_in_dim(diag, j, axis=1, keepdims=True)  # [E, 1]
        old = jax.lax.dynamic_index_in_dim(codes, j, axis=2, keepdims=False)
        zero = dj == 0
        target = (vj + hj / h_jj) / jnp.where(zero, 1.0, dj)
        new = jnp.where(zero, old, round_code(target))
        dv = new * dj - vj  # the value moves by dv, so r moves by -dv
        h_row = jax.lax.dynamic_index_in_dim(h, j, axis=1, keepdims=False)  # [E, in]
        hr = hr - dv[:, :, None] * h_row[:, None, :]
        v = jax.lax.dynamic_update_index_in_dim(v, new * dj, j, axis=2)
        codes = jax.lax.dynamic_update_index_in_dim(codes, new, j, axis=2)
        return v, codes, hr

    carry = (v, q.astype(jnp.float32), hr)
    _, codes, _ = jax.lax.fori_loop(0, sweeps * n_in, one_column, carry)
    return codes.astype(jnp.int8)


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
