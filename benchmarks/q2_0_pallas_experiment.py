"""EXPERIMENT (not used by healsweep): the Q2_0 search as one Pallas kernel for CUDA GPUs.

Status, measured on an H200 (jax 0.11.2, Triton through Pallas) on 2026-12-02: **the Triton
compile of this kernel took 3 min 15 s for one chunk shape**, so its run time was never
measured; a sweep worker would pay that per row width unless a persistent compilation cache
holds it. Two tensor formulations of the same search (whole [16, 64] or transposed [64, k, 16]
tiles with the sums as reductions) compiled in 6-26 s but ran at 5-10 G weights/s, below the
XLA fusion the product uses (35 G weights/s), and were dropped. The kernel's two arithmetic
tricks (rounding by two adds; seeds s and -s sharing a first pass) both made that XLA fusion
slower when put into it: 21.5 and 15.8 G weights/s. Kept here so that the next
attempt starts from a kernel that lowers, whose interpreted run equals the CPU kernel bit for
bit (``python benchmarks/q2_0_pallas_experiment.py`` checks that on any machine), and which
``bench_quant.py --experiments`` times on a GPU (about 10 minutes with both designs).

A second design at the end of the file, :func:`quantize_rows_stream`, not yet timed, trades the
registers for small code: it streams each block from L1 on every pass (coalesced, after an XLA
transpose), so that it compiles in seconds.

The design. Same search, same float32 operations and the same summation order as
:func:`healsweep.kernels.q2_0.search_tiles`, so its codes and scales equal the CPU kernel's
except where the GPU contracts a multiply and an add into one fused multiply-add (a float32
near-tie, as the codec tests document). What was meant to make it fast on a GPU:

- **A thread per block, its 64 weights in registers.** A program covers ``rows x k`` blocks
  (``rows`` consecutive matrix rows, ``k`` consecutive column blocks); weight ``i`` of all its
  blocks is one ``[rows, k]`` tensor, one element per thread, so every sum over a block is a
  chain of 64 adds inside one thread: no shuffles, no shared memory, and the weights are read
  from memory once for all 21 passes.
- **Rounding by adding and subtracting 1.5 * 2**23** (round half to even for ``|x| < 2**22``, which
  the clip to [-1, 2] guarantees) instead of a float-to-integer round, a conversion that runs
  at a fraction of the add rate. The constant is an input, not a literal, so that no compiler
  folds ``(x + M) - M`` back to ``x``.
- **The first pass is shared by the seeds s and -s.** ``w / d0`` is below 2.5 in magnitude for
  every first pass (``|w| <= amax`` and ``|s| >= 0.42``), so its rounded value ``r`` needs no
  upper clip; the seed ``+s`` takes ``max(r, -1)`` and the seed ``-s`` takes ``-min(r, 1)``,
  both exact. The positive and negative seeds keep separate running bests, merged at the end
  with the positive one winning ties: the first-seed-wins order of the search.
- **The five seed magnitudes run in a loop**, not unrolled, so that the code stays small
  enough for the instruction cache.

It runs wherever Pallas runs: compiled through Triton on an NVIDIA GPU, or in Pallas' interpreter
on a CPU (how ``_self_check`` checks it). Importance is one row per weight row or one per group of
``rows`` weight rows (per expert, as ``quantize_matrix`` groups them).
"""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from healsweep.kernels.q2_0 import LANES, QK, SEEDS, _pow2_inverse, _row_sums, stored_scale
from healsweep.kernels.q2_0 import _safe_ratio as _ratio

MAGIC = 12582912.0  # 1.5 * 2**23: x + MAGIC - MAGIC rounds x half to even for |x| < 2**22
N_MAGNITUDES = len(SEEDS) // 2
assert SEEDS[N_MAGNITUDES:] == tuple(-s for s in SEEDS[:N_MAGNITUDES])


def _seed(m):
    """``SEEDS[m]`` for a traced magnitude index ``m`` in [0, 5), as a chain of selects."""
    s = jnp.float32(SEEDS[N_MAGNITUDES - 1])
    for j in range(N_MAGNITUDES - 2, -1, -1):
        s = jnp.where(m == j, jnp.float32(SEEDS[j]), s)
    return s


