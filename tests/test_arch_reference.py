"""Every architecture's forward against llama.cpp's on a random file of it (slow tier).

llama.cpp (``llama-cpp-python``) reads the same GGUF with its own loader and runs its own graph
for the architecture, so agreement checks our reading of each graph: norms, RoPE kind, routing
variant, shared expert. Matrices are stored F32 so that neither side rounds weights; llama.cpp
still keeps its KV cache in F16, which is most of the remaining difference (about 3e-4 of the
largest logit). Each architecture also gets one deliberate error that must break the agreement.
"""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.gguf_io import open_model, tokenizer_metadata_from_tokenizer, write_model
from healsweep.model import LayerReplacement, forward
from test_llama_reference import _llama_logits

pytestmark = pytest.mark.slow

TOLERANCE = 5e-3  # max |Δlogit| <= TOLERANCE * max |logit|
COMMON = dict(n_layer=2, n_embd=128, n_head=4, n_expert=8, n_expert_used=2, n_ff_exp=64,
              context_length=256, types="F32", seed=41)
SHAPES = {
    "olmoe": dict(n_head_kv=4),  # llama.cpp sizes olmoe's k norm [n_embd]: no GQA
    "llama": dict(n_head_kv=2),
    # a dense first layer, half the head dims rotated, 4 groups of 4 experts (2 allowed),
    # sigmoid top-4 with the selection bias, renormalized and scaled
    "glm4moe": dict(n_layer=3, n_head_kv=2, head_dim=64, n_rot=32, n_leading_dense=1,
                    n_expert=16, n_expert_used=4, n_expert_groups=4, n_group_used=2,
                    norm_topk_prob=True, expert_weights_scale=2.5),
}
# One deliberate error per architecture: hparams that a careless reading of the file would give.
DELIBERATE = {
    "olmoe": {"renormalized top-k": dict(norm_topk_prob=True)},  # as Mixtral does
    "llama": {"neox RoPE": dict(rope_kind="neox")},  # halves instead of consecutive pairs
    "glm4moe": {
        "no group mask": dict(n_expert_groups=0),
        "no selection bias": "drop exp_probs_b",
        "no shared expert": "drop shexp",
    },
}


def _relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=sorted(SHAPES))
def compared(request, random_gguf, tmp_path_factory):
    arch = request.param
    model = open_model(random_gguf(arch, **{**COMMON, **SHAPES[arch]}))
    tokens = np.random.default_rng(3).integers(0, model.hparams.n_vocab, 100).astype(np.int32)
    ref = _llama_logits(model.path, tokens, tmp_path_factory.mktemp(arch))
    return arch, model, tokens, ref


def test_logits_match_llama_cpp(compared):
    arch, model, tokens, ref = compared
    err = _relative_error(forward(model, [tokens]).logits[0], ref)
    print(f"{arch}: max |Δlogit| / max |logit| = {err:.2e}")
    assert np.abs(ref).max() > 1.0
    assert err <= TOLERANCE


def _wrong_forward(model, tokens, error, tmp_path):
    """Our forward with one deliberate error (hparams changed, or a tensor zeroed)."""
    if isinstance(error, dict):
        return forward(model.with_hparams(**error), [tokens]).logits[0]
    if error == "drop shexp":  # the shared expert's output zeroed through the student hook
        zero = {i: LayerReplacement(down_shexp=np.zeros(
            model.tensor_shape(f"blk.{i}.ffn_down_shexp.weight"), np.float32))
            for i in model.hparams.moe_layers}
        return forward(model, [tokens], replacements=zero).logits[0]
    # the same file with every exp_probs_b zeroed: what ignoring the bias computes
    tensors = {n: model.tensor(n) * (0.0 if n.endswith("exp_probs_b.bias") else 1.0)
               for n in model.tensor_names}
    types = {n: model.tensor_type(n) for n in model.tensor_names}
    path = write_model(tmp_path / "unbiased.gguf", model.arch, model.hparams, tensors, types,
                       tokenizer_metadata_from_tokenizer(model.tokenizer()))
    return forward(open_model(path), [tokens]).logits[0]


def test_a_deliberate_error_breaks_the_comparison(compared, tmp_path):
    arch, model, tokens, ref = compared
    for name, error in DELIBERATE[arch].items():
        err = _relative_error(_wrong_forward(model, tokens, error, tmp_path), ref)
        print(f"{arch} with {name}: {err:.2e}")
        assert err > 5 * TOLERANCE, name
