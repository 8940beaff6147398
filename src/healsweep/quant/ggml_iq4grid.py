"""The IQ4_XS grid as stored bytes hold it: each weight's code re-chosen on the scales ggml stored.

IQ4_XS (136 bytes a 256-weight block, ggml's ``block_iq4_xs``; gguf-py's ``IQ4_XS`` reads it
alike): the fp16 super-block ``d``, a uint16 of the high 2 bits of the eight 6-bit scales (bits
``2i``, ``2i + 1`` for sub-block ``i`` of 32 weights), 4 bytes of their low 4 bits (low nibble
first), then per sub-block 16 bytes of 4-bit codes (byte ``j``: weight ``j`` in its low nibble,
weight ``j + 16`` in its high). A weight decodes as ``dl · K[q]`` with ``dl = d · (ls − 32)``
and ``K`` IQ4_NL's 16 non-linear values (gguf-py's ``IQ4_NL.kvalues``, −127..113).

Given the scales every weight is independent, and its best code under any positive weight is the
nearest value ``dl · K[q]``: :class:`IQ4Grid` re-rounds one column at a time (``width`` 1, as
:class:`~healsweep.quant.ggml_kgrid.KGrid` on the K grids) and :meth:`IQ4Grid.packed` rewrites
the code nibbles of a copy of ggml's bytes, ``d`` and the scales kept. Values are formed in
float32 in the decoders' order (``(d · (ls − 32)) · K[q]``), equal to gguf-py's and ggml's
dequantization bit for bit. Host numpy.
"""

from __future__ import annotations

import numpy as np

GGML_IQ4_XS = 23
BLOCK_BYTES = 136
SUB = 32  # weights per 6-bit scale
KVALUES = np.array(
    (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32
)  # IQ4_NL's values (ggml's kvalues_iq4nl)
IQ4_TYPES: dict[int, int] = {GGML_IQ4_XS: BLOCK_BYTES}  # ggml id -> bytes per block


def sub_block_scales(raw: np.ndarray) -> np.ndarray:
    """``dl = d · (ls − 32)`` of each 32-weight sub-block of IQ4_XS rows ``raw`` uint8
    [out, nb·136]: float32 [out, nb·8]."""
    n_out = raw.shape[0]
    blocks = np.asarray(raw, np.uint8).reshape(n_out, -1, BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float32)
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")[..., 0].astype(np.int32)
    high = (high[..., None] >> (2 * np.arange(8))) & 3  # [out, nb, 8]
    low = (blocks[..., 4:8, None].astype(np.int32) >> np.array([0, 4])) & 0x0F
    scales = low.reshape(n_out, -1, 8) | (high << 4)
    return (d[..., None] * (scales - 32).astype(np.float32)).reshape(n_out, -1)


class IQ4Grid:
    """The code decisions of stored rows ``raw`` uint8 [out, nb·136] of IQ4_XS, made column by
    column with :meth:`round`; :meth:`packed` writes them into a copy of ``raw``."""

    width = 1

    def __init__(self, raw: np.ndarray, qtype: int):
        if qtype not in IQ4_TYPES:
            raise ValueError(f"ggml_iq4grid: type {qtype} is not IQ4_XS (23)")
        self.qtype, self.raw = qtype, np.asarray(raw, np.uint8)
        self.scale = sub_block_scales(self.raw)  # [out, sub-blocks]
        self.codes = np.zeros((self.raw.shape[0], self.scale.shape[1] * SUB), np.uint8)

    def round(self, j: int, target: np.ndarray, omega: np.ndarray) -> np.ndarray:
        """Column ``j`` of every row to its nearest value ``dl · K[q]`` for ``target`` [out, 1]
        (``omega`` does not change a nearest point; ties to the lower code); returns the
        values [out, 1] float32."""
        candidates = self.scale[:, j // SUB, None] * KVALUES  # [out, 16], the decoder's product
        distance = np.abs(np.asarray(target, np.float64) - candidates.astype(np.float64))
        best = np.argmin(distance, axis=1)
        self.codes[:, j] = best
        return np.take_along_axis(candidates, best[:, None], axis=1)

    def packed(self) -> np.ndarray:
        """A copy of the bytes with every code nibble replaced; ``d`` and the scales kept."""
        n_out = self.raw.shape[0]
        blocks = self.raw.reshape(n_out, -1, BLOCK_BYTES).copy()
        codes = self.codes.reshape(n_out, blocks.shape[1], 8, 2, 16)  # [.., sub, half, byte]
        nibbles = codes[..., 0, :] | (codes[..., 1, :] << 4)
        blocks[..., 8:136] = nibbles.reshape(n_out, -1, 128)
        return blocks.reshape(self.raw.shape)
