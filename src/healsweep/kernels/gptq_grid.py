"""GPTQ-style error feedback on a fixed affine grid: the K-quants' codes chosen column by column.

ggml's Q2_K and Q3_K store, per 16 weights of a row, a scale ``a = d·sc`` and an offset (``dmin·m``
for Q2_K, none for Q3_K); a weight holds ``a·(c − shift) − offset`` for an integer code ``c`` in
``0..n_codes−1`` (Q2_K: shift 0, 4 codes; Q3_K: shift 4, 8 codes). Given that grid (from ggml's
own quantization of the weights), this kernel re-chooses only the codes: columns are taken in
order, each column's weights (updated by the errors before them) are rounded to the nearest value
of their grid, and the column's error ``(w_j − v_j)/u_jj`` is subtracted from the columns not yet
rounded through row ``j`` of ``u`` (the upper Cholesky factor of the damped ``H⁻¹ = uᵀu``,
factored on the host), 64 columns at a time with GPTQ's lazy batch update for the rest.

Where ``u`` is diagonal nothing propagates and every code is the nearest one, which is what ggml's
quantizer stores for these grids (``tests/test_gptq_grid.py``). Float32 throughout; products at
``HIGHEST`` precision; gathers with int32 indices only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from healsweep.kernels._precision import healing_jit

SUB = 16  # weights per sub-block scale
BLOCK = 64  # columns per lazy update
_HIGHEST = jax.lax.Precision.HIGHEST


def grid_values(scale: jax.Array, offset: jax.Array, shift: int, n_codes: int) -> jax.Array:
    """``a·(c − shift) − offset`` for every code ``c``: ``[..., n_codes]`` float32, formed in the
    K-quant decoders' operation order (``(d·sc)·q − dmin·m``)."""
    codes = jnp.arange(n_codes, dtype=jnp.float32) - jnp.float32(shift)
    return scale[..., None] * codes - offset[..., None]


def nearest_codes(
    w: jax.Array, scale: jax.Array, offset: jax.Array, shift: int, n_codes: int
) -> tuple[jax.Array, jax.Array]:
    """The nearest grid code of each weight (the lower code on a tie) and its value: ``w``, scale
    and offset broadcast together ``[...]`` -> (int32 ``[...]``, float32 ``[...]``)."""
    values = grid_values(scale, offset, shift, n_codes)  # [..., K]
    codes = jnp.argmin(jnp.abs(values - w[..., None]), axis=-1).astype(jnp.int32)
    return codes, jnp.take_along_axis(values, codes[..., None], axis=-1)[..., 0]


@healing_jit(static_argnums=(4, 5))
def quantize(
    w: jax.Array, scale: jax.Array, offset: jax.Array, u: jax.Array, shift: int, n_codes: int
) -> jax.Array:
    """GPTQ codes of the stack ``w`` [E, out, in] (``in % 64 == 0``) on its grid ``scale``,
    ``offset`` [E, out, in/16]; ``u`` [E, in, in] upper, ``H⁻¹ = uᵀu``. Returns int32 codes
    [E, out, in] in ``0..n_codes−1``."""
    n_exp, n_out, n_in = w.shape
    cols = jnp.arange(BLOCK)
    all_cols = jnp.arange(n_in)

    def one_block(b, carry):
        w, codes = carry
        start = b * BLOCK
        wb = jax.lax.dynamic_slice_in_dim(w, start, BLOCK, axis=2)  # [E, out, 64]
        ub = jax.lax.dynamic_slice(u, (0, start, start), (n_exp, BLOCK, BLOCK))  # [E, 64, 64]
        sb = jax.lax.dynamic_slice_in_dim(scale, start // SUB, BLOCK // SUB, axis=2)
        ob = jax.lax.dynamic_slice_in_dim(offset, start // SUB, BLOCK // SUB, axis=2)
        u_diag = jnp.diagonal(ub, axis1=1, axis2=2)  # [E, 64]

        def one_column(j, inner):
            wb, cb, errb = inner
            col = jax.lax.dynamic_index_in_dim(wb, j, axis=2, keepdims=False)  # [E, out]
            a = jax.lax.dynamic_index_in_dim(sb, j // SUB, axis=2, keepdims=False)
            off = jax.lax.dynamic_index_in_dim(ob, j // SUB, axis=2, keepdims=False)
            c, v = nearest_codes(col, a, off, shift, n_codes)
            u_jj = jax.lax.dynamic_index_in_dim(u_diag, j, axis=1, keepdims=True)  # [E, 1]
            err = (col - v) / u_jj
            u_row = jax.lax.dynamic_index_in_dim(ub, j, axis=1, keepdims=False)  # [E, 64]
            u_row = jnp.where(cols > j, u_row, 0.0)  # only the block's later columns
            wb = wb - err[:, :, None] * u_row[:, None, :]
            cb = jax.lax.dynamic_update_index_in_dim(cb, c, j, axis=2)
            errb = jax.lax.dynamic_update_index_in_dim(errb, err, j, axis=2)
            return wb, cb, errb

        zeros = jnp.zeros_like(wb)
        _, cb, errb = jax.lax.fori_loop(0, BLOCK, one_column, (wb, zeros.astype(jnp.int32), zeros))
        u_rows = jax.lax.dynamic_slice_in_dim(u, start, BLOCK, axis=1)  # [E, 64, in]
        update = jnp.einsum("eoj,ejk->eok", errb, u_rows, precision=_HIGHEST)
        w = w - jnp.where(all_cols >= start + BLOCK, update, 0.0)  # lazy: the later blocks
        return w, jax.lax.dynamic_update_slice_in_dim(codes, cb, start, axis=2)

    codes0 = jnp.zeros((n_exp, n_out, n_in), jnp.int32)
    _, codes = jax.lax.fori_loop(0, n_in // BLOCK, one_block, (jnp.asarray(w, jnp.float32), codes0))
    return codes