def _q2_kernel(magic_ref, gain_ref, w_ref, a_ref, d_ref, q_ref, *, k: int):
    magic = magic_ref[0]
    gain = gain_ref[0]

    def rint(x):
        return (x + magic) - magic

    def code(x):  # clip(round_half_even(x), -1, 2) for any finite x
        return rint(jnp.minimum(jnp.maximum(x, -1.0), 2.0))

    def column(ref, i):  # weight i of each of the k blocks: [rows, k] (or [1, k])
        return ref[:, pl.ds(i, k, stride=QK)]

    w = [column(w_ref, i) for i in range(QK)]
    a = [column(a_ref, i) for i in range(QK)]
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

    def refit(d0, step0, sqw, sqq):
        """The second pass of a seed from its first pass's sums: (d1, score)."""
        d1 = _ratio(sqw * scale, sqq, d0)
        sqw, sqq = _row_sums(w, a, scale / d1, code)
        sqw = sqw * scale
        return d1, _ratio(sqw * sqw, sqq, 0.0)

    def magnitude(m, carry):
        pos_score, pos_d1, neg_score, neg_d1 = carry
        d0 = _seed(m) * amax_n
        step = scale / d0
        sqw_p = sqq_p = sqw_n = sqq_n = None
        for w_i, a_i in zip(w, a, strict=True):
            r = rint(w_i * step)  # |w * step| < 2.5: r in [-2, 2]
            qp, qn = jnp.maximum(r, -1.0), jnp.minimum(r, 1.0)  # seed s: qp; seed -s: -qn
            ap, an = a_i * qp, a_i * qn
            if sqw_p is None:
                sqw_p, sqq_p, sqw_n, sqq_n = ap * w_i, ap * qp, an * w_i, an * qn
            else:
                sqw_p, sqq_p = sqw_p + ap * w_i, sqq_p + ap * qp
                sqw_n, sqq_n = sqw_n + an * w_i, sqq_n + an * qn
        d1, score = refit(d0, step, sqw_p, sqq_p)
        better = score > pos_score
        pos_score, pos_d1 = jnp.where(better, score, pos_score), jnp.where(better, d1, pos_d1)
        d1, score = refit(-d0, -step, -sqw_n, sqq_n)
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
    sqw = sqq = saw2 = None
    for i, (w_i, a_i) in enumerate(zip(w, a, strict=True)):
        y_i = w_i * scale
        q = code(w_i * step)
        q_ref[:, pl.ds(i, k, stride=QK)] = q.astype(jnp.int8)
        aq = a_i * q
        sqw = aq * y_i if sqw is None else sqw + aq * y_i
        sqq = aq * q if sqq is None else sqq + aq * q
        saw2 = a_i * y_i * y_i if saw2 is None else saw2 + a_i * y_i * y_i
    d = stored_scale(sqw, sqq, saw2, live, gain)
    d_ref[...] = (d / scale).astype(jnp.float16)


