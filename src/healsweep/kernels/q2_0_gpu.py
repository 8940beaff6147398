"""The Q2_0 search as one Pallas kernel for NVIDIA GPUs (compiled by Triton).

Same search as :mod:`healsweep.kernels.q2_0` (its docstring defines it), laid out for a GPU:

- **A thread per block, its 64 weights and importances in registers.** A program covers
  ``LANES`` rows (one importance group) by ``k`` column blocks. The tile is read with one load,
  then split into 64 columns ``[B]`` (column ``i`` holds weight ``i`` of every block), so every
  sum over a block is a chain of adds inside one thread: no shuffles, no shared memory after
  the split, and the weights are read from memory once for all 21 passes.
- **One load and one store a tile.** A kernel that reads the 64 columns with 128 strided loads
  computes the same thing, but Triton's coalescing pass is quadratic in memory operations:
  it compiled for 3 to 14 minutes. Split and join compile in seconds.
- **The seeds ``s`` and ``-s`` share their first pass** (``|w / d0| < 2.5``, so its rounded
  value needs no upper clip: the seed ``s`` takes ``max(r, -1)``, the seed ``-s`` takes
  ``-min(r, 1)``), and the five magnitudes run in a loop, so the code stays small.
- **Running sums are PTX ``fma`` and rounding is PTX ``cvt.rni``.** The Triton that XLA runs
  contracts no multiply-add by itself; explicit FMAs remove about 40 of ~220 instructions a
  weight. The FMAs change the sums' last bits, as XLA's GPU fusion does: codes equal the CPU
  kernel's in every block measured, fp16 scales in 99.99% (``benchmarks/bench_quant.py``).

Under Pallas' interpreter (``interpret=True``, any machine) the same kernel runs with plain
float32 operations and equals the CPU kernel bit for bit; the tests check that. Measured on an
H200: ``docs/q2-gpu-kernel.md``.
"""

from __future__ import annotations

import logging
from functools import cache, partial

import jax
import jax.numpy as jnp

from healsweep.kernels._q2_0_scale import LANES, QK, SEEDS, stored_scale
from healsweep.kernels._q2_0_scale import pow2_inverse as _pow2_inverse
from healsweep.kernels._q2_0_scale import safe_ratio as _safe_ratio

log = logging.getLogger(__name__)

N_MAGNITUDES = len(SEEDS) // 2
assert SEEDS[N_MAGNITUDES:] == tuple(-s for s in SEEDS[:N_MAGNITUDES])
MAX_K = 8  # column blocks a program: 16 x 8 blocks, 4 warps (k = 4 measured the same)


def _seed(m):
    """``SEEDS[m]`` for a traced magnitude index ``m`` in [0, 5), as a chain of selects."""
    s = jnp.float32(SEEDS[N_MAGNITUDES - 1])
    for j in range(N_MAGNITUDES - 2, -1, -1):
        s = jnp.where(m == j, jnp.float32(SEEDS[j]), s)
    return s


def _ptx(asm: str, *args):
    """One float32 PTX instruction applied elementwise."""
    # lazy: heavy (pallas)
    from jax.experimental.pallas import triton as plgpu

    shape = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
    constraints = ",".join(["=f"] + ["f"] * len(args))
    return plgpu.elementwise_inline_asm(
        asm, args=list(args), constraints=constraints, pack=1, result_shape_dtypes=[shape]
    )[0]


