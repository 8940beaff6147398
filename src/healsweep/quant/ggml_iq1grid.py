"""The IQ1_S and IQ1_M grids as stored bytes hold them: each group of 8 weights re-chosen on the
scales ggml stored.

Both types decode a group of 8 consecutive weights of a row as ``dl · (grid[idx] + δ)``:
``grid[idx]`` one row of 8 values in {−1, 0, 1} (gguf-py's ``IQ1_S.grid``, 2048 rows, an 11-bit
index, IQ1_M shares it), ``δ = ±0.125`` (ggml's ``IQ1S_DELTA``/``IQ1M_DELTA``: a shift of the
whole group, sign stored in one bit) and ``dl = d · (2s + 1)`` with the fp16 super-block ``d`` and
a 3-bit scale ``s``. No sign bits: the grid holds its own signs. Layout of a 256-weight block:

- IQ1_S (50 bytes): ``d``, then 32 index low bytes ``qs``, then 8 uint16 ``qh``, one per 32
  weights: bits ``3l..3l+2`` the high index bits of its group ``l``, bits 12-14 ``s``, bit 15 the
  sign of ``δ`` (one ``δ`` and one ``s`` for the four groups of 32 weights).
- IQ1_M (56 bytes): 32 ``qs``, then 16 bytes ``qh``, one per 2 groups: per nibble the 3 high
  index bits and (bit 3) the sign of that group's ``δ``; then 4 uint16 holding 16 3-bit scales
  (one per 16 weights, 4 per word at bits ``3j``) and in their top nibbles the fp16 ``d``
  (nibble ``i`` of ``d`` in word ``i``; :func:`healsweep.gguf_io.fold_scale` folds alpha there).

:class:`IQ1Grid` keeps every scale of ggml's answer (and IQ1_S's ``δ``, shared by four groups)
and chooses a group's index exactly: the lowest ``Σ ω_i (t_i − dl·(g_i + δ))²`` over all 2048
grid rows, on IQ1_M jointly with its own ``δ`` sign (4096 candidates). It is what column-wise
error feedback (:mod:`healsweep.quant.ggml_gptq`) rounds with, 8 columns at a time, as
:class:`~healsweep.quant.ggml_iqgrid.IQ2Grid` does on the IQ2 grids. The values it returns are
formed in float32 in the decoders' order (``dl · (grid + δ)``), so they equal gguf-py's and
ggml's dequantization of the packed bytes bit for bit. Host numpy.
"""

from __future__ import annotations

from functools import cache

import numpy as np

GGML_IQ1_S, GGML_IQ1_M = 19, 29
GROUP = 8  # weights per grid row
GROUPS = 32  # groups per 256-weight block
DELTA = np.float32(0.125)  # ggml's IQ1S_DELTA = IQ1M_DELTA
# ggml id -> bytes per block
IQ1_TYPES: dict[int, int] = {GGML_IQ1_S: 50, GGML_IQ1_M: 56}


@cache
def grid_table() -> np.ndarray:
    """gguf-py's IQ1 grid (IQ1_S's, which IQ1_M shares): float32 [2048, 8] in {−1, 0, 1}."""
    # lazy: heavy (gguf)
    import gguf.quants

    quant = gguf.quants.IQ1_S
    quant.init_grid()
    return np.asarray(quant.grid, np.float32).reshape(quant.grid_shape)


def _u16(blocks: np.ndarray, first: int, count: int) -> np.ndarray:
    """``count`` little-endian uint16 from byte ``first`` of each block: [..., nb, count]."""
    return np.ascontiguousarray(blocks[..., first : first + 2 * count]).view("<u2")