def _compiler_params(num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    params = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return params(num_warps=num_warps, num_stages=1)


def tile_options(n_in: int, cap: int = 2) -> dict:
    """Program shape for rows of ``n_in`` weights: ``LANES`` rows (one importance group) by the
    largest power of two ``k <= cap`` of column blocks that divides ``in / 64``, a warp per 32
    blocks (one block per thread)."""
    k = 1
    while k < cap and (n_in // QK) % (2 * k) == 0:
        k *= 2
    return {"rows": LANES, "k": k, "num_warps": max(1, LANES * k // 32)}


def quantize_rows_pallas(
    w, importance, gain, rows: int = LANES, k: int = 2, num_warps: int = 1, interpret: bool = False
):
    """Quantize ``w`` [R, in] (``R % rows == 0``; ``in / 64`` a multiple of ``k``) with
    ``importance`` [R, in] (per row) or [R / rows, in] (one row per group of ``rows`` rows).

    Returns ``(d [R, in/64] float16, q [R, in] int8)``. A program handles ``rows x k`` blocks;
    ``rows * k`` should be ``32 * num_warps`` for one block per thread.
    """
    return _call(_magic(), w, importance, gain, rows, k, num_warps, interpret)


@cache
def _magic() -> jax.Array:
    """The rounding constant as a device array. It enters the jitted call as an argument: as a
    constant inside it, XLA (which runs the kernel under the interpreter) would fold
    ``(x + M) - M`` to ``x``."""
    return jnp.full((1,), MAGIC, jnp.float32)


@partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _call(magic, w, importance, gain, rows, k, num_warps, interpret):
    n_rows, n_in = w.shape
    nb = n_in // QK
    if n_rows % rows or nb % k or n_in % QK:
        raise ValueError(f"quantize_rows_pallas: {w.shape} does not tile by rows={rows}, k={k}")
    per_row = importance.shape[0] == n_rows
    if not per_row and importance.shape[0] * rows != n_rows:
        raise ValueError(
            f"quantize_rows_pallas: importance {importance.shape} is neither per row nor per "
            f"group of {rows} rows of {w.shape}"
        )
    a_rows = rows if per_row else 1
    tile = (rows, k * QK)
    call = pl.pallas_call(
        partial(_q2_kernel, k=k),
        grid=(n_rows // rows, nb // k),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec(tile, lambda i, j: (i, j)),
            pl.BlockSpec((a_rows, k * QK), lambda i, j: (i, j)),
        ],
        out_specs=[
            pl.BlockSpec((rows, k), lambda i, j: (i, j)),
            pl.BlockSpec(tile, lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_rows, nb), jnp.float16),
            jax.ShapeDtypeStruct((n_rows, n_in), jnp.int8),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(num_warps),
        name="q2_0_search",
    )
    gain = jnp.reshape(jnp.asarray(gain, jnp.float32), (1,))
    return tuple(call(magic, gain, w.astype(jnp.float32), importance.astype(jnp.float32)))


def flops_per_weight() -> int:
    """Floating-point operations per weight of this formulation (a fused multiply-add counts
    2; min, max and compare count 1): the numerator of the fp32 ceiling."""
    first = 3 + 2 * (1 + 1 + 2 + 2)  # x, +M, -M; per seed sign: clip, a*q, 2 FMA
    second = 1 + 2 + 2 + 1 + 2 + 2  # x, clip, +M, -M, a*q, 2 FMA
    final = second + 1 + 1 + 2  # + y = w*scale, a*y, an FMA for Σay²
    return 2 + 2 + N_MAGNITUDES * (first + 2 * second) + final  # + |w| max, a max and a*inv


# ---- second design, not yet timed: stream the block from L1 on every pass, small code ----
#
# The weights are first transposed (by XLA) to ``[64, G, nb, 16]``: weight ``i`` of the 16
# blocks of one importance group and column block sits in 16 consecutive floats, so a program
# covering ``kj`` column blocks of one group reads weight ``i`` of its ``kj * 16`` blocks with
# one coalesced load. Each pass loops over ``i`` (``UNROLL`` weights an iteration) and loads
# again, from L1, instead of holding 64 weights in registers: few registers, small code, a
# compile of seconds. Importance is expanded to one row per weight row (same layout as w).

UNROLL = 4


def _stream_kernel(magic_ref, gain_ref, w_ref, a_ref, d_ref, q_ref):
    magic = magic_ref[0]
    gain = gain_ref[0]

    def rint(x):
        return (x + magic) - magic

    def code(x):
        return rint(jnp.minimum(jnp.maximum(x, -1.0), 2.0))

    def loop(body, init):
        """``body(i, carry)`` for i = 0..63, UNROLL of them per loop iteration, in order."""

        def step(j, carry):
            for u in range(UNROLL):
                carry = body(j * UNROLL + u, carry)
            return carry

        return jax.lax.fori_loop(0, QK // UNROLL, step, init)

    zero = jnp.zeros(d_ref.shape, jnp.float32)
    amax, a_top = loop(
        lambda i, c: (jnp.maximum(c[0], jnp.abs(w_ref[i])), jnp.maximum(c[1], a_ref[i])),
        (zero, zero),
    )
    a_inv = _pow2_inverse(a_top)  # importance scaled so that its max is in [1, 2), exactly
    live = amax > 0
    scale = _pow2_inverse(amax)
    amax_n = jnp.where(live, amax * scale, 1.0)

    def first(step):
        def body(i, c):
            w, a = w_ref[i], a_ref[i] * a_inv
            r = rint(w * step)
            qp, qn = jnp.maximum(r, -1.0), jnp.minimum(r, 1.0)
            ap, an = a * qp, a * qn
            return (c[0] + ap * w, c[1] + ap * qp, c[2] + an * w, c[3] + an * qn)

        return loop(body, (zero, zero, zero, zero))

    def second(step_p, step_n):
        def body(i, c):
            w, a = w_ref[i], a_ref[i] * a_inv
            qp, qn = code(w * step_p), code(w * step_n)
            ap, an = a * qp, a * qn
            return (c[0] + ap * w, c[1] + ap * qp, c[2] + an * w, c[3] + an * qn)

        return loop(body, (zero, zero, zero, zero))

    def magnitude(m, carry):
        pos_score, pos_d1, neg_score, neg_d1 = carry
        d0 = _seed(m) * amax_n
        sqw_p, sqq_p, sqw_n, sqq_n = first(scale / d0)
        d1_p = _ratio(sqw_p * scale, sqq_p, d0)
        d1_n = _ratio(-sqw_n * scale, sqq_n, -d0)
        sqw_p, sqq_p, sqw_n, sqq_n = second(scale / d1_p, scale / d1_n)
        sqw_p, sqw_n = sqw_p * scale, sqw_n * scale
        score_p, score_n = _ratio(sqw_p * sqw_p, sqq_p, 0.0), _ratio(sqw_n * sqw_n, sqq_n, 0.0)
        better_p, better_n = score_p > pos_score, score_n > neg_score
        return (
            jnp.where(better_p, score_p, pos_score),
            jnp.where(better_p, d1_p, pos_d1),
            jnp.where(better_n, score_n, neg_score),
            jnp.where(better_n, d1_n, neg_d1),
        )

    start, one = zero - 1.0, zero + 1.0
    pos_score, pos_d1, neg_score, neg_d1 = jax.lax.fori_loop(
        0, N_MAGNITUDES, magnitude, (start, one, start, one)
    )
    step = scale / jnp.where(neg_score > pos_score, neg_d1, pos_d1)

    def final(i, c):
        w, a = w_ref[i], a_ref[i] * a_inv
        y = w * scale
        q = code(w * step)
        q_ref[i] = q.astype(jnp.int8)
        aq = a * q
        return (c[0] + aq * y, c[1] + aq * q, c[2] + a * y * y)

    sqw, sqq, saw2 = loop(final, (zero, zero, zero))
    d = stored_scale(sqw, sqq, saw2, live, gain)
    d_ref[...] = (d / scale).astype(jnp.float16)


def stream_flops_per_weight() -> int:
    """:func:`flops_per_weight` plus the importance rescaling it repeats on every pass."""
    return flops_per_weight() + 2 * N_MAGNITUDES + 1


def quantize_rows_stream(w, importance, gain, kj: int = 2, num_warps: int = 1, interpret=False):
    """The streaming design on ``w`` [R, in] (``R % 16 == 0``, ``in/64 % kj == 0``) with
    ``importance`` [R, in] or [R/16, in]; returns ``(d [R, in/64] float16, q [R, in] int8)``."""
    return _call_stream(_magic(), w, importance, gain, kj, num_warps, interpret)


@partial(jax.jit, static_argnums=(4, 5, 6))
def _call_stream(magic, w, importance, gain, kj, num_warps, interpret):
    n_rows, n_in = w.shape
    nb, groups = n_in // QK, n_rows // LANES
    if importance.shape[0] != n_rows:  # one row per group of LANES rows -> one per row
        importance = jnp.repeat(importance, LANES, axis=0)

    def lead(x):  # [R, in] -> [64, G, nb, 16]
        return x.astype(jnp.float32).reshape(groups, LANES, nb, QK).transpose(3, 0, 2, 1)

    tile = pl.BlockSpec((QK, None, kj, LANES), lambda g, j: (0, g, j, 0))
    scalar = pl.BlockSpec((1,), lambda g, j: (0,))
    call = pl.pallas_call(
        _stream_kernel,
        grid=(groups, nb // kj),
        in_specs=[scalar, scalar, tile, tile],
        out_specs=[pl.BlockSpec((None, kj, LANES), lambda g, j: (g, j, 0)), tile],
        out_shape=[
            jax.ShapeDtypeStruct((groups, nb, LANES), jnp.float16),
            jax.ShapeDtypeStruct((QK, groups, nb, LANES), jnp.int8),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(num_warps),
        name="q2_0_stream",
    )
    gain = jnp.reshape(jnp.asarray(gain, jnp.float32), (1,))
    d, qt = call(magic, gain, lead(w), lead(importance))
    return d.transpose(0, 2, 1).reshape(n_rows, nb), qt.transpose(1, 3, 2, 0).reshape(n_rows, n_in)


def _self_check() -> None:
    """Interpreted kernel against the CPU kernel on 32 rows of 128 weights, odd blocks included."""
    from healsweep.kernels import q2_0

    rng = np.random.default_rng(22)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    w[1, :64], w[2, :64], w[3, :64] = 0.0, -0.37, w[3, :64] * 1e-30
    for n_imp in (32, 2):  # per row, then per group of 16 rows
        imp = rng.uniform(0.1, 4.0, (n_imp, 128)).astype(np.float32)
        d_cpu, q_cpu = q2_0.quantize_rows(w, imp, 0.3, options={"tiles": True})
        for kernel in (quantize_rows_pallas, quantize_rows_stream):
            d, q = kernel(w, imp, np.float32(0.3), interpret=True)
            same = (np.asarray(d) == d_cpu).all() and (np.asarray(q) == q_cpu).all()
            assert same, (kernel.__name__, n_imp)
    print("interpreted Pallas kernels == CPU kernel, bit for bit (per-row and grouped importance)")


if __name__ == "__main__":
    _self_check()
