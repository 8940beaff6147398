"""Every architecture's forward against llama.cpp's on a random file of it (slow tier).

llama.cpp (``llama-cpp-python``) reads the same GGUF with its own loader and runs its own graph
for the architecture, so agreement checks our reading of each graph: norms, RoPE kind, routing
variant, shared expert. Matrices are stored F32 so that neither side rounds weights; llama.cpp
still keeps its KV cache in F16, which is most of the remaining difference (about 3e-4 of the
largest logit). Each architecture also gets deliberate errors that must break the agreement.

A routing near-tie (two experts' selection scores within ~1e-4, which float32 summation order
decides) flips one expert at one token and misses by far there: deepseek2 with seed 41 has one
(margin 4e-5 at one of 300 token-layers), so its files use seed 42, whose smallest margin is 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.gguf_io import tokenizer_metadata_from_tokenizer
from healsweep.model import LayerReplacement, forward, open_model, write_model
from test_llama_reference import _llama_logits

pytestmark = pytest.mark.slow

TOLERANCE = 5e-3  # max |Δlogit| <= TOLERANCE * max |logit|
COMMON = dict(n_layer=2, n_embd=128, n_head=4, n_expert=8, n_expert_used=2, n_ff_exp=64,
              context_length=256, types="F32", seed=41)
SHAPES = {  # label → (architecture, its random file's shape)
    "olmoe": ("olmoe", dict(n_head_kv=4)),  # llama.cpp sizes olmoe's k norm [n_embd]: no GQA
    "llama": ("llama", dict(n_head_kv=2)),
    # a dense first layer, half the head dims rotated, 4 groups of 4 experts (2 allowed),
    # sigmoid top-4 with the selection bias, renormalized and scaled
    "glm4moe": ("glm4moe", dict(n_layer=3, n_head_kv=2, head_dim=64, n_rot=32, n_leading_dense=1,
                                n_expert=16, n_expert_used=4, n_expert_groups=4, n_group_used=2,
                                norm_topk_prob=True, expert_weights_scale=2.5)),
    # V3-like: q_lora, attn_kv_b, YaRN x40 (V2's mscale_all_dim 0.707), sigmoid + bias, groups
    "deepseek2": ("deepseek2", dict(n_layer=3, seed=42, n_expert=16, n_expert_used=4,
                                    n_expert_groups=4, n_group_used=2, expert_weights_scale=2.5,
                                    yarn_factor=40.0, yarn_orig_ctx=64, yarn_log_mul=0.0707)),
    # the split attn_k_b/attn_v_b layout without q_lora, softmax routing as in V2
    "deepseek2-split": ("deepseek2", dict(n_layer=3, seed=42, kv_b_split=True, q_lora_rank=0,
                                          gating="softmax", norm_topk_prob=False,
                                          n_expert_groups=4, n_group_used=2)),
}
# Deliberate errors: hparams a careless reading of the file would give, or a file rewritten so
# that our forward computes what the error computes.
DELIBERATE = {
    "olmoe": {"renormalized top-k": dict(norm_topk_prob=True)},  # as Mixtral does
    "llama": {"neox RoPE": dict(rope_kind="neox")},  # halves instead of consecutive pairs
    "glm4moe": {
        "no group mask": dict(n_expert_groups=0),
        "no selection bias": "drop exp_probs_b",
        "no shared expert": "drop shexp",
    },
    "deepseek2": {
        "rope split swapped": "swap rope split",
        "no YaRN": dict(yarn_factor=0.0),
        "no group mask": dict(n_expert_groups=0),
        "no shared expert": "drop shexp",
    },
    "deepseek2-split": {"rope split swapped": "swap rope split"},
}


def _relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=sorted(SHAPES))
def compared(request, random_gguf, tmp_path_factory):
    label = request.param
    arch, shape = SHAPES[label]
    model = open_model(random_gguf(arch, **{**COMMON, **shape}))
    tokens = np.random.default_rng(3).integers(0, model.hparams.n_vocab, 100).astype(np.int32)
    ref = _llama_logits(model.path, tokens, tmp_path_factory.mktemp(label))
    return label, model, tokens, ref


def test_logits_match_llama_cpp(compared):
    arch, model, tokens, ref = compared
    err = _relative_error(forward(model, [tokens]).logits[0], ref)
    print(f"{arch}: max |Δlogit| / max |logit| = {err:.2e}")
    assert np.abs(ref).max() > 1.0
    assert err <= TOLERANCE


def _rewritten(model, change, tmp_path):
    """Our forward on a copy of the file with ``change(name, values)`` applied to each tensor."""
    tensors = {n: change(n, model.tensor(n)) for n in model.tensor_names}
    types = {n: model.tensor_type(n) for n in model.tensor_names}
    path = write_model(tmp_path / "changed.gguf", model.arch, model.hparams, tensors, types,
                       tokenizer_metadata_from_tokenizer(model.tokenizer()))
    return open_model(path)


def _swap_rope_split(name, values, hp):
    """Each q head's and the kv_a output's rope dims moved from the end to the front."""
    rope = hp.rope_dim
    if name.endswith(("attn_q.weight", "attn_q_b.weight")):
        heads = values.reshape(hp.n_head, hp.head_dim, -1)
        return np.concatenate([heads[:, -rope:], heads[:, :-rope]], axis=1).reshape(values.shape)
    if name.endswith("attn_kv_a_mqa.weight"):  # [kv | rope] rows → [rope | kv]
        return np.concatenate([values[-rope:], values[:-rope]], axis=0)
    return values


def _wrong_forward(model, tokens, error, tmp_path):
    """Our forward with one deliberate error (hparams changed, or a tensor zeroed)."""
    if isinstance(error, dict):
        return forward(model.with_hparams(**error), [tokens]).logits[0]
    if error == "drop shexp":  # the shared expert's output zeroed through the student hook
        zero = {i: LayerReplacement(down_shexp=np.zeros(
            model.tensor_shape(f"blk.{i}.ffn_down_shexp.weight"), np.float32))
            for i in model.hparams.moe_layers}
        return forward(model, [tokens], replacements=zero).logits[0]
    if error == "drop exp_probs_b":  # every selection bias zeroed: what ignoring it computes
        changed = _rewritten(model, lambda n, v: 0 * v if n.endswith("exp_probs_b.bias") else v,
                             tmp_path)
    else:  # reading rope dims from the front of each head instead of the end
        changed = _rewritten(model, lambda n, v: _swap_rope_split(n, v, model.hparams), tmp_path)
    return forward(changed, [tokens]).logits[0]


def test_a_deliberate_error_breaks_the_comparison(compared, tmp_path):
    arch, model, tokens, ref = compared
    for name, error in DELIBERATE[arch].items():
        err = _relative_error(_wrong_forward(model, tokens, error, tmp_path), ref)
        print(f"{arch} with {name}: {err:.2e}")
        assert err > 5 * TOLERANCE, name