def search_columns(w, a, gain, ptx: bool):
    """The search on blocks given as 64 columns: ``w[i]`` and ``a[i]`` hold weight ``i`` and its
    raw importance for every block of the program. Returns the codes as 64 float32 columns and
    the stored scale (float32, exact in fp16). ``ptx``: PTX ``fma`` and ``cvt.rni`` (compiled
    kernels) instead of float32 multiply, add and round (the interpreter)."""

    def fma(x, y, acc):  # acc + x * y
        if acc is None:
            return x * y
        return _ptx("fma.rn.f32 $0, $1, $2, $3;", x, y, acc) if ptx else acc + x * y

    def rint(x):  # round half to even
        return _ptx("cvt.rni.f32.f32 $0, $1;", x) if ptx else jnp.round(x)

    def code(x):  # clip(round_half_even(x), -1, 2)
        return rint(jnp.minimum(jnp.maximum(x, -1.0), 2.0))

    def sums(step):  # Σaqw, Σaq² for q = code(w * step)
        sqw = sqq = None
        for w_i, a_i in zip(w, a, strict=True):
            q = code(w_i * step)
            aq = a_i * q
            sqw, sqq = fma(aq, w_i, sqw), fma(aq, q, sqq)
        return sqw, sqq

    a_top = a[0]
    for a_i in a[1:]:
        a_top = jnp.maximum(a_top, a_i)
    a_inv = _pow2_inverse(a_top)  # max a in [1, 2), exactly, as the CPU kernel scales it
    a = [a_i * a_inv for a_i in a]
    amax = jnp.abs(w[0])
    for w_i in w[1:]:
        amax = jnp.maximum(amax, jnp.abs(w_i))
    live = amax > 0
    scale = _pow2_inverse(amax)
    amax_n = jnp.where(live, amax * scale, 1.0)

    def refit(d0, sqw, sqq):
        """A seed's second pass from its first pass's sums: ``(d1, score)``."""
        d1 = _safe_ratio(sqw * scale, sqq, d0)
        sqw, sqq = sums(scale / d1)
        sqw = sqw * scale
        return d1, _safe_ratio(sqw * sqw, sqq, 0.0)

    def magnitude(m, carry):
        pos_score, pos_d1, neg_score, neg_d1 = carry
        d0 = _seed(m) * amax_n
        step = scale / d0
        sqw_p = sqq_p = sqw_n = sqq_n = None
        for w_i, a_i in zip(w, a, strict=True):
            r = rint(w_i * step)  # |w * step| < 2.5: r in [-2, 2]
            qp, qn = jnp.maximum(r, -1.0), jnp.minimum(r, 1.0)  # seed s: qp; seed -s: -qn
            ap, an = a_i * qp, a_i * qn
            sqw_p, sqq_p = fma(ap, w_i, sqw_p), fma(ap, qp, sqq_p)
            sqw_n, sqq_n = fma(an, w_i, sqw_n), fma(an, qn, sqq_n)
        d1, score = refit(d0, sqw_p, sqq_p)
        better = score > pos_score  # strictly: the first seed wins a tie
        pos_score, pos_d1 = jnp.where(better, score, pos_score), jnp.where(better, d1, pos_d1)
        d1, score = refit(-d0, -sqw_n, sqq_n)
        better = score > neg_score
        neg_score, neg_d1 = jnp.where(better, score, neg_score), jnp.where(better, d1, neg_d1)
        return pos_score, pos_d1, neg_score, neg_d1

    start = jnp.full(amax.shape, -1.0, jnp.float32)
    one = jnp.ones(amax.shape, jnp.float32)
    pos_score, pos_d1, neg_score, neg_d1 = jax.lax.fori_loop(
        0, N_MAGNITUDES, magnitude, (start, one, start, one)
    )
    best_d1 = jnp.where(neg_score > pos_score, neg_d1, pos_d1)  # positive seeds come first
    step = scale / best_d1
    codes = []
    sqw = sqq = saw2 = None
    for w_i, a_i in zip(w, a, strict=True):
        y_i = w_i * scale  # normalized, so that Σay² cannot underflow for tiny blocks
        q = code(w_i * step)
        codes.append(q)
        aq = a_i * q
        sqw, sqq, saw2 = fma(aq, y_i, sqw), fma(aq, q, sqq), fma(a_i * y_i, y_i, saw2)
    return codes, stored_scale(sqw, sqq, saw2, live, gain) / scale


def flops_per_weight() -> int:
    """Floating-point operations a weight of this formulation (an FMA counts 2; min, max,
    compare and round count 1): the numerator of the fp32 ceiling in the benchmark."""
    first = 2 + 2 * (1 + 1 + 2 + 2)  # w*step, round; per seed sign: clip, a*q, 2 FMA
    second = 1 + 2 + 1 + 1 + 2 + 2  # w*step, clip, round, a*q, 2 FMA
    final = second + 1 + 1 + 2  # + y = w*scale, a*y and an FMA for Σay²
    return 2 + 2 + N_MAGNITUDES * (first + 2 * second) + final  # + |w|, max; a max, a*inv


def _split_columns(x):
    """``[B, 64]`` -> 64 columns ``[B]`` by halving splits (one load feeds them all)."""
    return [c.reshape(c.shape[0]) for c in jnp.split(x, QK, axis=1)]


def _join_columns(cols):
    """Inverse of :func:`_split_columns`: 64 columns ``[B]`` -> ``[B, 64]``. Stacking column
    ``j`` with column ``j + half`` adds the next lower bit of the column index."""
    parts = list(cols)
    while len(parts) > 1:
        half = len(parts) // 2
        parts = [jnp.stack([parts[j], parts[j + half]], axis=-1) for j in range(half)]
    return parts[0].reshape(parts[0].shape[0], QK)


