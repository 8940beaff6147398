"""Per-token KL divergence and agreement statistics between a teacher and a student.

Everything here is pure ``jax.numpy`` in float32. The vocabulary axis is processed in chunks of
``chunk`` columns so that the temporaries stay ``[T, chunk]`` however large ``V`` is; the inputs
themselves are the only ``[T, V]`` arrays alive.

Both arguments may be raw logits or log-probabilities: a log-softmax is invariant to a constant
shift per row, so the teacher-logit cache can hand in stored log-softmax rows unchanged.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

DEFAULT_CHUNK = 16384


class TokenStats(NamedTuple):
    """Per-token statistics of one window; every array is ``[T]``.

    ``kld`` is KL(teacher || student) in nats. ``*_logp_next`` are the log-probabilities the two
    models give the actual next token (their negatives are the NLLs behind perplexity).
    """

    kld: jax.Array  # [T] float32, >= 0
    top1_agree: jax.Array  # [T] bool: argmax of teacher == argmax of student
    teacher_argmax: jax.Array  # [T] int32
    student_argmax: jax.Array  # [T] int32
    teacher_logp_next: jax.Array  # [T] float32
    student_logp_next: jax.Array  # [T] float32


def _chunks(n_vocab: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, n_vocab)) for lo in range(0, n_vocab, chunk)]


def _row_max_logsum_argmax(x: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row max ``m``, ``log sum exp(x - m)`` and argmax of ``x [T, V]`` in one chunked pass.

    Keeping ``m`` apart from the small ``log sum`` lets callers form ``x - m`` exactly (Sterbenz)
    before subtracting the normaliser, so logits far from 0 lose no precision.
    """
    n_tok, n_vocab = x.shape
    run_max = jnp.full((n_tok,), -jnp.inf, dtype=jnp.float32)  # [T]
    run_sum = jnp.zeros((n_tok,), dtype=jnp.float32)  # [T] sum of exp(x - run_max)
    run_arg = jnp.zeros((n_tok,), dtype=jnp.int32)  # [T]
    for lo, hi in _chunks(n_vocab, chunk):
        block = x[:, lo:hi].astype(jnp.float32)  # [T, C]
        block_max = jnp.max(block, axis=1)  # [T]
        block_arg = jnp.argmax(block, axis=1).astype(jnp.int32) + lo  # [T]
        new_max = jnp.maximum(run_max, block_max)
        # Strict '>' keeps the first index on ties, like a single argmax over the row.
        run_arg = jnp.where(block_max > run_max, block_arg, run_arg)
        run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.sum(
            jnp.exp(block - new_max[:, None]), axis=1
        )
        run_max = new_max
    return run_max, jnp.log(run_sum), run_arg


def log_softmax(logits: jax.Array, chunk: int = DEFAULT_CHUNK) -> jax.Array:
    """Stable float32 log-softmax over the last axis of ``logits [T, V]``."""
    row_max, log_sum, _ = _row_max_logsum_argmax(logits, chunk)  # [T] x 2
    return (logits.astype(jnp.float32) - row_max[:, None]) - log_sum[:, None]  # [T, V]


def _shifted(x: jax.Array, row_max: jax.Array, lo: int, hi: int) -> jax.Array:
    """Columns ``lo:hi`` of ``x`` minus the row max (exact in float32): ``[T, C]``."""
    return x[:, lo:hi].astype(jnp.float32) - row_max[:, None]


def _centred_excess(
    t_shift: jax.Array, s_shift: jax.Array, log_sum_t: jax.Array, mu: jax.Array
) -> jax.Array:
    """``p_t * expm1(-(d - mu))`` per column of a vocab chunk, ``[T, C]``, for max-shifted logits.

    Where the student is relatively likelier (``y = d - mu < -1``), or the teacher gives the
    token probability 0, the product is formed as ``exp(s' - log_sum_t + mu) - p_t`` (its exact
    rewrite): ``p_t`` may underflow to 0 there while the product is not small at all, and student
    mass outside the teacher's support still counts. Elsewhere ``|expm1(-y)| < e`` and expm1
    keeps small gaps exact.
    """
    logp_t = t_shift - log_sum_t[:, None]  # [T, C]
    p_t = jnp.exp(logp_t)  # [T, C]
    y = (t_shift - s_shift) - mu[:, None]  # [T, C]
    small = p_t * jnp.expm1(-y)
    large = jnp.exp(s_shift - log_sum_t[:, None] + mu[:, None]) - p_t
    return jnp.where((y < -1.0) | (t_shift == -jnp.inf), large, small)


