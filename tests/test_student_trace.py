"""The student's trace (issue 49, item 3): Part A and Part B fit the MoE inputs the student's own
retyped layers produce. Checked against a forward with the retyped layers captured, float64 numpy
for the shared expert's gap and Part B's right-hand side, the teacher's trace bit for bit when
the "retyped" tensors are the teacher's own, and the keys.

Here the retyped tensors are made by gguf-py's Q4_0 quantizer (no ggml: default tier); the
pipeline with ggml's types is tests/test_student_trace_pipeline.py (slow tier, where ggml is).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from _heal_fixtures import heal_setup
from healsweep.cache import StageCache
from healsweep.gguf_io import HEAD
from healsweep.heal import ridge, student_trace
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import StageRunner, _layer_inputs, _plan
from healsweep.heal.trace import budgeted, calibration_trace, make_chunks
from healsweep.kernels.ggml_decode import GGMLWeight
from healsweep.model import LayerReplacement, forward
from healsweep.model.forward import device_weight

setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
Q4_0 = GGMLQuantizationType.Q4_0
RETYPED = ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.1.attn_v.weight",
           "blk.0.ffn_gate_shexp.weight", "blk.0.ffn_up_shexp.weight",
           "blk.0.ffn_down_shexp.weight", "token_embd.weight")  # fmt: skip


def _q4(model, name):
    """Tensor ``name`` in Q4_0 by gguf-py's quantizer, as the forward takes it."""
    values = model.tensor(name).reshape(-1, model.tensor_shape(name)[-1])
    return GGMLWeight(quantize(values.astype(np.float32), Q4_0), int(Q4_0), values.shape[-1])


@pytest.fixture(scope="module")
def traced(setup, tmp_path_factory):
    """The teacher's trace and the student's with RETYPED in Q4_0, in one cache."""
    model, corpus = setup
    cache = StageCache(tmp_path_factory.mktemp("st"))
    teacher = calibration_trace(model, CAL, cache, corpus)
    weights = {name: _q4(model, name) for name in RETYPED}
    tensors = {name: f"key-of-{name}" for name in RETYPED}
    student = student_trace.student_trace(
        model, CAL, cache, teacher, tensors, weights.__getitem__, corpus
    )
    return model, corpus, cache, teacher, student, weights


def _direct(model, corpus, replacements):
    """The captures of one forward of every calibration chunk with ``replacements``, per MoE
    layer over the chunks' tokens in order."""
    chunks, _ = make_chunks(corpus.pool("calibration"), model.tokenizer(), budgeted(model, CAL))
    tokens = [c.tokens for c in chunks]
    return forward(model, tokens, capture=True, replacements=replacements).captures


def test_the_student_trace_is_the_forward_of_the_retyped_layers_captured(traced):
    model, corpus, _, teacher, student, weights = traced
    by_layer = {HEAD: LayerReplacement(tensors={"token_embd.weight": weights["token_embd.weight"]})}
    for name, weight in weights.items():
        layer, suffix = name.split(".", 2)[1:] if name.startswith("blk.") else (None, name)
        if layer is not None:
            layer = int(layer)
            tensors = dict(by_layer.get(layer, LayerReplacement(tensors={})).tensors)
            by_layer[layer] = LayerReplacement(tensors={**tensors, suffix: weight})
    direct = _direct(model, corpus, by_layer)
    for layer in model.hparams.moe_layers:
        arrays, before = student.layer(layer), teacher.layer(layer)
        for name, field in (("x", "ffn_input"), ("y_ref", "routed_output"),
                            ("gate", "shexp_gate"), ("weights", "topk_weights")):  # fmt: skip
            want = getattr(direct[layer], field)
            tol = 2**-11 if name == "x" else 2e-4  # x is stored in float16
            np.testing.assert_allclose(arrays[name], want, rtol=tol, atol=2e-5)
        np.testing.assert_array_equal(arrays["ids"], direct[layer].topk_ids)
        # the retyping moved the inputs: what the teacher's trace holds is another thing
        moved = np.abs(arrays["x"].astype(np.float32) - before["x"].astype(np.float32)).max()
        assert moved > 100 * 2**-11 * np.abs(before["x"].astype(np.float32)).max()
    assert student.report["retyped"] == sorted(RETYPED)
    assert student.report["tokens_used"] == teacher.report["tokens_used"]


def _swiglu(x, wg, wu):
    g = x @ wg.T
    return g / (1 + np.exp(-g)) * (x @ wu.T)


