"""build_student: each stage is cached by exactly the inputs it reads, code included."""

from __future__ import annotations

from _heal_fixtures import heal_setup
from healsweep.cache import StageCache
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.quantize import layer_keys

CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
STAGES = (
    "calib_trace",
    "quantize",
    "routed_q",
    "part_a",
    "residuals",
    "ridge_basis",
    "ridge_rhs",
    "ridge_fit",
    "ridge_heldout",
    "part_b",
)


setup = heal_setup


def _delta(cache, before):
    return {s: cache.computed[s] - before.get(s, 0) for s in STAGES}


def test_each_knob_recomputes_only_the_stages_that_read_it(setup, tmp_path):
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    n = model.hparams.n_layer
    build_student(model, Knobs(), CAL, cache, corpus=corpus)
    assert dict(cache.computed) == {
        "calib_trace": 1,
        "quantize": 2 * n,  # gate/up and down: one entry each per layer
        "routed_q": n,
        "part_a": n,
        "residuals": n,
        "ridge_basis": n,
        "ridge_rhs": n,
        "ridge_fit": n,
        "ridge_heldout": n,
        "part_b": n,
    }
    # a new rho: dW from the cached basis and B (and its held-out diagnostic)
    heal = {"ridge_fit": n, "ridge_heldout": n, "part_b": n}
    # a new target dY: B once more (one pass over Z'), then the same
    alpha = {"part_a": n, "residuals": n, "ridge_rhs": n}
    # a knob of one tensor group re-quantizes that group only
    requant = {"quantize": n, "routed_q": n, **alpha, **heal}
    steps = [
        (Knobs(), {}),  # same knobs: everything from the cache
        (Knobs(eta=0.3), {"part_b": n}),  # eta re-uses the quantized experts, y_q and dW
        (Knobs(rho=2.0, eta=0.3), heal),  # rho: two matrix products, no new factorization
        (Knobs(rho=2.0, eta=0.15), {"part_b": n}),
        (Knobs(gamma=0.5), {**alpha, **heal}),
        (Knobs(gain_d=0.1), requant),
        (Knobs(importance="act"), requant),
        (Knobs(alpha="none", gamma=0.1, ridge=False, rho=3.0), {"part_a": n}),  # no trace
        (Knobs(alpha="none", gamma=0.9, ridge=False, rho=5.0), {}),  # inert knobs share entries
    ]
    for knobs, want in steps:
        before = dict(cache.computed)
        build_student(model, knobs, CAL, cache, corpus=corpus)
        assert _delta(cache, before) == {s: want.get(s, 0) for s in STAGES}, knobs
    # gain_d never re-runs the teacher; neither does a knob set that needs no trace at all.
    assert cache.computed["calib_trace"] == 1
    before = dict(cache.computed)
    fresh = build_student(
        model,
        Knobs(alpha="gaussian", ridge=False),
        CAL,
        StageCache(tmp_path / "other"),
        corpus=corpus,
    )
    assert fresh.report["calibration"] is None and cache.computed == before


def test_a_trial_reads_the_trace_only_when_a_stage_computes(setup, tmp_path, monkeypatch):
    """The layer's trace (hundreds of MB at real size) is read only by a stage that computes:
    an eta-only trial reads none of it, a rho-only trial every layer's once."""
    from healsweep.heal.trace import Trace

    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    build_student(model, Knobs(), CAL, cache, corpus=corpus)
    reads: list[int] = []
    original = Trace.layer
    monkeypatch.setattr(Trace, "layer", lambda self, i: reads.append(i) or original(self, i))
    eta_only = build_student(model, Knobs(eta=0.3), CAL, cache, corpus=corpus)
    assert reads == []
    rho_only = build_student(model, Knobs(rho=2.0, eta=0.3), CAL, cache, corpus=corpus)
    assert reads == list(range(model.hparams.n_layer))
    for a, b in zip(eta_only.report["layers"], rho_only.report["layers"], strict=True):
        assert a["residual"] == b["residual"] and a["alpha"] == b["alpha"]


def test_act_importance_keys_quantization_by_the_trace(setup, tmp_path):
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    build_student(model, Knobs(importance="act"), CAL, cache, corpus=corpus)
    before = dict(cache.computed)
    other_cal = CalibrationConfig(
        chunk_length=64, min_tokens_per_expert=4, exclude_doc_ids=("cal-3",)
    )
    build_student(model, Knobs(importance="act"), other_cal, cache, corpus=corpus)
    assert _delta(cache, before)["quantize"] == model.hparams.n_layer
    build_student(model, Knobs(), CAL, cache, corpus=corpus)
    before = dict(cache.computed)
    build_student(model, Knobs(), other_cal, cache, corpus=corpus)  # norm proxy: not trace-keyed
    assert _delta(cache, before)["quantize"] == 0
    assert _delta(cache, before)["routed_q"] == model.hparams.n_layer  # new inputs, same experts
    assert layer_keys(model, Knobs(), "trace-a", 0) == layer_keys(model, Knobs(), "trace-b", 0)
    act_a = layer_keys(model, Knobs(importance="act"), "trace-a", 0)
    act_b = layer_keys(model, Knobs(importance="act"), "trace-b", 0)
    assert act_a["gu"] != act_b["gu"] and act_a["d"] == act_b["d"]  # act reads gate/up's


def test_ridge_bases_built_ahead_on_a_thread_give_the_same_student(setup, tmp_path, monkeypatch):
    """On an accelerator the next layer's ridge basis is built on a host thread while the device
    heals the layer before it; forced on here (the CPU backend leaves it off), the student and
    every stage entry are those of the serial build, and each basis is computed once."""
    import numpy as np

    from healsweep.heal.pipeline import BASIS_AHEAD_ENV

    model, corpus = setup
    built = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(BASIS_AHEAD_ENV, mode)
        cache = StageCache(tmp_path / mode)
        built[mode] = build_student(model, Knobs(), CAL, cache, corpus=corpus)
        assert cache.computed["ridge_basis"] == model.hparams.n_layer
    assert built["on"].key == built["off"].key
    for i, layer in built["off"].replacements.items():
        other = built["on"].replacements[i]
        assert np.array_equal(np.asarray(layer.down_shexp), np.asarray(other.down_shexp))
    off = sorted(p.stem for p in (tmp_path / "off" / "ridge_basis").rglob("*.hsc"))
    on = sorted(p.stem for p in (tmp_path / "on" / "ridge_basis").rglob("*.hsc"))
    assert off == on and len(on) == model.hparams.n_layer
    for key in on:  # the same arrays (the record also holds the eigh's seconds)
        a = StageCache(tmp_path / "off").get("ridge_basis", key)[0]
        b = StageCache(tmp_path / "on").get("ridge_basis", key)[0]
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_student_without_diagnostics_is_the_same_student(setup, tmp_path):
    """A sweep builds its students without Part B's held-out diagnostic: nothing the student
    is made of reads it, so the student and its key are those of a build with it."""
    import numpy as np

    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    lean = build_student(model, Knobs(), CAL, cache, corpus=corpus, diagnostics=False)
    assert cache.computed["ridge_heldout"] == 0 and cache.computed["part_b"] > 0
    assert all("heldout_change" not in r.get("ridge", {}) for r in lean.report["layers"])
    full = build_student(model, Knobs(), CAL, StageCache(tmp_path / "full"), corpus=corpus)
    assert full.key == lean.key
    assert all("heldout_change" in r["ridge"] for r in full.report["layers"])
    for i, layer in full.replacements.items():
        assert np.array_equal(np.asarray(layer.down_shexp), np.asarray(lean.replacements[i].down_shexp))
