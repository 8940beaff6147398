"""Healing on top of every routed-expert type: one cached stage per (layer, group, type), alpha
folded into the type's fp16 scales, mixed-type export, and llama.cpp's baseline reproduced.

The ggml types need ggml's quantizer (llama-cpp-python), so most of this is the slow tier; the
refusals before any teacher pass run everywhere. References: ggml's quantizer and gguf-py's
dequantizer (independent of healsweep's decoders), ``healsweep baseline llama`` (the same
quantizer through another code path, byte for byte), and float64 products.
"""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import _corpus_file, heal_setup
from healsweep.cache import StageCache
from healsweep.data.corpus import load_corpus
from healsweep.errors import GGUFFormatError, KnobError
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.kernels.ggml_types import ROUTED_TYPES, ggml_type
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model

CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
GGML_TYPES = [t.name for t in ROUTED_TYPES if t.name != "q2_0"]
setup = heal_setup  # rows of 64: Q2_0 and IQ4_NL fit, the 256-blocks do not


def test_a_type_whose_blocks_do_not_fill_the_rows_is_refused_before_the_trace(setup, tmp_path):
    model, corpus = setup  # n_embd 64, n_ff_exp 64
    cache = StageCache(tmp_path / "cache")
    with pytest.raises(GGUFFormatError) as info:
        build_student(model, Knobs(type_d="iq2_xs"), CAL, cache, corpus=corpus)
    assert str(info.value) == (
        f"{model.path}: the rows of ffn_down_exps hold 64 values, not a multiple of the "
        "IQ2_XS block of 256; they cannot be stored as iq2_xs. The types that fit this model, "
        "smallest first: q2_0 (2.25 bits), iq4_nl (4.5 bits); these knobs fit the packaged model "
        "demo-medium-cpu (rows of 256): run them there (`healsweep heal demo-medium-cpu --knobs "
        "K.yaml --out OUT.gguf`)"
    )
    with pytest.raises(GGUFFormatError, match=r"rows of blk\.1\.ffn_gate_exps/ffn_up_exps .*Q4_K"):
        build_student(model, Knobs(layer_types="-1:q4_k/q2_0"), CAL, cache, corpus=corpus)
    with pytest.raises(KnobError, match="layer 2 is not a MoE layer"):
        build_student(model, Knobs(layer_types="2:iq4_nl"), CAL, cache, corpus=corpus)
    assert sum(cache.computed.values()) == 0  # nothing ran, the teacher was never traced


# --- the slow tier: ggml's quantizer ----------------------------------------------------------

SHAPE = dict(n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=8, n_expert_used=2,
             types={"ffn_down_shexp.weight": "Q8_0"})  # fmt: skip


@pytest.fixture(scope="module")
def rows256(tmp_path_factory):
    """A random qwen2moe whose expert rows fill blocks of 256, its corpus and a stage cache."""
    root = tmp_path_factory.mktemp("rows256")
    model = open_model(write_random_model(root / "m.gguf", **SHAPE))
    return model, load_corpus(_corpus_file(root / "corpus.jsonl")), StageCache(root / "cache")


def _delta(cache, before):
    return {k: v - before.get(k, 0) for k, v in cache.computed.items() if v != before.get(k, 0)}


@pytest.mark.slow
def test_a_type_only_trial_requantizes_that_group_only(rows256):
    from healsweep.kernels.ggml_decode import GGMLWeight

    model, corpus, cache = rows256
    n = model.hparams.n_layer
    knobs = Knobs(type_gu="iq2_xs", type_d="iq2_xs", alpha="mse")
    first = build_student(model, knobs, CAL, cache, corpus=corpus)
    for replacement in first.replacements.values():
        for w in (replacement.gate_exps, replacement.up_exps, replacement.down_exps):
            assert isinstance(w, GGMLWeight) and w.qtype == ggml_type("iq2_xs").ggml_id
    downstream = {"routed_q": n, "part_a": n, "residuals": n, "ridge_rhs": n, "ridge_fit": n,
                  "ridge_heldout": n, "part_b": n}  # fmt: skip
    before = dict(cache.computed)
    second = build_student(model, knobs.replace(type_d="q2_k"), CAL, cache, corpus=corpus)
    assert _delta(cache, before) == {"quantize": n, **downstream}  # down only; no trace, basis
    assert [r["types"] for r in second.report["layers"]] == [{"gu": "iq2_xs", "d": "q2_k"}] * n
    before = dict(cache.computed)
    third = build_student(
        model, knobs.replace(type_d="q2_k", layer_types="1:iq2_xs/iq3_xxs"), CAL, cache,
        corpus=corpus,
    )  # fmt: skip
    assert _delta(cache, before) == {"quantize": 1, **{k: 1 for k in downstream}}  # layer 1's
    assert third.replacements[0].down_exps.qtype == ggml_type("q2_k").ggml_id
    assert third.replacements[1].down_exps.qtype == ggml_type("iq3_xxs").ggml_id
    # the search's gain and the plain quantizer are not read by a group stored in a ggml type
    # (``gptq`` is: error feedback on the IQ2 grid, test_ggml_gptq): the same student, cached
    before = dict(cache.computed)
    again = build_student(model, knobs.replace(gain_gu=1.1, quantizer="plain"), CAL, cache,
                          corpus=corpus)  # fmt: skip
    assert _delta(cache, before) == {} and again.key == first.key


