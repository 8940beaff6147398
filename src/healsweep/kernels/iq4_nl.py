"""IQ4_NL: 4-bit non-linear blocks of 32 weights with one fp16 scale (ggml's ``block_iq4_nl``).

gguf-py reads IQ4_NL but cannot write it; Part B requantizes the shared expert's down
projection to it. A block ``x[0..31]`` is stored as ``d`` (fp16) and 4-bit indices into the
16-value codebook ``KVALUES``; its value is ``d * KVALUES[idx]``. Bytes: ``d`` (little-endian),
then 16 bytes whose low nibbles hold indices 0..15 and high nibbles indices 16..31.

The search, per block with importance ``a`` (uniform by default):

- the base scale maps the largest-magnitude weight ``m`` onto the codebook's end of its sign,
  ``m/-127`` or ``m/113`` (two grids, as a signed ``d`` mirrors the asymmetric codebook);
- each base scale times each of ``MULTIPLIERS``: nearest indices (a tie goes to the larger
  value, as in ggml), then the least-squares ``d = Σavx/Σav²`` for those indices;
- plain round-to-nearest at ``m/-127`` (ggml's starting point) is one more candidate;
- the candidate whose fp16-rounded ``d`` gives the smallest weighted SSE wins (the first on a
  tie), so the result is never worse than that round-to-nearest baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QK = 32
BYTES_PER_BLOCK = 18
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MULTIPLIERS = (0.91, 0.94, 0.97, 1.0, 1.03, 1.06, 1.09)
_ZERO_INDEX = 8  # KVALUES[8] = 1 is the codebook value nearest 0
_CHUNK_BLOCKS = 4096


def _nearest(t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Nearest codebook index and value of ``t`` (in codebook units) without a gather."""
    idx = jnp.zeros(t.shape, jnp.int32)
    val = jnp.full(t.shape, float(KVALUES[0]), jnp.float32)
    for k in range(len(KVALUES) - 1):
        up = t >= 0.5 * (KVALUES[k] + KVALUES[k + 1])  # midpoints are exact in float32
        idx = idx + up.astype(jnp.int32)
        val = val + jnp.where(up, float(KVALUES[k + 1] - KVALUES[k]), 0.0)
    return idx, val


def lookup(idx) -> jax.Array:
    """``KVALUES[idx]`` as float32, by selects (no gather)."""
    idx = jnp.asarray(idx).astype(jnp.int32)
    out = jnp.zeros(idx.shape, jnp.float32)
    for k, v in enumerate(KVALUES):
        out = jnp.where(idx == k, float(v), out)
    return out