def test_part_b_fits_the_students_shared_expert_and_its_gap_to_the_teachers(traced):
    model, _, _, _, student, weights = traced
    arrays = student.layer(0)  # layer 0's shared expert gate and up are retyped
    assert "shexp_weights" in arrays and "shexp_gap" in arrays
    assert "shexp_weights" not in student.layer(1) and "shexp_gap" not in student.layer(1)
    x, gate = arrays["x"].astype(np.float64), arrays["gate"].astype(np.float64)[:, None]
    teacher = [model.tensor(f"blk.0.ffn_{n}_shexp.weight").astype(np.float64) for n in ("gate", "up")]
    ours = [np.asarray(weights[f"blk.0.ffn_{n}_shexp.weight"].dequantize(), np.float64)
            for n in ("gate", "up")]  # fmt: skip
    down = model.tensor("blk.0.ffn_down_shexp.weight").astype(np.float64)  # the teacher's W
    z_teacher, z_student = gate * _swiglu(x, *teacher), gate * _swiglu(x, *ours)
    gap = (z_teacher - z_student) @ down.T
    assert np.abs(gap).max() > 1e-3 * np.abs(z_teacher @ down.T).max()  # a real difference
    np.testing.assert_allclose(arrays["shexp_gap"], gap, rtol=0, atol=1e-4 * np.abs(gap).max())
    # Part B: Z' of the student's gate and up; B = Z'ᵀ(y_ref - alpha·y_q + gap)
    rng = np.random.default_rng(0)
    y_q = (arrays["y_ref"] * 0.9 + 0.01 * rng.standard_normal(arrays["y_ref"].shape)).astype(
        np.float32
    )
    basis = ridge.compute_basis(model, 0, arrays)
    gram = z_student.T @ z_student
    np.testing.assert_allclose(basis.trace_g, np.trace(gram), rtol=1e-4)
    rhs = ridge.compute_rhs(model, 0, arrays, y_q, 0.8, basis)
    target = arrays["y_ref"].astype(np.float64) - 0.8 * y_q.astype(np.float64) + gap
    want = z_student.T @ target
    np.testing.assert_allclose(rhs.rhs, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_the_teachers_own_bytes_as_replacements_give_the_teachers_trace_bit_for_bit(traced):
    model, corpus, _, teacher, _, _ = traced
    names = ("blk.0.attn_q.weight", "blk.1.attn_k.weight", "token_embd.weight")
    tensors = {name: f"teacher-{name}" for name in names}
    own = {name: device_weight(model, name) for name in names}
    if not isinstance(own["token_embd.weight"], GGMLWeight):  # the embedding is a row lookup
        raw = model.raw_rows("token_embd.weight")
        qtype = int(model.tensor_type("token_embd.weight"))
        own["token_embd.weight"] = GGMLWeight(raw, qtype, model.tensor_shape("token_embd.weight")[-1])
    same = student_trace.student_trace(
        model, CAL, teacher.cache, teacher, tensors, own.__getitem__, corpus
    )
    assert same.key != teacher.key
    for layer in model.hparams.moe_layers:
        got, want = same.layer(layer), teacher.layer(layer)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_the_key_is_the_teacher_trace_and_the_retyped_tensors_and_nothing_else(setup):
    model, _ = setup
    base = {"blk.0.attn_q.weight": "a", "blk.0.ffn_up_shexp.weight": "b"}
    key = student_trace.student_trace_key("T", base)
    assert student_trace.student_trace_key("T", dict(reversed(base.items()))) == key
    assert student_trace.student_trace_key("T2", base) != key
    assert student_trace.student_trace_key("T", {**base, "blk.0.attn_q.weight": "c"}) != key
    assert student_trace.student_trace_key("T", {"blk.0.attn_q.weight": "a"}) != key
    # what reaches a MoE layer's input: attention, shared expert, embeddings; not the output
    retype = {"blk.0.attn_q.weight": 1, "blk.1.ffn_down_shexp.weight": 2,
              "token_embd.weight": 3, "output.weight": 4}  # fmt: skip
    assert set(student_trace.upstream(model, retype)) == set(retype) - {"output.weight"}


def test_a_config_that_retypes_nothing_upstream_fits_the_teachers_trace(setup, tmp_path):
    model, corpus = setup
    run = StageRunner(StageCache(tmp_path / "c"))
    knobs = Knobs(alpha="mse", ridge=False)
    plan, _ = _plan(run, model, knobs, CAL, corpus, lambda s, m: None, False)
    assert plan.trace is not None and plan.student is None and not plan.retype
    assert not run.cache.computed.get("student_trace")
    layer = _layer_inputs(run, plan, 0, False)  # what routed_q, Part A and Part B read
    assert layer.fit_trace is plan.trace
    np.testing.assert_array_equal(layer.fit_layer()["x"], plan.trace.layer(0)["x"])
