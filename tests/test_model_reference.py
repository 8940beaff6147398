"""Our JAX forward against Hugging Face transformers loading the same GGUF (``gguf_file=``).

transformers dequantizes the GGUF with gguf-py and runs its own PyTorch Qwen2-MoE / Qwen3-MoE
modules, so it is an independent implementation of the same file. It does not read the expert
FFN sizes from GGUF metadata (``expert_feed_forward_length``), so those two config fields are
passed explicitly; everything else comes from the file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # the [test] extra: CPU torch + transformers (+ accelerate for gguf_file=)

from healsweep.model import forward, open_model

MIXED_TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "F16",
    "attn_q.weight": "F32",
    "attn_k.weight": "Q8_0",
    "attn_output.weight": "Q4_0",
    "ffn_gate_exps.weight": "Q8_0",
    "ffn_up_exps.weight": "F16",
    "ffn_down_exps.weight": "Q8_0",
    "ffn_gate_inp.weight": "F32",
    "ffn_down_shexp.weight": "Q8_0",
}
SHAPES = {
    "qwen2moe": dict(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_expert=8, n_expert_used=2,
                     n_ff_exp=32, n_ff_shexp=64, rope_freq_base=10000.0),
    "qwen3moe": dict(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_expert=8,
                     n_expert_used=3, n_ff_exp=32, rope_freq_base=1e6),
}
TOLERANCE = 2e-3  # max |Δlogit| <= TOLERANCE * max |logit|


def _hf_model(path, hp):
    from transformers import AutoModelForCausalLM

    sizes = {"moe_intermediate_size": hp.n_ff_exp}
    if hp.arch == "qwen2moe":
        sizes["shared_expert_intermediate_size"] = hp.n_ff_shexp
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **sizes
    )
    return model.eval()


def _hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()


def _relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=["qwen2moe", "qwen3moe"])
def setup(request, random_gguf, tiny_tokenizer):
    arch = request.param
    path = random_gguf(arch, types=MIXED_TYPES, seed=11, **SHAPES[arch])
    model = open_model(path)
    text = ("<|im_start|>user\nRoute this sentence through the experts, please.<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nok\n</think>\n\n Done: 1 2 3.<|im_end|>")
    rng = np.random.default_rng(5)
    long_ids = np.concatenate([tiny_tokenizer.encode(text).ids,
                               rng.integers(0, model.hparams.n_vocab, 60)]).astype(np.int32)
    sequences = [long_ids, long_ids[:37][::-1].copy()]  # 100+ tokens (crosses a pad bucket), 37
    hf = _hf_model(path, model.hparams)
    return model, sequences, [_hf_logits(hf, s) for s in sequences]


def test_file_really_mixes_storage_types(setup):
    model, _, _ = setup
    kinds = {model.tensor_type(n).name for n in model.tensor_names}
    assert {"F32", "F16", "Q8_0", "Q4_0"} <= kinds


def test_batched_logits_match_transformers(setup):
    model, sequences, reference = setup
    result = forward(model, sequences)
    for ours, ref, seq in zip(result.logits, reference, sequences, strict=True):
        assert ours.shape == ref.shape == (len(seq), model.hparams.n_vocab)
        assert _relative_error(ours, ref) <= TOLERANCE
        assert np.abs(ref).max() > 1.0  # logits large enough that the bound means something


def test_logits_for_returns_exactly_the_requested_rows(setup):
    model, sequences, reference = setup
    wanted = [np.array([0, 63, 64, len(sequences[0]) - 1]), np.array([], np.int64)]
    result = forward(model, sequences, logits_for=wanted)
    assert result.logits[1].shape == (0, model.hparams.n_vocab)
    assert _relative_error(result.logits[0], reference[0][wanted[0]]) <= TOLERANCE


@pytest.mark.parametrize(
    "bug",
    ["flip_topk_normalization", "wrong_rope_base"],
)
def test_a_deliberate_error_breaks_the_comparison(setup, bug):
    """The comparison has teeth: each known-wrong variant of our forward misses by far."""
    model, sequences, reference = setup
    hp = model.hparams
    if bug == "flip_topk_normalization":  # qwen2moe renormalized / qwen3moe left as softmax
        wrong = model.with_hparams(norm_topk_prob=not hp.norm_topk_prob)
    else:
        wrong = model.with_hparams(rope_freq_base=hp.rope_freq_base * 0.01)
    logits = forward(wrong, sequences[:1]).logits[0]
    assert _relative_error(logits, reference[0]) > 5 * TOLERANCE
