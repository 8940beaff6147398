"""Healing on the added architectures: glm4moe and deepseek2 with a leading dense layer and an
ungated shared expert (Part B with gate 1), and an olmoe without a shared expert (Part B skipped,
one notice)."""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import _corpus_file
from healsweep.cache import StageCache
from healsweep.data.corpus import load_corpus
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.model import forward, open_model
from healsweep.model.synthetic import write_random_model

CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return load_corpus(_corpus_file(tmp_path_factory.mktemp("corpus") / "corpus.jsonl"))


def _heal(model, corpus, tmp_path):
    said = []
    student = build_student(model, Knobs(), CAL, StageCache(tmp_path / "cache"), corpus=corpus,
                            progress=lambda stage, line: said.append((stage, line)))
    return student, said


SHARED_EXPERT_MODELS = {
    "glm4moe": dict(n_expert_groups=4, n_group_used=2, norm_topk_prob=True,
                    expert_weights_scale=2.0),
    "deepseek2": dict(kv_b_split=True, n_expert_groups=4, n_group_used=2, yarn_factor=40.0,
                      yarn_orig_ctx=64, yarn_log_mul=0.1),
}


@pytest.mark.parametrize("arch", sorted(SHARED_EXPERT_MODELS))
def test_moe_layers_heal_with_part_b_on_the_ungated_shared_expert(corpus, tmp_path, arch):
    model = open_model(write_random_model(
        tmp_path / f"{arch}.gguf", arch, n_layer=3, n_ff_exp=64, n_leading_dense=1,
        **SHARED_EXPERT_MODELS[arch],
    ))
    student, said = _heal(model, corpus, tmp_path)
    assert sorted(student.replacements) == [1, 2]  # layer 0 is dense: nothing to heal
    assert ("layers", "layers 0..0 skipped: dense FFN, no routed experts to quantize or heal "
            "(they stay as in the teacher)") in said
    assert student.report["executed"]["part_b"] == 2 and len(student.alphas) == 2
    for i in (1, 2):
        healed = np.asarray(student.replacements[i].down_shexp)
        assert not np.allclose(healed, model.tensor(f"blk.{i}.ffn_down_shexp.weight"))
        assert student.report["layers"][i - 1]["ridge"]["realized_in_sample_change"] < 0
    tokens = [np.arange(3, 60, dtype=np.int32)]
    teacher = forward(model, tokens, capture=True)
    assert len(teacher.captures) == 2 and teacher.router[0].shape == (57, 2, 2)
    np.testing.assert_array_equal(teacher.captures[0].shexp_gate, 1.0)  # ungated: gate 1
    logits = forward(model, tokens, replacements=student.replacements).logits[0]
    assert np.isfinite(logits).all() and not np.allclose(logits, teacher.logits[0])


def test_olmoe_skips_part_b_with_one_line(corpus, tmp_path):
    model = open_model(write_random_model(tmp_path / "olmoe.gguf", "olmoe", n_head_kv=4,
                                          n_ff_exp=64))
    student, said = _heal(model, corpus, tmp_path)
    notices = [line for stage, line in said if stage == "part_b"]
    assert len(notices) == 1 and notices[0].startswith("Part B skipped: olmoe has no shared")
    assert "part_b" not in student.report["executed"]
    assert student.report["executed"]["part_a"] == model.hparams.n_layer
    assert all(r.down_shexp is None for r in student.replacements.values())
