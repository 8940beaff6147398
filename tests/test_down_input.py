"""``down_input: student`` (quant/ggml_gptq.py): down quantized on the quantized gate and up's
``h``, its target re-fitted so that its output matches the teacher's.

References: numpy's float64 least squares for the re-fitted target; the objective
``Σ ‖W·h_t − Q·h_s‖²`` in float64 for the quantization (ggml's quantizer: slow tier, as every
ggml test); the stage keys for what a down quantized this way depends on.
"""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.heal.knobs import Knobs
from healsweep.heal.quantize import layer_keys
from healsweep.quant import ggml_gptq


def _silu(z):
    return z / (1.0 + np.exp(-z))


def _hidden(x, w_gate, w_up):
    return _silu(x @ w_gate.T) * (x @ w_up.T)


def _layer(rng, n_expert=3, d=64, f=256, tokens=600, k=2):
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    ids = np.stack([rng.permutation(n_expert)[:k] for _ in range(tokens)]).astype(np.int32)
    gate = (rng.standard_normal((n_expert, f, d)) / np.sqrt(d)).astype(np.float32)
    up = (rng.standard_normal((n_expert, f, d)) / np.sqrt(d)).astype(np.float32)
    noise = 0.2 / np.sqrt(d)  # a student gate/up: the teacher's with an error of ~20%
    student = tuple(
        (w + noise * rng.standard_normal(w.shape)).astype(np.float32) for w in (gate, up)
    )
    down = (rng.standard_normal((n_expert, 32, f)) / np.sqrt(f)).astype(np.float32)
    return x, ids, (gate, up), student, down


def _routed(x, ids, e):
    return np.asarray(x[np.any(ids == e, axis=1)], np.float64)


def test_the_moments_and_the_refitted_target_match_float64_least_squares():
    rng = np.random.default_rng(0)
    x, ids, teacher, student, down = _layer(rng)
    experts = np.arange(3)
    grams, cross = ggml_gptq.student_moments(x, ids, experts, teacher, student)
    damp = 0.01
    u, ok = ggml_gptq.inverse_factor(grams, damp)
    assert ok.all()
    (fitted,) = ggml_gptq.corrected_targets([down], cross, grams, damp, u, ok)
    for e in experts:
        xe = _routed(x, ids, e)
        h_t = _hidden(xe, *(np.asarray(w[e], np.float64) for w in teacher))
        h_s = _hidden(xe, *(np.asarray(w[e], np.float64) for w in student))
        np.testing.assert_allclose(grams[e], h_s.T @ h_s, rtol=2e-4, atol=2e-3)
        np.testing.assert_allclose(cross[e], h_t.T @ h_s, rtol=2e-4, atol=2e-3)
        # W' = argmin ‖h_t·Wᵀ − h_s·W'ᵀ‖² + λ‖W' − W‖²: stacked least squares in float64
        w = down[e].astype(np.float64)
        lam = damp * np.trace(h_s.T @ h_s) / h_s.shape[1]
        a = np.vstack([h_s, np.sqrt(lam) * np.eye(h_s.shape[1])])
        b = np.vstack([h_t @ w.T, np.sqrt(lam) * w.T])
        want = np.linalg.lstsq(a, b, rcond=None)[0].T
        np.testing.assert_allclose(fitted[e], want, rtol=0, atol=2e-3 * np.abs(want).max())
        err_fit = np.linalg.norm(h_t @ w.T - h_s @ fitted[e].T.astype(np.float64))
        err_keep = np.linalg.norm(h_t @ w.T - h_s @ w.T)
        assert err_fit < 0.9 * err_keep  # the re-fit makes up part of gate/up's error
    # a student whose h is the teacher's leaves W as it is (no shrinking toward zero)
    grams, cross = ggml_gptq.student_moments(x, ids, experts, teacher, teacher)
    u, ok = ggml_gptq.inverse_factor(grams, damp)
    (same,) = ggml_gptq.corrected_targets([down], cross, grams, damp, u, ok)
    np.testing.assert_allclose(same, down, rtol=0, atol=1e-4 * np.abs(down).max())


def test_a_down_from_the_student_is_keyed_on_the_gate_up_quantization():
    from healsweep.model import open_model

    model = open_model("demo-medium-cpu")
    layer = model.hparams.moe_layers[0]
    base = Knobs(quantizer="gptq", type_gu="iq2_xxs", type_d="iq2_xxs")
    other_gu = {"type_gu": "iq2_xs"}
    for mode, follows in (("teacher", False), ("student", True)):
        knobs = base.replace(down_input=mode)
        keys = layer_keys(model, knobs, "trace", layer)
        moved = layer_keys(model, knobs.replace(**other_gu), "trace", layer)
        assert keys["gu"] != moved["gu"]
        assert (keys["d"] != moved["d"]) is follows, mode
    teacher = layer_keys(model, base, "trace", layer)
    student = layer_keys(model, base.replace(down_input="student"), "trace", layer)
    assert teacher["gu"] == student["gu"] and teacher["d"] != student["d"]
    # on a grid GPTQ does not run on (q2_k down here), the knob is inert: one entry
    k_down = base.replace(type_d="q2_k", quantizer="search")
    assert layer_keys(model, k_down, "trace", layer) == layer_keys(
        model, k_down.replace(down_input="student"), "trace", layer
    )


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["iq2_xxs", "iq2_xs"])
def test_down_on_the_student_input_lowers_its_output_error_against_the_teacher(qtype):
    rng = np.random.default_rng(1)
    x, ids, teacher, student, down = _layer(rng, d=64, f=256, tokens=800)
    importance = np.ones((3, 256), np.float32)
    experts = np.arange(3)
    errors = {}
    for name, extra in (("teacher", None), ("student", student)):
        (raw,), fed = ggml_gptq.quantize_experts_ef(
            [down], qtype, x, ids, experts, 0.01, importance, teacher, method="column",
            student_gate_up=extra,
        )  # fmt: skip
        assert fed.all()
        from healsweep.kernels.ggml_decode import decode_rows
        from healsweep.kernels.ggml_types import ggml_type

        q = np.asarray(decode_rows(raw, ggml_type(qtype).ggml_id, 256), np.float64)
        total = 0.0
        for e in experts:
            xe = _routed(x, ids, e)
            h_t = _hidden(xe, *(np.asarray(w[e], np.float64) for w in teacher))
            h_s = _hidden(xe, *(np.asarray(w[e], np.float64) for w in student))
            total += np.sum((h_t @ down[e].T - h_s @ q[e].T) ** 2)
        errors[name] = total
    assert errors["student"] < 0.9 * errors["teacher"], errors
