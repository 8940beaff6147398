"""The expert-cache scan against a plain Python per-token LRU loop, on random router outputs."""

from __future__ import annotations

from collections import OrderedDict

import jax
import numpy as np
import pytest

from healsweep.model.expert_cache import (
    CacheState,
    ExpertCacheInput,
    cached_routing,
    empty_state,
    layer_routing,
)
from healsweep.model.routing import router_topk


def reference_lru(probs, k, normalize, bonus, capacity, runs, starts_from=None, selection=None,
                  scale=1.0):
    """Per token: selected ids (selection order), float64 weights, misses; and the final caches.

    ``runs``: per sequence, its number of tokens; sequences are cold unless ``starts_from[b]``
    holds an OrderedDict (least recent first) to start from, or is "previous". Experts are
    chosen by ``selection`` (default ``probs``) plus the bonus; weights are ``probs``.
    """
    selection = probs if selection is None else selection
    ids_out, weights_out, misses_out, finals = [], [], [], []
    row = 0
    lru: OrderedDict = OrderedDict()
    for b, n in enumerate(runs):
        start = None if starts_from is None else starts_from[b]
        if start is None:
            lru = OrderedDict()
        elif start != "previous":
            lru = OrderedDict(start)
        for _ in range(n):
            p, sel = probs[row].astype(np.float64), selection[row].astype(np.float64)
            scores = [sel[e] + (bonus if e in lru else 0.0) for e in range(len(p))]
            # top-k by score, lower expert id first among equal scores (as lax.top_k)
            chosen = sorted(range(len(p)), key=lambda e: (-scores[e], e))[:k]
            misses_out.append(sum(e not in lru for e in chosen))
            for e in chosen:  # touched in selection order
                lru.pop(e, None)
                lru[e] = True
            while len(lru) > capacity:
                lru.popitem(last=False)
            w = np.array([p[e] for e in chosen])
            weights_out.append((w / w.sum() if normalize else w) * scale)
            ids_out.append(chosen)
            row += 1
        finals.append(list(lru))  # least recent first
    return np.array(ids_out), np.array(weights_out), np.array(misses_out), finals


def resident_order(stamp: np.ndarray) -> list[int]:
    """Resident experts of a stamp vector, least recent first."""
    resident = [e for e in range(len(stamp)) if stamp[e] >= 0]
    return sorted(resident, key=lambda e: stamp[e])


def scan(probs, k, normalize, bonus, capacity, runs, continues=None, selection=None, scale=1.0):
    padded = max(runs)
    n_seq, n_expert = len(runs), probs.shape[1]
    cache = ExpertCacheInput(bonus, [capacity], continues=continues)
    routing = layer_routing(cache, 0, n_expert, runs, padded)
    full = np.zeros((n_seq * padded, n_expert), np.float32)
    real = np.concatenate([b * padded + np.arange(n) for b, n in enumerate(runs)])
    full[real] = probs
    chosen_by = None
    if selection is not None:
        chosen_by = np.full((n_seq * padded, n_expert), -np.inf, np.float32)
        chosen_by[real] = selection
    route, finals = jax.jit(cached_routing, static_argnums=(1, 2, 10))(
        full, k, normalize, routing.bonus, routing.capacity, routing.init,
        routing.sequence, routing.starts, routing.valid, chosen_by, scale,
    )  # fmt: skip
    return (np.asarray(route.ids)[real], np.asarray(route.weights)[real],
            np.asarray(route.misses)[real], finals)  # fmt: skip


def random_probs(rng, n, n_expert, temperature=1.0):
    logits = rng.normal(size=(n, n_expert)).astype(np.float32) / temperature
    return np.asarray(jax.nn.softmax(logits, axis=-1))


# (n_expert, k, capacity): capacity = k (every token can flush the cache) up to E (never evicts)
SHAPES = [(16, 2, 4), (8, 2, 2), (12, 3, 7), (16, 4, 16), (60, 4, 15)]