def _quantized_stack(name, rng, n_exp=3, n_out=8, n_in=512):
    """A random expert stack [E, out, in] in type ``name`` (Q2_0 by the codec, the others by
    ggml with a random importance row per expert) and its float32 weights."""
    from healsweep.kernels import q2_0
    from healsweep.kernels.ggml_decode import GGMLWeight
    from healsweep.quant.imatrix import quantize_expert_stack

    w = rng.standard_normal((n_exp, n_out, n_in)).astype(np.float32)
    if name == "q2_0":
        return q2_0.quantize_matrix(w, None, 0.3, packed=True)
    imp = rng.uniform(0.1, 2.0, (n_exp, n_in)).astype(np.float32)
    qtype = ggml_type(name).ggml_id
    return GGMLWeight(quantize_expert_stack(w, qtype, imp), qtype, n_in)


@pytest.mark.slow
@pytest.mark.parametrize("name", [t.name for t in ROUTED_TYPES])
def test_alpha_folded_into_scales_is_alpha_on_the_outputs_within_fp16_rounding(name):
    from healsweep.quant.registry import stored

    rng = np.random.default_rng(7)
    stack = _quantized_stack(name, rng)
    scaled = stored(name).fold_alpha  # every class of a type folds alpha alike
    w = np.asarray(stack.dequantize(), np.float64)  # [E, out, in]
    x = rng.standard_normal((16, w.shape[-1]))
    # one scale per block (or super-block): every weight moves by at most fp16's half ulp
    # (Q2_0 forms d * alpha in float32 first); two fp16 fields (Q2_K, Q4_K, Q5_K: d, dmin) bound
    # the error of the whole output instead
    single = name not in ("q2_k", "q4_k", "q5_k")  # ggml-common.h: only these carry a dmin
    eps = 2.0**-11 * (1 + 2.0**-12)
    for alpha in (0.8731, np.array([0.9, 1.07, 1.31], np.float32)):
        a = np.asarray(alpha, np.float64).reshape(-1, 1, 1)
        folded = np.asarray(scaled(stack, alpha).dequantize(), np.float64)
        assert not np.array_equal(folded, w)
        out = np.einsum("ti,eoi->eto", x, w) * a  # alpha applied to the outputs
        got = np.einsum("ti,eoi->eto", x, folded)  # alpha folded into the scales
        if single:
            assert np.all(np.abs(folded - a * w) <= eps * np.abs(a * w) + 1e-30)
            bound = eps * np.einsum("ti,eoi->eto", np.abs(x), np.abs(a * w))
            assert np.all(np.abs(got - out) <= bound * (1 + 1e-9))
        else:
            assert np.linalg.norm(got - out) <= 2.0**-10 * np.linalg.norm(out)


@pytest.mark.slow
def test_the_student_scores_the_down_experts_alpha_folded_as_exported(rows256, tmp_path):
    from healsweep.heal.export import write_healed_gguf
    from healsweep.heal.quantize import cached_experts, layer_keys
    from healsweep.quant.registry import stored

    model, corpus, cache = rows256
    knobs = Knobs(type_gu="iq2_xs", type_d="q3_k", alpha="mse")
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    path = write_healed_gguf(student, tmp_path / "s.gguf")
    written = open_model(path)
    for i, alpha in enumerate(student.alphas):
        assert alpha != 1.0
        raw = cached_experts(cache, layer_keys(model, knobs, student.report["trace_key"], i))
        down = student.replacements[i].down_exps
        folded = stored(ggml_type(down.qtype).name).fold_alpha(raw.down, alpha)
        np.testing.assert_array_equal(down.raw, folded.raw)
        np.testing.assert_array_equal(student.replacements[i].gate_exps.raw, raw.gate.raw)
        name = f"blk.{i}.ffn_down_exps.weight"
        np.testing.assert_array_equal(written.raw_rows(name), down.raw)  # what is scored


def _tensor_bytes(path):
    import gguf

    from healsweep.gguf_io import q2_0_type

    q2_0_type()
    reader = gguf.GGUFReader(path)
    return {t.name: (int(t.tensor_type), t.data.tobytes()) for t in reader.tensors}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["iq2_xxs", "q2_k"])
