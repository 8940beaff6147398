"""The Q2_K and Q3_K grids as stored bytes hold them: read each weight's grid, rewrite its code.

Both types keep one fp16 super-block scale and a small integer scale per 16 weights, so every
weight ``i`` of a stored super-block has a fixed uniform grid ``value = step_i · q + offset_i``
with integer codes ``q`` in a fixed range:

- Q2_K (84 bytes): ``step = d · (sc & 15)``, ``offset = −dmin · (sc >> 4)``, ``q`` in 0..3; the
  2-bit codes are "crumbs": byte ``32h + l`` of the 64 code bytes holds weight ``128h + 32j + l``
  at bits ``2j``.
- Q3_K (110 bytes): ``step = d · (sc − 32)`` with 6-bit scales, ``offset = 0``, ``q`` in −4..3
  stored as ``q + 4``: its low two bits in the crumbs, its bit 2 as bit ``i`` of mask byte ``l``
  for weight ``32i + l``.

Column-wise error feedback (:mod:`healsweep.quant.ggml_gptq`) keeps the scales ggml chose and
re-rounds every weight onto this grid; :func:`pack_codes` writes the new codes into a copy of the
bytes, leaving every scale byte as it was, so the result decodes with any Q2_K/Q3_K decoder.
The products ``step · q + offset`` are formed in float32 in the decoders' order (``d · sc``
first), so :func:`grid_values` equals ggml's and gguf-py's dequantization bit for bit.
Host numpy on uint8 arrays ``[..., n_blocks · block_bytes]``.
"""

from __future__ import annotations

import numpy as np

GGML_Q2_K, GGML_Q3_K = 10, 11
QK_K = 256
# ggml id -> (bytes per super-block, smallest code, largest code)
K_TYPES: dict[int, tuple[int, int, int]] = {GGML_Q2_K: (84, 0, 3), GGML_Q3_K: (110, -4, 3)}
_CODE_BYTES = {GGML_Q2_K: 16, GGML_Q3_K: 32}  # where the 64 crumb bytes start


def _blocks(raw: np.ndarray, qtype: int) -> np.ndarray:
    """``raw`` uint8 [..., nb·size] viewed as [..., nb, size]."""
    if qtype not in K_TYPES:
        raise ValueError(f"ggml_kgrid: type {qtype} is not Q2_K (10) or Q3_K (11)")
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


def grid(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """``(step, offset)`` float32 [..., n] of each weight of the stored rows ``raw`` [..., bytes]."""
    b = _blocks(raw, qtype)
    if qtype == GGML_Q2_K:
        sc = b[..., 0:16].astype(np.int32)
        step = _fp16(b, 80)[..., None] * (sc & 0x0F).astype(np.float32)  # [..., nb, 16]
        offset = -(_fp16(b, 82)[..., None] * (sc >> 4).astype(np.float32))
    else:
        step = _fp16(b, 108)[..., None] * _q3_k_scales(b[..., 96:108]).astype(np.float32)
        offset = np.zeros_like(step)
    lead = b.shape[:-2]
    expand = (*lead, b.shape[-2] * QK_K)
    return np.repeat(step, 16, axis=-1).reshape(expand), np.repeat(offset, 16, axis=-1).reshape(
        expand
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
    b = _blocks(raw, qtype).astype(np.int32)
    first = _CODE_BYTES[qtype]
    qs = b[..., first : first + 64].reshape(*b.shape[:-1], 2, 1, 32)
    crumbs = ((qs >> np.arange(0, 8, 2)[:, None]) & 3).reshape(*b.shape[:-1], QK_K)
    if qtype == GGML_Q3_K:
        high = (b[..., None, 0:32] >> np.arange(8)[:, None]) & 1  # [..., nb, 8, 32]
        crumbs = crumbs + 4 * high.reshape(*b.shape[:-1], QK_K) - 4
    return crumbs.reshape(*b.shape[:-2], b.shape[-2] * QK_K)


def pack_codes(raw: np.ndarray, new_codes: np.ndarray, qtype: int) -> np.ndarray:
    """A copy of ``raw`` [..., bytes] with every weight's code replaced by ``new_codes``
    [..., n] (in the type's range); the scale bytes are kept."""
    b = _blocks(raw, qtype).copy()
    _, low, high = K_TYPES[qtype]
    q = np.asarray(new_codes, np.int64)
    if q.min(initial=low) < low or q.max(initial=high) > high:
        raise ValueError(f"ggml_kgrid.pack_codes: codes outside {low}..{high} for type {qtype}")
    stored = (q - low).reshape(*b.shape[:-1], QK_K)  # Q3_K: q + 4 in 0..7
    crumbs = (stored & 3).reshape(*b.shape[:-1], 2, 4, 32)  # [..., half, shift j, byte l]
    qs = np.bitwise_or.reduce(crumbs << (2 * np.arange(4))[:, None], axis=-2)  # [..., 2, 32]
    first = _CODE_BYTES[qtype]
    b[..., first : first + 64] = qs.reshape(*b.shape[:-1], 64)
    if qtype == GGML_Q3_K:
        bits = (stored >> 2).reshape(*b.shape[:-1], 8, 32)  # [..., bit i, byte l]
        b[..., 0:32] = np.bitwise_or.reduce(bits << np.arange(8)[:, None], axis=-2)
    return b.reshape(np.shape(raw))


class KGrid:
    """The code decisions of stored rows ``raw`` [out, bytes] of Q2_K/Q3_K, made column by column
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
