"""Decoders of ggml's lattice ("i-quant") super-block types to float32, in the graph.

IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S store, per group of 8 (IQ1/IQ2) or 4
(IQ3) weights, an index into a fixed grid of magnitudes, plus signs and sub-block scales. Same
contract as ``_decode_legacy``: ``b`` int32 ``[..., nb, type_size]`` -> float32 ``[..., nb, 256]``
in ``gguf.quants.dequantize``'s (and ggml's ``to_float``'s) float32 operation order: the sub-block
scale first (``d * (0.5 + s) * 0.25`` and the like), then times the grid value. ggml then applies
the sign (``(db * g) * s``); here the sign is applied to the integer grid value first,
``db * (g * s)``, which has the same bits (negation is exact and rounding is sign-symmetric) and
saves a float multiply per weight.

The grids are gguf-py's (``gguf.quants.IQ2_XXS.grid`` ...; public class attributes), read once and
kept as int32 words holding four grid bytes each, little-endian, as ggml's own ``uint64``/``uint32``
grid tables do; one int32-index gather per group of weights fetches a row's words, shifts unpack
them. The sign table of IQ2_XXS/IQ2_XS/IQ3_XXS (ggml's ``ksigns_iq2xs``) is built here: entry
``i`` is the 7 bits of ``i`` plus an 8th bit making the popcount even.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels._decode_legacy import fp16_at, u16_at

QK_K = 256
IQ1_DELTA = 0.125  # ggml's IQ1S_DELTA: the shift of IQ1's ternary grid, sign from one bit
_F32 = jnp.float32
_SEVEN_BITS = np.arange(128, dtype=np.uint8)
_PARITY = np.unpackbits(_SEVEN_BITS[:, None], axis=1).sum(axis=1) & 1
# ggml's ksigns_iq2xs: 7 sign bits and an 8th that makes the number of set bits even
KSIGNS = (_SEVEN_BITS | (_PARITY << 7)).astype(np.int32)


@cache
def grid_words(name: str) -> np.ndarray:
    """gguf-py's grid of type ``name`` as int32 ``[rows, bytes/4]``: each row's values as bytes
    (IQ1's -1/0/1 stored plus one), four to a little-endian word."""
    # lazy: heavy (gguf)
    import gguf.quants

    quant = getattr(gguf.quants, name)
    quant.init_grid()
    values = np.asarray(quant.grid, np.float32).reshape(quant.grid_shape)
    if name.startswith("IQ1"):
        values = values + 1.0
    as_bytes = np.ascontiguousarray(values.astype(np.uint8))
    return as_bytes.view("<u4").astype(np.int32)


def grid_rows(name: str, idx: jax.Array) -> jax.Array:
    """Grid rows for int32 indices ``idx [...]``: int32 ``[..., row]`` (one word gather a row)."""
    table = jnp.asarray(grid_words(name))  # [rows, words]
    words = jnp.take(table, idx.astype(jnp.int32), axis=0, mode="clip")  # [..., words]
    shifts = jnp.arange(0, 32, 8, dtype=jnp.int32)
    return ((words[..., None] >> shifts) & 0xFF).reshape(*idx.shape, -1)


def _low28(b: jax.Array) -> jax.Array:
    """The low 28 bits of the little-endian uint32 in ``b[..., 0:4]`` (int32, never negative)."""
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | ((b[..., 3] & 0x0F) << 24)


def _bits8(byte: jax.Array) -> jax.Array:
    """``[...]`` -> ``[..., 8]``: bit ``j`` of each byte."""
    return (byte[..., None] >> jnp.arange(8, dtype=jnp.int32)) & 1


def _ksigns(s7: jax.Array) -> jax.Array:
    """ggml's ``ksigns_iq2xs[s7]`` as sign factors: ``[...]`` -> int32 ``[..., 8]`` of +-1.

    A gather, though each entry is just ``s7`` plus its parity bit: on the CPU the gathered
    bytes are computed once per group instead of once per weight, 1.8x faster here."""
    table = jnp.asarray(KSIGNS)
    return _sign_bytes(jnp.take(table, s7.astype(jnp.int32), axis=0, mode="clip"))


def _sign_bytes(byte: jax.Array) -> jax.Array:
    """Plain sign bytes (IQ2_S, IQ3_S): ``[...]`` -> int32 ``[..., 8]`` of +-1, bit set = -1."""
    return 1 - 2 * _bits8(byte)


def _iq2_scales(d: jax.Array, scales: jax.Array) -> jax.Array:
    """IQ2_XS/IQ2_S: ``d * (0.5 + s) * 0.25`` per nibble of 8 scale bytes -> ``[..., 16]``
    (low nibble first: one scale per 16 weights)."""
    nib = jnp.stack([scales & 0x0F, scales >> 4], axis=-1).reshape(*scales.shape[:-1], 16)
    return d[..., None] * (0.5 + nib.astype(_F32)) * 0.25


def decode_iq2_xxs(b: jax.Array) -> jax.Array:
    """IQ2_XXS (2.06 bpw): fp16 ``d`` then 8 sub-blocks of 32 weights, each 8 bytes: 4 grid
    indices (8 weights each) and a uint32 holding four 7-bit sign indices and a 4-bit scale
    ``s`` (top nibble); ``db = d * (0.5 + s) * 0.25``. ``[..., nb, 66]`` -> ``[..., nb, 256]``."""
    lead = b.shape[:-1]
    q = b[..., 2:66].reshape(*lead, 8, 8)
    db = fp16_at(b, 0)[..., None] * (0.5 + (q[..., 7] >> 4).astype(_F32)) * 0.25  # [..., 8]
    s7 = (_low28(q[..., 4:8])[..., None] >> jnp.arange(0, 28, 7, dtype=jnp.int32)) & 127
    signed = grid_rows("IQ2_XXS", q[..., 0:4]) * _ksigns(s7)  # [..., 8, 4, 8]
    return (db[..., None, None] * signed.astype(_F32)).reshape(*lead, QK_K)


def decode_iq2_xs(b: jax.Array) -> jax.Array:
    """IQ2_XS (2.31 bpw): fp16 ``d``, 32 uint16 (9-bit grid index, 7-bit sign index), 8 scale
    bytes (two 4-bit scales each). ``[..., nb, 74]`` -> ``[..., nb, 256]``."""
    lead = b.shape[:-1]
    q16 = b[..., 2:66:2] | (b[..., 3:66:2] << 8)  # [..., 32]
    db = _iq2_scales(fp16_at(b, 0), b[..., 66:74])  # [..., 16]
    signed = grid_rows("IQ2_XS", q16 & 511) * _ksigns(q16 >> 9)  # [..., 32, 8]
    return (db[..., None] * signed.reshape(*lead, 16, 16).astype(_F32)).reshape(*lead, QK_K)


def decode_iq2_s(b: jax.Array) -> jax.Array:
    """IQ2_S (2.56 bpw): fp16 ``d``, 32 low index bytes, 32 sign bytes, 8 bytes of 2-bit index
    tops (group ``l`` of a sub-block at bits ``2l``), 8 scale bytes. ``[.., 82]`` -> ``[.., 256]``."""
    lead = b.shape[:-1]
    high = (b[..., 66:74, None] >> jnp.arange(0, 8, 2, dtype=jnp.int32)) & 3  # [..., 8, 4]
    idx = b[..., 2:34] | (high.reshape(*lead, 32) << 8)
    db = _iq2_scales(fp16_at(b, 0), b[..., 74:82])  # [..., 16]
    signed = grid_rows("IQ2_S", idx) * _sign_bytes(b[..., 34:66])  # [..., 32, 8]
    return (db[..., None] * signed.reshape(*lead, 16, 16).astype(_F32)).reshape(*lead, QK_K)


def decode_iq3_xxs(b: jax.Array) -> jax.Array:
    """IQ3_XXS (3.06 bpw): fp16 ``d``, 64 grid indices (4 weights each), then per sub-block of
    32 a uint32 of four 7-bit sign indices and a 4-bit scale ``s``; ``db = d * (0.5 + s) * 0.5``.
    ``[..., nb, 98]`` -> ``[..., nb, 256]``."""
    lead = b.shape[:-1]
    ss = b[..., 66:98].reshape(*lead, 8, 4)
    db = fp16_at(b, 0)[..., None] * (0.5 + (ss[..., 3] >> 4).astype(_F32)) * 0.5  # [..., 8]
    s7 = (_low28(ss)[..., None] >> jnp.arange(0, 28, 7, dtype=jnp.int32)) & 127  # [..., 8, 4]
    signed = grid_rows("IQ3_XXS", b[..., 2:66]).reshape(*lead, 8, 4, 8) * _ksigns(s7)
    return (db[..., None, None] * signed.astype(_F32)).reshape(*lead, QK_K)


def decode_iq3_s(b: jax.Array) -> jax.Array:
    """IQ3_S (3.44 bpw): fp16 ``d``, 64 low index bytes, 8 bytes of 9th index bits (bit ``k`` of
    byte ``i``: index ``8i+k``), 32 sign bytes, 4 scale bytes; ``db = d * (1 + 2s)``.
    ``[..., nb, 110]`` -> ``[..., nb, 256]``."""
    lead = b.shape[:-1]
    idx = b[..., 2:66] | (_bits8(b[..., 66:74]).reshape(*lead, 64) << 8)
    sc = b[..., 106:110]
    nib = jnp.stack([sc & 0x0F, sc >> 4], axis=-1).reshape(*lead, 8)
    db = fp16_at(b, 0)[..., None] * (1 + 2 * nib).astype(_F32)  # [..., 8]
    signed = grid_rows("IQ3_S", idx).reshape(*lead, 32, 8) * _sign_bytes(b[..., 74:106])
    return (db[..., None] * signed.reshape(*lead, 8, 32).astype(_F32)).reshape(*lead, QK_K)


def decode_iq1_s(b: jax.Array) -> jax.Array:
    """IQ1_S (1.56 bpw): fp16 ``d``, 32 low index bytes, per sub-block of 32 a uint16 with four
    3-bit index tops, a 3-bit scale ``s`` (bits 12-14) and the delta's sign (bit 15); value
    ``d * (2s + 1) * (grid + delta)``, grid in {-1, 0, 1}. ``[.., 50]`` -> ``[.., 256]``."""
    lead = b.shape[:-1]
    qh = b[..., 34:50:2] | (b[..., 35:50:2] << 8)  # [..., 8]
    dl = fp16_at(b, 0)[..., None] * (2 * ((qh >> 12) & 7) + 1).astype(_F32)  # [..., 8]
    delta = jnp.where((qh & 0x8000) != 0, -IQ1_DELTA, IQ1_DELTA).astype(_F32)
    high = (qh[..., None] >> jnp.arange(0, 12, 3, dtype=jnp.int32)) & 7  # [..., 8, 4]
    idx = b[..., 2:34] | (high.reshape(*lead, 32) << 8)
    grid = (grid_rows("IQ1_S", idx) - 1).astype(_F32).reshape(*lead, 8, 4, 8)
    return (dl[..., None, None] * (grid + delta[..., None, None])).reshape(*lead, QK_K)


def iq1_m_scale_bits(b: jax.Array) -> jax.Array:
    """IQ1_M's fp16 super-block scale, spread over the top nibbles of the four uint16 at bytes
    48-55 (nibble ``i`` of the fp16 in uint16 ``i``), as int32 bits ``[...]``."""
    top = [u16_at(b, 48 + 2 * i) >> 12 for i in range(4)]
    return top[0] | (top[1] << 4) | (top[2] << 8) | (top[3] << 12)


def decode_iq1_m(b: jax.Array) -> jax.Array:
    """IQ1_M (1.75 bpw): 32 low index bytes, 16 bytes of nibbles (3 index bits and the delta's
    sign, one nibble per 8 weights), four uint16 of 3-bit scales (one per 16 weights) whose top
    nibbles hold the fp16 ``d``; value ``d * (2s + 1) * (grid + delta)``.
    ``[..., nb, 56]`` -> ``[..., nb, 256]``."""
    lead = b.shape[:-1]
    bits = iq1_m_scale_bits(b).astype(jnp.uint16)
    d = jax.lax.bitcast_convert_type(bits, jnp.float16).astype(_F32)  # [...]
    sc = b[..., 48:56:2] | (b[..., 49:56:2] << 8)  # [..., 4]
    s3 = (sc[..., None] >> jnp.arange(0, 12, 3, dtype=jnp.int32)) & 7  # [..., 4, 4]
    dl = d[..., None] * (2 * s3.reshape(*lead, 16) + 1).astype(_F32)  # [..., 16]
    nib = (b[..., 32:48, None] >> jnp.asarray([0, 4], jnp.int32)) & 0x0F  # [..., 16, 2]
    nib = nib.reshape(*lead, 32)
    delta = jnp.where((nib & 8) != 0, -IQ1_DELTA, IQ1_DELTA).astype(_F32).reshape(*lead, 16, 2, 1)
    idx = b[..., 0:32] | ((nib & 7) << 8)
    grid = (grid_rows("IQ1_M", idx) - 1).astype(_F32).reshape(*lead, 16, 2, 8)
    return (dl[..., None, None] * (grid + delta)).reshape(*lead, QK_K)
