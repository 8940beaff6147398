"""KL(teacher || student) from a compact teacher record: exact top-K plus a sampled tail.

A compact record holds, per scored position, the teacher's top-K token ids and log-probs, ``S``
token ids drawn from the teacher's tail (``p`` restricted to the other tokens and renormalised)
with their log-probs, and the tail mass ``P_tail``. With the student's fresh logits ``q``:

    KL(p || q) = sum_topK p_i (log p_i - log q_i) + P_tail E_{j ~ p_tail}[log p_j - log q_j]

and the tail expectation is estimated from the stored draws. ``tail="plain"`` takes their mean
of ``log p - log q``: unbiased, but its noise shrinks only like ``|log p - log q|``, so it is
large next to a small KL. ``tail="cv"`` adds the control variate ``c = e^y - 1`` (``y = log q -
log p``), whose tail mean is known exactly from the top-K and the student's full row (given
every tail token has ``p > 0``): the per-draw term becomes ``e^y - 1 - y >= 0``, second order
in ``y``, but heavy-tailed where the student puts far more mass than the teacher on a tail
token. ``tail="adaptive"`` (the default) adds ``beta c`` with, per position, the
variance-minimising ``beta`` in [0, 1] fitted on the window's *other* positions' draws: those
are independent of this position's, so the estimate stays unbiased and takes the better of the
two regimes. ``tail="lumped"`` (the tail as one bucket, ``P_tail log(P_tail / Q_tail)``) is
biased low and kept for comparison. ``benchmarks/teacher_cache_table.py`` measures them all.

Everything is float32 ``jax.numpy``; the student's normaliser is accumulated over vocabulary
chunks exactly as in :mod:`healsweep.kernels.kld`, so top-1 and next-token log-probs match
:func:`~healsweep.kernels.kld.token_stats` bit for bit.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from healsweep.kernels.kld import DEFAULT_CHUNK, TokenStats, _row_max_logsum_argmax, log_softmax

TAIL_ESTIMATORS = ("adaptive", "plain", "cv", "lumped")


@partial(jax.jit, static_argnames=("top_k", "chunk"))
def teacher_top(
    logprobs: jax.Array, next_ids: jax.Array, top_k: int, chunk: int = DEFAULT_CHUNK
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The teacher's side of a compact record from its log-probs ``[T, V]``.

    Returns ``(logp [T, V], top_ids [T, K], top_logp [T, K], logp_next [T])`` where ``logp`` is
    the log-softmax of ``logprobs`` (what :func:`~healsweep.kernels.kld.token_stats` derives from
    a cached row, so ``logp_next`` equals its ``teacher_logp_next``); ties in the top-K keep the
    lower token id first, so ``top_ids[:, 0]`` is the teacher's argmax.
    """
    logp = log_softmax(logprobs, chunk)  # [T, V]
    top_logp, top_ids = jax.lax.top_k(logp, top_k)  # [T, K] x 2
    ids = next_ids.astype(jnp.int32)[:, None]  # [T, 1]
    logp_next = jnp.take_along_axis(logp, ids, axis=1)[:, 0]  # [T]
    return logp, top_ids.astype(jnp.int32), top_logp, logp_next


def _loo_beta(num: jax.Array, den: jax.Array) -> jax.Array:
    """Leave-one-position-out regression coefficient in [0, 1] from per-position sums ``[T]``."""
    rest_num = jnp.sum(num) - num  # [T]
    rest_den = jnp.sum(den) - den  # [T]
    beta = jnp.where(rest_den > 0, -rest_num / jnp.where(rest_den > 0, rest_den, 1.0), 0.0)
    return jnp.clip(beta, 0.0, 1.0)


