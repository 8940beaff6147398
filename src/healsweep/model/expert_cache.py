"""Routing through a per-layer LRU cache of routed experts, with the MoCE bonus (docs/expert-cache.md).

An engine that streams experts from SSD keeps the last-used ones of each MoE layer in memory and,
with a bonus ``b``, prefers them: token t selects the top-k of ``s_e = p_e + b·[e resident]``
(p: the architecture's router probabilities), mixes them with the *unbiased* ``p`` (renormalized
when the architecture renormalizes), marks them most recent, and loads the ones not resident
(misses), evicting the least recent. The selection of a token depends on the cache state the
tokens before it left, so this is a ``lax.scan`` over tokens in order; router logits before it and
the experts after it stay batched.

Recency is a stamp per expert, ``clock·k + j`` for the expert of selection rank j at the clock's
token (-1 = not resident): experts used by one token are touched in rank order, so among them the
top-ranked one is the least recent. Stamps are unique among resident experts, so eviction has no
ties. ``capacity`` must lie in ``[k, E]`` (the used experts of a token always fit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.model.routing import mix_weights

_NOT_RESIDENT = -1
_NEVER = jnp.iinfo(jnp.int32).max


class CacheState(NamedTuple):
    """One layer's cache: ``stamp [..., E]`` int32 (last use, -1 = not resident) and ``clock
    [...]`` int32 (tokens seen; the next token's stamps start at ``clock·k``)."""

    stamp: jax.Array
    clock: jax.Array


def empty_state(n_expert: int, batch: tuple[int, ...] = ()) -> CacheState:
    """An empty cache (nothing resident, clock 0), with leading ``batch`` axes."""
    return CacheState(
        jnp.full((*batch, n_expert), _NOT_RESIDENT, jnp.int32), jnp.zeros(batch, jnp.int32)
    )


class CachedRoute(NamedTuple):
    """Per-token results of :func:`cached_routing` over ``N`` tokens."""

    ids: jax.Array  # [N, k] int32, in selection order
    weights: jax.Array  # [N, k] float32 mixing weights (from the unbiased probabilities)
    misses: jax.Array  # [N] int32 used experts that were not resident (0 for invalid tokens)


def _step(k: int, bonus: jax.Array, capacity: jax.Array, stamp: jax.Array, clock, p):
    """One token: ``(stamp', ids [k], misses)`` for selection scores ``p [E]``."""
    n_expert = p.shape[0]
    resident = stamp >= 0  # [E]
    scores = p + bonus * resident.astype(jnp.float32)  # -inf (a masked group) stays -inf
    _, ids = jax.lax.top_k(scores, k)  # [k]
    ids = ids.astype(jnp.int32)
    used = jnp.zeros(n_expert, bool).at[ids].set(True)
    misses = jnp.sum(used & ~resident).astype(jnp.int32)
    stamp = stamp.at[ids].set(clock * k + jnp.arange(k, dtype=jnp.int32))
    over = jnp.sum(stamp >= 0) - capacity  # in [0, k] when capacity >= k
    age = jnp.where((stamp >= 0) & ~used, stamp, _NEVER)  # candidates for eviction
    _, oldest = jax.lax.top_k(-age, k)  # the k least recent candidates, oldest first
    evict = jnp.arange(k) < over
    stamp = stamp.at[oldest].set(jnp.where(evict, _NOT_RESIDENT, stamp[oldest]))
    return stamp, ids, misses


def cached_routing(
    probs: jax.Array,
    k: int,
    normalize: bool,
    bonus: jax.Array,
    capacity: jax.Array,
    init: CacheState,
    sequence: jax.Array,
    starts: jax.Array,
    valid: jax.Array,
    selection: jax.Array | None = None,
    scale: float = 1.0,
) -> tuple[CachedRoute, CacheState]:
    """Route ``N`` tokens in order through one layer's cache: ``(CachedRoute, final states)``.

    ``probs [N, E]``: router probabilities, which the weights come from
    (:func:`healsweep.model.routing.mix_weights` with ``normalize`` and ``scale``);
    ``selection [N, E]``: the scores experts are chosen by before the resident bonus (biased,
    group-masked; default ``probs``). The tokens are the concatenation of ``B`` sequences:
    ``sequence [N]`` int32 says which, ``starts [N]`` marks a sequence's first token, where the
    cache is set to that sequence's ``init`` state (``stamp [B, E]``, ``clock [B]``; an
    :func:`empty_state` for a cold start); ``valid [N]`` is False for padding, which neither
    changes the cache nor counts. Returns the final state of every sequence (``[B, E]``, ``[B]``),
    taken after its last valid token.
    """
    n_seq, n_expert = init.stamp.shape
    bonus = jnp.asarray(bonus, jnp.float32)
    capacity = jnp.asarray(capacity, jnp.int32)

    def token(carry, inp):
        stamp, clock, finals = carry
        p, seq, start, ok = inp
        stamp = jnp.where(start, init.stamp[seq], stamp)
        clock = jnp.where(start, jnp.maximum(init.clock[seq], 0), clock)
        new_stamp, ids, misses = _step(k, bonus, capacity, stamp, clock, p)
        stamp = jnp.where(ok, new_stamp, stamp)
        clock = clock + ok.astype(jnp.int32)
        finals = CacheState(
            finals.stamp.at[seq].set(stamp), finals.clock.at[seq].set(clock)
        )  # the last write of a sequence is its final state
        return (stamp, clock, finals), (ids, jnp.where(ok, misses, 0))

    carry0 = (jnp.full(n_expert, _NOT_RESIDENT, jnp.int32), jnp.int32(0), init)
    scores = probs if selection is None else selection
    xs = (scores.astype(jnp.float32), sequence.astype(jnp.int32), starts, valid)
    (_, _, finals), (ids, misses) = jax.lax.scan(token, carry0, xs)
    weights = mix_weights(probs.astype(jnp.float32), ids, normalize=normalize, scale=scale)
    return CachedRoute(ids, weights, misses), finals


class CacheRouting(NamedTuple):
    """What a layer needs to route through its cache (a pytree; see :func:`cached_routing`)."""

    bonus: jax.Array  # [] float32
    capacity: jax.Array  # [] int32
    init: CacheState  # [B, E], [B]
    sequence: jax.Array  # [N] int32
    starts: jax.Array  # [N] bool
    valid: jax.Array  # [N] bool


def route_through_cache(
    probs: jax.Array,
    selection: jax.Array,
    k: int,
    normalize: bool,
    scale: float,
    routing: CacheRouting,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(ids [N, k], weights [N, k], {cache_misses [N], cache_stamp [B, E], cache_clock [B]})``
    from the architecture's routing scores (:func:`healsweep.model.layers.routing_scores`)."""
    route, finals = cached_routing(
        probs, k, normalize, routing.bonus, routing.capacity, routing.init,
        routing.sequence, routing.starts, routing.valid, selection, scale,
    )  # fmt: skip
    extra = {"cache_misses": route.misses, "cache_stamp": finals.stamp,
             "cache_clock": finals.clock}  # fmt: skip
    return route.ids, route.weights, extra


class ExpertCacheInput(NamedTuple):
    """The expert cache of one forward (host side): ``forward(..., expert_cache=...)``.

    ``capacity[l]``: experts layer l's cache holds. ``init[l]``: per-sequence start states of
    layer l (``stamp [B, E]``, ``clock [B]``), None for empty caches everywhere.
    ``continues[b]``: sequence b starts from sequence b-1's final state instead of its ``init``
    (windows of one document in one batch, ``--warm-cache``); None for never.
    """

    bonus: float
    capacity: Sequence[int]
    init: Sequence[CacheState] | None = None
    continues: Sequence[bool] | None = None


def layer_routing(
    cache: ExpertCacheInput, layer: int, n_expert: int, lengths: Sequence[int], padded_len: int
) -> CacheRouting:
    """Layer ``layer``'s :class:`CacheRouting` for right-padded sequences of ``lengths``."""
    n_seq = len(lengths)
    sequence = np.repeat(np.arange(n_seq, dtype=np.int32), padded_len)  # [B*T]
    position = np.tile(np.arange(padded_len), n_seq)
    valid = position < np.repeat(np.asarray(lengths), padded_len)
    continues = np.zeros(n_seq, bool) if cache.continues is None else np.asarray(cache.continues)
    starts = (position == 0) & ~continues[sequence]
    init = empty_state(n_expert, (n_seq,)) if cache.init is None else cache.init[layer]
    return CacheRouting(
        bonus=jnp.float32(cache.bonus),
        capacity=jnp.int32(cache.capacity[layer]),
        init=CacheState(jnp.asarray(init.stamp, jnp.int32), jnp.asarray(init.clock, jnp.int32)),
        sequence=jnp.asarray(sequence),
        starts=jnp.asarray(starts),
        valid=jnp.asarray(valid),
    )


__all__ = [
    "CacheRouting",
    "ExpertCacheInput",
    "layer_routing",
    "CacheState",
    "CachedRoute",
    "cached_routing",
    "empty_state",
    "route_through_cache",
]
