"""The sensitivity pass and the allocator sampler on a real Ray cluster with real Tune and Optuna.

The work here is the test's own (``toy_work``, the signature of ``run_trial_work``, as in
test_sweep_tune): a window's KLD is a known function of the per-layer types of the config,
additive over tensor groups, so what the pass must measure is known exactly (each move's change
of pooled KLD is its cost change times the windows' mean factor) and so is what the allocator
must propose (the best allocation under the budget, found here by enumerating every one of them).
The sizes come from a real GGUF with rows of 256 (``ModelShapes``). The same pass with the real
healer and scorer, and the CLI, run in the slow tier (test_sensitivity_heal: ggml's quantizer).

The specs are validated by the spec's model alone (``SweepSpec.model_validate``): loading a spec
with ggml types also asks for ggml's quantizer, which the toy work never runs and the default
install lacks (that check is tested in test_type_knobs and, for the allocator, in the slow tier).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

import test_sweep_tune
from healsweep.heal.knobs import Knobs, LayerTypes
from healsweep.heal.size import ModelShapes
from healsweep.kernels.ggml_types import ggml_type
from healsweep.model import open_model
from healsweep.score.record import WindowRecord
from healsweep.sweep.sensitivity import (
    STAGE,
    entry_key,
    moves,
    pass_spec,
    run_sensitivity,
    sensitivity_base,
    steps,
)
from healsweep.sweep.spec import SweepSpec
from healsweep.sweep.work import trial_order

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray_cluster = test_sweep_tune.ray_cluster  # one embedded Ray cluster for this module

ROWS256 = dict(n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4, n_expert_used=2)
LADDER = ["iq1_s", "iq1_m", "iq2_xxs"]
N_WINDOWS = 12
WINDOW_IDS = sorted(hashlib.sha256(f"w{i}".encode()).hexdigest()[:16] for i in range(N_WINDOWS))
IDENTITY = {"model_fingerprint": "toy-model", "split_lock_id": "toy-split"}


def _u(*parts: object) -> float:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def toy_cost(layer: int, group: str, type_name: str) -> float:
    """What a group in a type adds to every window's KLD (before the window's factor): less
    with more bits, more for later layers and for down."""
    bits = ggml_type(type_name).bits_per_weight
    return 0.004 * (1.0 + layer) * (2.0 if group == "d" else 1.0) * 2 ** (-2 * (bits - 1.5))


def toy_factor(window_id: str) -> float:
    return 0.5 + _u("factor", window_id)


def toy_tokens(window_id: str) -> int:
    return 20 + int(30 * _u("len", window_id))


def toy_window_kld(knobs: Knobs, window_id: str, moe, n_layer) -> float:
    types = knobs.expert_types(moe, n_layer)
    cost = sum(toy_cost(i, g, types[i].of(g)) for i in moe for g in ("gu", "d"))
    return (0.002 + cost) * toy_factor(window_id)


def toy_work(spec, knobs, done, seed, *, log: str):
    """Score the first ``max_windows`` toy windows not in ``done``; log each one."""
    hp = open_model(spec.model).hparams
    n = min(N_WINDOWS, spec.scoring.max_windows or N_WINDOWS)
    for position, wi in enumerate(trial_order(n, seed)):
        window_id = WINDOW_IDS[wi]
        if window_id in done:
            continue
        tokens = toy_tokens(window_id)
        kld = toy_window_kld(knobs, window_id, hp.moe_layers, hp.n_layer)
        with open(log, "a") as f:
            f.write(f"{knobs.layer_types or '-'}|{knobs.type_gu}/{knobs.type_d} {window_id}\n")
        metrics = {
            "kld_sum": kld * tokens, "kld_count": tokens, "kld_mean": kld, "top1": 0.9,
            "top1_count": int(0.9 * tokens), "delta_p_mean": -0.01, "teacher_nll_sum": tokens,
            "student_nll_sum": 1.1 * tokens, "router_jaccard": 0.8,
            "router_jaccard_layers": [0.8, 0.8],
        }  # fmt: skip
        yield WindowRecord(window_id, wi, position, n, "ops", "toy", f"d{wi}", "text", metrics)


def toy_identity(spec):
    return dict(IDENTITY)


def _mean_factor(n: int) -> float:
    ids = WINDOW_IDS[:n]
    tokens = np.array([toy_tokens(w) for w in ids], float)
    return float((tokens * [toy_factor(w) for w in ids]).sum() / tokens.sum())


@pytest.fixture(scope="module")
def model(random_gguf):
    return random_gguf("qwen2moe", seed=7, **ROWS256)


def _spec(model, tmp_path, **extra) -> SweepSpec:
    return SweepSpec.model_validate({
        "name": "alloc", "model": str(model), "sampler": "allocator", "references": False,
        "budget": {"routed_bpw": [1.8]}, "pruner": "none", "max_concurrent": 2,
        "baseline": {"type_gu": "iq1_m", "type_d": "iq1_m", "alpha": "mse"},
        "allocator": {"ladder": LADDER, "proposals": 2, "windows": 6},
        "cache_root": str(tmp_path / "cache"), **extra,
    })  # fmt: skip


def test_the_moves_are_one_step_down_and_up_the_ladder(model):
    shapes = ModelShapes.of(open_model(model))
    base = Knobs(type_gu="iq1_m", type_d="iq2_xxs", layer_types="1:iq1_s/iq1_s")
    found = moves(base, shapes, LADDER)
    assert [(m.layer, m.group, m.source, m.target) for m in found] == [
        (0, "gu", "iq1_m", "iq1_s"), (0, "gu", "iq1_m", "iq2_xxs"), (0, "d", "iq2_xxs", "iq1_m"),
        (1, "gu", "iq1_s", "iq1_m"), (1, "d", "iq1_s", "iq1_m"),  # the ends of the ladder
    ]  # fmt: skip
    assert all(m.direction == ("up" if m.bits > 0 else "down") for m in found)
    # without a ladder, the table's: iq2_xxs steps to q2_0 (rows of 256 and of 64 both fit it)
    assert steps("iq2_xxs", 256, None) == ("iq1_m", "q2_0")
    assert steps("iq2_xs", 256, ["iq2_xxs", "iq2_s"]) == ("iq2_xs", "iq2_xs")  # not on it


def test_the_pass_measures_each_moves_cost_and_caches_it(ray_cluster, model, tmp_path):
    log = tmp_path / "scored.log"
    spec = _spec(model, tmp_path)
    work = functools.partial(toy_work, log=str(log))
    lines: list[str] = []
    table = run_sensitivity(spec, IDENTITY, work_fn=work, say=lines.append)
    shapes = ModelShapes.of(open_model(model))
    base = sensitivity_base(spec)
    assert base == spec.baseline and table.base == base
    expected = moves(base, shapes, LADDER)
    assert [r.move for r in table.results] == expected and len(expected) == 8
    factor = _mean_factor(6)
    for r in table.results:
        m = r.move
        assert r.scores.window_ids == tuple(WINDOW_IDS[:6]) == r.base.window_ids
        want = toy_cost(m.layer, m.group, m.target) - toy_cost(m.layer, m.group, m.source)
        assert r.delta_kld == pytest.approx(want * factor, rel=1e-9)
        lo, hi = r.rel_change_ci()
        assert lo <= r.rel_change <= hi
        # the moved config is the base with one group of one layer in another type
        types = r.knobs.expert_types(shapes.moe_layers, shapes.n_layer)
        assert types[m.layer].of(m.group) == m.target
        assert sum(t != LayerTypes("iq1_m", "iq1_m") for t in types.values()) == 1
    scored = log.read_text().splitlines()
    assert len(scored) == 9 * 6  # the base and 8 moves, 6 windows each
    assert lines[0].startswith("sensitivity of 8 moves around iq1_m/iq1_m at 1.75 routed bpw")
    assert "0 of 9 configs cached, 9 to score on 6 dev windows" in lines[0]
    assert sum(line.startswith("[") for line in lines) == 9

    # a second pass (another sweep, or `healsweep sensitivity`) reads every config back
    again = run_sensitivity(spec, IDENTITY, work_fn=work, say=lines.append)
    assert len(log.read_text().splitlines()) == 9 * 6
    assert "9 of 9 configs cached, 0 to score" in lines[-1]
    assert [r.delta_kld for r in again.results] == [r.delta_kld for r in table.results]
    assert len(list((tmp_path / "cache" / STAGE).rglob("*.hsc"))) == 9
    # keyed by the model, the split, the calibration, the scoring, the base, the move and the
    # work: each of them changed, another key
    base, move = table.base, table.results[0].move
    knobs = table.results[0].knobs
    key = entry_key(pass_spec(spec), IDENTITY, knobs, base, move, work)
    for changed in (
        (pass_spec(spec), {**IDENTITY, "model_fingerprint": "other"}, base, move, work),
        (pass_spec(spec), {**IDENTITY, "split_lock_id": "other"}, base, move, work),
        (pass_spec(_spec(model, tmp_path, calibration={"max_tokens": 999})), IDENTITY, base,
         move, work),
        (pass_spec(_spec(model, tmp_path, scoring={"max_scored": 64})), IDENTITY, base, move,
         work),
        (pass_spec(spec), IDENTITY, base.replace(alpha="none"), move, work),
        (pass_spec(spec), IDENTITY, base, table.results[1].move, work),
        (pass_spec(spec), IDENTITY, base, move, functools.partial(toy_identity)),
    ):  # fmt: skip
        assert entry_key(changed[0], changed[1], knobs, *changed[2:]) != key
    # fewer windows: every config scored again, on those windows
    fewer = _spec(model, tmp_path, allocator={"ladder": LADDER, "windows": 4})
    run_sensitivity(fewer, IDENTITY, work_fn=work)
    assert len(log.read_text().splitlines()) == 9 * 6 + 9 * 4


def _trials(sweep_dir: Path) -> list[dict]:
    return pq.read_table(sweep_dir / "trials.parquet").to_pylist()


def _knobs(row: dict) -> Knobs:
    return Knobs(**{k[5:]: v for k, v in row.items() if k.startswith("knob_")})


def test_an_allocator_sweep_scores_the_best_allocation_under_its_budget(
    ray_cluster, model, tmp_path
):
    from healsweep.results.report import write_report
    from healsweep.sweep.driver import run_sweep

    log = tmp_path / "scored.log"
    spec = _spec(model, tmp_path, search_space={"type_gu": ["iq1_s", "iq1_m"],
                                                "type_d": ["iq1_m", "iq2_xxs"]})  # fmt: skip
    notes: list[str] = []
    run = run_sweep(spec, results_root=tmp_path / "results", identity_fn=toy_identity,
                    work_fn=functools.partial(toy_work, log=str(log)),
                    on_note=notes.append)  # fmt: skip
    shapes = ModelShapes.of(open_model(model))
    budget = spec.budget.budget()
    record = json.loads((run.sweep_dir / "allocator.json").read_text())
    assert len(record["sensitivity"]["moves"]) == 8 and record["sensitivity"]["windows"] == 6
    trials = _trials(run.sweep_dir)
    assert all(t["status"] == "completed" for t in trials)
    by_knobs = {_knobs(t): t for t in trials}
    # the grid: the baseline and 2 x 2 types (iq1_m/iq1_m is the baseline's student; iq1_m
    # gate/up with iq2_xxs down is over 1.8 bpw), then the allocator's proposals
    over = json.loads((run.sweep_dir / "over_budget.json").read_text())
    assert [Knobs(**e["knobs"]).type_d for e in over.values()] == ["iq2_xxs"]
    proposals = [Knobs(**p["knobs"]) for p in record["proposals"]]
    assert 1 <= len(proposals) <= 2 and all(p in by_knobs for p in proposals)
    assert len(trials) == 1 + 2 + len(proposals)
    assert any(line.startswith("allocator, within 1.8 bpw: ") for line in notes)

    # the first proposal is the best allocation within the budget (toy costs are additive)
    best = None
    moe = shapes.moe_layers
    for picks in itertools.product(LADDER, repeat=2 * len(moe)):
        types = {i: LayerTypes(picks[2 * n], picks[2 * n + 1]) for n, i in enumerate(moe)}
        knobs = spec.baseline.replace(layer_types=",".join(
            f"{i}:{t.gu}/{t.d}" for i, t in types.items()))  # fmt: skip
        if budget.admits(shapes.size(knobs)):
            kld = toy_window_kld(knobs, WINDOW_IDS[0], moe, shapes.n_layer)
            if best is None or kld < best[0]:
                best = (kld, types)
    first = proposals[0]
    assert first.expert_types(moe, shapes.n_layer) == best[1]
    row = by_knobs[first]
    assert row["routed_bpw"] <= 1.8 + 1e-9
    assert row["kld_mean"] == pytest.approx(best[0] / toy_factor(WINDOW_IDS[0]) * _mean_factor(12))
    assert row["kld_mean"] < min(t["kld_mean"] for t in trials if t is not row)

    # the sensitivity configs were scored once, on the pass's 6 windows, and the trials on 12
    scored = [line.split()[0] for line in log.read_text().splitlines()]
    assert len(scored) == 9 * 6 + 12 * len(trials)

    report = write_report(run.sweep_dir, n_boot=200)["markdown"].read_text()
    assert "## Allocations beside the best uniform recipe of their size" in report
    assert "## Sensitivity of each tensor group" in report


def test_an_allocator_spec_is_refused_in_one_line_where_it_cannot_work():
    from healsweep.errors import SpecError
    from healsweep.sweep.spec_files import spec_from_dict

    budget = {"budget": {"routed_bpw": 1.8}}
    for bad, why in (
        ({"sampler": "allocator"}, "sampler allocator chooses types under a size budget: add a"),
        ({"allocator": {"proposals": 2}, **budget},
         "field 'allocator' needs sampler allocator (the sampler is grid); remove it or set"),
        ({"sampler": "allocator", "allocator": {"ladder": ["iq1_m", "iq1_m"]}, **budget},
         "it lists a type twice"),
        ({"sampler": "allocator", "allocator": {"ladder": ["q3_k", "iq3_s"]}, **budget},
         "q3_k and iq3_s have the same bits per weight (3.4375)"),
        ({"sampler": "allocator", "allocator": {"ladder": ["iq9"]}, **budget},
         "field 'allocator.ladder[0]' = 'iq9' is not allowed"),
        ({"sampler": "allocator", "allocator": {"proposals": 0}, **budget},
         "field 'allocator.proposals' = 0 is not allowed"),
        ({"sampler": "allocator", "num_samples": 4, **budget},
         "field 'num_samples' = 4 is not allowed; sampler allocator runs the grid and its"),
        ({"sampler": "allocator", "search_space": {"alpha": {"choices": ["mse"]}}, **budget},
         "with sampler allocator a dimension is a non-empty list of values"),
    ):  # fmt: skip
        with pytest.raises(SpecError, match=re.escape(why)) as info:
            spec_from_dict({"name": "x", **bad})
        assert "\n" not in str(info.value)
    assert "allocator" not in spec_from_dict({"name": "x"}).model_dump()  # earlier hashes hold


@pytest.mark.slow  # a ladder of ggml types needs ggml's quantizer where the spec is loaded
def test_an_allocator_ladder_is_ordered_by_bits_per_weight():
    from healsweep.sweep.spec_files import spec_from_dict

    spec = spec_from_dict({"name": "x", "sampler": "allocator", "budget": {"routed_bpw": 1.8},
                           "allocator": {"ladder": ["iq2_xs", "iq1_s", "q2_0"]}})  # fmt: skip
    assert spec.allocator.ladder == ["iq1_s", "q2_0", "iq2_xs"]  # ordered by bits per weight