class IQ1Grid:
    """The group decisions of stored rows ``raw`` uint8 [out, nb·size] of IQ1_S or IQ1_M, made
    group by group with :meth:`round`; :meth:`packed` writes them into a copy of ``raw``."""

    width = GROUP

    def __init__(self, raw: np.ndarray, qtype: int):
        if qtype not in IQ1_TYPES:
            raise ValueError(f"ggml_iq1grid: type {qtype} is not IQ1_S (19) or IQ1_M (29)")
        self.qtype, self.raw = qtype, np.asarray(raw, np.uint8)
        n_out = self.raw.shape[0]
        blocks = self.raw.reshape(n_out, -1, IQ1_TYPES[qtype])  # [out, nb, size]
        nb = blocks.shape[1]
        if qtype == GGML_IQ1_S:
            d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float32)
            qh = _u16(blocks, 34, 8).astype(np.int64)  # [out, nb, 8]
            scale = (2 * ((qh >> 12) & 7) + 1).astype(np.float32)  # per 32 weights
            per_group = 4
            delta = np.where(qh & 0x8000, -DELTA, DELTA).astype(np.float32)
            self.delta = np.repeat(delta, per_group, axis=2).reshape(n_out, nb * GROUPS)
        else:
            words = _u16(blocks, 48, 4).astype(np.int64)  # [out, nb, 4]
            bits = sum(((words[..., i] >> 12) & 0xF) << (4 * i) for i in range(4))
            d = bits.astype(np.uint16).view(np.float16).astype(np.float32)  # [out, nb]
            scales = (words[..., :, None] >> np.array([0, 3, 6, 9])) & 7  # [out, nb, 4, 4]
            scale = (2 * scales.reshape(n_out, nb, 16) + 1).astype(np.float32)  # per 16 weights
            per_group = 2
            self.delta = np.full((n_out, nb * GROUPS), DELTA, np.float32)  # chosen per group
        dl = d[..., None] * scale  # [out, nb, scales], float32 as the decoders form it
        self.scale = np.repeat(dl, per_group, axis=2).reshape(n_out, nb * GROUPS)  # [out, groups]
        self.index = np.zeros(self.scale.shape, np.uint32)

    def round(self, g: int, target: np.ndarray, omega: np.ndarray) -> np.ndarray:
        """Choose group ``g`` of every row for ``target`` [out, 8] under per-column weights
        ``omega`` [8] (> 0); returns the decoded values [out, 8] float32."""
        table = grid_table().astype(np.float64)  # [N, 8]
        scale = self.scale[:, g].astype(np.float64)[:, None]  # [out, 1]
        t = np.asarray(target, np.float64)
        omega = np.asarray(omega, np.float64)
        pull = t * omega  # [out, 8]
        # Σ ω (t − s·(G + δ))² = Σωt² − 2s(ωt·G + δ Σωt) + s²(ω·G² + 2δ ω·G + δ² Σω):
        # products of [out, 8] by [8, N], never an [out, N, 8] tensor
        linear = pull @ table.T  # [out, N]
        square, first = omega @ np.square(table).T, omega @ table.T  # [N]
        pulled, total = pull.sum(1, keepdims=True), omega.sum()
        signs = (-1.0, 1.0) if self.qtype == GGML_IQ1_M else (None,)
        best_cost = best_index = best_delta = None
        for sign in signs:
            delta = (
                self.delta[:, g].astype(np.float64)[:, None]
                if sign is None
                else np.full_like(scale, sign * float(DELTA))
            )  # [out, 1]
            cost = -2 * scale * (linear + delta * pulled)
            cost += np.square(scale) * (square + 2 * delta * first + np.square(delta) * total)
            index = np.argmin(cost, axis=1)
            low = np.take_along_axis(cost, index[:, None], axis=1)[:, 0]
            if best_cost is None:
                best_cost, best_index, best_delta = low, index, delta[:, 0]
            else:
                better = low < best_cost
                best_cost = np.where(better, low, best_cost)
                best_index = np.where(better, index, best_index)
                best_delta = np.where(better, delta[:, 0], best_delta)
        self.index[:, g] = best_index
        self.delta[:, g] = best_delta.astype(np.float32)
        shifted = grid_table()[best_index] + self.delta[:, g, None]  # float32, grid + δ
        return self.scale[:, g, None] * shifted

    def packed(self) -> np.ndarray:
        """A copy of the bytes with every group's index (and IQ1_M's δ sign) replaced; the
        scales, ``d`` and IQ1_S's shared δ kept."""
        size = IQ1_TYPES[self.qtype]
        n_out = self.raw.shape[0]
        blocks = self.raw.reshape(n_out, -1, size).copy()
        nb = blocks.shape[1]
        index = self.index.reshape(n_out, nb, GROUPS).astype(np.int64)
        high = (index >> 8) & 7
        if self.qtype == GGML_IQ1_S:
            blocks[..., 2:34] = (index & 0xFF).astype(np.uint8)
            qh = _u16(blocks, 34, 8).astype(np.int64)  # [out, nb, 8]
            fields = (high.reshape(n_out, nb, 8, 4) << np.array([0, 3, 6, 9])).sum(-1)
            qh = (qh & 0xF000) | fields
            blocks[..., 34:50] = qh.astype("<u2").view(np.uint8).reshape(n_out, nb, 16)
        else:
            blocks[..., 0:32] = (index & 0xFF).astype(np.uint8)
            negative = (self.delta.reshape(n_out, nb, GROUPS) < 0).astype(np.int64)
            nibble = (high | (negative << 3)).reshape(n_out, nb, 16, 2)
            blocks[..., 32:48] = (nibble[..., 0] | (nibble[..., 1] << 4)).astype(np.uint8)
        return blocks.reshape(self.raw.shape)
