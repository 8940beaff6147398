"""The IQ2_XXS and IQ2_XS grids as stored bytes hold them: each group of 8 weights re-chosen on the
scales ggml stored.

Both types store an fp16 super-block ``d`` and 4-bit scales ``s`` (IQ2_XXS: one per 32 weights,
IQ2_XS: one per 16), so a group of 8 consecutive weights of a row decodes as
``(db · grid[idx]) · sign`` with ``db = d · (0.5 + s) · 0.25``, ``grid[idx]`` one row of 8
magnitudes (gguf-py's ``IQ2_XXS.grid``, 256 rows; ``IQ2_XS.grid``, 512 rows) and signs with an
even number of minus signs (7 stored bits, the 8th their parity: ggml's ``ksigns_iq2xs``).
Layout (after ``d``): IQ2_XXS, per 32 weights, 4 index bytes then a uint32 of four 7-bit sign
indices and the scale in its top 4 bits; IQ2_XS, one uint16 per group (9-bit index, 7-bit signs)
then 8 scale bytes.

:class:`IQ2Grid` keeps every scale byte of ggml's answer and chooses a group's (index, signs)
exactly: the lowest ``Σ ω_i (t_i − v_i)²`` over every grid row, the signs of ``t`` with, when
their count of minus signs is odd, the one flip that costs least (any odd number of flips costs
more than one). It is what column-wise error feedback (:mod:`healsweep.quant.ggml_gptq`) rounds
with, 8 columns at a time. Host numpy.
"""

from __future__ import annotations

from functools import cache

import numpy as np

GGML_IQ2_XXS, GGML_IQ2_XS = 16, 17
QK_K = 256
GROUP = 8  # weights per grid row
# ggml id -> (gguf-py class name, bytes per super-block, weights per 4-bit scale)
IQ_TYPES: dict[int, tuple[str, int, int]] = {
    GGML_IQ2_XXS: ("IQ2_XXS", 66, 32),
    GGML_IQ2_XS: ("IQ2_XS", 74, 16),
}


@cache
def grid_table(qtype: int) -> np.ndarray:
    """gguf-py's grid of ``qtype``: float32 [rows, 8] magnitudes (8, 25 or 43)."""
    # lazy: heavy (gguf)
    import gguf.quants

    quant = getattr(gguf.quants, IQ_TYPES[qtype][0])
    quant.init_grid()
    return np.asarray(quant.grid, np.float32).reshape(quant.grid_shape)


class IQ2Grid:
    """The group decisions of stored rows ``raw`` uint8 [out, nb·size] of an IQ2 type, made
    group by group with :meth:`round`; :meth:`packed` writes them into a copy of ``raw``."""

    width = GROUP

    def __init__(self, raw: np.ndarray, qtype: int):
        _, size, per_scale = IQ_TYPES[qtype]
        self.qtype, self.raw = qtype, np.asarray(raw, np.uint8)
        n_out = self.raw.shape[0]
        blocks = self.raw.reshape(n_out, -1, size)
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if qtype == GGML_IQ2_XXS:
            words = np.ascontiguousarray(blocks[..., 2:66]).view(np.uint32).reshape(n_out, -1, 8, 2)
            scales = (words[..., 1] >> 28).astype(np.float32)  # [out, nb, 8]
        else:
            packed = blocks[..., 66:74, None] >> np.array([0, 4], np.uint8)
            scales = (packed & 0x0F).reshape(n_out, -1, 16).astype(np.float32)
        db = d[..., None] * (np.float32(0.5) + scales) * np.float32(0.25)  # [out, nb, scales]
        self.scale = np.repeat(db.reshape(n_out, -1), per_scale // GROUP, axis=1)  # [out, groups]
        self.index = np.zeros(self.scale.shape, np.uint32)
        self.signs = np.zeros(self.scale.shape, np.uint32)  # 8-bit masks, even parity

    def round(self, g: int, target: np.ndarray, omega: np.ndarray) -> np.ndarray:
        """Choose group ``g`` of every row for ``target`` [out, 8] under per-column weights
        ``omega`` [8] (> 0); returns the decoded values [out, 8] float32."""
        table = grid_table(self.qtype)  # [N, 8]
        scale = self.scale[:, g].astype(np.float64)[:, None]  # [out, 1]
        magnitude = np.abs(target).astype(np.float64)
        pull = magnitude * omega  # [out, 8]
        # Σ ω (|t| − s·G)² expanded: two small products instead of an [out, N, 8] tensor
        cost = (pull * magnitude).sum(1, keepdims=True) - 2 * scale * (pull @ table.T)
        cost += np.square(scale) * (omega @ np.square(table).T)[None, :]  # [out, N]
        negative = target < 0
        odd = np.count_nonzero(negative, axis=1) % 2 == 1
        # an odd count of minus signs: the cheapest single flip, 4·ω·|t|·s·G, per grid row
        odd_pull = pull[odd]
        cheapest = np.multiply.outer(odd_pull[:, 0], table[:, 0])  # [odd rows, N]
        for i in range(1, GROUP):  # [odd, N] at a time, not an [odd, N, 8] tensor
            np.minimum(cheapest, np.multiply.outer(odd_pull[:, i], table[:, i]), out=cheapest)
        cost[odd] += 4 * scale[odd] * cheapest
        best = np.argmin(cost, axis=1)
        flipped = np.argmin(odd_pull * table[best[odd]], axis=1)
        negative[np.nonzero(odd)[0], flipped] ^= True
        self.index[:, g] = best
        self.signs[:, g] = (negative.astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(1)
        values = self.scale[:, g, None] * table[best]  # the decoder's db · grid, float32
        return values * np.where(negative, np.float32(-1), np.float32(1))

    def packed(self) -> np.ndarray:
        """A copy of the bytes with every group's index and signs replaced; scales kept."""
        _, size, _ = IQ_TYPES[self.qtype]
        n_out = self.raw.shape[0]
        blocks = self.raw.reshape(n_out, -1, size).copy()
        nb = blocks.shape[1]
        signs = self.signs & 127  # ksigns index of an even-parity mask
        if self.qtype == GGML_IQ2_XXS:
            index = self.index.reshape(n_out, nb, 8, 4)
            sign7 = signs.reshape(n_out, nb, 8, 4)
            words = np.ascontiguousarray(blocks[..., 2:66]).view(np.uint32).reshape(n_out, nb, 8, 2)
            low = (index << np.array([0, 8, 16, 24], np.uint32)).sum(-1)
            high = (sign7 << np.array([0, 7, 14, 21], np.uint32)).sum(-1) | (
                words[..., 1] & 0xF0000000
            )
            words = np.stack([low, high], axis=-1).astype(np.uint32)
            blocks[..., 2:66] = words.reshape(n_out, nb, 16).view(np.uint8)
        else:
            words = (self.index | (signs << 9)).astype(np.uint16).reshape(n_out, nb, 32)
            blocks[..., 2:66] = words.view(np.uint8)
        return blocks.reshape(self.raw.shape)
