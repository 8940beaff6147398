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

from healsweep.gguf_io import open_model
from healsweep.model import forward
from test_llama_reference import _llama_logits

pytestmark = pytest.mark.slow

TOLERANCE = 5e-3  # max |Δlogit| <= TOLERANCE * max |logit|
COMMON = dict(n_layer=2, n_embd=128, n_head=4, n_expert=8, n_expert_used=2, n_ff_exp=64,
              context_length=256, types="F32", seed=41)
SHAPES = {
    "olmoe": dict(n_head_kv=4),  # llama.cpp sizes olmoe's k norm [n_embd]: no GQA
    "llama": dict(n_head_kv=2),
}
# One deliberate error per architecture: hparams that a careless reading of the file would give.
DELIBERATE = {
    "olmoe": dict(norm_topk_prob=True),  # renormalize the top-k weights as Mixtral does
    "llama": dict(rope_kind="neox"),  # rotate halves instead of consecutive pairs
}


def _relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=sorted(SHAPES))
def compared(request, random_gguf, tmp_path_factory):
    arch = request.param
    model = open_model(random_gguf(arch, **COMMON, **SHAPES[arch]))
    tokens = np.random.default_rng(3).integers(0, model.hparams.n_vocab, 100).astype(np.int32)
    ref = _llama_logits(model.path, tokens, tmp_path_factory.mktemp(arch))
    return arch, model, tokens, ref


def test_logits_match_llama_cpp(compared):
    arch, model, tokens, ref = compared
    err = _relative_error(forward(model, [tokens]).logits[0], ref)
    print(f"{arch}: max |Δlogit| / max |logit| = {err:.2e}")
    assert np.abs(ref).max() > 1.0
    assert err <= TOLERANCE


def test_a_deliberate_error_breaks_the_comparison(compared):
    arch, model, tokens, ref = compared
    wrong = model.with_hparams(**DELIBERATE[arch])
    err = _relative_error(forward(wrong, [tokens]).logits[0], ref)
    print(f"{arch} with {DELIBERATE[arch]}: {err:.2e}")
    assert err > 5 * TOLERANCE