@pytest.mark.parametrize("normalize", [False, True], ids=["softmax-topk", "renormalized"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-k{}-C{}".format(*s))
@pytest.mark.parametrize("bonus", [0.0, 0.05, 0.3, 1.0])
def test_scan_matches_python_lru(normalize, shape, bonus):
    n_expert, k, capacity = shape
    rng = np.random.default_rng(hash((n_expert, k, capacity, bonus, normalize)) % 2**32)
    runs = [37, 5, 20]
    probs = random_probs(rng, sum(runs), n_expert, temperature=0.5)
    ids, weights, misses, finals = scan(probs, k, normalize, bonus, capacity, runs)
    ref_ids, ref_w, ref_misses, ref_finals = reference_lru(
        probs, k, normalize, bonus, capacity, runs
    )
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(misses, ref_misses)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-6)
    for b in range(len(runs)):
        assert resident_order(np.asarray(finals.stamp[b])) == ref_finals[b]
        assert int(finals.clock[b]) == runs[b]


def grouped_selection(probs, bias, n_groups, n_used):
    """float64 numpy: biased probabilities, -inf outside each token's n_used best groups (a
    group scored by its two largest biased probabilities)."""
    biased = probs.astype(np.float64) + bias
    t, e = biased.shape
    grouped = biased.reshape(t, n_groups, e // n_groups)
    score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [T, G]
    keep = np.zeros((t, n_groups), bool)
    for i in range(t):
        keep[i, sorted(range(n_groups), key=lambda g: (-score[i, g], g))[:n_used]] = True
    return np.where(keep[:, :, None], grouped, -np.inf).reshape(t, e)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["no-groups", "4-groups-2-used"])
@pytest.mark.parametrize("bonus", [0.0, 0.05, 0.5])
def test_scan_matches_python_lru_for_sigmoid_biased_grouped_gating(groups, bonus):
    """glm4moe/deepseek2 routing: sigmoid probabilities, a selection-only bias, expert groups,
    renormalized and scaled weights; the bonus is added to the group-masked biased scores."""
    rng = np.random.default_rng(int(bonus * 100) + groups[0])
    n_expert, k, capacity, runs = 16, 4, 6, [30, 12]
    logits = rng.normal(size=(sum(runs), n_expert)).astype(np.float32)
    probs = np.asarray(jax.nn.sigmoid(logits))
    bias = rng.normal(scale=0.1, size=n_expert).astype(np.float32)
    selection = grouped_selection(probs, bias, *groups).astype(np.float32)
    ids, weights, misses, finals = scan(probs, k, True, bonus, capacity, runs,
                                        selection=selection, scale=2.5)  # fmt: skip
    ref_ids, ref_w, ref_misses, ref_finals = reference_lru(
        probs, k, True, bonus, capacity, runs, selection=selection, scale=2.5
    )
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(misses, ref_misses)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-6)
    for b in range(len(runs)):
        assert resident_order(np.asarray(finals.stamp[b])) == ref_finals[b]
    if groups[0] > 1:  # no token ever uses an expert of a masked group
        assert np.all(np.take_along_axis(selection, ids, axis=1) > -np.inf)


@pytest.mark.parametrize("normalize", [False, True], ids=["softmax-topk", "renormalized"])
def test_bonus_zero_is_plain_routing(normalize):
    rng = np.random.default_rng(7)
    probs = random_probs(rng, 50, 16)
    ids, weights, _, _ = scan(probs, 4, normalize, 0.0, 4, [50])
    logits = np.log(probs)
    plain_ids, plain_w = router_topk(logits, 4, normalize)
    np.testing.assert_array_equal(ids, np.asarray(plain_ids))
    # same probabilities picked: the scan's weights are the plain route's (softmax of log p ~ p)
    np.testing.assert_allclose(weights, np.asarray(plain_w), rtol=1e-5)


def test_carry_over_between_sequences():
    """``continues`` starts a sequence from the previous one's final cache (warm cache)."""
    rng = np.random.default_rng(3)
    runs = [10, 12, 9]
    probs = random_probs(rng, sum(runs), 16, temperature=0.5)
    ids, _, misses, finals = scan(probs, 2, False, 0.4, 5, runs, continues=[False, True, False])
    ref = reference_lru(probs, 2, False, 0.4, 5, runs, starts_from=[None, "previous", None])
    np.testing.assert_array_equal(ids, ref[0])
    np.testing.assert_array_equal(misses, ref[2])
    assert [resident_order(np.asarray(s)) for s in finals.stamp] == ref[3]


def test_start_from_given_state():
    """A sequence starts from an explicit earlier state (a window after one in another batch)."""
    rng = np.random.default_rng(5)
    first, second = random_probs(rng, 30, 16), random_probs(rng, 25, 16)
    _, _, _, after_first = scan(first, 2, True, 0.5, 6, [30])
    cache = ExpertCacheInput(0.5, [6], init=[CacheState(*after_first)])
    routing = layer_routing(cache, 0, 16, [25], 25)
    route, _ = cached_routing(second, 2, True, routing.bonus, routing.capacity, routing.init,
                              routing.sequence, routing.starts, routing.valid)  # fmt: skip
    ref = reference_lru(np.concatenate([first, second]), 2, True, 0.5, 6, [30, 25],
                        starts_from=[None, "previous"])  # fmt: skip
    np.testing.assert_array_equal(np.asarray(route.ids), ref[0][30:])
    np.testing.assert_array_equal(np.asarray(route.misses), ref[2][30:])


def test_empty_state_shape():
    state = empty_state(8, (3,))
    assert state.stamp.shape == (3, 8) and state.clock.shape == (3,)
    assert bool((state.stamp < 0).all())
