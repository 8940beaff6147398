"""Our forward against llama.cpp's on the same GGUF (slow tier; needs the ``[bench]`` extra).

llama.cpp is the runtime users serve these files with and an implementation independent of ours
in everything: its own GGUF reader, its own block decoders (it multiplies quantized blocks
directly, quantizing activations to 8 bits for the K-quants), its own MoE graph. Files mix the
block families the in-graph decoders cover. Attention and shared-expert matrices stay F16:
llama-cpp-python 0.3.36 crashes (SIGSEGV) on these small random files when any of them is
quantized (seen with Q8_0 attn_q and with a quantized shared expert).
"""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.model import forward, open_model

pytestmark = pytest.mark.slow

TYPES = {
    "q8_0": {"ffn_gate_exps.weight": "Q8_0", "ffn_up_exps.weight": "Q8_0",
             "ffn_down_exps.weight": "Q8_0", "output.weight": "Q8_0"},
    "k_quants": {"ffn_gate_exps.weight": "Q4_K", "ffn_up_exps.weight": "Q5_K",
                 "ffn_down_exps.weight": "Q6_K", "output.weight": "Q6_K"},
    "legacy_and_iq4": {"ffn_gate_exps.weight": "Q4_0", "ffn_up_exps.weight": "Q5_1",
                       "ffn_down_exps.weight": "IQ4_XS", "output.weight": "Q5_0"},
}
SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_expert=8, n_expert_used=2,
             n_ff_exp=256, n_ff_shexp=512, context_length=256)
# llama.cpp rounds activations to 8 bits (Q8_0/Q8_K) before quantized dot products, so it sits
# further from a float32 decode than transformers does (whose max error on K-quant files stays
# under 2e-3, tests/test_forward_in_graph.py); the bound is on the RMS of the logit error
# relative to the RMS logit, and another model's logits miss it tenfold.
TOLERANCE = 2.5e-2


def _relative_rms(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((ours - ref) ** 2) / np.mean(ref**2)))


_LLAMA_SCRIPT = """
import sys, numpy as np
from llama_cpp import Llama
tokens = np.load(sys.argv[2])
llm = Llama(model_path=sys.argv[1], n_ctx=len(tokens), n_batch=len(tokens),
            n_ubatch=len(tokens), logits_all=True, n_threads=2, verbose=False)
llm.eval(tokens.tolist())
np.save(sys.argv[3], np.array(llm.scores[: len(tokens)], np.float32))
"""


def _llama_logits(path, tokens: np.ndarray, tmp_path) -> np.ndarray:
    """llama.cpp's logits, in a process of its own (its CPU backend and XLA's do not share one)."""
    import subprocess
    import sys

    np.save(tmp_path / "tokens.npy", tokens)
    out = tmp_path / "llama.npy"
    subprocess.run([sys.executable, "-c", _LLAMA_SCRIPT, str(path), str(tmp_path / "tokens.npy"),
                    str(out)], check=True, timeout=300)
    return np.load(out)


@pytest.mark.parametrize("types", sorted(TYPES))
def test_logits_match_llama_cpp(random_gguf, types, tmp_path):
    model = open_model(random_gguf("qwen2moe", types=TYPES[types], seed=31, **SHAPE))
    tokens = np.random.default_rng(2).integers(0, model.hparams.n_vocab, 120).astype(np.int32)
    ours = forward(model, [tokens]).logits[0]
    ref = _llama_logits(model.path, tokens, tmp_path)
    assert np.abs(ref).max() > 1.0
    err = _relative_rms(ours, ref)
    print(f"{types}: relative RMS {err:.2e}")
    assert err <= TOLERANCE, f"{types}: RMS Δlogit / RMS logit = {err:.2e}"
    # With teeth: the same comparison against a model with other random weights fails by far.
    other = open_model(random_gguf("qwen2moe", types=TYPES[types], seed=32, **SHAPE))
    wrong = forward(other, [tokens]).logits[0]
    assert _relative_rms(wrong, ref) > 10 * TOLERANCE
