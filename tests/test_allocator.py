"""The allocator's knapsack and its proposals, against brute force and the model's own sizes.

``best_allocations`` is checked against an enumeration of every allocation on random instances
(sizes of either sign, ties, a room nothing fits); the sizes it works in (``group_size``, the
room a limit leaves) against ``ModelShapes.size``, the sizing of budgets (itself checked against
written files in test_config_size); the knobs a proposal is stated in against the per-layer
types they must give back. Pure: no ggml, no Ray.
"""

from __future__ import annotations

import itertools
import random

import pytest

from healsweep.heal.knobs import Knobs, LayerTypes
from healsweep.heal.size import Budget, ModelShapes
from healsweep.model import open_model
from healsweep.sweep import allocator
from healsweep.sweep.allocator import (
    Group,
    Option,
    allocation_knobs,
    best_allocations,
    group_size,
    propose,
    room_for,
)

ROWS256 = dict(n_layer=3, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4, n_expert_used=2)
LADDER = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs")


def _brute(groups, room):
    """Every allocation that fits, best first: (kld, size, picks)."""
    found = []
    for picks in itertools.product(*(range(len(g.options)) for g in groups)):
        chosen = [g.options[p] for g, p in zip(groups, picks, strict=True)]
        size = sum(o.size for o in chosen)
        if size <= room:
            found.append((sum(o.kld for o in chosen), size, picks))
    return sorted(found)


def _random_groups(rng, n):
    groups = []
    for layer in range(n):
        options = [Option("base", 0, 0.0)]
        for _ in range(rng.randint(0, 2)):
            # sizes share a unit (as bytes of blocks do); KLD of either sign, ties on purpose
            options.append(Option(f"t{len(options)}", rng.choice([-3, -2, -1, 1, 2, 4]) * 8,
                                  round(rng.uniform(-0.2, 1.0), 1)))  # fmt: skip
        groups.append(Group(layer, "gu", tuple(options)))
    return groups


def test_the_knapsack_finds_the_k_best_allocations_of_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        groups = _random_groups(rng, rng.randint(1, 6))
        room = rng.randint(-24, 40)
        k = rng.randint(1, 5)
        want = _brute(groups, room)[:k]
        got = best_allocations(groups, room, k)
        assert [round(a.kld, 9) for a in got] == [round(w[0], 9) for w in want]
        for a in got:
            chosen = [g.options[p] for g, p in zip(groups, a.picks, strict=True)]
            assert a.size == sum(o.size for o in chosen) <= room
            assert a.kld == pytest.approx(sum(o.kld for o in chosen))
        assert len({a.picks for a in got}) == len(got)  # k distinct allocations


def test_a_coarsened_knapsack_never_exceeds_the_room(monkeypatch):
    monkeypatch.setattr(allocator, "MAX_STATES", 3)  # units coarsened well past the gcd
    rng = random.Random(1)
    for _ in range(100):
        groups = _random_groups(rng, rng.randint(2, 6))
        room = rng.randint(-8, 40)
        best = _brute(groups, room)
        got = best_allocations(groups, room, 3)
        assert all(a.size <= room for a in got)
        assert bool(got) <= bool(best)
        if got:
            assert got[0].kld >= best[0][0] - 1e-12  # never better than the true optimum


@pytest.fixture(scope="module")
def shapes(random_gguf):
    return ModelShapes.of(open_model(random_gguf("qwen2moe", seed=5, **ROWS256)))


def test_a_groups_size_is_what_the_budget_counts(shapes):
    base = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs")
    for layer, group, target in itertools.product(shapes.moe_layers, ("gu", "d"), LADDER):
        types = dict(base.expert_types(shapes.moe_layers, shapes.n_layer))
        old = types[layer]
        types[layer] = old._replace(**{group: target})
        moved = allocation_knobs(base, types, shapes.moe_layers, shapes.n_layer)
        before, after = shapes.size(base), shapes.size(moved)
        weights = sum(n_in * rows for n_in, rows in _weights(shapes))
        bits = group_size(shapes, layer, group, target, "routed_bpw") - group_size(
            shapes, layer, group, "iq2_xxs", "routed_bpw")  # fmt: skip
        assert (after.routed_bpw - before.routed_bpw) * weights == pytest.approx(bits)
        nbytes = group_size(shapes, layer, group, target, "file_bytes") - group_size(
            shapes, layer, group, "iq2_xxs", "file_bytes")  # fmt: skip
        assert after.file_bytes - before.file_bytes == nbytes


def _weights(shapes):
    for _, _, _, shape, _ in shapes.routed:
        *lead, n_in = shape
        rows = 1
        for n in lead:
            rows *= n
        yield n_in, rows