def _pow2_inverse(amax: jax.Array) -> jax.Array:
    """``2**-e`` with ``amax = m * 2**e``, ``m`` in [1, 2); 1 where ``amax`` is 0 (exact)."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32) & 0x7F800000
    inv = jax.lax.bitcast_convert_type(0x7F000000 - bits, jnp.float32)
    return jnp.where(amax > 0, inv, 1.0)


@jax.jit
def _quantize_blocks(x: jax.Array, a: jax.Array):
    """``x`` [C, 32], ``a`` [C, 32] or [1, 32] -> ``(d [C] float16, idx [C, 32] int8)``."""
    hi, lo = jnp.max(x, axis=1), jnp.min(x, axis=1)
    m = jnp.where(-lo > hi, lo, hi)  # the signed weight of largest magnitude
    live = m != 0
    scale = _pow2_inverse(jnp.abs(m))  # exact normalization: tiny blocks cannot underflow
    y, m = x * scale[:, None], jnp.where(live, m * scale, 1.0)
    a = a * _pow2_inverse(jnp.max(a, axis=1))[:, None]
    bases = (m / KVALUES[0], m / KVALUES[-1])
    trials = [base * mult for base in bases for mult in MULTIPLIERS]  # K-1 x [C]
    cand_d, cand_v, cand_i = [], [], []
    for d_try in [bases[0], *trials]:  # the first candidate is the round-to-nearest baseline
        idx, val = _nearest(y / d_try[:, None])
        num, den = jnp.sum(a * val * y, axis=1), jnp.sum(a * val * val, axis=1)
        refit = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), d_try)
        cand_d.append(d_try if not cand_d else refit)
        cand_v.append(val)
        cand_i.append(idx)
    best_sse = best_d = best_i = None
    for d_k, v_k, i_k in zip(cand_d, cand_v, cand_i, strict=True):
        stored = (d_k / scale).astype(jnp.float16)
        d_eff = stored.astype(jnp.float32) * scale  # what the fp16 scale reconstructs
        sse = jnp.sum(a * (y - d_eff[:, None] * v_k) ** 2, axis=1)
        if best_sse is None:
            best_sse, best_d, best_i = sse, stored, i_k
            continue
        better = sse < best_sse
        best_sse = jnp.where(better, sse, best_sse)
        best_d = jnp.where(better, stored, best_d)
        best_i = jnp.where(better[:, None], i_k, best_i)
    best_d = jnp.where(live, best_d, jnp.float16(0))
    best_i = jnp.where(live[:, None], best_i, _ZERO_INDEX)
    return best_d, best_i.astype(jnp.int8)


def quantize(w, importance=None):
    """IQ4_NL-quantize blocks ``w`` [N, 32]; ``importance`` [N, 32], [32] or None (uniform).

    Returns ``(d [N] float16, idx [N, 32] int8)`` with ``idx`` in 0..15: numpy arrays computed
    in fixed-shape chunks, or, when called under a jax transformation, the traced kernel's
    output for all blocks at once.
    """
    if np.ndim(w) != 2 or np.shape(w)[1] != QK:
        raise ValueError(f"iq4_nl.quantize: expected w of shape [N, {QK}], got {np.shape(w)}")
    imp = jnp.ones((1, QK), jnp.float32) if importance is None else importance
    if np.shape(imp) == (QK,):
        imp = jnp.reshape(imp, (1, QK))
    if np.shape(imp) not in ((1, QK), np.shape(w)):
        raise ValueError(
            f"iq4_nl.quantize: importance must be [{QK}] or {np.shape(w)}, got {np.shape(imp)}"
        )
    if isinstance(w, jax.core.Tracer) or isinstance(imp, jax.core.Tracer):
        return _quantize_blocks(jnp.asarray(w, jnp.float32), jnp.asarray(imp, jnp.float32))
    w, imp = np.asarray(w, np.float32), np.asarray(imp, np.float32)
    n = w.shape[0]
    chunk = min(_CHUNK_BLOCKS, 1 << max(n - 1, 255).bit_length())
    padded = -(-n // chunk) * chunk
    w = np.concatenate([w, np.zeros((padded - n, QK), np.float32)])
    if imp.shape[0] != 1:
        imp = np.concatenate([imp, np.ones((padded - n, QK), np.float32)])
    d_out = np.empty(padded, np.float16)
    i_out = np.empty((padded, QK), np.int8)
    for lo in range(0, padded, chunk):
        a = imp if imp.shape[0] == 1 else imp[lo : lo + chunk]
        d, idx = _quantize_blocks(w[lo : lo + chunk], a)
        d_out[lo : lo + chunk], i_out[lo : lo + chunk] = np.asarray(d), np.asarray(idx)
    return d_out[:n], i_out[:n]


def dequantize(d, idx) -> jax.Array:
    """Values ``d * KVALUES[idx]`` as float32: ``d`` [..., N] float16, ``idx`` [..., N, 32]."""
    return jnp.asarray(d).astype(jnp.float32)[..., None] * lookup(idx)


def pack(d, idx) -> jax.Array:
    """``block_iq4_nl`` bytes ``uint8 [N, 18]``: fp16 ``d``, then ``idx[j] | idx[j+16] << 4``."""
    idx = jnp.asarray(idx).astype(jnp.int32).reshape(-1, QK)
    nibbles = idx[:, : QK // 2] | (idx[:, QK // 2 :] << 4)
    d_bytes = jax.lax.bitcast_convert_type(jnp.asarray(d, jnp.float16).reshape(-1), jnp.uint8)
    return jnp.concatenate([d_bytes, nibbles.astype(jnp.uint8)], axis=1)


def unpack(packed) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack`: ``uint8 [N, 18]`` -> ``(d [N] float16, idx [N, 32] int8)``."""
    packed = jnp.asarray(packed, jnp.uint8)
    d = jax.lax.bitcast_convert_type(packed[:, :2], jnp.float16)
    body = packed[:, 2:].astype(jnp.int32)
    return d, jnp.concatenate([body & 15, body >> 4], axis=1).astype(jnp.int8)


def quantize_matrix(w, importance=None) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_NL-quantize ``w`` [..., out, in] along ``in`` (a multiple of 32).

    ``importance`` is per input channel, [in], or None. Returns ``(d [..., out, in/32] float16,
    idx [..., out, in] int8)``; ``pack(d, idx)`` gives the tensor's bytes in GGUF row order.
    """
    w = np.asarray(w, np.float32)
    if w.ndim < 2 or w.shape[-1] % QK != 0:
        raise ValueError(
            f"iq4_nl.quantize_matrix: expected w [..., out, in] with in % {QK} == 0, got {w.shape}"
        )
    n_in = w.shape[-1]
    imp = None
    if importance is not None:
        imp = np.asarray(importance, np.float32)
        if imp.shape != (n_in,):
            raise ValueError(
                f"iq4_nl.quantize_matrix: importance must be [{n_in}], got {imp.shape}"
            )
        imp = np.broadcast_to(imp.reshape(-1, QK)[None], (w.size // n_in, n_in // QK, QK))
        imp = imp.reshape(-1, QK)
    d, idx = quantize(w.reshape(-1, QK), imp)
    return d.reshape(*w.shape[:-1], n_in // QK), idx.reshape(w.shape)


def dequantize_matrix(d, idx) -> jax.Array:
    """The dense float32 matrix ``[..., out, in]`` of ``quantize_matrix``'s output."""
    idx = jnp.asarray(idx)
    *lead, n_in = idx.shape
    blocks = idx.reshape(*lead, n_in // QK, QK)
    return dequantize(d, blocks).reshape(*lead, n_in)