def test_an_unhealed_uniform_student_is_llama_cpps_baseline_byte_for_byte(rows256, tmp_path, name):
    from healsweep.heal.export import write_healed_gguf
    from healsweep.heal.llama_baseline import write_llama_baseline

    model, corpus, cache = rows256
    knobs = Knobs(type_gu=name, type_d=name, alpha="none", ridge=False)
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    ours = write_healed_gguf(student, tmp_path / "ours.gguf")
    cal = CAL.model_copy(update={"corpus": str(tmp_path / "c.jsonl")})
    _corpus_file(tmp_path / "c.jsonl")  # the same documents, read from a file by the baseline
    theirs = write_llama_baseline(model, name, tmp_path / "llama.gguf", calibration=cal,
                                  cache=cache)  # fmt: skip
    mine, baseline = _tensor_bytes(ours), _tensor_bytes(theirs)
    assert mine == baseline  # every tensor: the experts ggml quantized, the rest the teacher's
    assert sum(n.endswith("_exps.weight") for n in mine) == 3 * model.hparams.n_layer


@pytest.mark.slow
def test_every_type_round_trips_through_our_reader_against_gguf_py(rows256, tmp_path):
    import gguf
    from gguf.quants import dequantize

    from healsweep.heal.export import write_healed_gguf

    model, corpus, cache = rows256
    names = [t.name for t in ROUTED_TYPES]
    for start in range(0, len(names), 4):  # four types a file: two groups in each of 2 layers
        chosen = (names[start : start + 4] * 4)[:4]
        layer_types = f"0:{chosen[0]}/{chosen[1]},1:{chosen[2]}/{chosen[3]}"
        student = build_student(model, Knobs(layer_types=layer_types, alpha="mse"), CAL, cache,
                                corpus=corpus)  # fmt: skip
        path = write_healed_gguf(student, tmp_path / f"s{start}.gguf")
        written = open_model(path)
        assert written.metadata("healsweep.expert_types") == layer_types
        bits = [ggml_type(t).bits_per_weight for t in chosen]
        assert written.metadata("healsweep.routed_bpw") == pytest.approx(
            (2 * bits[0] + bits[1] + 2 * bits[2] + bits[3]) / 6
        )
        for layer, (gu, d) in enumerate((chosen[:2], chosen[2:])):
            for tensor, type_name in (("gate", gu), ("up", gu), ("down", d)):
                name = f"blk.{layer}.ffn_{tensor}_exps.weight"
                qtype = int(written.tensor_type(name))
                assert qtype == ggml_type(type_name).ggml_id
                ours = written.tensor(name)  # healsweep's reader and in-graph decoder
                stack = getattr(student.replacements[layer], f"{tensor}_exps")
                np.testing.assert_array_equal(ours, np.asarray(stack.dequantize()))
                if type_name != "q2_0":  # gguf-py does not know type 42
                    ref = dequantize(written.raw_rows(name), gguf.GGMLQuantizationType(qtype))
                    np.testing.assert_array_equal(ours, ref.reshape(ours.shape), err_msg=name)


@pytest.mark.slow
def test_gptq_on_the_k_grids_lowers_the_routed_error_and_is_keyed_by_its_knobs(rows256):
    model, corpus, cache = rows256
    n = model.hparams.n_layer
    plain = Knobs(type_gu="q2_k", type_d="q3_k", alpha="none", ridge=False)
    ggml = build_student(model, plain, CAL, cache, corpus=corpus)
    before = dict(cache.computed)
    refined = build_student(model, plain.replace(quantizer="gptq"), CAL, cache, corpus=corpus)
    assert _delta(cache, before)["quantize"] == 2 * n  # both groups: both types have a K grid
    for layer in refined.report["layers"]:
        assert set(layer["quantize"]["gptq_fallback"]) == {"gate", "up", "down"}
    error = {s: sum(r["residual_alpha_1"] for r in b.report["layers"])
             for s, b in (("ggml", ggml), ("gptq", refined))}  # fmt: skip
    print(f"routed residual at alpha 1, summed over layers: {error}")
    assert error["gptq"] < error["ggml"]
    for i in range(n):  # the same grid (scales), other codes
        a, b = ggml.replacements[i].down_exps.raw, refined.replacements[i].down_exps.raw
        np.testing.assert_array_equal(a.reshape(*a.shape[:-1], -1, 110)[..., 96:],
                                      b.reshape(*b.shape[:-1], -1, 110)[..., 96:])  # fmt: skip
        assert not np.array_equal(a, b)
    before = dict(cache.computed)
    build_student(model, plain.replace(quantizer="gptq", gptq_damp=0.1), CAL, cache, corpus=corpus)
    assert _delta(cache, before)["quantize"] == 2 * n
    # IQ2_S has no such grid: gptq is not read there (and the gptq q3_k down is cached)
    mixed = build_student(model, plain.replace(type_gu="iq2_s", quantizer="gptq"), CAL, cache,
                          corpus=corpus)  # fmt: skip
    before = dict(cache.computed)
    again = build_student(model, plain.replace(type_gu="iq2_s", quantizer="gptq", gain_gu=1.7),
                          CAL, cache, corpus=corpus)  # fmt: skip
    assert _delta(cache, before) == {} and again.key == mixed.key
    assert "gate" not in mixed.report["layers"][0]["quantize"]["gptq_fallback"]
    # IQ2_XXS has one (quant.ggml_gptq): gptq re-quantizes gate/up only, and lowers its error
    iq2 = plain.replace(type_gu="iq2_xxs")
    ggml_iq2 = build_student(model, iq2, CAL, cache, corpus=corpus)
    before = dict(cache.computed)
    fed = build_student(model, iq2.replace(quantizer="gptq"), CAL, cache, corpus=corpus)
    assert _delta(cache, before)["quantize"] == n  # the gptq q3_k down groups are cached
    assert "gate" in fed.report["layers"][0]["quantize"]["gptq_fallback"]
    error = {s: sum(r["residual_alpha_1"] for r in b.report["layers"])
             for s, b in (("ggml", ggml_iq2), ("gptq", fed))}  # fmt: skip
    print(f"iq2_xxs gate/up, routed residual at alpha 1: {error}")
    assert error["gptq"] < error["ggml"]


