"""The IQ3_XXS and IQ3_S grids as stored bytes hold them: each group of weights re-chosen on the
scales ggml stored.

Both types decode 4 consecutive weights of a row as ``db · grid[idx] · sign`` with ``grid[idx]``
one row of 4 positive magnitudes and ``db`` a 4-bit scale per 32 weights on the fp16 super-block
``d`` (layouts as ggml's ``block_iq3_xxs``/``block_iq3_s``; gguf-py's ``IQ3_XXS``/``IQ3_S`` read
them alike):

- IQ3_XXS (98 bytes): ``d``, 64 index bytes (256 grid rows, magnitudes 4..62), then per 32
  weights a uint32: four 7-bit sign indices (one per 8 weights, the 8th sign their parity, as on
  the IQ2 grids: ggml's ``ksigns_iq2xs``) and the scale ``s`` in its top 4 bits;
  ``db = d · (0.5 + s) · 0.5``. The parity couples the two grid rows of 8 weights: a group here
  is 8 weights.
- IQ3_S (110 bytes): ``d``, 64 index low bytes, 8 bytes of index high bits (bit ``l`` of byte
  ``b``: index ``8b + l``, 512 grid rows, magnitudes 1..15), 32 sign bytes (bit ``j`` of byte
  ``k``: weight ``8k + j``, every mask allowed), 4 bytes of scales (low nibble first);
  ``db = d · (1 + 2s)``. Signs are free, so a group is one grid row of 4 weights.

:class:`IQ3Grid` keeps every scale byte of ggml's answer and chooses a group's (indices, signs)
exactly: the lowest ``Σ ω_i (t_i − v_i)²``. With free signs each weight takes the sign of its
target; under IQ3_XXS's parity, an odd count of minus signs costs the one cheapest flip
(``4·ω·|t|·db·G``) in either grid row of the group, so the optimum is the better of "flip in the
first row" and "flip in the second", each a sum of two independent minima over 256 rows (ggml
writes ``d ≥ 0``; a negative ``d`` mirrors every sign). Values are formed in float32 in the
decoders' order (``(db · grid) · ±1``), equal to gguf-py's and ggml's dequantization bit for
bit. It is what column-wise error feedback (:mod:`healsweep.quant.ggml_gptq`) rounds with, as
:class:`~healsweep.quant.ggml_iqgrid.IQ2Grid` does on the IQ2 grids. Host numpy.
"""

from __future__ import annotations

from functools import cache

import numpy as np

GGML_IQ3_XXS, GGML_IQ3_S = 18, 21
ROW = 4  # weights per grid row
# ggml id -> (gguf-py class name, bytes per 256-weight block, weights per group)
IQ3_TYPES: dict[int, tuple[str, int, int]] = {
    GGML_IQ3_XXS: ("IQ3_XXS", 98, 8),
    GGML_IQ3_S: ("IQ3_S", 110, 4),
}


@cache
def grid_table(qtype: int) -> np.ndarray:
    """gguf-py's grid of ``qtype``: float32 [rows, 4] positive magnitudes (256 or 512 rows)."""
    # lazy: heavy (gguf)
    import gguf.quants

    quant = getattr(gguf.quants, IQ3_TYPES[qtype][0])
    quant.init_grid()
    return np.asarray(quant.grid, np.float32).reshape(quant.grid_shape)


def _row_costs(magnitude, omega, scale, table):
    """``Σ ω (|t| − s·G)²`` of every grid row for targets' magnitudes [out, 4]: [out, N]
    float64, expanded into two products instead of an [out, N, 4] tensor."""
    pull = magnitude * omega
    cost = (pull * magnitude).sum(1, keepdims=True) - 2 * scale * (pull @ table.T)
    return cost + np.square(scale) * (omega @ np.square(table).T)[None, :]


def _cheapest_flip(pull, scale, table):
    """Per grid row, the cost ``4·s·min_i ω_i|t_i|G_i`` of flipping one sign: [out, N]."""
    cheapest = np.multiply.outer(pull[:, 0], table[:, 0])
    for i in range(1, ROW):  # [out, N] at a time, not an [out, N, 4] tensor
        np.minimum(cheapest, np.multiply.outer(pull[:, i], table[:, i]), out=cheapest)
    return 4 * scale * cheapest


