"""Stratified draws from a teacher's tail, on the device: the sampled half of a compact record.

Given the teacher's log-probs ``logp [T, V]``, the top-K ids it keeps exactly and one stratified
uniform per draw (``strata [T, S]`` in ``[0, 1)``, from a seeded host generator so the draws
repeat on every backend and jax version), :func:`tail_draws` returns per row the drawn tail ids
and their log-probs, the tail mass and whether every tail token has a finite log-prob. Only
``[T, S]`` draws and two ``[T]`` figures leave the device, never the ``[T, V]`` row.

The draws invert the tail's cumulative distribution in float32 (Metal has no float64) down a
tree of block masses: the tail's p in blocks of :data:`FANOUT` tokens, those blocks' masses in
blocks of FANOUT, ... (three levels at a 152k vocabulary). A draw descends from the top, at each
level taking the child whose running mass first passes what is left of its target. A flat
float32 running sum over a 152k vocabulary would step in units of eps·P_tail, so tokens far
below that would be drawn with the wrong frequency (total variation up to ~V·eps/2 ≈ 0.5%); down
the tree each level adds about FANOUT·eps/2 of a node's mass, about 1e-5 in all (the float64
host sums of before: ~1e-16·V). The running sums are sequential float32 additions (in groups,
not XLA's tree-shaped cumsum, whose neighbouring sums round independently): they never decrease
and stay equal across a zero, so a draw that lands on token i has ``p_i > 0``. Per draw and
level only FANOUT masses are summed (``[T, S, FANOUT]``); the ``[T, V]`` row is read twice
(the tail mask and the first level's sums).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FANOUT = 64  # children of a node of the inverse CDF's tree of block masses


def _scan_sum(x: jax.Array) -> jax.Array:
    """Inclusive running sum along the last axis, one float32 addition after another."""

    def step(total, column):
        total = total + column
        return total, total

    columns = jnp.moveaxis(x, -1, 0)  # [N, ...]
    _, sums = jax.lax.scan(step, jnp.zeros_like(columns[0]), columns)
    return jnp.moveaxis(sums, 0, -1)


def _running_sum(x: jax.Array) -> jax.Array:
    """Inclusive running sum along the last axis (``N``) that never decreases where ``x >= 0``
    and stays equal across zeros, in about ``2 sqrt(N)`` sequential steps: running sums inside
    groups of ``g`` (vectorised over the groups), the groups' offsets as a running sum of their
    totals, and ``offset + inside``. Each offset is the same float32 addition as the last sum
    of the group before, so the result is non-decreasing across group edges too."""
    n = x.shape[-1]
    g = math.ceil(math.sqrt(n))
    if n <= 32:
        return _scan_sum(x)
    n_groups = -(-n // g)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_groups * g - n)])
    inside = _scan_sum(padded.reshape(*x.shape[:-1], n_groups, g))  # [..., G, g]
    totals = inside[..., -1]  # [..., G]

    def step(offset, total):
        return offset + total, offset

    _, offsets = jax.lax.scan(
        step, jnp.zeros_like(totals[..., 0]), jnp.moveaxis(totals, -1, 0)
    )  # [G, ...]: the running sum before each group
    sums = jnp.moveaxis(offsets, 0, -1)[..., None] + inside  # [..., G, g]
    return sums.reshape(*x.shape[:-1], n_groups * g)[..., :n]


def _count_at_most(cum: jax.Array, x: jax.Array) -> jax.Array:
    """``[T, S]``: entries of ``cum [T, S, N]`` (non-decreasing in N) ``<= x [T, S]``, i.e. the
    first index with ``cum > x`` (``N`` when there is none)."""
    return jnp.sum(cum <= x[..., None], axis=-1, dtype=jnp.int32)


def _last_positive(p: jax.Array) -> jax.Array:
    """Index of the last entry > 0 along the last axis (-1 where there is none)."""
    idx = jnp.arange(p.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(p > 0, idx, -1), axis=-1)


def _level_sums(p: jax.Array) -> list[jax.Array]:
    """``p [T, V]`` and the sums of its blocks of :data:`FANOUT`, of theirs, ... up to a level
    of at most FANOUT entries; every level but the last padded to a whole number of blocks."""
    levels = []
    while True:
        n = p.shape[1]
        if n <= FANOUT:
            return [*levels, p]
        p = jnp.pad(p, ((0, 0), (0, -n % FANOUT)))
        levels.append(p)
        p = jnp.sum(p.reshape(p.shape[0], -1, FANOUT), axis=2)


def _descend(children: jax.Array, rest: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The child ``[T, S]`` of ``children [T, S, F]`` (masses) whose running mass first passes
    ``rest [T, S]``, and what is left of ``rest`` inside it."""
    cum = _running_sum(children)  # [T, S, F]
    child = _count_at_most(cum, rest)
    child = jnp.clip(child, 0, jnp.maximum(_last_positive(children), 0))  # rounding past the end
    before = jnp.take_along_axis(cum, jnp.maximum(child - 1, 0)[..., None], axis=2)[..., 0]
    return child, jnp.maximum(rest - jnp.where(child > 0, before, 0.0), 0.0)


@jax.jit
def tail_draws(
    logp: jax.Array, top_ids: jax.Array, strata: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(tail_ids [T, S] int32, tail_logp [T, S] float32, tail_mass [T] float32, tail_full [T]
    bool)``.

    ``logp [T, V]`` float32 teacher log-probs, ``top_ids [T, K]`` int32 the tokens left out,
    ``strata [T, S]`` float32 in ``[0, 1)``: draw s of row t is the tail token whose cumulative
    tail mass brackets ``strata[t, s] · P_tail``. Rows without tail mass draw their argmax
    (``top_ids[:, 0]``) as a placeholder (their tail weighs 0). ``tail_full``: every non-top-K
    token has a finite log-prob (p > 0), the control variate's condition.
    """
    n_rows, n_draws = strata.shape
    rows = jnp.arange(n_rows, dtype=jnp.int32)[:, None]
    # [T, V] tail, unnormalised: the top-K zeroed in place (no [T, V] mask)
    p = jnp.exp(logp.astype(jnp.float32)).at[rows, top_ids].set(0.0)
    # every tail token has p > 0: a -inf log-prob anywhere is one of the top-K's (counted once)
    dead = jnp.isneginf(logp).at[rows, top_ids].set(False)  # [T, V]
    full = ~jnp.any(dead, axis=1)  # [T]
    *lower, top = _level_sums(p)  # top [T, <= F]
    # Summed down the tree (sums of <= 64 terms): the same bits run to run on a GPU too, where
    # one reduction over a whole 152k row may be split across blocks and added atomically.
    mass = jnp.sum(top, axis=1)  # [T]
    children = jnp.broadcast_to(top[:, None, :], (n_rows, n_draws, top.shape[1]))
    rest = strata.astype(jnp.float32) * _running_sum(top)[:, -1:]  # [T, S] mass to pass
    node, rest = _descend(children, rest)
    for level in reversed(lower):  # [T, n_l], n_l a multiple of F: node's children are a row
        blocks = level.reshape(n_rows, -1, FANOUT)
        children = jnp.take_along_axis(blocks, node[..., None], axis=1)  # [T, S, F]
        child, rest = _descend(children, rest)
        node = node * FANOUT + child
    ids = jnp.where((mass > 0)[:, None], node, top_ids[:, :1]).astype(jnp.int32)
    return ids, jnp.take_along_axis(logp, ids, axis=1), mass, full


__all__ = ["FANOUT", "tail_draws"]
