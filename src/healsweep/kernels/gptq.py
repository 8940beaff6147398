"""GPTQ-style error feedback for Q2_0: quantize a stack of matrices column block by column block,
propagating each column's rounding error to the columns not yet quantized.

Inputs are a stack ``w`` [E, out, in] (one matrix per routed expert) and, per matrix, the upper
Cholesky factor ``u`` of the inverse of its damped input second moment (``H⁻¹ = uᵀu``; factored
on the host, never here: Metal has no Cholesky). Per 64-column block ``b`` (one Q2_0 block column):

1. the block's scale comes from the exact Q2_0 search of :mod:`q2_0` (same seeds, same
   arithmetic, same gain) run on the *error-updated* weights at the block's start, with the
   block's importance ``a`` (the diagonal of H: the part of GPTQ's objective that a per-block
   search can see). The search yields the stored fp16 ``d`` and its rounding step ``1/d1``;
2. the 64 columns are then rounded one by one with that fixed step, ``q_j = round_code(w_j/d1)``,
   each column's error ``(w_j − q_j·d)/u_jj`` (``q_j·d`` is the value the file will hold) being
   subtracted from the block's later columns through row ``j`` of ``u``;
3. the block's 64 errors update every later column at once (GPTQ's lazy batch update).

Where ``u`` is diagonal nothing propagates and step 2 rounds exactly as the search does, so the
result equals :func:`q2_0.quantize_matrix` bit for bit (the property test of ``tests/test_gptq.py``).
Float32 throughout; matrix products at ``HIGHEST`` precision (no TF32 on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from healsweep.kernels._precision import healing_jit
from healsweep.kernels.q2_0 import QK, _pow2_inverse, round_code, search_tiles

_HIGHEST = jax.lax.Precision.HIGHEST


def block_scale(w: jax.Array, a: jax.Array, gain: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Q2_0 search on one block column: ``w`` [E, out, 64], ``a`` [E, 64] (> 0).

    Returns ``(d [E, out] float16, step [E, out] float32)``: the stored scale and the rounding
    step of the search's winner (codes ``round_code(w * step)``), as ``q2_0._quantize_rows`` lays
    blocks out without tiles (one block per row, the same arithmetic as every other layout).
    """
    n_exp, n_out, _ = w.shape
    a = a * _pow2_inverse(jnp.max(a, axis=1))[:, None]  # max a in [1, 2), exactly, as the codec
    blocks = w.reshape(n_exp * n_out, QK, 1)
    a_rows = jnp.broadcast_to(a[:, None, :], (n_exp, n_out, QK)).reshape(n_exp * n_out, QK, 1)
    d, scale, best_d1, _ = search_tiles(blocks, a_rows, gain)  # [E*out, 1] each
    d16 = (d / scale).astype(jnp.float16).reshape(n_exp, n_out)
    return d16, (scale / best_d1).reshape(n_exp, n_out)


@healing_jit
def quantize(w: jax.Array, u: jax.Array, importance: jax.Array, gain: jax.Array):
    """GPTQ Q2_0 of the stack ``w`` [E, out, in] (``in % 64 == 0``).

    ``u`` [E, in, in]: upper Cholesky factor of each matrix's damped H⁻¹; ``importance`` [E, in]
    (> 0): the per-column weights of each block's scale search. Returns ``(d [E, out, in/64]
    float16, q [E, out, in] int8)`` in {-1, 0, 1, 2}: ordinary Q2_0.
    """
    n_exp, n_out, n_in = w.shape
    cols = jnp.arange(QK)
    all_cols = jnp.arange(n_in)

    def one_block(b, carry):
        w, d_out, q_out = carry
        start = b * QK
        wb = jax.lax.dynamic_slice_in_dim(w, start, QK, axis=2)  # [E, out, 64]
        ub = jax.lax.dynamic_slice(u, (0, start, start), (n_exp, QK, QK))  # [E, 64, 64]
        ab = jax.lax.dynamic_slice_in_dim(importance, start, QK, axis=1)  # [E, 64]
        d16, step = block_scale(wb, ab, gain)
        d32 = d16.astype(jnp.float32)
        u_diag = jnp.diagonal(ub, axis1=1, axis2=2)  # [E, 64]

        def one_column(j, inner):
            wb, qb, errb = inner
            col = jax.lax.dynamic_index_in_dim(wb, j, axis=2, keepdims=False)  # [E, out]
            q = round_code(col * step)
            u_jj = jax.lax.dynamic_index_in_dim(u_diag, j, axis=1, keepdims=True)  # [E, 1]
            err = (col - q * d32) / u_jj
            u_row = jax.lax.dynamic_index_in_dim(ub, j, axis=1, keepdims=False)  # [E, 64]
            u_row = jnp.where(cols > j, u_row, 0.0)  # only the block's later columns
            wb = wb - err[:, :, None] * u_row[:, None, :]
            qb = jax.lax.dynamic_update_index_in_dim(qb, q, j, axis=2)
            errb = jax.lax.dynamic_update_index_in_dim(errb, err, j, axis=2)
            return wb, qb, errb

        zeros = jnp.zeros_like(wb)
        _, qb, errb = jax.lax.fori_loop(0, QK, one_column, (wb, zeros, zeros))
        u_rows = jax.lax.dynamic_slice_in_dim(u, start, QK, axis=1)  # [E, 64, in]
        update = jnp.einsum("eoj,ejk->eok", errb, u_rows, precision=_HIGHEST)
        w = w - jnp.where(all_cols >= start + QK, update, 0.0)  # lazy: the later blocks only
        d_out = jax.lax.dynamic_update_index_in_dim(d_out, d16, b, axis=2)
        q_out = jax.lax.dynamic_update_slice_in_dim(q_out, qb.astype(jnp.int8), start, axis=2)
        return w, d_out, q_out

    d0 = jnp.zeros((n_exp, n_out, n_in // QK), jnp.float16)
    q0 = jnp.zeros((n_exp, n_out, n_in), jnp.int8)
    _, d, q = jax.lax.fori_loop(0, n_in // QK, one_block, (w.astype(jnp.float32), d0, q0))
    return d, q