@partial(jax.jit, static_argnames=("tail", "chunk"))
def compact_token_stats(
    top_ids: jax.Array,
    top_logp: jax.Array,
    tail_ids: jax.Array,
    tail_logp: jax.Array,
    tail_mass: jax.Array,
    tail_full: jax.Array,
    teacher_logp_next: jax.Array,
    student_logits: jax.Array,
    next_ids: jax.Array,
    tail: str = "adaptive",
    chunk: int = DEFAULT_CHUNK,
) -> TokenStats:
    """Per-token KL estimate, top-1 agreement and next-token log-probs from a compact record.

    ``top_ids, top_logp [T, K]`` (int32, float32; sorted, ``top_ids[:, 0]`` the argmax),
    ``tail_ids, tail_logp [T, S]``, ``tail_mass [T]`` (``P_tail``; 0 when the tail is empty),
    ``tail_full [T]`` (bool: every tail token has ``p > 0``, which the control variate needs),
    ``teacher_logp_next [T]``, ``student_logits [T, V]``, ``next_ids [T]``. ``tail`` picks the
    tail estimator (module docstring). ``kld`` is not clamped at 0: one token's estimate can dip
    below it, and clamping would bias sums of them upwards.
    """
    if tail not in TAIL_ESTIMATORS:
        raise ValueError(
            f"compact_token_stats: tail must be one of {TAIL_ESTIMATORS}, got {tail!r}"
        )
    max_s, ls_s, arg_s = _row_max_logsum_argmax(student_logits, chunk)  # [T] x 3

    def student_logp(ids: jax.Array) -> jax.Array:  # [T, X] -> [T, X]
        picked = jnp.take_along_axis(student_logits, ids, axis=1).astype(jnp.float32)
        return (picked - max_s[:, None]) - ls_s[:, None]

    top_q = student_logp(top_ids)  # [T, K]
    y_top = top_q - top_logp  # [T, K] log q - log p
    p_top = jnp.exp(top_logp)  # [T, K]
    y_tail = student_logp(tail_ids) - tail_logp  # [T, S]
    has_tail = tail_mass > 0  # [T]
    top_term = jnp.sum(jnp.where(p_top > 0, -p_top * y_top, 0.0), axis=1)  # [T]
    plain = tail_mass * jnp.mean(-y_tail, axis=1)  # [T]
    if tail == "lumped":
        q_tail = jnp.maximum(1.0 - jnp.sum(jnp.exp(top_q), axis=1), 1e-30)  # [T]
        tail_term = tail_mass * (jnp.log(tail_mass) - jnp.log(q_tail))  # [T]
    elif tail == "plain":
        tail_term = plain
    else:
        # Control variate c = e^y - 1 over the tail: its mean under p_tail is known exactly,
        # (Q_tail - P_tail) / P_tail = -sum_topK p (e^y - 1) / P_tail, given full support.
        usable = has_tail & tail_full  # [T]
        safe_mass = jnp.where(usable, tail_mass, 1.0)  # [T]
        top_excess = jnp.sum(jnp.where(p_top > 0, p_top * jnp.expm1(y_top), 0.0), axis=1)
        centred = jnp.expm1(y_tail) + (top_excess / safe_mass)[:, None]  # [T, S] mean 0
        # q/p past float32 (p_s < 1e-38 q_s, a draw that all but never happens) falls back to
        # the plain term for that position rather than turning the window into NaN.
        usable = usable & jnp.all(jnp.isfinite(centred), axis=1)
        centred = jnp.where(usable[:, None], centred, 0.0)
        control = tail_mass * jnp.mean(centred, axis=1)  # [T] expectation 0
        if tail == "cv":
            beta = jnp.ones_like(tail_mass)
        else:
            # The coefficient minimising the window's variance, from the other positions'
            # draws only: independent of this position's, so the estimate stays unbiased.
            weight = jnp.square(tail_mass)  # [T] variance of position i scales with P_tail^2
            num = weight * jnp.mean(-y_tail * centred, axis=1)  # [T] covariance sums
            den = weight * jnp.mean(jnp.square(centred), axis=1)  # [T]
            beta = _loo_beta(num, den)  # [T]
        tail_term = plain + beta * control
    kld = top_term + jnp.where(has_tail, tail_term, 0.0)  # an empty tail adds nothing
    ids = next_ids.astype(jnp.int32)[:, None]  # [T, 1]
    next_s = jnp.take_along_axis(student_logits, ids, axis=1)[:, 0].astype(jnp.float32)  # [T]
    arg_t = top_ids[:, 0].astype(jnp.int32)  # [T]
    return TokenStats(
        kld=kld.astype(jnp.float32),  # unclamped: a clamp would bias the estimates upwards
        top1_agree=arg_t == arg_s,
        teacher_argmax=arg_t,
        student_argmax=arg_s,
        teacher_logp_next=teacher_logp_next.astype(jnp.float32),
        student_logp_next=(next_s - max_s) - ls_s,
    )


__all__ = ["TAIL_ESTIMATORS", "compact_token_stats", "teacher_top"]
