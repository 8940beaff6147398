"""Q2_0: 2-bit blocks of 64 weights with one signed fp16 scale, and its exact scale search.

A block ``w[0..63]`` (64 consecutive weights along the input dimension) with importance
``a[0..63] > 0`` is stored as ``d`` (fp16) and codes ``c = q + 1`` with ``q`` in {-1, 0, 1, 2};
its value is ``q * d``, so a negative ``d`` gives the mirrored grid. The search (issue 4):

- ``amax = max|w|``; ``amax == 0`` gives ``d = 0`` and every ``q = 0``;
- for each seed ``s`` in ``SEEDS`` (in that order): ``d0 = s*amax``,
  ``q = clip(round_half_even(w/d0), -1, 2)``, ``d1 = Σaqw/Σaq²`` (``d0`` when ``Σaq² = 0``),
  ``q = clip(round_half_even(w/d1), -1, 2)``, ``score = (Σaqw)²/Σaq²`` (0 when ``Σaq² = 0``);
- the first seed with the strictly highest score wins; ``d_ls = Σaqw/Σaq²`` for its ``q``;
- ``r² = score/Σaw²`` (taken as 1 when ``Σaw² = 0``) and the stored
  ``d = fp16(d_ls * max(r², 0.25)^(-gain/2))``.

Float32 choices, each a source of the rare near-ties the tests document: ``w/d`` is evaluated as
``w * (1/d)`` (XLA rewrites a division by a broadcast scalar that way regardless); every block is
first scaled by a power of two so that its ``amax`` lies in [1, 2), and its importance likewise
so that ``max a`` does — exact operations that keep tiny blocks (``amax ~ 1e-30``) from
underflowing ``score``; subnormal inputs may be flushed to zero by the backend.

Layout, for speed (see ``benchmarks/bench_quant.py``): on a CPU, blocks are regrouped into
tiles ``[T, 64, L]`` whose ``L`` lanes are ``L`` blocks, so that every sum over a block is a
chain of 64 vector adds along the lane axis, and the ten seeds' passes run as loop fusions over
a seed axis. On an NVIDIA GPU the search is one Pallas kernel (:mod:`q2_0_gpu`: a thread per
block, its weights in registers); on other accelerators the blocks stay in place and the seeds
are unrolled into one XLA fusion, also a thread per block. ``quantize`` and ``quantize_matrix``
are host drivers that feed the jitted chunk kernel fixed-shape chunks, so each shape compiles
once.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels import q2_0_gpu
from healsweep.kernels._q2_0_scale import LANES, QK, SEEDS, stored_scale
from healsweep.kernels._q2_0_scale import pow2_inverse as _pow2_inverse
from healsweep.kernels._q2_0_scale import safe_ratio as _safe_ratio

BYTES_PER_BLOCK = 18
_CHUNK_WEIGHTS = {"cpu": 1 << 18, "gpu": 1 << 24, "pallas": 1 << 26}


def round_code(x: jax.Array) -> jax.Array:
    """``clip(round_half_even(x), -1, 2)``.

    (The two-add "magic number" rounding is not usable: XLA reassociates it away.)
    """
    return jnp.clip(jnp.round(x), -1.0, 2.0)


def round_code_by_compare(x: jax.Array) -> jax.Array:
    """The same function as :func:`round_code` for every non-NaN ``x``, ties included, built
    from three comparisons (full-rate on a GPU, where a float round is a slow conversion)."""
    one = jnp.float32(1.0)
    up = jnp.where(x >= -0.5, one, 0.0) + jnp.where(x > 0.5, one, 0.0)
    return up + jnp.where(x >= 1.5, one, 0.0) - one


def _row_sums(rows, arows, step: jax.Array, rnd=round_code):
    """``Σaqw`` and ``Σaq²`` over the 64 rows of each tile, ``q = round_code(w * step)``.

    ``rows[i]`` is [T, L], ``arows[i]`` [T, L] or [T, 1], ``step`` [..., T, L]: a chain of 64
    vector multiply-adds along the lane axis, which XLA emits as one vectorized loop fusion.
    """
    sqw = sqq = None
    for w_i, a_i in zip(rows, arows, strict=True):
        q = rnd(w_i * step)
        aq = a_i * q
        sqw = aq * w_i if sqw is None else sqw + aq * w_i
        sqq = aq * q if sqq is None else sqq + aq * q
    return sqw, sqq


def _max_rows(rows) -> jax.Array:
    out = None
    for r in rows:
        out = r if out is None else jnp.maximum(out, r)
    return out


def search_tiles(w: jax.Array, a: jax.Array, gain: jax.Array, rnd=round_code, unroll=False):
    """The seed search on tiles ``w`` [T, 64, L] (blocks along axis 1) with importance ``a``
    [T, 64, L] or [T, 64, 1]; returns float32 ``(d, scale, best_d1, (d1, score))``.

    Each block is normalized by ``scale`` [T, L], a power of two that puts its ``amax`` in
    [1, 2) (1 for an all-zero block): ``y = w * scale``. ``d`` and ``best_d1`` [T, L] are in those
    units: the stored scale is ``fp16(d / scale)``, the codes ``round_code(w * scale / best_d1)``
    (0 for an all-zero block, whose ``d`` is 0). The scaling is folded into each pass's step
    (``w * (scale/d)`` rounds exactly like ``y * (1/d)``) and into its sums (``Σaqy = scale·Σaqw``)
    so that it costs no extra pass. All ten seeds run side by side on a leading axis; the
    per-seed ``(d1, score)`` [10, T, L] are returned so that XLA materializes them instead of
    re-deriving them inside later fusions (which repeats passes in loops LLVM does not vectorize).
    ``unroll=True`` runs the seeds one after the other instead, with the same arithmetic, so
    that XLA can fuse the whole search into one loop (one GPU thread per block); no extras then.
    """
    rows = [w[:, i, :] for i in range(QK)]  # 64 x [T, L]
    arows = [a[:, i, :] for i in range(QK)]  # 64 x [T, L] or [T, 1]
    amax = _max_rows([jnp.abs(r) for r in rows])  # [T, L]
    live = amax > 0
    scale = _pow2_inverse(amax)
    amax_n = jnp.where(live, amax * scale, 1.0)
    best_score = jnp.full(amax.shape, -1.0, jnp.float32)
    best_d1 = jnp.ones_like(amax)
    seeds = [jnp.float32(s) for s in SEEDS] if unroll else [jnp.asarray(SEEDS)[:, None, None]]
    for seed in seeds:
        d0 = seed * amax_n  # [T, L], or [S, T, L] with the seeds on an axis
        sqw, sqq = _row_sums(rows, arows, scale / d0, rnd)
        d1 = _safe_ratio(sqw * scale, sqq, d0)
        sqw, sqq = _row_sums(rows, arows, scale / d1, rnd)
        sqw = sqw * scale
        score = _safe_ratio(sqw * sqw, sqq, 0.0)
        for d1_s, score_s in [(d1, score)] if unroll else zip(d1, score, strict=True):
            better = score_s > best_score  # strictly: the first seed wins a tie
            best_score = jnp.where(better, score_s, best_score)
            best_d1 = jnp.where(better, d1_s, best_d1)
    step = scale / best_d1  # [T, L]
    sqw = sqq = saw2 = None
    for w_i, a_i in zip(rows, arows, strict=True):
        y_i = w_i * scale  # normalized here so that Σay² cannot underflow for tiny blocks
        q = rnd(w_i * step)
        aq = a_i * q
        sqw = aq * y_i if sqw is None else sqw + aq * y_i
        sqq = aq * q if sqq is None else sqq + aq * q
        saw2 = a_i * y_i * y_i if saw2 is None else saw2 + a_i * y_i * y_i
    d = stored_scale(sqw, sqq, saw2, live, gain)
    return d, scale, best_d1, (() if unroll else (d1, score))


def _to_tiles(x: jax.Array, lanes: int) -> jax.Array:
    """``[R, nb, k]`` -> ``[nb * R/lanes, k, lanes]``: lane ``l`` of tile ``(j, g)`` is row ``g*lanes+l``."""
    n_rows, nb, k = x.shape
    x = x.reshape(n_rows // lanes, lanes, nb, k).transpose(2, 0, 3, 1)
    return x.reshape(nb * (n_rows // lanes), k, lanes)


def _from_tiles(x: jax.Array, n_rows: int, nb: int) -> jax.Array:
    """Inverse of :func:`_to_tiles`: ``[nb * R/lanes, k, lanes]`` -> ``[R, nb, k]``."""
    _, k, lanes = x.shape
    x = x.reshape(nb, n_rows // lanes, k, lanes).transpose(1, 3, 0, 2)
    return x.reshape(n_rows, nb, k)


@partial(jax.jit, static_argnames=("lanes", "keep_extras", "compare_round", "tiles", "unroll"))
def _quantize_rows(
    w,
    importance,
    gain,
    lanes: int = LANES,
    keep_extras: bool = True,
    compare_round: bool = False,
    tiles: bool = True,
    unroll: bool = False,
):
    """Quantize ``w`` [R, in] (``R % lanes == 0``) with ``importance`` [R, in] or [R/lanes, in]
    (one importance row shared by each group of ``lanes`` rows).

    Returns ``(d, q [R, in] int8, extras)``. With ``tiles`` (the CPU layout) ``d`` is float16
    ``[T, 1, L]`` in tile order, put in row order by ``_untile_np`` outside (so that XLA keeps the
    final pass in the vectorized layout); without, blocks stay where they are (one per row of
    a ``[R*in/64, 64, 1]`` view, no transposes: a GPU thread per block) and ``d`` is [R, in/64].
    ``keep_extras=False`` drops the per-seed arrays, ``unroll`` runs the seeds one by one (see
    :func:`search_tiles`), ``compare_round`` rounds with :func:`round_code_by_compare`. Every
    combination computes the same codes and scales.
    """
    n_rows, n_in = w.shape
    nb = n_in // QK
    wb = w.reshape(n_rows, nb, QK)  # [R, nb, 64]
    ab = importance.reshape(importance.shape[0], nb, QK)
    ab = ab * _pow2_inverse(jnp.max(ab, axis=2))[:, :, None]  # max a in [1, 2), exactly
    per_row = importance.shape[0] == n_rows
    if tiles:
        blocks = _to_tiles(wb, lanes)  # [T, 64, L]
        if per_row:
            a = _to_tiles(ab, lanes)  # [T, 64, L]
        else:  # [R/L, nb, 64] -> [T, 64, 1]
            a = ab.transpose(1, 0, 2).reshape(nb * (n_rows // lanes), QK, 1)
    else:
        blocks = wb.reshape(n_rows * nb, QK, 1)  # [R*nb, 64, 1], a free view
        if not per_row:
            ab = jnp.broadcast_to(ab[:, None], (n_rows // lanes, lanes, nb, QK))
        a = ab.reshape(n_rows * nb, QK, 1)
    rnd = round_code_by_compare if compare_round else round_code
    d, scale, best_d1, extras = search_tiles(blocks, a, gain, rnd, unroll)  # [T, L] each
    d = (d / scale).astype(jnp.float16)
    step = scale / best_d1
    if tiles:
        d = d[:, None, :]  # [T, 1, L]
        step = _from_tiles(step[:, None, :], n_rows, nb)  # [R, nb, 1]
    else:
        d, step = d.reshape(n_rows, nb), step.reshape(n_rows, nb, 1)
    # q in row order, straight from w: the same products as inside the search.
    q = rnd(wb * step).astype(jnp.int8)  # all-zero blocks: finite step, q = 0
    return d, q.reshape(n_rows, n_in), (extras if keep_extras else ())


def _untile_np(d: np.ndarray, n_rows: int) -> np.ndarray:
    """``[nb * R/L, 1, L]`` tile order -> ``[R, nb]`` row order (numpy twin of _from_tiles)."""
    n_tiles, _, lanes = d.shape
    nb = n_tiles // (n_rows // lanes)
    return d.reshape(nb, n_rows // lanes, lanes).transpose(1, 2, 0).reshape(n_rows, nb)


def _backend_options(platform: str | None = None) -> dict:
    """Kernel for ``platform`` (default: the default backend's): on a CPU, vector tiles with the
    seeds on an axis; on an NVIDIA GPU the Pallas kernel of :mod:`q2_0_gpu` (a thread per block,
    its weights in registers); on other accelerators blocks in place and the seeds unrolled into
    one XLA fusion (one thread per block). Measured on an H200 (``benchmarks/bench_quant.py``):
    the Pallas kernel about 2x the fusion, the fusion about 5x the CPU layout."""
    if (platform or jax.default_backend()) == "cpu":
        return {"tiles": True, "keep_extras": True}

    if q2_0_gpu.on_cuda() and q2_0_gpu.lowers():
        return {"pallas": True}
    return {"tiles": False, "unroll": True, "keep_extras": False}


def kernel_path(options: dict) -> str:
    """A name for the layout ``options`` (:func:`_backend_options`) select, for reports."""
    if options.get("pallas"):
        return "pallas"
    return "cpu tiles" if options.get("tiles", True) else "xla blocks"


def _chunk_rows(n_rows: int, n_in: int, target: int) -> int:
    """Rows per jitted call: about ``target`` weights, a multiple of LANES. Smaller inputs get
    a power of two of at least 2**16 weights, so that few shapes compile."""
    rows = max(LANES, (target // n_in) // LANES * LANES)
    small = max(n_rows, (1 << 16) // n_in, LANES)
    return min(rows, 1 << (small - 1).bit_length())


def _pad_rows(x: np.ndarray, n_rows: int, value: float) -> np.ndarray:
    if x.shape[0] == n_rows:
        return x
    return np.concatenate([x, np.full((n_rows - x.shape[0], x.shape[1]), value, np.float32)])


@partial(jax.jit, static_argnums=(2,))
def _device_rows(w: jax.Array, start, size: int) -> jax.Array:
    """Rows ``start .. start + size`` of a device matrix, zero rows added if it is shorter."""
    if w.shape[0] < size:
        w = jnp.pad(w, ((0, size - w.shape[0]), (0, 0)))
    return jax.lax.dynamic_slice_in_dim(w, start, size)


@jax.jit
def pack_codes(q) -> jax.Array:
    """int8 codes in {-1, 0, 1, 2} ``[..., n]`` -> uint8 ``[..., n/4]``, four 2-bit codes
    ``c = q + 1`` a byte, code ``j`` at bits ``2*(j%4)`` of byte ``j//4`` (ggml's type 42)."""
    c = (jnp.asarray(q).astype(jnp.int32) + 1).reshape(*q.shape[:-1], q.shape[-1] // 4, 4)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(jnp.uint8)


def quantize_rows(
    w, importance, gain: float, options=None, packed: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows ``w`` [R, in] (``R % LANES == 0``, ``in % 64 == 0``) in fixed-shape chunks.

    ``importance`` is [R, in] (one row per weight row) or [R / LANES, in] (one row per group of
    LANES consecutive rows). Returns ``(d [R, in/64] float16, q [R, in] int8)`` as numpy arrays,
    or with ``packed`` the codes four to a byte (``uint8 [R, in/4]``, see :func:`pack_codes`),
    packed on the device so that a quarter of the bytes come back. ``w`` may be a device array
    (decoded there from the model's bytes): it is then sliced and padded on the device and
    never crosses to the host. The chunk shape depends only on ``in`` and the backend, so each
    is compiled once; ``options`` (``_quantize_rows`` layout flags, or ``{"pallas": True}`` for
    the GPU kernel of :mod:`q2_0_gpu`, with ``"interpret": True`` for its interpreter) default
    to the backend's.
    """
    n_rows, n_in = w.shape
    per_row = importance.shape[0] == n_rows
    opts = options or _backend_options()
    pallas = opts.get("pallas", False)
    backend = "pallas" if pallas else jax.default_backend()
    chunk = _chunk_rows(n_rows, n_in, _CHUNK_WEIGHTS.get(backend, _CHUNK_WEIGHTS["gpu"]))
    imp_chunk = chunk if per_row else chunk // LANES
    n_chunks = -(-n_rows // chunk)
    if not isinstance(w, jax.Array):
        w = np.asarray(w, np.float32)
    importance = np.asarray(importance, np.float32)
    gain32 = jnp.float32(gain)
    opts = {"tiles": True, **opts}
    d_out = np.empty((n_rows, n_in // QK), np.float16)
    q_out = np.empty((n_rows, n_in // 4 if packed else n_in), np.uint8 if packed else np.int8)
    for c in range(n_chunks):
        a, b = c * chunk, min((c + 1) * chunk, n_rows)
        # A short last chunk is the last `chunk` rows (overlapping the one before; only its new
        # rows are kept), so a device array is cut by one compiled slice; padded only when
        # the whole matrix is shorter than a chunk.
        start = max(0, min(a, n_rows - chunk))
        if isinstance(w, jax.Array):
            w_c = _device_rows(w, start, chunk)
        else:
            w_c = _pad_rows(w[start : start + chunk], chunk, 0.0)
        imp_start = start if per_row else start // LANES
        imp_c = _pad_rows(importance[imp_start : imp_start + imp_chunk], imp_chunk, 1.0)
        if pallas:
            d, q = q2_0_gpu.quantize_rows(w_c, imp_c, gain32, opts.get("interpret", False))
            d = np.asarray(d)
        else:
            d, q, _ = _quantize_rows(w_c, imp_c, gain32, **opts)
            d = _untile_np(np.asarray(d), chunk) if opts["tiles"] else np.asarray(d)
        d_out[a:b] = d[a - start : b - start]
        q_out[a:b] = np.asarray(pack_codes(q) if packed else q)[a - start : b - start]
    return d_out, q_out


def quantize(w, importance, gain: float) -> tuple[np.ndarray, np.ndarray]:
    """Q2_0-quantize blocks ``w`` [N, 64] float32 with ``importance`` [N, 64] or [64] (> 0).

    Returns ``(d [N] float16, q [N, 64] int8)`` with ``q`` in {-1, 0, 1, 2}, value ``q * d``.
    ``importance=None`` means uniform importance.
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] != QK:
        raise ValueError(f"q2_0.quantize: expected w of shape [N, {QK}], got {w.shape}")
    imp = np.ones(QK, np.float32) if importance is None else np.asarray(importance, np.float32)
    if imp.shape not in ((QK,), w.shape):
        raise ValueError(f"q2_0.quantize: importance must be [{QK}] or {w.shape}, got {imp.shape}")
    n = w.shape[0]
    padded = -(-n // LANES) * LANES
    w = _pad_rows(w, padded, 0.0)
    if imp.ndim == 1:
        imp = np.broadcast_to(imp, (padded // LANES, QK))
    else:
        imp = _pad_rows(imp, padded, 1.0)
    d, q = quantize_rows(w, imp, gain)
    return d[:n, 0], q[:n]


def quantize_matrix(w, importance, gain: float, packed: bool = False) -> Q2Weight | Q2Packed:
    """Q2_0-quantize ``w`` [..., out, in] along ``in`` (a multiple of 64).

    ``importance`` is per input channel: [in] (shared), [..., in] (one row per matrix, e.g. per
    expert) or None (uniform). ``w`` may be a device array (it stays on the device). Returns a
    :class:`Q2Weight`, or with ``packed`` a :class:`Q2Packed` (codes packed on the device).
    """
    if not isinstance(w, jax.Array):
        w = np.asarray(w, np.float32)
    if w.ndim < 2 or w.shape[-1] % QK != 0:
        raise ValueError(
            f"q2_0.quantize_matrix: expected w [..., out, in] with in % {QK} == 0, got {w.shape}"
        )
    *lead, n_out, n_in = w.shape
    n_mat = int(np.prod(lead, dtype=np.int64))
    imp = np.ones(n_in, np.float32) if importance is None else np.asarray(importance, np.float32)
    if imp.shape not in ((n_in,), (*lead, n_in)):
        raise ValueError(
            f"q2_0.quantize_matrix: importance must be [{n_in}] or {(*lead, n_in)}, got {imp.shape}"
        )
    out_pad = -(-n_out // LANES) * LANES
    rows = w.reshape(n_mat, n_out, n_in)
    if out_pad != n_out:
        xp = jnp if isinstance(rows, jax.Array) else np
        rows = xp.concatenate([rows, xp.zeros((n_mat, out_pad - n_out, n_in), np.float32)], 1)
    groups = out_pad // LANES
    if imp.ndim == 1:
        imp_groups = np.broadcast_to(imp, (n_mat * groups, n_in))
    else:
        imp_groups = np.repeat(imp.reshape(n_mat, n_in), groups, axis=0)
    d, q = quantize_rows(rows.reshape(n_mat * out_pad, n_in), imp_groups, gain, packed=packed)
    d = d.reshape(n_mat, out_pad, -1)[:, :n_out].reshape(*lead, n_out, n_in // QK)
    q = q.reshape(n_mat, out_pad, -1)[:, :n_out].reshape(*lead, n_out, q.shape[-1])
    return Q2Packed(d, q) if packed else Q2Weight(d, q)


def dequantize(d, q) -> jax.Array:
    """Values ``q * d`` as float32: ``d`` [..., N] float16, ``q`` [..., N, 64] int8."""
    return jnp.asarray(q).astype(jnp.float32) * jnp.asarray(d).astype(jnp.float32)[..., None]


@jax.tree_util.register_pytree_node_class
class Q2Weight:
    """A Q2_0 matrix: ``d`` [..., out, in/64] float16 and ``q`` [..., out, in] int8 in {-1..2}."""

    __slots__ = ("d", "q")
    qtype = 42  # ggml's type id of Q2_0 (kernels.ggml_types): what a stack is stored as

    def __init__(self, d, q):
        self.d = d
        self.q = q

    def tree_flatten(self):
        return (self.d, self.q), None

    @classmethod
    def tree_unflatten(cls, _aux, children) -> Q2Weight:
        return cls(*children)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dense matrix, ``[..., out, in]``."""
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed Q2_0 encoding (18 per block of 64 weights)."""
        return int(np.prod(self.q.shape, dtype=np.int64)) // QK * BYTES_PER_BLOCK

    def dequantize(self) -> jax.Array:
        """The dense float32 matrix ``[..., out, in]``."""
        *lead, n_out, n_in = self.q.shape
        q = jnp.asarray(self.q).reshape(*lead, n_out, n_in // QK, QK)
        return dequantize(self.d, q).reshape(*lead, n_out, n_in)

    def scale_d(self, factor) -> Q2Weight:
        """A new Q2Weight whose scales are multiplied by ``factor`` (scalar or broadcastable)."""
        d = (jnp.asarray(self.d).astype(jnp.float32) * factor).astype(jnp.float16)
        return Q2Weight(d, self.q)

    def __repr__(self) -> str:
        return f"Q2Weight(shape={self.shape})"


def pack(d, q) -> jax.Array:
    """Q2_0 blocks as bytes ``uint8 [N, 18]``: fp16 ``d`` (little-endian), then 16 bytes whose
    bits ``2*(i%4)`` of byte ``i//4`` hold code ``c_i = q_i + 1``."""
    codes = (jnp.asarray(q).astype(jnp.int32) + 1).reshape(-1, QK // 4, 4)  # [N, 16, 4]
    packed = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    d_bytes = jax.lax.bitcast_convert_type(jnp.asarray(d, jnp.float16).reshape(-1), jnp.uint8)
    return jnp.concatenate([d_bytes, packed.astype(jnp.uint8)], axis=1)


def unpack(packed) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack`: ``uint8 [N, 18]`` -> ``(d [N] float16, q [N, 64] int8)``."""
    packed = jnp.asarray(packed, jnp.uint8)
    d = jax.lax.bitcast_convert_type(packed[:, :2], jnp.float16)
    body = packed[:, 2:].astype(jnp.int32)  # [N, 16]
    codes = jnp.stack([(body >> (2 * k)) & 3 for k in range(4)], axis=-1)  # [N, 16, 4]
    return d, (codes.reshape(-1, QK) - 1).astype(jnp.int8)


@jax.tree_util.register_pytree_node_class
class Q2Packed:
    """A Q2_0 matrix kept packed: ``d`` [..., out, in/64] float16 and ``codes`` [..., out, in/4]
    uint8, four codes ``c = q + 1`` per byte (code ``j`` at bits ``2*(j%4)`` of byte ``j//4``, as
    in ggml's type 42). Decoded in the graph by :meth:`dequantize`, bit-identical to
    :class:`Q2Weight`; it moves a quarter of Q2Weight's bytes and is never unpacked on the host
    unless ``.q`` is asked for."""

    __slots__ = ("d", "codes")
    qtype = 42  # ggml's type id of Q2_0 (kernels.ggml_types): what a stack is stored as

    def __init__(self, d, codes):
        self.d = d
        self.codes = codes

    def tree_flatten(self):
        return (self.d, self.codes), None

    @classmethod
    def tree_unflatten(cls, _aux, children) -> Q2Packed:
        return cls(*children)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dense matrix, ``[..., out, in]``."""
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 4)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed Q2_0 encoding (18 per block of 64 weights)."""
        return int(np.prod(self.shape, dtype=np.int64)) // QK * BYTES_PER_BLOCK

    @property
    def q(self) -> np.ndarray:
        """The int8 codes in {-1..2}, ``[..., out, in]`` (unpacked on the host)."""
        codes = np.asarray(self.codes)
        c = (codes[..., None] >> np.array([0, 2, 4, 6], np.uint8)) & np.uint8(3)
        return (c.astype(np.int8) - 1).reshape(self.shape)

    def dequantize(self) -> jax.Array:
        """The dense float32 matrix ``[..., out, in]``."""
        *lead, n_out, n_bytes = self.codes.shape
        codes = jnp.asarray(self.codes).astype(jnp.int32)  # [..., out, in/4]
        shifts = jnp.arange(0, 8, 2, dtype=jnp.int32)
        q = ((codes[..., None] >> shifts) & 3) - 1  # [..., out, in/4, 4]
        q = q.reshape(*lead, n_out, n_bytes * 4 // QK, QK)
        return dequantize(self.d, q).reshape(*lead, n_out, n_bytes * 4)

    def scale_d(self, factor) -> Q2Packed:
        """A new Q2Packed whose scales are multiplied by ``factor`` (stored back as fp16)."""
        d = (np.asarray(self.d, np.float32) * np.float32(factor)).astype(np.float16)
        return Q2Packed(d, self.codes)

    def __repr__(self) -> str:
        return f"Q2Packed(shape={self.shape})"
