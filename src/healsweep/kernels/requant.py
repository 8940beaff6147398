"""Requantization on the device: what Part B's healed shared-expert down projection is stored in,
encoded where its values are, so only the stored bytes cross to the host
(:meth:`healsweep.quant.formats.StorageFormat.requantize_on_device`).

Q8_0: ggml's blocks of 32 int8 codes and one fp16 scale. A block ``x[0..31]`` is stored as ``d = max|x| / 127`` rounded to fp16 (little-endian), then the
32 codes ``q = round(x / d)`` as int8, the value read back being ``q * d``. The arithmetic is
``gguf.quants``' own, step by step in float32 (the scale's reciprocal, one product, rounding half
away from zero as ``np_roundf`` does), so the bytes are gguf-py's and ggml's reference
quantizer's bit for bit (tests/test_requant.py). F16: the values rounded once to half precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QK = 32
BYTES_PER_BLOCK = 34


def _round_half_away(x: jax.Array) -> jax.Array:
    """``np_roundf``: |x| floored, plus 1 where its fraction is at least one half; x's sign.
    Each step is exact in float32 for |x| < 2**23 (the codes are at most 127)."""
    a = jnp.abs(x)
    floored = jnp.floor(a)
    return jnp.sign(x) * (floored + jnp.floor(2.0 * (a - floored)))


@jax.jit
def encode_q8_0(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 ``[rows, cols]`` (cols a multiple of 32) to Q8_0: (the rows' bytes, uint8
    ``[rows, cols/32*34]``; the values they decode to, float32 ``[rows, cols]``: each code
    times its block's fp16 scale widened to float32, as ``gguf.quants.dequantize`` computes)."""
    rows, cols = values.shape
    blocks = jnp.asarray(values, jnp.float32).reshape(rows, cols // QK, QK)
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / jnp.float32(127)
    inverse = jnp.where(d == 0, jnp.float32(0), jnp.float32(1) / jnp.where(d == 0, 1, d))
    codes = _round_half_away(blocks * inverse).astype(jnp.int8)
    half = d.astype(jnp.float16)
    bits = jax.lax.bitcast_convert_type(half, jnp.uint16)  # [rows, nb, 1]
    head = jnp.concatenate([bits & 0xFF, bits >> 8], axis=-1).astype(jnp.uint8)  # little-endian
    body = jax.lax.bitcast_convert_type(codes, jnp.uint8)  # two's complement, as written
    raw = jnp.concatenate([head, body], axis=-1).reshape(rows, cols // QK * BYTES_PER_BLOCK)
    stored = codes.astype(jnp.float32) * half.astype(jnp.float32)
    return raw, stored.reshape(rows, cols)


def round_half(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """F16: ``values`` rounded to half precision (the writer's values) and widened back to
    float32 (what a reader decodes), both where ``values`` are."""
    half = jnp.asarray(values).astype(jnp.float16)
    return half, half.astype(jnp.float32)


def on_device(values: np.ndarray) -> jax.Array:
    """Host values as a float32 array on the default device."""
    return jnp.asarray(values, jnp.float32)