def test_the_room_is_what_keeps_a_config_inside_its_limit(shapes):
    base = Knobs(type_gu="iq1_m", type_d="iq1_m")
    for measure, limits in (("routed_bpw", (1.6, 1.75, 1.8, 2.0)),
                            ("file_bytes", (shapes.size(base).file_bytes - 5000,
                                            shapes.size(base).file_bytes + 20000))):  # fmt: skip
        budget = Budget(measure, tuple(sorted(limits)))
        for limit in budget.limits:
            room = room_for(shapes, base, budget, limit)
            # one group of the last layer moved up: inside exactly when its growth fits the room
            for group, target in (("d", "iq2_xxs"), ("gu", "iq2_xs"), ("d", "iq1_s")):
                growth = group_size(shapes, 2, group, target, measure) - group_size(
                    shapes, 2, group, "iq1_m", measure)  # fmt: skip
                types = dict(base.expert_types(shapes.moe_layers, shapes.n_layer))
                types[2] = types[2]._replace(**{group: target})
                moved = allocation_knobs(base, types, shapes.moe_layers, shapes.n_layer)
                assert budget.fits(shapes.size(moved), limit) == (growth <= room)


def test_an_allocation_is_stated_as_knobs_that_give_it_back(shapes):
    rng = random.Random(2)
    moe, n_layer = shapes.moe_layers, shapes.n_layer
    base = Knobs(type_gu="iq2_xxs", type_d="iq2_xs", alpha="mse", eta=0.3)
    for _ in range(50):
        types = {i: LayerTypes(rng.choice(LADDER), rng.choice(LADDER)) for i in moe}
        knobs = allocation_knobs(base, types, moe, n_layer)
        assert knobs.expert_types(moe, n_layer) == types
        assert (knobs.alpha, knobs.eta) == ("mse", 0.3)  # the base's other knobs
        for entry in filter(None, knobs.layer_types.split(",")):
            index = int(entry.split(":")[0])
            # the first half by block index, the second counted from the last
            assert (index >= 0) == (moe.index(index % n_layer) < (len(moe) + 1) // 2)
    uniform = {i: LayerTypes("iq1_m", "iq2_xxs") for i in moe}
    assert allocation_knobs(base, uniform, moe, n_layer) == base.replace(
        type_gu="iq1_m", type_d="iq2_xxs")  # fmt: skip
    assert allocation_knobs(base, {0: LayerTypes("iq2_xs", "iq2_xs"), 1: LayerTypes(
        "iq2_xxs", "iq2_xs"), 2: LayerTypes("iq2_xxs", "iq2_xxs")}, moe, n_layer).layer_types == (
        "0:iq2_xs/iq2_xs,-1:iq2_xxs/iq2_xxs")  # fmt: skip


def test_each_proposal_fits_its_limit_and_the_first_is_the_best_that_does(shapes):
    rng = random.Random(3)
    base = Knobs(type_gu="iq1_m", type_d="iq1_m")
    budget = Budget("routed_bpw", (1.7, 1.8, 1.9))
    groups = []
    for layer, group in itertools.product(shapes.moe_layers, ("gu", "d")):
        here = group_size(shapes, layer, group, "iq1_m", "routed_bpw")
        options = [Option("iq1_m", 0, 0.0)]
        for target in ("iq1_s", "iq2_xxs"):
            size = group_size(shapes, layer, group, target, "routed_bpw") - here
            cost = rng.uniform(0.001, 0.01) * (1 if target == "iq1_s" else -1)
            options.append(Option(target, size, cost))
        groups.append(Group(layer, group, tuple(options)))
    proposals = propose(base, shapes, budget, groups, per_limit=2)
    assert proposals and len(proposals) <= 2 * len(budget.limits)
    seen = set()
    for p in proposals:
        assert budget.fits(shapes.size(p.knobs), p.limit) and p.size == shapes.size(p.knobs)
        types = p.knobs.expert_types(shapes.moe_layers, shapes.n_layer)
        moved = {(layer, group, types[layer].of(group)) for layer, group in itertools.product(
            shapes.moe_layers, ("gu", "d")) if types[layer].of(group) != "iq1_m"}  # fmt: skip
        assert moved == set(p.moves) and moved  # never the base itself
        predicted = sum(next(o.kld for o in g.options if o.type == types[g.layer].of(g.group))
                        for g in groups)  # fmt: skip
        assert p.predicted_kld == pytest.approx(predicted)
        assert p.knobs not in seen
        seen.add(p.knobs)
    for limit in budget.limits:  # the best allocation of each limit is proposed (here or below)
        room = room_for(shapes, base, budget, limit)
        best = [b for b in _brute(groups, room) if any(b[2])]  # the base is not proposed
        proposed = [p.predicted_kld for p in proposals if p.limit <= limit]
        assert any(k == pytest.approx(best[0][0]) for k in proposed)
