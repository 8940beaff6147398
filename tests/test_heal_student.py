"""build_student's healed layers against independent float64 numpy computations and the real forward."""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import _corpus_file, heal_setup
from healsweep.cache import StageCache
from healsweep.conformance.references import routed_experts as _routed_float64
from healsweep.data.corpus import load_corpus
from healsweep.heal import stages
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.quantize import cached_experts, layer_keys
from healsweep.kernels.alpha import gaussian_probe_experts
from healsweep.model import forward, open_model
from healsweep.model.synthetic import write_random_model

CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)


setup = heal_setup


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache for the tests that do not count executions, so they share the trace."""
    return StageCache(tmp_path_factory.mktemp("shared") / "cache")


def test_healed_layers_match_independent_computations(setup, shared_cache):
    model, corpus = setup
    cache = shared_cache
    knobs = Knobs(alpha="mse", gamma=0.0)
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    trace_key = student.report["trace_key"]
    from healsweep.heal.trace import LAYER_STAGE, layer_key

    for layer in range(model.hparams.n_layer):
        arrays = cache.get(LAYER_STAGE, layer_key(trace_key, layer))[0]
        qkeys = layer_keys(model, knobs, trace_key, layer)
        experts = cached_experts(cache, qkeys)
        dense = {n: np.asarray(w.dequantize(), np.float64) for n, w in experts._asdict().items()}
        y_q = cache.get("routed_q", stages.routed_q_key(qkeys, trace_key, layer))[0]["y_q"]
        want = _routed_float64(
            arrays["x"], arrays["ids"], arrays["weights"], dense["gate"], dense["up"], dense["down"]
        )
        np.testing.assert_allclose(y_q, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
        y_ref = arrays["y_ref"].astype(np.float64)
        alpha = np.sum(y_ref * want) / np.sum(want * want)
        assert student.alphas[layer] == pytest.approx(alpha, rel=1e-4)
        report = student.report["layers"][layer]
        assert report["residual"] <= report["residual_alpha_1"] + 1e-7  # mse never loses to 1
        replacement = student.replacements[layer]
        d_scaled = np.asarray(replacement.down_exps.d, np.float32)
        d_plain = np.asarray(experts.down.d, np.float32)
        np.testing.assert_array_equal(
            d_scaled, (d_plain * np.float32(student.alphas[layer])).astype(np.float16)
        )
        shexp = replacement.down_shexp
        assert shexp.shape == model.tensor_shape(f"blk.{layer}.ffn_down_shexp.weight")
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        requant = dequantize(quantize(shexp, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        np.testing.assert_allclose(requant, shexp, atol=1e-6)  # already on the Q8_0 grid
        assert report["ridge"]["storage_type"] == "Q8_0"
        assert report["ridge"]["in_sample_change"] <= 0


def test_student_forward_reproduces_alpha_times_y_q_in_layer_0(setup, shared_cache):
    model, corpus = setup
    cache = shared_cache
    student = build_student(model, Knobs(alpha="mse", ridge=False), CAL, cache, corpus=corpus)
    from healsweep.heal.trace import budgeted, make_chunks

    chunks, _ = make_chunks(corpus.pool("calibration"), model.tokenizer(), budgeted(model, CAL))
    tokens = [c.tokens for c in chunks[:3]]
    rep = student.replacements[0]
    out = forward(model, tokens, capture=True, replacements={0: rep})
    teacher = forward(model, tokens, capture=True)
    x = teacher.captures[0].ffn_input
    np.testing.assert_allclose(out.captures[0].ffn_input, x, rtol=1e-5, atol=1e-6)
    cap = teacher.captures[0]
    dense = {
        n: np.asarray(getattr(rep, f"{n}_exps").dequantize(), np.float64)
        for n in ("gate", "up", "down")
    }
    want = _routed_float64(
        x, cap.topk_ids, cap.topk_weights, dense["gate"], dense["up"], dense["down"]
    )
    got = out.captures[0].routed_output
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    assert rep.down_shexp is None and not student.shexp_raw


def test_gaussian_alpha_is_the_shipped_probe(setup, shared_cache):
    model, corpus = setup
    cache = shared_cache
    knobs = Knobs(alpha="gaussian", gamma=0.75, ridge=False)
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    weights = model.layer(1)
    experts = cached_experts(cache, layer_keys(model, knobs, None, 1))._asdict()
    probe = list(gaussian_probe_experts(model.hparams.n_expert))
    scale = np.abs(weights["ffn_norm.weight"]).astype(np.float64)
    x = np.random.default_rng(0).standard_normal((16, scale.size), dtype=np.float32) * scale
    ref, q = [], []
    for e in probe:
        for store, w in (
            (ref, {n: weights[f"ffn_{n}_exps.weight"][e] for n in ("gate", "up", "down")}),
            (q, {n: np.asarray(experts[n].dequantize())[e] for n in ("gate", "up", "down")}),
        ):
            g, u = x @ w["gate"].T.astype(np.float64), x @ w["up"].T.astype(np.float64)
            store.append((g / (1 + np.exp(-g)) * u) @ w["down"].T.astype(np.float64))
    a, b = np.concatenate(ref).ravel(), np.concatenate(q).ravel()
    cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    want = cos**0.25 / (np.linalg.norm(b) / np.linalg.norm(a))
    assert student.alphas[1] == pytest.approx(want, rel=1e-4)


def test_qwen3moe_has_no_ridge_stage(tmp_path):
    model = open_model(write_random_model(tmp_path / "q3.gguf", "qwen3moe", n_layer=1, n_ff_exp=64))
    corpus = load_corpus(_corpus_file(tmp_path / "c.jsonl"))
    cache = StageCache(tmp_path / "cache")
    student = build_student(model, Knobs(alpha="mse"), CAL, cache, corpus=corpus)
    assert cache.computed["part_b"] == 0 and student.replacements[0].down_shexp is None
    assert "ridge" not in student.report["layers"][0]


def test_act_quantization_uses_per_expert_input_statistics(setup, shared_cache):
    from healsweep.heal.trace import LAYER_STAGE, layer_key
    from healsweep.kernels import q2_0

    model, corpus = setup
    cache = shared_cache
    knobs = Knobs(importance="act", importance_down="act", ridge=False, alpha="none")
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    arrays = cache.get(LAYER_STAGE, layer_key(student.report["trace_key"], 0))[0]
    weights = model.layer(0)
    x, ids = arrays["x"].astype(np.float64), arrays["ids"]
    n_expert = model.hparams.n_expert
    routed = [np.any(ids == e, axis=1) for e in range(n_expert)]
    layer_x = sum((x[r] ** 2).sum(0) for r in routed) / sum(r.sum() for r in routed)
    imp_x = np.stack(
        [(x[r] ** 2).mean(0) if r.sum() >= CAL.min_tokens_per_expert else layer_x for r in routed]
    )
    gate = q2_0.quantize_matrix(weights["ffn_gate_exps.weight"], imp_x.astype(np.float32), 0.3)
    got = student.replacements[0].gate_exps
    assert np.mean(np.asarray(got.q) == np.asarray(gate.q)) > 0.999
    hidden = []
    for e in range(n_expert):
        xe = x[routed[e]]
        g = xe @ weights["ffn_gate_exps.weight"][e].T.astype(np.float64)
        u = xe @ weights["ffn_up_exps.weight"][e].T.astype(np.float64)
        hidden.append(((g / (1 + np.exp(-g)) * u) ** 2, routed[e].sum()))
    layer_h = sum(h.sum(0) for h, _ in hidden) / sum(n for _, n in hidden)
    imp_h = np.stack([h.mean(0) if n >= CAL.min_tokens_per_expert else layer_h for h, n in hidden])
    down = q2_0.quantize_matrix(weights["ffn_down_exps.weight"], imp_h.astype(np.float32), 0.3)
    assert np.mean(np.asarray(student.replacements[0].down_exps.q) == np.asarray(down.q)) > 0.999
    plain = q2_0.quantize_matrix(weights["ffn_down_exps.weight"], None, 0.3)
    assert np.mean(np.asarray(plain.q) != np.asarray(down.q)) > 0.005  # importance mattered
