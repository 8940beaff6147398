"""GPTQ-style error feedback on a fixed affine grid: the K-quants' codes chosen column by column.

ggml's Q2_K and Q3_K store, per 16 weights of a row, a scale ``a = d·sc`` and an offset (``dmin·m``
for Q2_K, none for Q3_K); a weight holds ``a·(c − shift) − offset`` for an integer code ``c`` in
``0..n_codes−1`` (Q2_K: shift 0, 4 codes; Q3_K: shift 4, 8 codes). Given that grid (from ggml's
own quantization of the weights), this kernel re-chooses only the codes, in GPTQ's LDLQ form as
:mod:`healsweep.kernels.gptq` does for Q2_0: with the damped input second moment ``H = V·D·Vᵀ``
(``V`` unit upper, factored on the host) and the feedback ``f = V − I``, column ``k`` is rounded
to its grid's nearest value from ``w_k + Σ_{j<k} r_j·f_jk``, ``r_j = w_j − v_j`` the error of an
earlier column against the original weights. Columns are taken 64 at a time, one by one inside
the block, and a block's errors reach the later columns in one product (lazy batch update).

Where ``f`` is 0 nothing propagates and every code is the nearest one, which is what ggml's
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
    w: jax.Array, scale: jax.Array, offset: jax.Array, f: jax.Array, shift: int, n_codes: int
) -> jax.Array:
    """GPTQ codes of the stack ``w`` [E, out, in] (``in % 64 == 0``) on its grid ``scale``,
    ``offset`` [E, out, in/16]; ``f`` [E, in, in] the strictly upper feedback ``V − I`` of each
    matrix's damped ``H = V·D·Vᵀ`` (:func:`healsweep.quant.gptq.factor`). Returns int32 codes
    [E, out, in] in ``0..n_codes−1``."""
    n_exp, n_out, n_in = w.shape
    w = jnp.asarray(w, jnp.float32)
    all_cols = jnp.arange(n_in)

    def one_block(b, carry):
        base, codes = carry  # base: w plus the errors of the earlier blocks
        start = b * BLOCK
        zb = jax.lax.dynamic_slice_in_dim(base, start, BLOCK, axis=2)  # [E, out, 64]
        ob = jax.lax.dynamic_slice_in_dim(w, start, BLOCK, axis=2)
        f_rows = jax.lax.dynamic_slice_in_dim(f, start, BLOCK, axis=1)  # [E, 64, in]
        fb = jax.lax.dynamic_slice_in_dim(f_rows, start, BLOCK, axis=2)  # [E, 64, 64]
        sb = jax.lax.dynamic_slice_in_dim(scale, start // SUB, BLOCK // SUB, axis=2)
        offb = jax.lax.dynamic_slice_in_dim(offset, start // SUB, BLOCK // SUB, axis=2)

        def one_column(j, inner):
            zb, cb, rb = inner
            z = jax.lax.dynamic_index_in_dim(zb, j, axis=2, keepdims=False)  # [E, out]
            a = jax.lax.dynamic_index_in_dim(sb, j // SUB, axis=2, keepdims=False)
            off = jax.lax.dynamic_index_in_dim(offb, j // SUB, axis=2, keepdims=False)
            c, v = nearest_codes(z, a, off, shift, n_codes)
            r = jax.lax.dynamic_index_in_dim(ob, j, axis=2, keepdims=False) - v
            f_row = jax.lax.dynamic_index_in_dim(fb, j, axis=1, keepdims=False)  # [E, 64]
            zb = zb + r[:, :, None] * f_row[:, None, :]  # f strictly upper: later columns only
            cb = jax.lax.dynamic_update_index_in_dim(cb, c, j, axis=2)
            rb = jax.lax.dynamic_update_index_in_dim(rb, r, j, axis=2)
            return zb, cb, rb

        zeros = jnp.zeros_like(zb)
        _, cb, rb = jax.lax.fori_loop(0, BLOCK, one_column, (zb, zeros.astype(jnp.int32), zeros))
        update = jnp.einsum("eoj,ejk->eok", rb, f_rows, precision=_HIGHEST)
        base = base + jnp.where(all_cols >= start + BLOCK, update, 0.0)  # the later blocks
        return base, jax.lax.dynamic_update_slice_in_dim(codes, cb, start, axis=2)

    codes0 = jnp.zeros((n_exp, n_out, n_in), jnp.int32)
    _, codes = jax.lax.fori_loop(0, n_in // BLOCK, one_block, (w, codes0))
    return codes
