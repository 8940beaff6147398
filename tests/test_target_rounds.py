"""Rounds of the size target's allocation (``healsweep heal --target-... --rounds N``).

One pass and its knapsack see one step of the ladder and add the moves' measured changes; each
further round scores the last allocation and moves every group again from there. The work is
test_sensitivity's toy (a window's KLD a known function of the routed types, through the real
pass on a real Ray cluster), so every measured KLD here is checked against that function, and
the allocation a single round can reach (one step from the base) against what rounds reach.
"""

from __future__ import annotations

import functools
import json

import pytest

import test_sensitivity as toy
import test_sweep_tune
from healsweep.heal.knobs import Knobs
from healsweep.heal.size import ModelShapes
from healsweep.model import open_model
from healsweep.sweep.spec import SweepSpec
from healsweep.sweep.target import Target, allocate_target, allocation_record

ray_cluster = test_sweep_tune.ray_cluster  # one embedded Ray cluster for this module

LADDER = ["iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s"]
WINDOWS = 6
BASE = Knobs(type_gu="iq1_s", type_d="iq1_s", alpha="mse")


@pytest.fixture(scope="module")
def model(random_gguf):
    return random_gguf("qwen2moe", seed=7, **toy.ROWS256)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One stage cache for the module: a pass around a centre is scored once."""
    return tmp_path_factory.mktemp("rounds-cache")


def _spec_for(model, cache, limit: float):
    def spec_for(centre: Knobs) -> SweepSpec:
        return SweepSpec.model_validate({
            "name": "target", "model": str(model), "sampler": "allocator", "references": False,
            "budget": {"routed_bpw": [limit]}, "pruner": "none", "max_concurrent": 2,
            "baseline": centre.model_dump(), "scoring": {"max_windows": WINDOWS},
            "allocator": {"ladder": LADDER, "proposals": 1, "windows": WINDOWS},
            "cache_root": str(cache),
        })  # fmt: skip

    return spec_for


def _toy_kld(knobs: Knobs, shapes: ModelShapes) -> float:
    """The pooled KLD the toy work gives ``knobs`` on the pass's windows."""
    one = toy.toy_window_kld(knobs, toy.WINDOW_IDS[0], shapes.moe_layers, shapes.n_layer)
    return one / toy.toy_factor(toy.WINDOW_IDS[0]) * toy._mean_factor(WINDOWS)


def _allocate(model, cache, limit: float, rounds: int, log: str):
    shapes = ModelShapes.of(open_model(model))
    work = functools.partial(toy.toy_work, log=log)
    lines: list[str] = []
    found = allocate_target(_spec_for(model, cache, limit), BASE, shapes,
                            Target("routed_bpw", limit), rounds=rounds, say=lines.append,
                            work_fn=work, identity_fn=toy.toy_identity)  # fmt: skip
    return shapes, found, lines


def test_rounds_reach_past_one_step_and_keep_the_best_measured(ray_cluster, model, cache,
                                                               tmp_path):
    log = tmp_path / "scored.log"
    limit = 2.2  # from IQ1_S (1.5625) one step reaches IQ1_M (1.75) at most
    shapes, (table, once, history), _ = _allocate(model, cache, limit, 1, str(log))
    assert len(history) == 1 and history[0].proposal == once
    assert {t for types in once.knobs.expert_types(shapes.moe_layers, shapes.n_layer).values()
            for t in types} <= {"iq1_s", "iq1_m"}  # fmt: skip
    scored_once = len(log.read_text().splitlines())

    _, (first, best, rounds), lines = _allocate(model, cache, limit, 2, str(log))
    assert first.base == table.base  # the first round is the pass a single round ran: cached
    assert len(log.read_text().splitlines()) > scored_once
    assert rounds[0].centre == BASE and rounds[1].centre == once.knobs
    # every measured KLD is the toy's value of that centre, and the answer is the least of them
    for r in rounds:
        assert r.kld == pytest.approx(_toy_kld(r.centre, shapes), rel=1e-9)
    assert best.knobs == min(rounds, key=lambda r: r.kld).centre
    assert best.predicted_kld == pytest.approx(min(r.kld for r in rounds) - rounds[0].kld)
    assert shapes.size(best.knobs).routed_bpw <= limit + 1e-12 and best.size.routed_bpw <= limit
    # more than one step up the ladder, and better than the single round's allocation
    types = best.knobs.expert_types(shapes.moe_layers, shapes.n_layer)
    assert any(t not in ("iq1_s", "iq1_m") for pair in types.values() for t in pair)
    assert _toy_kld(best.knobs, shapes) < _toy_kld(once.knobs, shapes)
    # its moves are what differs from the base; the record lists each round's centre
    moved = {(layer, group) for layer, group, _ in best.moves}
    assert moved == {(i, g) for i in shapes.moe_layers for g in ("gu", "d")
                     if types[i].of(g) != "iq1_s"}  # fmt: skip
    record = json.loads(allocation_record(first, best, Target("routed_bpw", limit), rounds))
    assert [s["dev_kld"] for s in record["rounds"]] == [r.kld for r in rounds]
    assert any(line.startswith("round 2: centre") for line in lines)


def test_a_round_that_does_not_improve_stops_and_keeps_the_best(ray_cluster, model, cache,
                                                                tmp_path):
    from healsweep.sweep.target import Round

    shapes = ModelShapes.of(open_model(model))
    limit = 1.9
    log = str(tmp_path / "scored.log")
    _, (_, best, rounds), lines = _allocate(model, cache, limit, 3, log)
    # the rounds end either converged (no move predicted to help) or at a centre no better
    last = rounds[-1]
    converged = last.proposal is not None and not last.proposal.moves
    stopped = last.proposal is None and last.kld >= min(r.kld for r in rounds[:-1])
    assert converged or stopped or len(rounds) == 4
    assert all(isinstance(r, Round) for r in rounds)
    assert best.knobs == min(rounds, key=lambda r: r.kld).centre
    kld = [r.kld for r in rounds if r.proposal is not None]
    assert kld == sorted(kld, reverse=True)  # each round's centre beat every earlier one
    # none of them is over the limit
    assert all(shapes.size(r.centre).routed_bpw <= limit + 1e-12 for r in rounds)


def test_rounds_below_one_are_refused(model, cache):
    from healsweep.errors import SettingError

    with pytest.raises(SettingError, match="rounds must be >= 1"):
        allocate_target(_spec_for(model, cache, 2.0), BASE, ModelShapes.of(open_model(model)),
                        Target("routed_bpw", 2.0), rounds=0)  # fmt: skip