class IQ3Grid:
    """The group decisions of stored rows ``raw`` uint8 [out, nb·size] of IQ3_XXS or IQ3_S,
    made group by group with :meth:`round`; :meth:`packed` writes them into a copy of ``raw``."""

    def __init__(self, raw: np.ndarray, qtype: int):
        if qtype not in IQ3_TYPES:
            raise ValueError(f"ggml_iq3grid: type {qtype} is not IQ3_XXS (18) or IQ3_S (21)")
        _, size, self.width = IQ3_TYPES[qtype]
        self.qtype, self.raw = qtype, np.asarray(raw, np.uint8)
        n_out = self.raw.shape[0]
        blocks = self.raw.reshape(n_out, -1, size)
        d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float32)
        if qtype == GGML_IQ3_XXS:
            words = np.ascontiguousarray(blocks[..., 66:98]).view("<u4")  # [out, nb, 8]
            scales = (words >> 28).astype(np.float32)
            db = d[..., None] * (np.float32(0.5) + scales) * np.float32(0.5)
        else:
            nibbles = blocks[..., 106:110, None] >> np.array([0, 4], np.uint8)
            scales = (nibbles & 0x0F).reshape(n_out, -1, 8).astype(np.float32)
            db = d[..., None] * (np.float32(1) + np.float32(2) * scales)
        self.scale = np.repeat(db.reshape(n_out, -1), 32 // ROW, axis=1)  # [out, grid rows]
        self.index = np.zeros(self.scale.shape, np.uint32)  # per grid row of 4 weights
        self.negative = np.zeros((n_out, self.scale.shape[1] * ROW), bool)  # per weight

    def round(self, g: int, target: np.ndarray, omega: np.ndarray) -> np.ndarray:
        """Choose group ``g`` (``width`` weights) of every row for ``target`` [out, width] under
        per-column weights ``omega`` [width] (> 0); returns the decoded values [out, width]."""
        table = grid_table(self.qtype).astype(np.float64)  # [N, 4]
        rows = g * self.width // ROW  # the group's first grid row
        signed = self.scale[:, rows].astype(np.float64)[:, None]  # [out, 1], one scale a group
        scale = np.abs(signed)  # a negative d mirrors every sign (8 flips keep the parity)
        target = np.asarray(target, np.float32)
        magnitude = np.abs(target).astype(np.float64)
        omega = np.asarray(omega, np.float64)
        negative = (target < 0) ^ (signed < 0)
        if self.qtype == GGML_IQ3_S:
            best = [np.argmin(_row_costs(magnitude, omega, scale, table), axis=1)]
        else:
            best = self._parity_rows(magnitude, omega, scale, table, negative)
        self.index[:, rows : rows + len(best)] = np.stack(best, axis=1)
        self.negative[:, g * self.width : (g + 1) * self.width] = negative
        chosen = np.concatenate([grid_table(self.qtype)[b] for b in best], axis=1)
        values = self.scale[:, rows, None] * chosen  # the decoder's db · grid, float32
        return values * np.where(negative, np.float32(-1), np.float32(1))

    @staticmethod
    def _parity_rows(magnitude, omega, scale, table, negative):
        """IQ3_XXS's two grid rows of a group of 8 under the even-parity sign constraint;
        ``negative`` [out, 8] becomes the chosen signs (one flip where the count is odd)."""
        halves = (slice(0, ROW), slice(ROW, 2 * ROW))
        costs = [_row_costs(magnitude[:, h], omega[h], scale, table) for h in halves]
        flips = [c + _cheapest_flip(magnitude[:, h] * omega[h], scale, table)
                 for c, h in zip(costs, halves, strict=True)]  # fmt: skip
        plain = [np.argmin(c, axis=1) for c in costs]
        flipped = [np.argmin(f, axis=1) for f in flips]
        out = np.arange(len(scale))
        low = [c[out, b] for c, b in zip(costs, plain, strict=True)]
        low_flip = [f[out, b] for f, b in zip(flips, flipped, strict=True)]
        odd = np.count_nonzero(negative, axis=1) % 2 == 1
        first = odd & (low_flip[0] + low[1] <= low[0] + low_flip[1])  # the flip in row 0
        second = odd & ~first
        best = [np.where(first, flipped[0], plain[0]), np.where(second, flipped[1], plain[1])]
        for half, where in ((0, first), (1, second)):
            cols = halves[half]
            pull = magnitude[where, cols] * omega[cols] * table[best[half][where]]
            negative[np.nonzero(where)[0], half * ROW + np.argmin(pull, axis=1)] ^= True
        return best

    def packed(self) -> np.ndarray:
        """A copy of the bytes with every grid index and sign replaced; ``d`` and the scales
        kept."""
        size = IQ3_TYPES[self.qtype][1]
        n_out = self.raw.shape[0]
        blocks = self.raw.reshape(n_out, -1, size).copy()
        nb = blocks.shape[1]
        index = self.index.reshape(n_out, nb, 64)
        bits = self.negative.reshape(n_out, nb, 32, 8).astype(np.uint32)
        masks = (bits << np.arange(8, dtype=np.uint32)).sum(-1)  # [out, nb, 32] per 8 weights
        blocks[..., 2:66] = (index & 0xFF).astype(np.uint8)
        if self.qtype == GGML_IQ3_XXS:
            words = np.ascontiguousarray(blocks[..., 66:98]).view("<u4")  # [out, nb, 8]
            sign7 = (masks & 127).reshape(n_out, nb, 8, 4)  # ksigns index of an even mask
            fields = (sign7 << np.array([0, 7, 14, 21], np.uint32)).sum(-1)
            words = (words & np.uint32(0xF0000000)) | fields.astype(np.uint32)
            blocks[..., 66:98] = words.astype("<u4").view(np.uint8).reshape(n_out, nb, 32)
        else:
            high = (index >> 8).reshape(n_out, nb, 8, 8)
            blocks[..., 66:74] = (high << np.arange(8, dtype=np.uint32)).sum(-1).astype(np.uint8)
            blocks[..., 74:106] = masks.astype(np.uint8)
        return blocks.reshape(self.raw.shape)