@partial(jax.jit, static_argnames=("chunk",))
def token_stats(
    teacher_logits: jax.Array,
    student_logits: jax.Array,
    next_ids: jax.Array,
    chunk: int = DEFAULT_CHUNK,
) -> TokenStats:
    """KL(teacher || student), top-1 agreement and next-token log-probs, token by token.

    ``teacher_logits, student_logits [T, V]`` are logits (or log-probs) at the positions that
    predict ``next_ids [T]`` (int32). KL is accumulated over vocabulary chunks (three passes:
    normalisers, mean logit gap, centred exponential moment) and clamped at 0, which it can
    only dip below through rounding.
    """
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"token_stats: teacher {teacher_logits.shape} and student {student_logits.shape} "
            "logits must have the same [T, V] shape"
        )
    max_t, ls_t, arg_t = _row_max_logsum_argmax(teacher_logits, chunk)  # [T] x 3
    max_s, ls_s, arg_s = _row_max_logsum_argmax(student_logits, chunk)  # [T] x 3
    n_tok, n_vocab = teacher_logits.shape
    # With the logit gap d = t' - s' of max-shifted logits, KL = E_p[d] + log E_p[exp(-d)] +
    # const, and the constant cancels. Centring d on its teacher mean mu and using expm1/log1p
    # keeps float32 *relative* precision for a KL of 1e-6, where the textbook sum of
    # p (log p - log q) drowns in the rounding of the two log-normalisers.
    mass = jnp.zeros((n_tok,), dtype=jnp.float32)  # [T] sum of p_t (1 up to rounding)
    mu = jnp.zeros((n_tok,), dtype=jnp.float32)  # [T] E_p[d] * mass
    for lo, hi in _chunks(n_vocab, chunk):
        t_shift = _shifted(teacher_logits, max_t, lo, hi)  # [T, C]
        p_t = jnp.exp(t_shift - ls_t[:, None])  # [T, C]
        gap = t_shift - _shifted(student_logits, max_s, lo, hi)  # [T, C]
        mass = mass + jnp.sum(p_t, axis=1)
        mu = mu + jnp.sum(jnp.where(p_t > 0, p_t * gap, 0.0), axis=1)
    # Dividing by the computed mass keeps E_p[d - mu] = 0 whatever the size of mu.
    mu = mu / mass
    excess = jnp.zeros((n_tok,), dtype=jnp.float32)  # [T] E_p[exp(-(d - mu)) - 1] * mass
    for lo, hi in _chunks(n_vocab, chunk):
        t_shift = _shifted(teacher_logits, max_t, lo, hi)  # [T, C]
        s_shift = _shifted(student_logits, max_s, lo, hi)  # [T, C]
        excess = excess + jnp.sum(_centred_excess(t_shift, s_shift, ls_t, mu), axis=1)
    centred = jnp.log1p(excess / mass)  # [T]
    # Past KL ~ 88 the exponential moment overflows float32; the log-normaliser form
    # mu + ls_s - ls_t is then precise enough (its absolute error is tiny next to KL).
    kld = jnp.where(jnp.isfinite(centred), centred, mu + ls_s - ls_t)  # [T]
    ids = next_ids.astype(jnp.int32)[:, None]  # [T, 1]
    next_t = jnp.take_along_axis(teacher_logits, ids, axis=1)[:, 0].astype(jnp.float32)  # [T]
    next_s = jnp.take_along_axis(student_logits, ids, axis=1)[:, 0].astype(jnp.float32)  # [T]
    return TokenStats(
        kld=jnp.maximum(kld, 0.0).astype(jnp.float32),
        top1_agree=arg_t == arg_s,
        teacher_argmax=arg_t,
        student_argmax=arg_s,
        teacher_logp_next=(next_t - max_t) - ls_t,
        student_logp_next=(next_s - max_s) - ls_s,
    )


@jax.jit
def topk_jaccard(teacher_ids: jax.Array, student_ids: jax.Array) -> jax.Array:
    """Jaccard index of two top-k expert sets per token: ``[T, k], [T, k] -> [T]`` float32.

    Each row holds k distinct expert ids, so ``|A u B| = 2k - |A n B|``.
    """
    same = teacher_ids[:, :, None] == student_ids[:, None, :]  # [T, k, k]
    inter = jnp.sum(same, axis=(1, 2)).astype(jnp.float32)  # [T]
    k = teacher_ids.shape[1]
    return inter / (2.0 * k - inter)


__all__ = ["DEFAULT_CHUNK", "TokenStats", "log_softmax", "token_stats", "topk_jaccard"]
