"""A retyped config heals on its own trace (issue 49, item 3), through build_student.

Retyping a group needs ggml's quantizer (llama-cpp-python, the ``[bench]`` extra): slow tier, as
tests/test_tensor_types.py's requantizing tests. The stage itself, without ggml, is
tests/test_student_trace.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import _corpus_file
from healsweep.cache import StageCache
from healsweep.data.corpus import load_corpus
from healsweep.gguf_io import HEAD
from healsweep.heal import stages, student_trace
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.trace import budgeted, layer_key, make_chunks
from healsweep.kernels import alpha as alpha_kernels
from healsweep.model import LayerReplacement, forward, open_model
from healsweep.model.forward import LayerCapture
from healsweep.model.synthetic import write_random_model

pytestmark = pytest.mark.slow
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
KNOBS = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs", alpha="mse", ridge=False, type_attn="q4_k",
              type_embd="q2_k")  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stp")
    model = open_model(write_random_model(
        root / "m.gguf", n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4,
        n_expert_used=2, n_head=4, n_head_kv=2))  # fmt: skip
    corpus = load_corpus(_corpus_file(root / "corpus.jsonl"))
    cache = StageCache(root / "c")
    return model, corpus, cache, build_student(model, KNOBS, CAL, cache, corpus=corpus)


def _captures(model, corpus, replacements):
    chunks, _ = make_chunks(corpus.pool("calibration"), model.tokenizer(), budgeted(model, CAL))
    direct = [forward(model, [c.tokens], capture=True, replacements=replacements).captures
              for c in chunks]  # fmt: skip
    return [{f: np.concatenate([getattr(d[i], f) for d in direct]) for f in LayerCapture._fields}
            for i in range(model.hparams.n_layer)]  # fmt: skip


def test_part_a_fits_the_moe_inputs_the_retyped_layers_produce(setup):
    model, corpus, cache, student = setup
    key = student.report["student_trace_key"]
    retyped = {i: LayerReplacement(tensors=student.replacements[i].tensors)
               for i in (HEAD, *model.hparams.moe_layers)}  # fmt: skip
    assert len(retyped[0].tensors) == 4 and "token_embd.weight" in retyped[HEAD].tensors
    ours, theirs = _captures(model, corpus, retyped), _captures(model, corpus, {})
    for i in model.hparams.moe_layers:
        arrays = cache.get(student_trace.LAYER_STAGE, layer_key(key, i))[0]
        np.testing.assert_allclose(arrays["x"], ours[i]["ffn_input"], rtol=2**-11, atol=2e-5)
        np.testing.assert_array_equal(arrays["ids"], ours[i]["topk_ids"])
        # Part A's alpha is the MSE fit of the quantized experts on those inputs: the student's
        # experts (alpha folded into down) have alpha ~1 there, not on the teacher's inputs
        replacement = student.replacements[i]
        experts = stages.ExpertStacks(replacement.gate_exps, replacement.up_exps,
                                      replacement.down_exps)  # fmt: skip
        refit = {}
        for name, found in (("student", ours[i]), ("teacher", theirs[i])):
            inputs = {"x": found["ffn_input"], "ids": found["topk_ids"],
                      "weights": found["topk_weights"]}  # fmt: skip
            y_q = stages.routed_output(experts, inputs, model.hparams.n_expert)
            refit[name] = float(alpha_kernels.alpha_mse(found["routed_output"], y_q, KNOBS.gamma))
        assert abs(refit["student"] - 1.0) < 2e-3, refit
        assert abs(refit["teacher"] - 1.0) > abs(refit["student"] - 1.0), refit


def test_the_student_trace_is_keyed_by_the_retyped_groups_alone(setup):
    model, corpus, cache, student = setup
    key = student.report["student_trace_key"]
    routed = build_student(model, KNOBS.replace(type_gu="iq2_xs", gamma=0.5), CAL, cache,
                           corpus=corpus)  # fmt: skip
    assert routed.report["student_trace_key"] == key
    assert "student_trace" not in routed.report["executed"]  # shared, not traced again
    attn = build_student(model, KNOBS.replace(type_attn="q5_k"), CAL, cache, corpus=corpus)
    assert attn.report["student_trace_key"] != key
    assert attn.report["executed"]["student_trace"] == 1
    head = build_student(model, KNOBS.replace(type_attn="teacher", type_embd="teacher",
                                              type_output="q6_k"), CAL, cache, corpus=corpus)  # fmt: skip
    assert "student_trace_key" not in head.report  # the output is downstream of every MoE layer
    assert head.report["trace_key"] == student.report["trace_key"]
