"""gptq_refine: code descent + closed-form block scales after GPTQ (issue 16), against float64."""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import correlated_layer, heal_setup
from healsweep.cache import StageCache
from healsweep.conformance import references
from healsweep.errors import KnobError
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.reads import stage_reads
from healsweep.kernels import gptq_refine
from healsweep.quant import gptq

setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)


def test_code_descent_matches_float64_and_never_raises_the_objective():
    w, h = correlated_layer(1, n_out=12)
    hd = gptq.damped(h, 0.01)
    d, q, _ = gptq.quantize_stack(w, h, 0.3, damp=0.01)
    new = np.asarray(gptq_refine.code_descent(w, hd, d, q, sweeps=2))
    ref_q = references.code_descent(w, hd, d, q, 2)
    # float32 H·r drifts ~1e-6 relative from the float64 one: a code at a rounding tie may differ
    assert np.mean(new != ref_q) <= 5e-3
    before, after = references.h_objective(w, d, q, hd), references.h_objective(w, d, new, hd)
    assert np.all(after <= before * (1 + 1e-5))
    assert after.sum() < 0.97 * before.sum()  # GPTQ's greedy codes are not a coordinate optimum


def test_scale_system_and_solve_match_a_float64_least_squares():
    w, h = correlated_layer(2, n_out=8)
    hd = gptq.damped(h, 0.01)
    d, q, _ = gptq.quantize_stack(w, h, 0.3, damp=0.01)
    a, b = gptq_refine.scale_system(w, hd, q)
    new = gptq.solve_scales(np.asarray(a), np.asarray(b), d)
    ref_a, ref_b = references.scale_system(w, hd, q)
    ref = np.linalg.solve(ref_a, ref_b[..., None])[..., 0]
    np.testing.assert_allclose(new.astype(np.float64), ref, rtol=2e-3, atol=1e-6)
    objective = np.asarray(gptq_refine.row_objective(w, hd, d, q), np.float64)
    np.testing.assert_allclose(objective, references.h_objective(w, d, q, hd), rtol=1e-4)


def test_empty_block_keeps_its_scale():
    a = np.zeros((1, 2, 2), np.float32)
    a[0, 0, 0] = 4.0
    b = np.array([[2.0, 0.0]], np.float32)
    d = np.array([[1.0, 0.25]], np.float16)
    np.testing.assert_array_equal(gptq.solve_scales(a, b, d), np.array([[0.5, 0.25]], np.float16))


@pytest.mark.parametrize("seed", range(3))
def test_refine_is_never_above_gptq_and_clearly_below_on_correlated_inputs(seed):
    w, h = correlated_layer(seed, n_out=24)
    hd = gptq.damped(h, 0.01)
    d0, q0, ok = gptq.quantize_stack(w, h, 0.3, damp=0.01)
    d3, q3, ok3 = gptq.quantize_stack(w, h, 0.3, damp=0.01, rounds=3)
    assert ok.all() and ok3.all() and q3.dtype == np.int8 and d3.dtype == np.float16
    assert set(np.unique(q3)) <= {-1, 0, 1, 2}
    before, after = references.h_objective(w, d0, q0, hd), references.h_objective(w, d3, q3, hd)
    assert np.all(after <= before * (1 + 1e-5)), (after / before).max()
    assert after.sum() < 0.9 * before.sum()


def test_refine_knob_is_validated_and_keyed_only_when_it_acts():
    assert Knobs().gptq_refine == 0
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(KnobError, match=r"^knob 'gptq_refine' = .* is not allowed: expected"):
            Knobs(gptq_refine=bad)
    plain_gptq = stage_reads(Knobs(quantizer="gptq"), "quantize")
    assert "gptq_refine" not in plain_gptq  # 0 keeps the keys of gptq as they were
    assert stage_reads(Knobs(quantizer="gptq", gptq_refine=2), "quantize") == {
        **plain_gptq,
        "gptq_refine": 2,
    }
    assert stage_reads(Knobs(gptq_refine=2), "quantize") == stage_reads(Knobs(), "quantize")


def test_build_student_with_refine_differs_from_gptq_and_is_cached(setup, tmp_path):
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    knobs = Knobs(quantizer="gptq", alpha="none", ridge=False)
    plain = build_student(model, knobs, CAL, cache, corpus=corpus)
    refined = build_student(model, knobs.replace(gptq_refine=2), CAL, cache, corpus=corpus)
    assert refined.key != plain.key
    g, p = refined.replacements[0].gate_exps, plain.replacements[0].gate_exps
    assert not np.array_equal(np.asarray(g.codes), np.asarray(p.codes))
    before = dict(cache.computed)
    again = build_student(model, knobs.replace(gptq_refine=2), CAL, cache, corpus=corpus)
    assert dict(cache.computed) == before and again.key == refined.key
