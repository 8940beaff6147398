"""Every tensor group besides the routed experts in the type of its knob (issue 39, whole-file
budgets): which matrices each group holds on every architecture, the type each gets, the file
size that follows, and the input moments their importance rows come from, checked against
float64 numpy references (the captures of the forward, the embeddings, the output matrix).

Requantizing needs ggml's quantizer: those tests sit in the slow tier (``[bench]`` extra).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.errors import KnobError
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.size import ModelShapes
from healsweep.heal.tensor_types import (
    GroupTensor,
    group_tensors,
    importance_site,
    planned_types,
)
from healsweep.kernels.ggml_types import fitting_type, tensor_type
from healsweep.model import forward, open_model
from healsweep.model.moments import input_moments
from healsweep.model.synthetic import write_random_model

ROOT = Path(__file__).resolve().parents[1]
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
ARCHS = {
    "qwen2moe": dict(n_ff_shexp=64),
    "olmoe": dict(n_head_kv=4),
    "glm4moe": dict(n_layer=3, head_dim=32, n_rot=16, n_leading_dense=1),
    "deepseek2": dict(n_layer=3),
    "deepseek2-split": dict(n_layer=3, kv_b_split=True, q_lora_rank=0),
}


def _random(tmp_path, label: str, **extra):
    arch = label.split("-")[0]
    return open_model(write_random_model(tmp_path / f"{label}.gguf", arch,
                                         **{**ARCHS[label], **extra}))  # fmt: skip


@pytest.mark.parametrize("label", list(ARCHS))
def test_every_matrix_is_in_one_group_or_is_routed_or_the_router(tmp_path, label):
    model = _random(tmp_path, label)
    hp = model.hparams
    grouped = {t.name: t.group for t in group_tensors(model)}
    for name in model.tensor_names:
        shape = model.tensor_shape(name)
        if len(shape) < 2:
            assert name not in grouped  # norms, biases, the shared expert's gate vector
            continue
        if "_exps." in name or ".ffn_gate_inp." in name:
            assert name not in grouped, name  # routed experts and the router
            continue
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        suffix = name.split(".", 2)[2] if layer is not None else name
        want = {"token_embd.weight": "embd", "output.weight": "output"}.get(name)
        if want is None and suffix.startswith("attn_"):
            want = "attn"
        elif want is None and "_shexp." in suffix:
            want = "shexp"
        elif want is None and layer is not None and layer < hp.n_leading_dense:
            want = "dense"
        assert grouped.get(name) == want, name
    assert {g for g in grouped.values()} >= {"attn", "embd", "output"}
    if hp.n_leading_dense:
        assert "dense" in grouped.values()
    if label.startswith("deepseek2"):
        mla = {name.split(".", 2)[2] for name, g in grouped.items() if g == "attn"}
        assert "attn_kv_a_mqa.weight" in mla and "attn_output.weight" in mla
        assert ("attn_k_b.weight" in mla) == (label == "deepseek2-split")


def test_a_type_that_does_not_fill_a_row_falls_back_to_the_smallest_of_its_bits_that_does():
    assert fitting_type("iq2_xxs", 512).name == "iq2_xxs"
    assert fitting_type("iq2_xxs", 128).name == "q2_0"  # blocks of 64, 2.25 bits
    assert fitting_type("q4_k", 96).name == "iq4_nl"  # 4.5 bits in blocks of 32
    assert fitting_type("q6_k", 160).name == "q8_0"
    with pytest.raises(KnobError, match="rows of 100"):
        fitting_type("q4_k", 100)
    tensors = (
        GroupTensor("blk.0.attn_q.weight", "attn", (64, 128), 1, 64 * 128 * 2),
        GroupTensor("blk.0.attn_output.weight", "attn", (128, 256), 12, 128 * 144),  # Q4_K
        GroupTensor("token_embd.weight", "embd", (100, 256), 1, 100 * 512),
    )
    planned = planned_types(tensors, Knobs(type_attn="q4_k"))
    assert {n: t.name for n, t in planned.items()} == {"blk.0.attn_q.weight": "iq4_nl"}
    assert planned_types(tensors, Knobs()) == {}
    both = planned_types(tensors, Knobs(type_attn="iq1_s", type_embd="q8_0"))
    assert {n: t.name for n, t in both.items()} == {
        "blk.0.attn_q.weight": "q2_0", "blk.0.attn_output.weight": "iq1_s",
        "token_embd.weight": "q8_0",
    }  # fmt: skip


def test_file_bytes_count_every_retyped_tensor_in_exact_arithmetic():
    others = (
        GroupTensor("token_embd.weight", "embd", (1000, 256), 1, 1000 * 256 * 2),
        GroupTensor("output.weight", "output", (1000, 256), 1, 1000 * 256 * 2),
        GroupTensor("blk.0.attn_v.weight", "attn", (128, 256), 1, 128 * 256 * 2),
        GroupTensor("blk.0.ffn_down_shexp.weight", "shexp", (256, 512), 8, 256 * 16 * 34),
    )
    shapes = ModelShapes((), 10_000_000, 32, (0,), 1, others)
    assert shapes.size(Knobs()).file_bytes == 10_000_000
    knobs = Knobs(type_embd="q6_k", type_output="iq2_xs", type_attn="q4_k", type_shexp="q8_0")
    # q6_k: 210 bytes a 256-weight row; iq2_xs 74; q4_k 144; the shared down is Q8_0 already;
    # every tensor's data padded to the file's alignment of 32

    def padded(n: int) -> int:
        return -(-n // 32) * 32

    want = 10_000_000 + padded(1000 * 210) + padded(1000 * 74) + padded(128 * 144)
    want -= 2 * 1000 * 512 + 128 * 512
    assert shapes.size(knobs).file_bytes == want
    assert shapes.size(knobs).routed_bpw != shapes.size(knobs).routed_bpw  # no routed: NaN
    for name in ("q6_k", "iq2_xs", "q4_k"):
        assert tensor_type(name).row_bytes(256) == {"q6_k": 210, "iq2_xs": 74, "q4_k": 144}[name]


def test_the_unsloth_style_knob_file_is_its_recipe_and_sizes_as_the_whole_file(tmp_path):
    """configs/knobs/unsloth-style-iq2_xxs.yaml: the allocation issue 39 states (attention Q4_K,
    shared expert, embeddings and output Q6_K, routed IQ2_XXS, the first layer's down IQ3_XXS),
    unhealed; its file is the teacher's with each group's tensors in those types, byte counts
    from the block geometry alone (rows of 256: every type fills them)."""
    import yaml

    from healsweep.heal.knobs import LayerTypes

    path = ROOT / "configs" / "knobs" / "unsloth-style-iq2_xxs.yaml"
    text = path.read_text()
    assert "Unsloth" in text and "DeepSeek-R1" in text  # it says where the recipe comes from
    knobs = Knobs(**yaml.safe_load(text))
    assert knobs.file_types() == {"attn": "q4_k", "shexp": "q6_k", "embd": "q6_k",
                                  "output": "q6_k", "dense": "q4_k"}  # fmt: skip
    assert (knobs.quantizer, knobs.alpha, knobs.ridge) == ("search", "none", False)
    model = open_model(write_random_model(
        tmp_path / "m.gguf", n_layer=4, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4,
        n_expert_used=2, n_head=4, n_head_kv=2))  # fmt: skip
    hp = model.hparams
    assert knobs.expert_types(hp.moe_layers, hp.n_layer) == {
        0: LayerTypes("iq2_xxs", "iq3_xxs"), **{i: LayerTypes("iq2_xxs", "iq2_xxs")
                                                for i in (1, 2, 3)}}  # fmt: skip
    shapes = ModelShapes.of(model)
    want = shapes.size(Knobs(type_gu="iq2_xxs", type_d="iq2_xxs", layer_types="0:iq2_xxs/iq3_xxs"))
    want = want.file_bytes
    per_row = {"q4_k": 144, "q6_k": 210}  # bytes of a 256-weight row
    for name in model.tensor_names:
        group = {t.name: t.group for t in shapes.others}.get(name)
        if group is None:
            continue
        rows = int(np.prod(model.tensor_shape(name)[:-1]))
        new = rows * per_row["q4_k" if group in ("attn", "dense") else "q6_k"]
        want += -(-new // 32) * 32 - -(-model.tensor_nbytes(name) // 32) * 32
    assert shapes.size(knobs).file_bytes == want


def test_a_files_bytes_are_counted_as_a_configs_without_its_metadata(tmp_path):
    """ModelShapes.file_bytes_of: the teacher's file with the other file's tensors in place (what
    the sweep records for an external file): two files of the same metadata written with other
    storage types differ by exactly that; a file of another model counts its size on disk."""
    kw = dict(n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4, n_expert_used=2,
              n_head=4, n_head_kv=2, seed=5)  # fmt: skip
    teacher = open_model(write_random_model(tmp_path / "t.gguf", **kw))
    other = open_model(write_random_model(
        tmp_path / "o.gguf", types={"ffn_down_shexp.weight": "Q8_0", "attn_q.weight": "Q8_0"},
        **kw))  # fmt: skip
    assert any(teacher.tensor_type(n) != other.tensor_type(n) for n in teacher.tensor_names)
    shapes = ModelShapes.of(teacher)
    assert shapes.file_bytes_of(teacher, other) == other.path.stat().st_size
    assert shapes.file_bytes_of(teacher, teacher) == teacher.path.stat().st_size
    small = open_model(write_random_model(tmp_path / "s.gguf", n_layer=1))
    assert shapes.file_bytes_of(teacher, small) == small.path.stat().st_size


def test_each_matrix_reads_the_importance_of_its_input():
    assert importance_site("blk.3.attn_q.weight") == "attn_in.3"
    assert importance_site("blk.3.attn_kv_a_mqa.weight") == "attn_in.3"
    assert importance_site("blk.3.attn_output.weight") == "attn_output.weight.3"
    assert importance_site("blk.3.attn_kv_b.weight") == "attn_kv_b.weight.3"
    assert importance_site("blk.3.attn_k_b.weight") is None
    assert importance_site("blk.1.ffn_up_shexp.weight") == "ffn_in.1"
    assert importance_site("blk.1.ffn_down_shexp.weight") == "shexp_hidden.1"
    assert importance_site("blk.0.ffn_gate.weight") == "ffn_in.0"
    assert importance_site("blk.0.ffn_down.weight") == "dense_hidden.0"
    assert importance_site("output.weight") == "output_in"
    assert importance_site("token_embd.weight") is None


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def test_input_moments_are_the_forwards_inputs_over_real_tokens_only(tmp_path):
    """float64 references: the embedding rows through the first attention norm (``attn_in.0``),
    the forward's captured FFN inputs (``ffn_in``) and, from them and the teacher's weights, the
    shared expert's hidden (``shexp_hidden``); the output norm's output recovered from the
    logits by least squares through the output matrix (``output_in``). A batch's padding adds
    nothing: two sequences apart sum to the two together."""
    model = _random(tmp_path, "qwen2moe", n_embd=64, n_ff_shexp=96)
    hp = model.hparams
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, hp.n_vocab, n).astype(np.int32) for n in (37, 70)]
    found, tokens = input_moments(model, seqs)
    assert tokens == 107
    apart = [input_moments(model, [s])[0] for s in seqs]
    for site, value in found.items():
        np.testing.assert_allclose(value, apart[0][site] + apart[1][site], rtol=2e-5, err_msg=site)
    emb = model.tensor("token_embd.weight").astype(np.float64)
    x0 = _rms(np.concatenate([emb[s] for s in seqs]),
              model.tensor("blk.0.attn_norm.weight").astype(np.float64), hp.rms_norm_eps)
    np.testing.assert_allclose(found["attn_in.0"], (x0**2).sum(0), rtol=1e-5)
    result = forward(model, seqs, capture=True)
    for layer, cap in enumerate(result.captures):
        x = cap.ffn_input.astype(np.float64)
        np.testing.assert_allclose(found[f"ffn_in.{layer}"], (x**2).sum(0), rtol=1e-4)
        gate = model.tensor(f"blk.{layer}.ffn_gate_shexp.weight").astype(np.float64)
        up = model.tensor(f"blk.{layer}.ffn_up_shexp.weight").astype(np.float64)
        g = x @ gate.T
        hidden = g / (1 + np.exp(-g)) * (x @ up.T)
        np.testing.assert_allclose(found[f"shexp_hidden.{layer}"], (hidden**2).sum(0),
                                   rtol=1e-3)  # fmt: skip
        assert found[f"attn_output.weight.{layer}"].shape == (hp.n_head * hp.head_dim,)
    w_out = model.tensor("output.weight").astype(np.float64)  # [V, D], V > D: full column rank
    logits = np.concatenate(result.logits).astype(np.float64)
    x_out = np.linalg.lstsq(w_out, logits.T, rcond=None)[0].T  # [T, D]
    np.testing.assert_allclose(found["output_in"], (x_out**2).sum(0), rtol=2e-3)


def test_dense_layers_and_mla_latents_have_their_moments(tmp_path):
    model = _random(tmp_path, "deepseek2")
    hp = model.hparams
    seqs = [np.arange(1, 40, dtype=np.int32)]
    found, _ = input_moments(model, seqs)
    assert found["dense_hidden.0"].shape == (hp.n_ff,) and found["dense_hidden.0"].sum() > 0
    assert found["ffn_in.0"].shape == (hp.n_embd,)
    assert found["attn_q_b.weight.1"].shape == (hp.q_lora_rank,)
    assert found["attn_kv_b.weight.1"].shape == (hp.kv_lora_rank,)
    for tensor in group_tensors(model):
        site = importance_site(tensor.name)
        if site is not None:
            assert found[site].shape == (tensor.shape[-1],), tensor.name


def test_the_group_knobs_at_teacher_change_no_student_key_and_off_it_name_the_student():
    from healsweep.heal.reads import stage_reads, student_key

    base = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs")
    assert base.file_types() == {}
    teacher = base.replace(type_attn="teacher", type_embd="teacher")
    assert student_key(teacher) == student_key(base)
    retyped = base.replace(type_attn="q4_k")
    assert student_key(retyped) != student_key(base)
    assert stage_reads(retyped, "quantize")["type_attn"] == "q4_k"
    assert retyped.file_types() == {"attn": "q4_k"}
    with pytest.raises(KnobError, match="type_embd"):
        Knobs(type_embd="f32")


@pytest.mark.slow
def test_a_student_of_retyped_groups_runs_as_its_export_and_requantizes_with_the_rows(tmp_path):
    """Each retyped tensor is ggml's quantizer on the teacher's values with the importance row of
    its input (the input moments over the calibration); Part B stores the healed shared down in
    ``type_shexp``; the exported file holds those bytes and is the student."""
    from _heal_fixtures import _corpus_file
    from healsweep.data.corpus import load_corpus
    from healsweep.gguf_io._ggml_lib import quantize_rows
    from healsweep.heal.export import write_healed_gguf
    from healsweep.heal.pipeline import build_student
    from healsweep.heal.tensor_importance import input_importance

    model = open_model(write_random_model(
        tmp_path / "m.gguf", n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4,
        n_expert_used=2, n_head=4, n_head_kv=2, types={"ffn_down_shexp.weight": "Q8_0"}))  # fmt: skip
    corpus = load_corpus(_corpus_file(tmp_path / "corpus.jsonl"))
    cache = StageCache(tmp_path / "c")
    knobs = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs", alpha="mse", type_attn="q4_k",
                  type_shexp="iq3_xxs", type_embd="q2_k", type_output="q6_k")  # fmt: skip
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    _, moments = input_importance(model, CAL, cache, corpus)
    name = "blk.1.attn_output.weight"
    row = moments.sums["attn_output.weight.1"] / moments.tokens
    want = quantize_rows(model.tensor(name), tensor_type("q4_k").ggml_id, row.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(student.replacements[1].tensors[
        "attn_output.weight"].raw), want)  # fmt: skip
    out = open_model(write_healed_gguf(student, tmp_path / "s.gguf"))
    kinds = {n: out.tensor_type(n).name for n in out.tensor_names}
    assert kinds["token_embd.weight"] == "Q2_K" and kinds["output.weight"] == "Q6_K"
    assert kinds["blk.0.attn_q.weight"] == "Q4_K"
    assert kinds["blk.0.ffn_down_shexp.weight"] == "IQ3_XXS"  # Part B's, in type_shexp
    assert kinds["blk.0.ffn_gate_inp.weight"] == model.tensor_type("blk.0.ffn_gate_inp.weight").name
    tokens = [np.random.default_rng(0).integers(0, model.hparams.n_vocab, 50).astype(np.int32)]
    ours = forward(model, tokens, replacements=student.replacements).logits[0]
    np.testing.assert_array_equal(forward(out, tokens).logits[0], ours)
    assert student.report["tensor_types"] == {"q2_k": 1, "q6_k": 1, "q4_k": 8, "iq3_xxs": 6}


@pytest.mark.slow
def test_llama_cpps_all_tensor_file_is_an_unhealed_uniform_student(tmp_path):
    """``baseline llama --all-tensors`` and an unhealed student whose every type knob names the
    same type write the same tensors, byte for byte; ``config_size`` predicts the file."""
    from _heal_fixtures import _corpus_file
    from healsweep.data.corpus import load_corpus
    from healsweep.heal.export import write_healed_gguf
    from healsweep.heal.llama_baseline import write_llama_baseline
    from healsweep.heal.pipeline import build_student
    from healsweep.heal.size import config_size

    model = open_model(write_random_model(
        tmp_path / "m.gguf", n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4,
        n_expert_used=2, n_head=4, n_head_kv=2))  # fmt: skip
    path = _corpus_file(tmp_path / "corpus.jsonl")
    corpus = load_corpus(path)
    cal = CalibrationConfig(**{**CAL.model_dump(), "corpus": str(path)})  # loaded by name
    cache = StageCache(tmp_path / "c")
    base = write_llama_baseline(model, "iq2_xxs", tmp_path / "all.gguf", calibration=cal,
                                cache=cache, all_tensors=True)  # fmt: skip
    uniform = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs", quantizer="search", alpha="none",
                    ridge=False, **dict.fromkeys(Knobs.FILE_TYPES, "iq2_xxs"))  # fmt: skip
    student = build_student(model, uniform, cal, cache, corpus=corpus)
    ours = open_model(write_healed_gguf(student, tmp_path / "ours.gguf"))
    theirs = open_model(base)
    assert ours.tensor_names == theirs.tensor_names
    for name in theirs.tensor_names:
        a, b = ours.raw_tensor(name)[1], theirs.raw_tensor(name)[1]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert theirs.tensor_type("blk.0.attn_q.weight").name == "IQ2_XXS"
    assert theirs.tensor_type("token_embd.weight").name == "IQ2_XXS"
    predicted = config_size(model, uniform).file_bytes
    assert 0 < base.stat().st_size - predicted < 2048  # the baseline's own metadata
    shapes = ModelShapes.of(model)  # a file counted as a config is, without its metadata
    assert shapes.file_bytes_of(model, theirs) == predicted == shapes.file_bytes_of(model, ours)
