"""Decoders of ggml's 256-weight super-block types (Q2_K-Q6_K, IQ4_XS) to float32.

Same contract as ``_decode_legacy``: ``b`` int32 ``[..., nb, type_size]`` -> float32
``[..., nb, 256]``, with ``gguf.quants.dequantize``'s float32 operation order (the sub-block scale
``d * sc`` is formed first, then multiplied by the code) so results are bit-identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from healsweep.kernels._decode_legacy import fp16_at, iq4_values, signed_byte, u16_at

QK_K = 256


def k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K packed 6-bit scales and mins: ``[..., 12]`` bytes -> two ``[..., 8]`` int32.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 keep
    their low 4 bits in the nibbles of bytes 8-11 and their high 2 bits in the top bits of
    bytes 0-3 (scales) and 4-7 (mins).
    """
    sd, sm, smd = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
    return sc, mn


def _nibble_pairs(qs: jax.Array) -> jax.Array:
    """``[..., 128]`` bytes -> ``[..., 8, 32]`` codes: 32-byte chunk ``c`` holds sub-blocks
    ``2c`` (low nibbles) and ``2c+1`` (high nibbles)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return jnp.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _affine(b: jax.Array, q: jax.Array) -> jax.Array:
    """``(d*sc) * q - dmin*m`` for Q4_K/Q5_K: ``q`` [..., 8, 32] -> [..., 256]."""
    d, dmin = fp16_at(b, 0)[..., None], fp16_at(b, 2)[..., None]  # [..., 1]
    sc, mn = k_scale_min(b[..., 4:16])  # [..., 8]
    dl = (d * sc.astype(jnp.float32))[..., None]  # [..., 8, 1]
    ml = (dmin * mn.astype(jnp.float32))[..., None]
    return (dl * q.astype(jnp.float32) - ml).reshape(*q.shape[:-2], QK_K)


def _crumbs(qs: jax.Array) -> jax.Array:
    """Q2_K/Q3_K 2-bit codes: ``[..., 64]`` bytes -> ``[..., 256]``. Each 32-byte half ``h``
    holds weights ``128h + 32j + l`` at bits ``2j`` of byte ``32h + l``."""
    halves = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    crumbs = (halves >> jnp.arange(0, 8, 2, dtype=jnp.int32)[:, None]) & 3  # [..., 2, 4, 32]
    return crumbs.reshape(*qs.shape[:-1], QK_K)


def decode_q2_k(b: jax.Array) -> jax.Array:
    """Q2_K: 16 scale bytes (low nibble scale, high nibble min, one per 16 weights), 64 code
    bytes, fp16 ``d``, ``dmin``; ``(d*sc) * q - dmin*m``. ``[..., nb, 84]`` -> ``[..., nb, 256]``."""
    lead = b.shape[:-1]
    d, dmin = fp16_at(b, 80)[..., None], fp16_at(b, 82)[..., None]  # [..., 1]
    dl = (d * (b[..., 0:16] & 0x0F).astype(jnp.float32))[..., None]  # [..., 16, 1]
    ml = (dmin * (b[..., 0:16] >> 4).astype(jnp.float32))[..., None]
    q = _crumbs(b[..., 16:80]).reshape(*lead, 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(*lead, QK_K)


def q3_k_scales(scales: jax.Array) -> jax.Array:
    """Q3_K's 16 packed 6-bit scales, ``[..., 12]`` bytes -> int32 ``[..., 16]`` in -32..31:
    low nibbles from bytes 0-7 (scales 0-7 low, 8-15 high nibble), top 2 bits of scale ``j``
    at bits ``2*(j//4)`` of byte ``8 + j%4``."""
    low = jnp.concatenate([scales[..., 0:8] & 0x0F, scales[..., 0:8] >> 4], axis=-1)
    top = (scales[..., None, 8:12] >> jnp.arange(0, 8, 2, dtype=jnp.int32)[:, None]) & 3
    return (low | (top.reshape(*scales.shape[:-1], 16) << 4)) - 32


def decode_q3_k(b: jax.Array) -> jax.Array:
    """Q3_K: 32 bytes of high-bit masks, 64 code bytes, 12 bytes of packed scales, fp16 ``d``;
    value ``(d*sc) * (q - 4*(1 - h))`` with ``h`` bit ``i`` of mask byte ``l`` for weight
    ``32i + l``. ``[..., nb, 110]`` -> ``[..., nb, 256]``."""
    lead = b.shape[:-1]
    high = (b[..., None, 0:32] >> jnp.arange(8, dtype=jnp.int32)[:, None]) & 1  # [..., 8, 32]
    q = _crumbs(b[..., 32:96]) - 4 * (1 - high.reshape(*lead, QK_K))
    dl = (fp16_at(b, 108)[..., None] * q3_k_scales(b[..., 96:108]).astype(jnp.float32))[..., None]
    return (dl * q.reshape(*lead, 16, 16).astype(jnp.float32)).reshape(*lead, QK_K)


def decode_q4_k(b: jax.Array) -> jax.Array:
    """Q4_K: fp16 ``d``, ``dmin``, 12 scale bytes, 128 code bytes. ``[.., 144]`` -> ``[.., 256]``."""
    return _affine(b, _nibble_pairs(b[..., 16:144]))


def decode_q5_k(b: jax.Array) -> jax.Array:
    """Q5_K: as Q4_K plus 32 bytes of high bits (bit ``i`` of byte ``l``: sub-block ``i``,
    weight ``l``) before the 128 nibble bytes. ``[..., nb, 176]`` -> ``[..., nb, 256]``."""
    qh = b[..., 16:48]  # [..., 32]
    high = (qh[..., None, :] >> jnp.arange(8, dtype=jnp.int32)[:, None]) & 1  # [..., 8, 32]
    return _affine(b, _nibble_pairs(b[..., 48:176]) | (high << 4))


def decode_q6_k(b: jax.Array) -> jax.Array:
    """Q6_K: 128 low-nibble bytes, 64 high-2-bit bytes, 16 int8 scales, fp16 ``d``.

    Each 128-weight half ``h`` takes nibbles from bytes ``64h..64h+63`` (low, then high) and its
    2-bit tops from bytes ``32h..32h+31`` (shifts 0, 2, 4, 6); value ``(d*scale) * (q - 32)``
    with one scale per 16 weights. ``[..., nb, 210]`` -> ``[..., nb, 256]``.
    """
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64)
    ql = jnp.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 2, 128)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    qh = (qh >> jnp.arange(0, 8, 2, dtype=jnp.int32)[:, None]) & 3  # [..., 2, 4, 32]
    q = (ql | (qh.reshape(*lead, 2, 128) << 4)) - 32
    scales = signed_byte(b[..., 192:208]).astype(jnp.float32)  # [..., 16]
    dl = (fp16_at(b, 208)[..., None] * scales)[..., None]  # [..., 16, 1]
    return (dl * q.reshape(*lead, 16, 16).astype(jnp.float32)).reshape(*lead, QK_K)


