"""Folding a factor into the fp16 scales of stored GGUF blocks (how Part A's alpha reaches any type).

Every block type healsweep heals decodes as ``fp16 scale(s) × (integers, grid values)``: scaling
the block's fp16 ``d`` (and, for the affine types, its fp16 min/offset ``dmin``/``m``) by ``f``
scales every decoded weight by ``f``, up to the fp16 rounding of the new scale. So the heal layer
applies alpha to the routed down projection of any type by rewriting a few bytes per block, with
no re-quantization and no float32 copy of the experts.

Host-side numpy on stored bytes: the product ``f × d`` is formed in float64 (exact for a float32
``f``) and rounded once to fp16, clipped to ±65504 so a large factor saturates instead of making
an infinity; scales that are already inf or NaN are left as they are.
"""

from __future__ import annotations

import numpy as np

from healsweep.errors import GGUFFormatError
from healsweep.kernels.ggml_types import STORED_TYPES, stored_type

_FP16_MAX = 65504.0

# ggml type id -> (bytes per block, byte offsets of the fp16 fields scaled together), from the
# one table of block geometry (kernels.ggml_types); the float types have no block scale
SCALE_FIELDS: dict[int, tuple[int, tuple[int, ...]]] = {
    t.ggml_id: (t.block_bytes, t.scale_offsets) for t in STORED_TYPES if t.scale_offsets is not None
}
FOLDABLE_TYPES: frozenset[int] = frozenset(SCALE_FIELDS)


def _scaled_fp16(bits: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """fp16 bit patterns (uint16) times ``factor`` (float64, broadcast), rounded once to fp16,
    clipped to the finite fp16 range; non-finite inputs keep their bits."""
    half = bits.view(np.float16)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN scales: replaced below
        product = np.clip(half.astype(np.float64) * factor, -_FP16_MAX, _FP16_MAX)
    return np.where(np.isfinite(half), product.astype(np.float16), half).view(np.uint16)


def _get_u16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset].astype(np.uint16) | (blocks[..., offset + 1].astype(np.uint16) << 8)


def _set_u16(blocks: np.ndarray, offset: int, bits: np.ndarray) -> None:
    blocks[..., offset] = bits & 0xFF
    blocks[..., offset + 1] = bits >> 8


def fold_scale(raw: np.ndarray, qtype: int, factor: float | np.ndarray) -> np.ndarray:
    """``raw`` with every block's fp16 scale(s) multiplied by ``factor``: decodes to ``factor``
    times what ``raw`` decodes to, up to the fp16 rounding of each new scale.

    ``raw`` is uint8 ``[..., out, row_bytes]`` (stored rows, e.g. an expert stack ``[E, out,
    row_bytes]``), ``qtype`` a ggml type id in :data:`FOLDABLE_TYPES`, ``factor`` a finite scalar
    or an array broadcastable to ``raw.shape[:-2]`` (one factor per expert, say). Returns a new
    uint8 array of ``raw``'s shape; ``factor == 1`` returns ``raw``'s bytes unchanged.
    """
    qtype = int(qtype)
    raw = np.asarray(raw)
    if qtype not in SCALE_FIELDS:
        raise GGUFFormatError(
            f"fold_scale: ggml type {qtype} has no fp16 block scale healsweep can fold into; "
            f"foldable types: {sorted(FOLDABLE_TYPES)}"
        )
    size, offsets = SCALE_FIELDS[qtype]
    if raw.dtype != np.uint8 or raw.ndim < 2 or raw.shape[-1] % size:
        raise GGUFFormatError(
            f"fold_scale: expected uint8 rows [..., out, row_bytes] of whole {size}-byte blocks "
            f"(ggml type {qtype}), got {raw.dtype} {raw.shape}"
        )
    factor = np.asarray(factor, np.float64)
    if not np.isfinite(factor).all():
        raise ValueError(f"fold_scale: factor must be finite, got {factor}")
    try:
        factor = np.broadcast_to(factor, raw.shape[:-2])[..., None, None]  # [..., 1, 1]
    except ValueError:
        raise ValueError(
            f"fold_scale: factor of shape {factor.shape} does not broadcast to the leading "
            f"dims {raw.shape[:-2]} of rows {raw.shape}"
        ) from None
    blocks = raw.reshape(*raw.shape[:-1], -1, size).copy()  # [..., out, nb, size]
    for offset in offsets:
        _set_u16(blocks, offset, _scaled_fp16(_get_u16(blocks, offset), factor))
    nibbles = stored_type(qtype).nibble_scale  # IQ1_M: the fp16 over four words' top nibbles
    if nibbles is not None:
        words = [_get_u16(blocks, nibbles + 2 * i) for i in range(4)]
        d_bits = (words[0] >> 12) | ((words[1] >> 12) << 4) | ((words[2] >> 12) << 8)
        d_bits = _scaled_fp16(d_bits | (words[3] & 0xF000), factor)
        for i, word in enumerate(words):
            top = ((d_bits >> (4 * i)) & 0xF) << 12
            _set_u16(blocks, nibbles + 2 * i, (word & 0x0FFF) | top)
    return blocks.reshape(raw.shape)
