"""The Q2_K-Q5_K grids as stored bytes hold them: read each weight's grid, rewrite its code.

Every K type keeps fp16 super-block scales and a small integer scale (and min) per 16 or 32
weights, so every weight ``i`` of a stored super-block has a fixed uniform grid
``value = step_i · q + offset_i`` with integer codes ``q`` in a fixed range:

- Q2_K (84 bytes): ``step = d · (sc & 15)``, ``offset = −dmin · (sc >> 4)``, ``q`` in 0..3; the
  2-bit codes are "crumbs": byte ``32h + l`` of the 64 code bytes holds weight ``128h + 32j + l``
  at bits ``2j``.
- Q3_K (110 bytes): ``step = d · (sc − 32)`` with 6-bit scales, ``offset = 0``, ``q`` in −4..3
  stored as ``q + 4``: its low two bits in the crumbs, its bit 2 as bit ``i`` of mask byte ``l``
  for weight ``32i + l``.
- Q4_K (144 bytes): fp16 ``d``, ``dmin``, 12 bytes of 6-bit scales ``sc`` and mins ``m`` (one
  each per 32 weights, packed as :func:`k_scale_min` reads them), 128 code bytes; ``step =
  d · sc``, ``offset = −dmin · m``, ``q`` in 0..15: 32-byte chunk ``c`` holds sub-block ``2c`` in
  its low nibbles and ``2c + 1`` in its high nibbles (weight ``l`` of each at byte ``32c + l``).
- Q5_K (176 bytes): Q4_K's grid with ``q`` in 0..31: the 32 bytes after the scales hold each
  code's bit 4 (sub-block ``i``'s weight ``l`` at bit ``i`` of byte ``l``), the nibbles follow.

Column-wise error feedback (:mod:`healsweep.quant.ggml_gptq`) keeps the scales ggml chose and
re-rounds every weight onto this grid; :func:`pack_codes` writes the new codes into a copy of the
bytes, leaving every scale byte as it was, so the result decodes with any decoder of its type.
The products ``step · q + offset`` are formed in float32 in the decoders' order (``d · sc``
first), so :func:`grid_values` equals ggml's and gguf-py's dequantization bit for bit.
Host numpy on uint8 arrays ``[..., n_blocks · block_bytes]``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from healsweep.kernels.ggml_types import stored_type

GGML_Q2_K, GGML_Q3_K, GGML_Q4_K, GGML_Q5_K = 10, 11, 12, 13
QK_K = 256


class _Layout(NamedTuple):
    """Where a K type keeps its codes: ``code_bits`` low bits of each code packed ``8 //
    code_bits`` to a byte from ``codes_at`` (weight ``32·(fields·g + f) + l`` at bits
    ``code_bits·f`` of byte ``32g + l``), the next bit in a plane of 32 bytes at ``plane_at``
    (weight ``32i + l`` at bit ``i`` of byte ``l``); stored code ``q − low``."""

    low: int  # smallest code
    high: int  # largest code
    sub: int  # weights per sub-block scale
    code_bits: int
    codes_at: int
    plane_at: int | None


_LAYOUTS = {
    GGML_Q2_K: _Layout(0, 3, 16, 2, 16, None),
    GGML_Q3_K: _Layout(-4, 3, 16, 2, 32, 0),
    GGML_Q4_K: _Layout(0, 15, 32, 4, 16, None),
    GGML_Q5_K: _Layout(0, 31, 32, 4, 48, 16),
}
# ggml id -> (bytes per super-block, smallest code, largest code)
K_TYPES: dict[int, tuple[int, int, int]] = {
    qtype: (stored_type(qtype).block_bytes, lay.low, lay.high) for qtype, lay in _LAYOUTS.items()
}


def _blocks(raw: np.ndarray, qtype: int) -> np.ndarray:
    """``raw`` uint8 [..., nb·size] viewed as [..., nb, size]."""
    if qtype not in K_TYPES:
        raise ValueError(f"ggml_kgrid: type {qtype} is not Q2_K, Q3_K, Q4_K or Q5_K (10-13)")
    size = K_TYPES[qtype][0]
    raw = np.asarray(raw, np.uint8)
    if raw.shape[-1] % size:
        raise ValueError(
            f"ggml_kgrid: rows of {raw.shape[-1]} bytes are not whole blocks of {size}"
        )
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // size, size)


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte ``offset`` of each block, as float32 [..., nb]."""
    return (
        np.ascontiguousarray(blocks[..., offset : offset + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 packed scale bytes [..., 12] -> int32 [..., 16] in −32..31: low nibbles from
    bytes 0-7 (scales 0-7 low, 8-15 high nibble), top two bits of scale ``j`` at bits
    ``2·(j // 4)`` of byte ``8 + j % 4``."""
    s = scales.astype(np.int32)
    low = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    top = (s[..., None, 8:12] >> np.arange(0, 8, 2)[:, None]) & 3  # [..., 4 shifts, 4 bytes]
    return (low | (top.reshape(*s.shape[:-1], 16) << 4)) - 32


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins, int32 [..., 8] each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 with their low 4
    bits in the nibbles of bytes 8-11 (scale low, min high) and their top 2 bits in the top
    bits of bytes 0-3 and 4-7."""
    s = scales.astype(np.int32)
    first, second, mixed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([first & 0x3F, (mixed & 0x0F) | ((first >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([second & 0x3F, (mixed >> 4) | ((second >> 2) & 0x30)], axis=-1)
    return sc, mn


def _sub_grid(b: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """``(step, offset)`` float32 [..., nb, sub-blocks] of the blocks ``b`` [..., nb, size]."""
    if qtype == GGML_Q2_K:
        sc = b[..., 0:16].astype(np.int32)
        step = _fp16(b, 80)[..., None] * (sc & 0x0F).astype(np.float32)  # [..., nb, 16]
        return step, -(_fp16(b, 82)[..., None] * (sc >> 4).astype(np.float32))
    if qtype == GGML_Q3_K:
        step = _fp16(b, 108)[..., None] * _q3_k_scales(b[..., 96:108]).astype(np.float32)
        return step, np.zeros_like(step)
    sc, mn = k_scale_min(b[..., 4:16])  # Q4_K, Q5_K: [..., nb, 8]
    step = _fp16(b, 0)[..., None] * sc.astype(np.float32)
    return step, -(_fp16(b, 2)[..., None] * mn.astype(np.float32))


def grid(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """``(step, offset)`` float32 [..., n] of each weight of the stored rows ``raw`` [..., bytes]."""
    b = _blocks(raw, qtype)
    step, offset = _sub_grid(b, qtype)
    width = _LAYOUTS[qtype].sub
    expand = (*b.shape[:-2], b.shape[-2] * QK_K)
    return (
        np.repeat(step, width, axis=-1).reshape(expand),
        np.repeat(offset, width, axis=-1).reshape(expand),
    )


def grid_values(step: np.ndarray, offset: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``step · q + offset`` float32, as the decoders compute it (``offset`` is ``−dmin·m``)."""
    return step * codes.astype(np.float32) + offset


def round_to_grid(values: np.ndarray, step: np.ndarray, offset: np.ndarray, qtype: int):
    """The nearest code of each value on its grid (ties to even, as ggml's ``nearest_int``),
    clipped to the type's range; a zero step (every code decodes alike) gives code 0 when the
    range holds it. int32, the shape of ``values``."""
    _, low, high = K_TYPES[qtype]
    nonzero = step != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(nonzero, (values - offset) / np.where(nonzero, step, 1.0), 0.0)
    return np.clip(np.rint(ratio), low, high).astype(np.int32)


def codes(raw: np.ndarray, qtype: int) -> np.ndarray:
    """The integer code of every weight of the stored rows ``raw`` [..., bytes]: int32 [..., n]."""
    lay = _LAYOUTS[qtype]
    b = _blocks(raw, qtype).astype(np.int32)
    bits, fields = lay.code_bits, 8 // lay.code_bits
    packed = b[..., lay.codes_at : lay.codes_at + 32 * bits].reshape(*b.shape[:-1], -1, 1, 32)
    shifts = (bits * np.arange(fields))[:, None]  # [fields, 1]
    stored = ((packed >> shifts) & ((1 << bits) - 1)).reshape(*b.shape[:-1], QK_K)
    if lay.plane_at is not None:
        plane = b[..., None, lay.plane_at : lay.plane_at + 32] >> np.arange(8)[:, None]  # [.., 8, 32]
        stored = stored + ((plane & 1).reshape(*b.shape[:-1], QK_K) << bits)
    return (stored + lay.low).reshape(*b.shape[:-2], b.shape[-2] * QK_K)


def pack_codes(raw: np.ndarray, new_codes: np.ndarray, qtype: int) -> np.ndarray:
    """A copy of ``raw`` [..., bytes] with every weight's code replaced by ``new_codes``
    [..., n] (in the type's range); the scale bytes are kept."""
    lay = _LAYOUTS[qtype]
    b = _blocks(raw, qtype).copy()
    q = np.asarray(new_codes, np.int64)
    if q.min(initial=lay.low) < lay.low or q.max(initial=lay.high) > lay.high:
        raise ValueError(
            f"ggml_kgrid.pack_codes: codes outside {lay.low}..{lay.high} for type {qtype}"
        )
    stored = (q - lay.low).reshape(*b.shape[:-1], QK_K)  # Q3_K: q + 4 in 0..7
    bits, fields = lay.code_bits, 8 // lay.code_bits
    low = (stored & ((1 << bits) - 1)).reshape(*b.shape[:-1], -1, fields, 32)  # [..., g, f, l]
    packed = np.bitwise_or.reduce(low << (bits * np.arange(fields))[:, None], axis=-2)
    b[..., lay.codes_at : lay.codes_at + 32 * bits] = packed.reshape(*b.shape[:-1], 32 * bits)
    if lay.plane_at is not None:
        plane = (stored >> bits).reshape(*b.shape[:-1], 8, 32)  # [..., bit i, byte l]
        b[..., lay.plane_at : lay.plane_at + 32] = np.bitwise_or.reduce(
            plane << np.arange(8)[:, None], axis=-2
        )
    return b.reshape(np.shape(raw))


class KGrid:
    """The code decisions of stored rows ``raw`` [out, bytes] of a K type, made column by column
    with :meth:`round` on the grid of ``raw``; :meth:`packed` writes them into a copy."""

    width = 1

    def __init__(self, raw: np.ndarray, qtype: int):
        self.qtype, self.raw = qtype, np.asarray(raw, np.uint8)
        self.step, self.offset = grid(self.raw, qtype)  # [out, n] each
        self.codes = np.zeros(self.step.shape, np.int32)

    def round(self, j: int, target: np.ndarray, omega: np.ndarray) -> np.ndarray:
        """Column ``j`` of every row to the nearest code for ``target`` [out, 1] (``omega`` does
        not change a nearest point); returns its values [out, 1]."""
        step, offset = self.step[:, j : j + 1], self.offset[:, j : j + 1]
        q = round_to_grid(target, step, offset, self.qtype)
        self.codes[:, j : j + 1] = q
        return grid_values(step, offset, q)

    def packed(self) -> np.ndarray:
        """A copy of the bytes with every code replaced; scales kept."""
        return pack_codes(self.raw, self.codes, self.qtype)
