"""Numpy quantizers for ggml types gguf-py cannot write: Q4_K, Q5_K, Q6_K and IQ4_XS.

They exist so benchmarks and tests can write random models whose experts are stored the way
real models ship. Each is plain round-to-nearest on ggml's block layout, not llama.cpp's
error-minimizing search, so its error is a little above llama.cpp's at the same type:

- Q4_K / Q5_K: super-blocks of 256 = 8 sub-blocks of 32. Per sub-block the range
  ``[min(x, 0), max(x)]`` gives a scale ``(max - min) / levels`` and a min ``-min(x, 0)``; the
  super-block stores fp16 ``d = max(scale)/63`` and ``dmin = max(min)/63`` and each sub-block
  6-bit integers ``sc``, ``m`` relative to them; codes round ``(x + dmin*m) / (d*sc)``.
- Q6_K: 16 sub-blocks of 16, symmetric: sub-scale ``amax/-32`` (the signed extreme maps onto
  code -32), stored as int8 relative to fp16 ``d = max|scale|/127``; codes -32..31.
- IQ4_XS: 8 sub-blocks of 32 on IQ4_NL's codebook; sub-scale ``amax/-127`` stored as a 6-bit
  signed integer relative to fp16 ``d = max|scale|/31``; nearest codebook entry.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256
_CHUNK = 1 << 14  # super-blocks per chunk (4M weights): bounded temporaries, cache-friendly
_FP16_MAX = 65504.0
KVALUES_IQ4 = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` rounded to fp16 (clipped to its range): ``(bytes [..., 2], float32 value)``."""
    half = np.clip(x, -_FP16_MAX, _FP16_MAX).astype(np.float16)
    return half[..., None].view(np.uint8), half.astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` with 0 where ``den`` is 0."""
    safe = np.where(den != 0, den, 1.0)
    return np.where(den != 0, num / safe, 0.0).astype(np.float32)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K packing of 6-bit scales and mins: two ``[..., 8]`` -> ``[..., 12]`` uint8."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    low_sc = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    low_mn = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    mixed = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return np.concatenate([low_sc, low_mn, mixed], axis=-1)


def _affine_k(x: np.ndarray, levels: int):
    """Q4_K/Q5_K fields of super-blocks ``x`` [S, 8, 32]: d, dmin bytes, packed scales, codes."""
    lo = np.minimum(x.min(axis=-1), 0.0)  # [S, 8]
    scale = (x.max(axis=-1) - lo) / levels
    d_bytes, d = _fp16(scale.max(axis=-1) / 63)  # [S, 2], [S]
    dmin_bytes, dmin = _fp16((-lo).max(axis=-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63)
    mn = np.clip(np.rint(_ratio(-lo, dmin[:, None])), 0, 63)
    dl, ml = d[:, None] * sc, dmin[:, None] * mn  # [S, 8] effective sub-block scale and min
    q = np.clip(np.rint(_ratio(x + ml[..., None], dl[..., None])), 0, levels).astype(np.uint8)
    return np.concatenate([d_bytes, dmin_bytes, pack_k_scales(sc, mn)], axis=-1), q


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Codes [S, 8, 32] (low 4 bits) -> [S, 128]: chunk c = sub-block 2c | sub-block 2c+1 << 4."""
    q = q & 0x0F
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    head, q = _affine_k(x.reshape(-1, 8, 32), 15)
    return np.concatenate([head, _nibble_pairs(q)], axis=-1)  # [S, 144]


def _q5_k(x: np.ndarray) -> np.ndarray:
    head, q = _affine_k(x.reshape(-1, 8, 32), 31)
    high = (q >> 4) << np.arange(8, dtype=np.uint8)[:, None]  # [S, 8, 32]: bit i = sub-block i
    qh = np.bitwise_or.reduce(high, axis=1)  # [S, 32]
    return np.concatenate([head, qh, _nibble_pairs(q)], axis=-1)  # [S, 176]


def _q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16)
    n = len(x)
    idx = np.abs(x).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(x, idx, axis=-1)[..., 0] / -32  # [S, 16] signed
    d_bytes, d = _fp16(np.abs(scale).max(axis=-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -128, 127)
    dl = d[:, None] * sc
    q = np.rint(_ratio(x, dl[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # halves of 128
    lo, hi = q & 0x0F, q >> 4
    ql = lo[..., :64] | (lo[..., 64:] << 4)  # [S, 2, 64]
    qh = hi[..., :32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:] << 6)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales, d_bytes], axis=-1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 8, 32)
    n = len(x)
    idx = np.abs(x).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(x, idx, axis=-1)[..., 0] / -127  # [S, 8] signed
    d_bytes, d = _fp16(np.abs(scale).max(axis=-1) / 31)
    ls = np.clip(np.rint(_ratio(scale, d[:, None])), -32, 31)  # [S, 8]
    dl = d[:, None] * ls
    t = _ratio(x, dl[..., None])
    mids = (KVALUES_IQ4[1:] + KVALUES_IQ4[:-1]) / 2
    code = np.searchsorted(mids, t, side="left").astype(np.uint8)  # nearest codebook entry
    stored = (ls + 32).astype(np.uint8)  # 0..63
    scales_h = np.zeros(n, np.uint16)
    for j in range(8):
        scales_h |= ((stored[:, j] >> 4) & 3).astype(np.uint16) << np.uint16(2 * j)
    scales_l = (stored[:, 0::2] & 0x0F) | ((stored[:, 1::2] & 0x0F) << 4)  # [S, 4]
    qs = (code[..., :16] | (code[..., 16:] << 4)).reshape(n, 128)
    h_bytes = scales_h.astype("<u2")[:, None].view(np.uint8)
    return np.concatenate([d_bytes, h_bytes, scales_l, qs], axis=-1)  # [S, 136]


_BLOCK_ENCODERS: dict[int, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    12: (144, _q4_k),
    13: (176, _q5_k),
    14: (210, _q6_k),
    23: (136, _iq4_xs),
}
KQUANT_TYPES = frozenset(_BLOCK_ENCODERS)


def quantize_kquant(values: np.ndarray, qtype: int) -> np.ndarray:
    """``values`` float32 ``[..., n]`` (``n`` a multiple of 256) -> uint8 ``[..., n/256*size]``
    in ggml type ``qtype`` (one of :data:`KQUANT_TYPES`: Q4_K, Q5_K, Q6_K, IQ4_XS)."""
    size, encode = _BLOCK_ENCODERS[int(qtype)]
    values = np.asarray(values, np.float32)
    if values.shape[-1] % QK_K:
        raise ValueError(f"quantize_kquant: rows of {values.shape[-1]} are not a multiple of 256")
    flat = values.reshape(-1, QK_K)
    out = np.empty((len(flat), size), np.uint8)
    for start in range(0, len(flat), _CHUNK):
        out[start : start + _CHUNK] = encode(flat[start : start + _CHUNK])
    return out.reshape(*values.shape[:-1], values.shape[-1] // QK_K * size)