def _kernel(gain_ref, w_ref, a_ref, d_ref, q_ref, *, ptx: bool):
    rows, width = w_ref.shape  # LANES rows x k blocks of 64
    k = width // QK
    w = _split_columns(w_ref[...].reshape(rows * k, QK))
    a_tile = a_ref[...]  # [1, width] (one row for the group) or [rows, width]
    a_tile = jnp.broadcast_to(a_tile.reshape(a_tile.shape[0], k, QK), (rows, k, QK))
    a = _split_columns(a_tile.reshape(rows * k, QK))
    codes, d = search_columns(w, a, gain_ref[0], ptx)
    q_ref[...] = _join_columns([c.astype(jnp.int8) for c in codes]).reshape(rows, width)
    d_ref[...] = d.reshape(rows, k).astype(jnp.float16)


def blocks_per_program(n_in: int) -> int:
    """``k``: the largest power of two up to MAX_K that divides the row's ``in / 64`` blocks."""
    k = 1
    while k < MAX_K and (n_in // QK) % (2 * k) == 0:
        k *= 2
    return k


def quantize_rows(w, importance, gain, interpret: bool = False):
    """Quantize ``w`` [R, in] (``R % 16 == 0``, ``in % 64 == 0``) with ``importance`` [R, in] (a
    row per weight row) or [R/16, in] (a row per group of 16 rows), on the default device.

    Returns ``(d [R, in/64] float16, q [R, in] int8)`` as device arrays. ``interpret`` runs
    the kernel in Pallas' interpreter (plain float32 operations), on any backend.
    """
    n_rows, n_in = w.shape
    if n_rows % LANES or n_in % QK:
        raise ValueError(f"q2_0_gpu.quantize_rows: {w.shape} is not [16·m, 64·n]")
    if importance.shape not in ((n_rows, n_in), (n_rows // LANES, n_in)):
        raise ValueError(
            f"q2_0_gpu.quantize_rows: importance {importance.shape} is neither per row nor per "
            f"group of {LANES} rows of {w.shape}"
        )
    k = blocks_per_program(n_in)
    return _call(w, importance, gain, k, interpret)


@partial(jax.jit, static_argnums=(3, 4))
def _call(w, importance, gain, k: int, interpret: bool):
    n_rows, n_in = w.shape
    a_rows = LANES if importance.shape[0] == n_rows else 1
    tile = (LANES, k * QK)
    params = None
    if not interpret:
        # lazy: heavy (pallas)
        from jax.experimental.pallas import triton as plgpu

        make = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
        params = make(num_warps=max(1, LANES * k // 32), num_stages=1)
    # lazy: heavy (pallas)
    from jax.experimental import pallas as pl

    call = pl.pallas_call(
        partial(_kernel, ptx=not interpret),
        grid=(n_rows // LANES, n_in // (k * QK)),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec(tile, lambda i, j: (i, j)),
            pl.BlockSpec((a_rows, k * QK), lambda i, j: (i, j)),
        ],
        out_specs=[
            pl.BlockSpec((LANES, k), lambda i, j: (i, j)),
            pl.BlockSpec(tile, lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_rows, n_in // QK), jnp.float16),
            jax.ShapeDtypeStruct((n_rows, n_in), jnp.int8),
        ],
        interpret=interpret,
        compiler_params=params,
        name="q2_0_search",
    )
    gain = jnp.reshape(jnp.asarray(gain, jnp.float32), (1,))
    return tuple(call(gain, w.astype(jnp.float32), importance.astype(jnp.float32)))


def on_cuda() -> bool:
    """Whether JAX's default backend is an NVIDIA GPU (the only one this kernel targets)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return "cuda" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # noqa: BLE001 (an unknown client: not known to be CUDA)
        return False


@cache
def lowers() -> bool:
    """Whether this JAX can lower the kernel for CUDA (Pallas' Triton lowering of ``split``
    came after jax 0.5.0). Checked once by lowering a one-tile call; no GPU needed."""
    shape = jax.ShapeDtypeStruct
    args = (
        shape((LANES, QK), jnp.float32),
        shape((1, QK), jnp.float32),
        shape((), jnp.float32),
    )
    try:
        _call.trace(*args, 1, False).lower(lowering_platforms=("cuda",))
    except Exception as err:  # noqa: BLE001 (any lowering failure means: use the XLA kernel)
        log.warning(
            "Q2_0: the Pallas GPU kernel does not lower on jax %s (%s); using the XLA kernel",
            jax.__version__,
            str(err).splitlines()[0][:160],
        )
        return False
    return True