def gptq_against_ggml(rows256, type_gu: str, type_d: str) -> tuple:
    """``(plain knobs, ggml's student, gptq's student)`` of ``type_gu``/``type_d`` without
    healing, after the checks every ``quantizer: gptq`` class owes: both groups quantized again
    (2 per layer), every expert's fallback reported, and the routed residual at alpha 1, summed
    over layers, below ggml's own quantizer with the imatrix."""
    model, corpus, cache = rows256
    n = model.hparams.n_layer
    plain = Knobs(type_gu=type_gu, type_d=type_d, alpha="none", ridge=False)
    ggml = build_student(model, plain, CAL, cache, corpus=corpus)
    before = dict(cache.computed)
    fed = build_student(model, plain.replace(quantizer="gptq"), CAL, cache, corpus=corpus)
    assert _delta(cache, before)["quantize"] == 2 * n
    for layer in fed.report["layers"]:
        assert set(layer["quantize"]["gptq_fallback"]) == {"gate", "up", "down"}
    error = {s: sum(r["residual_alpha_1"] for r in b.report["layers"])
             for s, b in (("ggml", ggml), ("gptq", fed))}  # fmt: skip
    print(f"{type_gu} gate/up, {type_d} down, routed residual at alpha 1: {error}")
    assert error["gptq"] < error["ggml"]
    return plain, ggml, fed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["iq3_xxs", "iq3_s", "iq4_xs"])
def test_gptq_on_the_iq3_and_iq4_grids_lowers_the_routed_error_on_ggmls_scales(rows256, name):
    """Issue 49: column-wise error feedback on IQ3_XXS, IQ3_S and IQ4_XS (quant.ggml_iq3grid,
    quant.ggml_iq4grid) lowers the layers' routed residual against ggml's own quantizer with the
    imatrix, every expert fed, and keyed by the gptq knobs."""
    gptq_against_ggml(rows256, name, name)


@pytest.mark.slow
def test_bench_trial_ends_with_a_type_only_trial_that_requantizes_the_down_group_only(tmp_path):
    from healsweep.bench.trial import bench_trials, format_trials

    model = open_model(write_random_model(tmp_path / "m.gguf", **SHAPE))
    corpus = load_corpus(_corpus_file(tmp_path / "corpus.jsonl"))
    rows = bench_trials(model, corpus, StageCache(tmp_path / "cache"), CAL)
    n = model.hparams.n_layer
    last = rows[-1]
    assert last["trial"] == "type_d only (q2_0 -> iq2_xs)"  # the next type up whose blocks fit
    assert last["layers"] == n
    # only the down projections are quantized again, in the new type; the trace and the ridge
    # basis are read from the cache; everything downstream of the experts follows
    assert last["executed"] == {"part_a": n, "part_b": n, "quantize": n, "residuals": n,
                                "ridge_fit": n, "ridge_heldout": n, "ridge_rhs": n,
                                "routed_q": n}  # fmt: skip
    table = format_trials(rows).splitlines()
    assert table[0].split() == ["trial", "seconds", "per", "layer", "peak", "RSS", "peak", "owned"]
    assert table[len(rows)].startswith("type_d only")
    assert f"{last['seconds']:9.2f}  {last['seconds'] / n:9.2f}" in table[len(rows)]
