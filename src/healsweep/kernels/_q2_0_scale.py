"""The pieces of the Q2_0 scale search that the XLA kernels (:mod:`healsweep.kernels.q2_0`) and the
Pallas kernel (:mod:`healsweep.kernels.q2_0_gpu`) share: the block geometry, the seeds, the
exact power-of-two normalization and the stored scale with its norm-inflation gain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QK = 64
SEEDS = (0.42, 0.55, 0.68, 0.81, 0.94, -0.42, -0.55, -0.68, -0.81, -0.94)
LANES = 16


def pow2_inverse(amax: jax.Array) -> jax.Array:
    """``2**-e`` with ``amax = m * 2**e``, ``m`` in [1, 2); 1 where ``amax`` is 0 (exact scaling)."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32) & 0x7F800000
    inv = jax.lax.bitcast_convert_type(0x7F000000 - bits, jnp.float32)
    return jnp.where(amax > 0, inv, 1.0)


def safe_ratio(num: jax.Array, den: jax.Array, fallback) -> jax.Array:
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), fallback)


def stored_scale(sqw, sqq, saw2, live, gain) -> jax.Array:
    """``d_ls * max(r², 0.25)^(-gain/2)`` from the winner's ``Σaqy``, ``Σaq²`` and ``Σay²``
    (``y`` the normalized block), 0 for all-zero blocks: the search's last step."""
    d_ls = safe_ratio(sqw, sqq, 0.0)
    r2 = safe_ratio(safe_ratio(sqw * sqw, sqq, 0.0), saw2, 1.0)
    return jnp.where(live, d_ls * jnp.power(jnp.maximum(r2, 0.25), -0.5 * gain), 0.0)
