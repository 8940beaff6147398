"""GPTQ-style error feedback for Q2_0: quantize a stack of matrices column block by column block,
moving each column's rounding error onto the columns not yet quantized.

Inputs are a stack ``w`` [E, out, in] (one matrix per routed expert) and, per matrix, two host
factors of its damped input second moment ``H = V·D·Vᵀ`` (``V`` unit upper triangular; factored
on the host, never here: Metal has no Cholesky):

- the feedback ``f = V − I`` [E, in, in], strictly upper. With ``r_j = w_j − q_j·d`` the error of
  column ``j`` against the *original* weights, column ``k`` is rounded from
  ``w_k + Σ_{j<k} r_j·f_jk``: GPTQ's value for it, written with H's own factor instead of the
  Cholesky factor of H⁻¹ (QuIP's LDLQ form, shown there to give GPTQ's codes), so the host
  needs one triangular factorization and no inverse;
- ``g`` [E, in/64, 64, 64], the inverse of each 64-block's diagonal block of ``V``. GPTQ's weights
  at the start of a block (all earlier columns' errors applied, none of the block's own) are
  ``w_b + (z_b − w_b)·g_b`` for the block's columns ``z_b`` of the form above.

Per 64-column block ``b`` (one Q2_0 block column):

1. the block's scale comes from the exact Q2_0 search of :mod:`q2_0` (same seeds, same
   arithmetic, same gain) run on GPTQ's error-updated weights at the block's start, with the
   block's importance ``a`` (the diagonal of H: the part of GPTQ's objective that a per-block
   search can see). The search yields the stored fp16 ``d`` and its rounding step ``1/d1``;
2. the 64 columns are then rounded one by one with that fixed step, ``q_j = round_code(w_j/d1)``
   (``q_j·d`` is the value the file will hold), from the block's start weights and the
   errors against them (:func:`_round_word`), in words of ``WORD`` columns whose errors reach
   each other one column at a time and each later word in one product; a word's 2-bit codes
   come back packed in one int32 per row of ``w``;
3. the block's errors reach the rest of its span of ``SPAN`` columns in one product, and each
   span's errors every later span in one product per pair (GPTQ's lazy batch updates, nested, so
   that most of the arithmetic is products with an inner dimension of ``SPAN``).

Where ``f`` is 0 nothing propagates and step 2 rounds exactly as the search does, so the result
equals :func:`q2_0.quantize_matrix` bit for bit (the property test of ``tests/test_gptq.py``).
The work runs transposed, ``[E, in, out]``: a column of ``w`` is a contiguous row, and a block is
the ``[E, 64, out]`` tile the search vectorizes over ``out``. Blocks and spans are driven from
the host, six jitted calls a block: the start weights and the scale search, one per word of
the rounding, then the errors' propagation (XLA's CPU backend runs a loop body's fusions
several times slower than the same fusions at top level, ran search and rounding in one program
2x slower than in two, and fused all of a block's words into one program that computed every
column's chain again for each later column; each compiled once per shape). Float32 throughout
(the packed codes int32); matrix
products at ``HIGHEST`` precision (no TF32 on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels._precision import healing_jit
from healsweep.kernels.q2_0 import LANES, QK, _pow2_inverse, round_code, search_tiles

_HIGHEST = jax.lax.Precision.HIGHEST
SPAN = 256  # columns whose errors travel to the later columns in one product
WORD = 16  # columns rounded in one loop fusion, their 2-bit codes packed in one int32


def block_scale(wt: jax.Array, a: jax.Array, gain: jax.Array):
    """The Q2_0 search on one block column, transposed: ``wt`` [E, 64, out], ``a`` [E, 64] (> 0).

    Returns ``(d [E, out] float16, step [E, out] float32, extras)``: the stored scale and the
    rounding step of the search's winner (codes ``round_code(w * step)``), and the search's
    per-seed arrays. The blocks lie along ``out`` (the search's tile layout, no copies); the
    caller returns ``extras`` from its jitted function so that XLA materializes them once
    (dropped, the CPU backend re-derives them inside later fusions: 10x slower).
    """
    a = a * _pow2_inverse(jnp.max(a, axis=1))[:, None]  # max a in [1, 2), exactly, as the codec
    d, scale, best_d1, extras = search_tiles(wt, a[:, :, None], gain)  # [E, out] each
    return (d / scale).astype(jnp.float16), scale / best_d1, extras


def _unpacked(words) -> jax.Array:
    """The codes ``q`` [E, WORD·len(words), out] float32 of the packed ``words`` (each
    [E, out] int32, code ``q + 1`` of column ``j`` in bits ``2j, 2j+1``)."""
    packed = jnp.stack(words, axis=1)  # [E, n, out]
    shifts = jnp.arange(0, 2 * WORD, 2, dtype=jnp.int32)[None, None, :, None]
    q = jax.lax.shift_right_logical(packed[:, :, None, :], shifts) & 3  # [E, n, WORD, out]
    n_exp, n_words, n_out = packed.shape
    return q.reshape(n_exp, n_words * WORD, n_out).astype(jnp.float32) - 1.0


@healing_jit
def _round_word(at_start, f_diag, step, d16, words):
    """GPTQ's rounding of the next ``WORD`` columns of a block once its scale is known, their
    codes packed in one ``[E, out]`` int32: ``at_start`` [E, 64, out] the block's weights at
    its start (every earlier block's errors applied: GPTQ's weights there), ``f_diag``
    [E, 64, 64] the feedback inside the block, ``step`` [E, out] / ``d16`` [E, out] float16
    the search's rounding step and stored scale, ``words`` the codes of the block's earlier
    columns (a tuple of :func:`_round_word`'s results, ``WORD`` columns each).

    With ``Δ = at_start − w_b`` and ``V_bb = I + f_diag``, the block's weights with the
    earlier blocks' feedback are ``w_b + V_bbᵀΔ``, so column ``k`` is rounded from
    ``at_start_k + Σ_{j<k} f_jk·e_j`` with ``e_j = at_start_j − q_j·d``: the block needs only
    its start. The earlier words' errors reach these columns in one product; inside the word
    each column takes the errors of the ones before it as it is reached, all in one loop
    fusion over ``[E, out]`` whose one output is the packed word (a result per column, or a
    stack of them, made XLA's CPU backend compute each column's chain again for every later
    column that read it; docs/sizing.md)."""
    at = len(words) * WORD
    d32 = d16.astype(jnp.float32)
    rows = at_start[:, at : at + WORD]  # [E, WORD, out]
    if words:  # f is strictly upper: only the earlier columns' errors reach these
        done = at_start[:, :at] - _unpacked(words) * d32[:, None]  # [E, at, out]
        f_in = f_diag[:, :at, at : at + WORD]  # [E, at, WORD]
        rows = rows + jnp.einsum("ejk,ejo->eko", f_in, done, precision=_HIGHEST)
    errors, word = [], None
    for j in range(WORD):
        row = rows[:, j]
        for i, e_i in enumerate(errors):
            row = row + f_diag[:, at + i, at + j, None] * e_i
        q = round_code(row * step)
        errors.append(at_start[:, at + j] - q * d32)
        code = jnp.left_shift((q + 1.0).astype(jnp.int32), jnp.int32(2 * j))
        word = code if word is None else word | code
    return word


def _round_words(at_start, f_diag, step, d16) -> tuple:
    """The block's codes, :func:`_round_word` after :func:`_round_word` (one call each)."""
    words = ()
    for _ in range(QK // WORD):
        words = (*words, _round_word(at_start, f_diag, step, d16, words))
    return words


@healing_jit
def _block_start(base, orig, g_block, importance, start, gain):
    """The block at column ``start`` of a span up to its scale: ``base`` [E, S, out] the
    span's columns with the errors so far, ``orig`` [E, S, out] the original ones, ``g_block``
    [E, 64, 64] the block's diagonal inverse, ``importance`` [E, S]. Returns ``(at_start
    [E, 64, out], d [E, out] float16, step [E, out], extras)`` as :func:`_lowrank_start`."""
    wb = jax.lax.dynamic_slice_in_dim(base, start, QK, axis=1)  # [E, 64, out]
    ob = jax.lax.dynamic_slice_in_dim(orig, start, QK, axis=1)
    ab = jax.lax.dynamic_slice_in_dim(importance, start, QK, axis=1)  # [E, 64]
    at_start = ob + jnp.einsum("ejk,ejo->eko", g_block, wb - ob, precision=_HIGHEST)
    d16, step, extras = block_scale(at_start, ab, gain)
    return at_start, d16, step, extras


@healing_jit(donate_argnums=(0,))
def _block_round(base, orig, f_span, words, d16, start):
    """The block at column ``start`` of a span after its codes (:func:`_round_words`):
    ``f_span`` [E, S, S] the feedback inside the span. Returns ``(base, q [E, 64, out] int8,
    r [E, 64, out])`` with ``r`` the errors against the original weights, already applied to
    the span's later columns of ``base`` (donated: updated in place)."""
    ob = jax.lax.dynamic_slice_in_dim(orig, start, QK, axis=1)
    fb = jax.lax.dynamic_slice_in_dim(f_span, start, QK, axis=1)  # [E, 64, S]
    q = _unpacked(words)  # [E, 64, out]
    r = ob - q * d16.astype(jnp.float32)[:, None]
    # every column of the span takes the block's errors; f is 0 up to the block's end, and
    # the block's own columns are never read again
    base = base + jnp.einsum("ejk,ejo->eko", fb, r, precision=_HIGHEST)
    return base, q.astype(jnp.int8), r


@jax.jit
def _diagonal_blocks(f):
    """``f``'s diagonal 64-blocks [E, n/64, 64, 64] of ``f`` [E, n, n]."""
    n_exp, n = f.shape[:2]
    nb = n // QK
    blocks = f.reshape(n_exp, nb, QK, nb, QK)
    return jnp.stack([blocks[:, b, :, b] for b in range(nb)], axis=1)


@healing_jit
def _lowrank_start(acc, orig, u, g_block, importance, start, gain):
    """The block at column ``start`` of :func:`quantize_lowrank` up to its scale: GPTQ's
    weights at the block's start, ``at_start = w_b + g_bbᵀ·u_bᵀ·acc`` [E, 64, out], with
    ``acc`` [E, P, out] the earlier columns' errors gathered through their rows, ``orig``
    [E, in, out] the group's matrices transposed (:func:`_transposed`: a block is a
    contiguous slice), ``u`` [E, P, in], ``g_block`` [E, 64, 64], ``importance`` [E, in]; and
    the block's search on them. Returns ``(at_start, d [E, out] float16, step [E, out],
    extras)``.

    The rounding that follows is a separate call (:func:`_lowrank_round`): in one program
    with the search, XLA's CPU backend ran the pair 2x slower than the two calls."""
    ob = jax.lax.dynamic_slice_in_dim(orig, start, QK, axis=1)  # [E, 64, out]
    u_b = jax.lax.dynamic_slice_in_dim(u, start, QK, axis=2)  # [E, P, 64]
    ab = jax.lax.dynamic_slice_in_dim(importance, start, QK, axis=1)  # [E, 64]
    u_start = jnp.einsum("epj,ejk->epk", u_b, g_block, precision=_HIGHEST)
    at_start = ob + jnp.einsum("epk,epo->eko", u_start, acc, precision=_HIGHEST)
    d16, step, extras = block_scale(at_start, ab, gain)
    return at_start, d16, step, extras


@healing_jit(donate_argnums=(0,))
def _lowrank_round(acc, orig, x, words, d16, start):
    """The block at column ``start`` after its codes (:func:`_round_words`, ``orig`` [E, in,
    out] as in :func:`_lowrank_start`): its codes ``q`` [E, 64, out] int8, and ``acc``
    (donated) with the block's errors against the original weights added through their rows,
    ``x`` [E, P, in]."""
    ob = jax.lax.dynamic_slice_in_dim(orig, start, QK, axis=1)  # [E, 64, out]
    x_b = jax.lax.dynamic_slice_in_dim(x, start, QK, axis=2)  # [E, P, 64]
    q = _unpacked(words)
    r = ob - q * d16.astype(jnp.float32)[:, None]
    acc = acc + jnp.einsum("epj,ejo->epo", x_b, r, precision=_HIGHEST)
    return acc, q.astype(jnp.int8)


@healing_jit(donate_argnums=(0,))
def _carry(base, f_cross, r):
    """``base`` [E, S', out] (a later span, donated) plus the errors ``r`` [E, S, out] of an
    earlier span through their feedback ``f_cross`` [E, S, S']."""
    return base + jnp.einsum("ejk,ejo->eko", f_cross, r, precision=_HIGHEST)


@jax.jit
def _tiled(w, experts):
    """``w[experts]`` [E, out, in] as float32 tiles ``[E, in/64, out/16, 64, 16]``: runs of 16
    floats moved (``out % 16 == 0``)."""
    stack = w[experts].astype(jnp.float32)
    n_exp, n_out, n_in = stack.shape
    tiles = stack.reshape(n_exp, n_out // LANES, LANES, n_in // QK, QK)
    return tiles.transpose(0, 3, 1, 4, 2)


@jax.jit
def _untiled(tiles):
    """:func:`_tiled`'s tiles as ``[E, in, out]`` (runs of 16 floats moved again)."""
    n_exp, nb, n_tiles = tiles.shape[:3]
    return tiles.transpose(0, 1, 3, 2, 4).reshape(n_exp, nb * QK, n_tiles * LANES)


@jax.jit
def _gathered_transposed(w, experts):
    """``w[experts]`` [E, in, out] float32 in one pass (any ``out``)."""
    return jnp.swapaxes(w[experts].astype(jnp.float32), 1, 2)


def _transposed(w, experts):
    """``w[experts]`` [E, in, out] float32. Where ``out % 16 == 0``, in two programs through
    the codec's tile layout (:func:`_tiled`, :func:`_untiled`): XLA's CPU backend moved an
    ``[8, 1408, 2048]`` group that way in 0.11 CPU s against 0.22 s for the one transpose
    (docs/sizing.md)."""
    if w.shape[1] % LANES:
        return _gathered_transposed(w, experts)
    return _untiled(_tiled(w, experts))


@jax.jit
def _assembled(d_blocks, q_blocks):
    """``d`` [E, out, nb] and ``q`` [E, out, in] from per-block ``[E, out]`` / ``[E, 64, out]``."""
    d = jnp.stack(d_blocks, axis=2)
    q = jnp.swapaxes(jnp.concatenate(q_blocks, axis=1), 1, 2)
    return d, q


def spans(n_in: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` column spans of a row of ``n_in`` (the last may be shorter)."""
    return [(a, min(a + SPAN, n_in)) for a in range(0, n_in, SPAN)]


def quantize(w, f, g, importance, gain, experts=None) -> tuple[jax.Array, jax.Array]:
    """GPTQ Q2_0 of the stack ``w`` [E, out, in] (``in % 64 == 0``; device or host), or with
    ``experts`` (int indices) of the stack ``w[experts]``.

    ``f`` [E, in, in]: each matrix's feedback, strictly upper (``V − I`` of its damped
    ``H = V·D·Vᵀ``); ``g`` [E, in/64, 64, 64]: the inverses of ``V``'s diagonal 64-blocks;
    ``importance`` [E, in] (> 0): the per-column weights of each block's scale search. Returns
    device arrays ``(d [E, out, in/64] float16, q [E, out, in] int8)`` in {-1, 0, 1, 2}:
    ordinary Q2_0. Dispatches a few jitted calls per block and returns without waiting.
    """
    n_in = w.shape[2]
    experts = np.arange(w.shape[0]) if experts is None else experts
    orig = _transposed(w, jnp.asarray(experts, jnp.int32))  # [E, in, out]: a column is a row
    f, g = jnp.asarray(f, jnp.float32), jnp.asarray(g, jnp.float32)
    importance, gain = jnp.asarray(importance, jnp.float32), jnp.float32(gain)
    parts = spans(n_in)
    # each span's columns with the errors so far (own buffers: _block and _carry donate them)
    pending = [jnp.copy(orig[:, a:b]) for a, b in parts]
    d_blocks, q_blocks = [], []
    for m, (a, b) in enumerate(parts):
        orig_m, f_m, imp_m = orig[:, a:b], f[:, a:b, a:b], importance[:, a:b]
        f_diag = _diagonal_blocks(f_m)  # [E, S/64, 64, 64]
        r_blocks = []
        for start in range(0, b - a, QK):
            at = np.int32(start)
            g_b = g[:, (a + start) // QK]
            at_start, d, step, _ = _block_start(pending[m], orig_m, g_b, imp_m, at, gain)
            words = _round_words(at_start, f_diag[:, start // QK], step, d)
            pending[m], q, r = _block_round(pending[m], orig_m, f_m, words, d, at)
            d_blocks.append(d)
            q_blocks.append(q)
            r_blocks.append(r)
        r_m = jnp.concatenate(r_blocks, axis=1) if len(r_blocks) > 1 else r_blocks[0]
        for k in range(m + 1, len(parts)):
            c, e = parts[k]
            pending[k] = _carry(pending[k], f[:, a:b, c:e], r_m)
    return _assembled(d_blocks, q_blocks)


def quantize_lowrank(w, x, u, f_diag, g, importance, gain, experts=None):
    """:func:`quantize` with the feedback in factored form, for ``H = λI + XᵀX`` of ``P`` rows
    (``P`` well below ``in``): ``f_jk = x_jᵀu_k`` for ``j < k``, with ``x`` [E, P, in] the rows
    (zero rows are inert) and ``u`` [E, P, in] from the host (:func:`healsweep.quant.gptq
    .factor_rows`); ``f_diag`` [E, in/64, 64, 64] the same feedback inside each diagonal block
    (``V − I`` there), ``g`` [E, in/64, 64, 64] the inverses of ``V``'s diagonal blocks,
    ``importance`` [E, in] as for :func:`quantize`.

    A column's feedback from every earlier block is ``u_kᵀ·acc`` with ``acc = Σ_j x_j ⊗ r_j``
    (``[E, P, out]``, each block's errors added once): ``2·P`` multiply-adds per weight instead
    of up to ``in``. The same codes as :func:`quantize` up to float32 rounding.
    """
    n_exp = w.shape[0] if experts is None else len(experts)
    experts = np.arange(w.shape[0]) if experts is None else experts
    orig = _transposed(w, jnp.asarray(experts, jnp.int32))  # [E, in, out]: a block is a slice
    x, u = jnp.asarray(x, jnp.float32), jnp.asarray(u, jnp.float32)
    f_diag, g = jnp.asarray(f_diag, jnp.float32), jnp.asarray(g, jnp.float32)
    importance, gain = jnp.asarray(importance, jnp.float32), jnp.float32(gain)
    acc = jnp.zeros((n_exp, x.shape[1], w.shape[1]), jnp.float32)
    d_blocks, q_blocks = [], []
    for b in range(w.shape[2] // QK):
        at = np.int32(b * QK)
        at_start, d, step, _ = _lowrank_start(acc, orig, u, g[:, b], importance, at, gain)
        words = _round_words(at_start, f_diag[:, b], step, d)
        acc, q = _lowrank_round(acc, orig, x, words, d, at)
        d_blocks.append(d)
        q_blocks.append(q)
    return _assembled(d_blocks, q_blocks)
