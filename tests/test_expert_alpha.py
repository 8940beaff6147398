"""alpha_granularity: expert — Part A's alpha per routed expert, folded into its down scales."""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import heal_setup
from healsweep.cache import StageCache
from healsweep.errors import KnobError
from healsweep.heal import expert_alpha, stages
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.trace import calibration_trace

setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)


def test_granularity_knob_is_validated_and_keyed_only_when_read():
    with pytest.raises(
        KnobError,
        match=r"^knob 'alpha_granularity' = 'neuron' is not allowed: expected one of layer, expert$",
    ):
        Knobs(alpha_granularity="neuron")
    layer = Knobs(alpha="mse").for_stage("part_a")
    assert "alpha_granularity" not in layer  # keys from before the knob
    assert Knobs(alpha="mse", alpha_granularity="expert").for_stage("part_a") == {
        **layer,
        "alpha_granularity": "expert",
    }
    assert Knobs(alpha="none", alpha_granularity="expert").for_stage("part_a") == {"alpha": "none"}


def _silu(v):
    return v / (1.0 + np.exp(-v))


def test_mse_alphas_match_a_float64_reference(setup, tmp_path):
    # gamma = 0: each expert's alpha is <r, q>/|q|² of its routing-weighted contributions.
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    student = build_student(model, Knobs(alpha="none", ridge=False), CAL, cache, corpus=corpus)
    layer = calibration_trace(model, CAL, cache, corpus).layer(1)
    weights = stages.expert_weights(model, 1)
    replacement = student.replacements[1]
    experts = stages.ExpertStacks(replacement.gate_exps, replacement.up_exps, replacement.down_exps)
    got = expert_alpha.mse_alphas(weights, experts, layer, 0.0, -7.0, CAL.min_tokens_per_expert)
    x = np.asarray(layer["x"], np.float64)
    dense = [
        np.asarray(weights[f"ffn_{n}_exps.weight"], np.float64) for n in ("gate", "up", "down")
    ]
    quant = [np.asarray(stack.dequantize(), np.float64) for stack in experts]
    for e in range(model.hparams.n_expert):
        routed = layer["ids"] == e
        rows = np.any(routed, axis=1)
        if rows.sum() < CAL.min_tokens_per_expert:
            assert got[e] == -7.0  # the layer's alpha, as handed in
            continue
        w_route = np.where(routed, layer["weights"], 0.0).sum(axis=1)[rows][:, None]

        def out(g, u, d, xs=x[rows], e=e, w_route=w_route):
            return (_silu(xs @ g[e].T) * (xs @ u[e].T)) @ d[e].T * w_route

        r, q = out(*dense), out(*quant)
        np.testing.assert_allclose(got[e], np.sum(r * q) / np.sum(q * q), rtol=2e-4)


def test_expert_alphas_are_folded_into_down_and_feed_part_b(setup, tmp_path):
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    knobs = Knobs(alpha="mse", gamma=0.0, alpha_granularity="expert")
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    plain = build_student(model, Knobs(alpha="none", ridge=False), CAL, cache, corpus=corpus)
    assert student.alphas == [1.0] * model.hparams.n_layer
    for i, layer in enumerate(student.report["layers"]):
        alphas = np.asarray(layer["expert_alphas"], np.float32)
        assert alphas.shape == (model.hparams.n_expert,) and len(set(alphas.tolist())) > 1
        d_plain = np.asarray(plain.replacements[i].down_exps.d, np.float32)
        expected = (d_plain * alphas[:, None, None]).astype(np.float16)
        got = np.asarray(student.replacements[i].down_exps.d)
        np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))
        assert "ridge" in layer and layer["residual"] < layer["residual_alpha_1"]
    before = dict(cache.computed)
    again = build_student(model, knobs, CAL, cache, corpus=corpus)
    assert dict(cache.computed) == before and again.key == student.key
    layer_mse = build_student(
        model, knobs.replace(alpha_granularity="layer"), CAL, cache, corpus=corpus
    )
    assert layer_mse.key != student.key and layer_mse.alphas != student.alphas


def test_gaussian_expert_alphas_run_without_a_trace(setup, tmp_path):
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    knobs = Knobs(alpha="gaussian", alpha_granularity="expert", ridge=False)
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    assert student.report["calibration"] is None  # the Gaussian probe needs no teacher pass
    alphas = student.report["layers"][0]["expert_alphas"]
    assert len(alphas) == model.hparams.n_expert and all(np.isfinite(alphas))
