"""``quantizer: gptq`` on ggml's Q2_K and Q3_K: error feedback over the grid ggml chose.

ggml quantizes the experts first (with their importance rows, as for any ggml type); the grid it
stored, one scale ``d·sc`` (and for Q2_K an offset ``dmin·m``) per 16 weights, is then kept and
only the codes are chosen again by :func:`healsweep.kernels.gptq_grid.quantize`, column by
column with each expert's damped input second moment ``H_e`` (the same ``H_e``, damping and
host factor as Q2_0's ``gptq``: :func:`healsweep.quant.gptq.factor`). The bytes stay a valid Q2_K / Q3_K block, so
llama.cpp runs them as any other. Experts with fewer than ``min_tokens_per_expert`` routed tokens,
or whose ``H_e`` does not factor, keep ggml's codes (counted in the stage's report).

Byte layouts (ggml-common.h): Q2_K ``scales[16]`` (low nibble ``sc``, high ``m``), ``qs[64]``,
fp16 ``d``, ``dmin``; Q3_K ``hmask[32]``, ``qs[64]``, ``scales[12]`` (6-bit, minus 32), fp16
``d``. The 2-bit crumbs of weight ``128h + 32j + l`` sit at bits ``2j`` of ``qs[32h + l]``; Q3_K's
third bit of weight ``32i + l`` at bit ``i`` of ``hmask[l]``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from healsweep.kernels import gptq_grid
from healsweep.kernels._decode_kquants import q3_k_scales
from healsweep.quant import gptq

GGML_Q2_K, GGML_Q3_K = 10, 11
# qtype -> (block bytes, code bytes offset, shift, codes)
_LAYOUT = {GGML_Q2_K: (84, 16, 0, 4), GGML_Q3_K: (110, 32, 4, 8)}


def grid(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The grid of stored rows ``raw`` uint8 ``[..., row_bytes]``: ``(scale, offset)`` float32
    ``[..., n/16]`` and the static ``(shift, n_codes)``; a weight holds ``scale·(c − shift) −
    offset`` (float32, the decoders' operation order)."""

    size, _, shift, n_codes = _LAYOUT[qtype]
    b = np.asarray(raw, np.uint8).reshape(*raw.shape[:-1], -1, size)  # [..., nb, size]
    if qtype == GGML_Q2_K:
        d, dmin = _fp16(b, 80), _fp16(b, 82)  # [..., nb, 1]
        scale = d * (b[..., :16] & 0x0F).astype(np.float32)
        offset = dmin * (b[..., :16] >> 4).astype(np.float32)
    else:
        sc = np.asarray(q3_k_scales(jnp.asarray(b[..., 96:108], jnp.int32)), np.float32)
        scale, offset = _fp16(b, 108) * sc, np.zeros(sc.shape, np.float32)
    lead = raw.shape[:-1]
    return scale.reshape(*lead, -1), offset.reshape(*lead, -1), shift, n_codes


def with_codes(raw: np.ndarray, qtype: int, codes: np.ndarray) -> np.ndarray:
    """``raw`` with every weight's code replaced by ``codes`` int ``[..., n]`` (scales kept)."""
    size, at, _, _ = _LAYOUT[qtype]
    b = np.array(raw, np.uint8).reshape(*raw.shape[:-1], -1, size)  # [..., nb, size]
    c = np.asarray(codes, np.uint8).reshape(*b.shape[:-1], 2, 4, 32)  # [..., nb, h, j, l]
    crumbs = (c & 3) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    b[..., at : at + 64] = np.bitwise_or.reduce(crumbs, axis=-2).reshape(*b.shape[:-1], 64)
    if qtype == GGML_Q3_K:
        high = (c.reshape(*b.shape[:-1], 8, 32) >> 2) << np.arange(8, dtype=np.uint8)[:, None]
        b[..., :32] = np.bitwise_or.reduce(high, axis=-2)
    return b.reshape(raw.shape)


def _fp16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16).astype(np.float32)


def gptq_stacks(
    raws: list[np.ndarray],
    weights: list[Any],
    qtype: int,
    trace_layer: dict[str, np.ndarray],
    damp: float,
    min_tokens: int,
    gate_up: tuple | None,
) -> tuple[list[np.ndarray], dict[str, int]]:
    """GPTQ codes on ggml's grid for the stacks ``weights`` [E, out, in] (which read one input:
    gate and up, or down with ``gate_up`` the teacher's gate and up stacks), replacing them in
    their ggml rows ``raws`` [E, out, row_bytes]; returns the new rows and the fallback counts."""

    counts = np.asarray(trace_layer["counts"])
    enough = np.nonzero(counts >= min_tokens)[0]
    out = [np.array(r) for r in raws]
    ok_all = np.zeros(len(enough), bool)
    for a in range(0, len(enough), gptq.GROUP):
        group = enough[a : a + gptq.GROUP]
        hessians = gptq.second_moments(trace_layer["x"], trace_layer["ids"], group, gate_up)
        factors = gptq.prepare(hessians, damp, keep_damped=False)
        ok = factors.ok
        ok_all[a : a + len(group)] = ok
        for n, w in enumerate(weights):
            scale, offset, shift, n_codes = grid(out[n][group], qtype)
            codes = gptq_grid.quantize(w[group], scale, offset, factors.feedback, shift, n_codes)
            fresh = with_codes(out[n][group], qtype, np.asarray(codes))
            out[n][group[ok]] = fresh[ok]
    fallback = {"few_tokens": int(len(counts) - len(enough)), "not_factored": int((~ok_all).sum())}
    return out, fallback
