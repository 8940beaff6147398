"""Decoders of ggml's float and 32/64-weight block types, from stored bytes to float32.

Every decoder takes ``b`` int32 ``[..., nb, type_size]`` (one stored block per row, each byte a
value 0..255) and returns float32 ``[..., nb, block]``, in the order and with the float32
arithmetic of ``gguf.quants.dequantize`` so the results are bit-identical. Little-endian fields
are assembled with shifts and reinterpreted with same-width bitcasts only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# IQ4_NL's non-linear codebook (ggml's kvalues_iq4nl), shared with IQ4_XS.
KVALUES_IQ4 = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def fp16_at(b: jax.Array, offset: int) -> jax.Array:
    """The little-endian fp16 at bytes ``offset, offset+1`` of each block, as float32 ``[...]``."""
    bits = b[..., offset] | (b[..., offset + 1] << 8)  # [...] int32 in 0..65535
    half = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return half.astype(jnp.float32)


def u16_at(b: jax.Array, offset: int) -> jax.Array:
    """The little-endian uint16 at ``offset`` of each block, as int32 ``[...]``."""
    return b[..., offset] | (b[..., offset + 1] << 8)


def signed_byte(b: jax.Array) -> jax.Array:
    """Bytes 0..255 read as int8 (two's complement), as int32."""
    return b - ((b >> 7) << 8)


def nibbles(qs: jax.Array) -> jax.Array:
    """``[..., n]`` bytes -> ``[..., 2n]``: the n low nibbles, then the n high nibbles."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def bits_le(qh: jax.Array) -> jax.Array:
    """``[..., n]`` bytes -> ``[..., 8n]`` bits, bit ``j`` = bit ``j%8`` of byte ``j//8``."""
    shifts = jnp.arange(8, dtype=jnp.int32)
    return ((qh[..., None] >> shifts) & 1).reshape(*qh.shape[:-1], -1)


def iq4_values(idx: jax.Array) -> jax.Array:
    """``KVALUES_IQ4[idx]`` as float32, by an int32-index gather (never an unsigned index)."""
    table = jnp.asarray(KVALUES_IQ4, jnp.float32)
    return jnp.take(table, idx.astype(jnp.int32), axis=0, mode="clip")


def decode_f32(b: jax.Array) -> jax.Array:
    """F32: ``[..., n, 4]`` -> ``[..., n, 1]`` (a bit-for-bit reinterpretation)."""
    bits = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)[..., None]


def decode_f16(b: jax.Array) -> jax.Array:
    """F16: ``[..., n, 2]`` -> ``[..., n, 1]``."""
    return fp16_at(b, 0)[..., None]


def decode_bf16(b: jax.Array) -> jax.Array:
    """BF16: ``[..., n, 2]`` -> ``[..., n, 1]``; the 16 bits become a float32's high half."""
    bits = (b[..., 0] << 16) | (b[..., 1] << 24)  # wraps into the sign bit, as intended
    return jax.lax.bitcast_convert_type(bits, jnp.float32)[..., None]


def decode_q8_0(b: jax.Array) -> jax.Array:
    """Q8_0: fp16 ``d``, 32 int8 ``q``; ``q * d``. ``[..., nb, 34]`` -> ``[..., nb, 32]``."""
    d = fp16_at(b, 0)[..., None]
    return signed_byte(b[..., 2:]).astype(jnp.float32) * d


def decode_q4_0(b: jax.Array) -> jax.Array:
    """Q4_0: fp16 ``d``, 16 bytes of nibbles; ``d * (q - 8)``. ``[..., nb, 18]`` -> ``[.., 32]``."""
    d = fp16_at(b, 0)[..., None]
    return d * (nibbles(b[..., 2:]) - 8).astype(jnp.float32)


def decode_q4_1(b: jax.Array) -> jax.Array:
    """Q4_1: fp16 ``d``, fp16 ``m``, nibbles; ``d * q + m``. ``[..., nb, 20]`` -> ``[.., 32]``."""
    d, m = fp16_at(b, 0)[..., None], fp16_at(b, 2)[..., None]
    return d * nibbles(b[..., 4:]).astype(jnp.float32) + m  # d*q is exact: no FMA hazard


def decode_q5_0(b: jax.Array) -> jax.Array:
    """Q5_0: fp16 ``d``, 32 high bits, nibbles; ``d * (q - 16)``. ``[.., 22]`` -> ``[.., 32]``."""
    d = fp16_at(b, 0)[..., None]
    q = nibbles(b[..., 6:]) | (bits_le(b[..., 2:6]) << 4)
    return d * (q - 16).astype(jnp.float32)


def decode_q5_1(b: jax.Array) -> jax.Array:
    """Q5_1: fp16 ``d``, ``m``, 32 high bits, nibbles; ``d * q + m``. ``[.., 24]`` -> ``[.., 32]``."""
    d, m = fp16_at(b, 0)[..., None], fp16_at(b, 2)[..., None]
    q = nibbles(b[..., 8:]) | (bits_le(b[..., 4:8]) << 4)
    return d * q.astype(jnp.float32) + m


def decode_iq4_nl(b: jax.Array) -> jax.Array:
    """IQ4_NL: fp16 ``d``, nibble indices; ``d * KVALUES[i]``. ``[.., 18]`` -> ``[.., 32]``."""
    d = fp16_at(b, 0)[..., None]
    return d * iq4_values(nibbles(b[..., 2:]))


def decode_q2_0(b: jax.Array) -> jax.Array:
    """Q2_0 (type 42): fp16 ``d``, 16 bytes of 2-bit codes ``c``; ``(c - 1) * d``.

    Code ``j`` sits at bits ``2*(j%4)`` of byte ``j//4``. ``[..., nb, 18]`` -> ``[..., nb, 64]``.
    """
    d = fp16_at(b, 0)[..., None]
    shifts = jnp.arange(0, 8, 2, dtype=jnp.int32)
    codes = (b[..., 2:, None] >> shifts) & 3  # [..., nb, 16, 4]
    codes = codes.reshape(*b.shape[:-1], 64)
    return (codes - 1).astype(jnp.float32) * d
