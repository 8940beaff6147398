"""Plain Q2_0: round-to-nearest under ``d = amax/2`` per block of 64, no search, no importance.

The reference a healer must beat (issue 16's ``plain`` row). Per block ``w[0..63]``:

- ``amax`` is the block's largest-magnitude weight *with its sign* (the first one on a tie), so
  the grid's long side ``2·d`` lands on it: a negative ``d`` mirrors the grid ``{-1,0,1,2}·d``
  and costs nothing (the codec is signed), while ``|amax|/2`` with a positive ``d`` would clip
  every block whose extreme is negative to ``-d``;
- ``d = fp16(amax / 2)``; ``q = clip(round_half_even(w / d), -1, 2)`` with the stored (fp16)
  ``d``, and ``q = 0`` where ``d == 0`` (an all-zero block, or one whose scale underflows fp16).

Every weight then lies within ``|d|/2`` of its value except those with ``w/d < -1.5`` (at most
``|d|`` away: the grid's short side), up to the fp16 rounding of ``d``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QK = 64


@jax.jit
def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w`` [..., in] (``in % 64 == 0``) -> ``(d [..., in/64] float16, q [..., in] int8)``."""
    *lead, n_in = w.shape
    blocks = jnp.asarray(w, jnp.float32).reshape(*lead, n_in // QK, QK)  # [..., nb, 64]
    at = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]  # [..., nb, 1]
    amax = jnp.take_along_axis(blocks, at, axis=-1)[..., 0]  # [..., nb], signed
    d = (amax * 0.5).astype(jnp.float16)
    # The codes divide by the stored fp16 d. XLA's GPU compiler drops an f32→f16→f32 round
    # trip by default (excess precision allowed) and divided by the unrounded d: 1 code in 4096
    # differed from the CPU on an H200. The barrier keeps the rounding.
    d32 = jax.lax.optimization_barrier(d).astype(jnp.float32)[..., None]
    safe = jnp.where(d32 == 0, 1.0, d32)
    q = jnp.where(d32 == 0, 0.0, jnp.clip(jnp.round(blocks / safe), -1, 2))
    return d, q.astype(jnp.int8).reshape(*lead, n_in)


__all__ = ["QK", "quantize"]