def decode_iq4_xs(b: jax.Array) -> jax.Array:
    """IQ4_XS: fp16 ``d``, uint16 high scale bits, 4 bytes of low scale nibbles, 128 index bytes.

    Sub-block ``i`` (32 weights) has the 6-bit scale ``lo | hi << 4`` minus 32, with ``lo`` the
    nibble ``i%2`` of byte ``i//2`` and ``hi`` bits ``2i`` of the uint16; its 16 bytes hold
    indices 0-15 (low nibbles) and 16-31 (high). ``[..., nb, 136]`` -> ``[..., nb, 256]``.
    """
    lead = b.shape[:-1]
    sl = b[..., 4:8, None] >> jnp.asarray([0, 4], jnp.int32)  # [..., 4, 2]
    sl = sl.reshape(*lead, 8) & 0x0F
    sh = (u16_at(b, 2)[..., None] >> jnp.arange(0, 16, 2, dtype=jnp.int32)) & 3  # [..., 8]
    scales = ((sl | (sh << 4)) - 32).astype(jnp.float32)
    dl = (fp16_at(b, 0)[..., None] * scales)[..., None]  # [..., 8, 1]
    qs = b[..., 8:136].reshape(*lead, 8, 1, 16)
    idx = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, 8, 32)
    return (dl * iq4_values(idx)).reshape(*lead, QK_K)
