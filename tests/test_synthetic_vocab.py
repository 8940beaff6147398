"""Random models with a real model's vocabulary size (issue 30): a grown byte-level BPE."""

from __future__ import annotations

import json

import numpy as np
import pytest

from healsweep.data.corpus import load_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.errors import TokenizerError
from healsweep.gguf_io._synthetic_vocab import grown_tokenizer
from healsweep.model import forward, open_model
from healsweep.model.synthetic import train_tiny_tokenizer, write_random_model

SHAPE = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_expert=8, n_expert_used=2,
             n_ff_exp=64, n_ff_shexp=128, context_length=512)  # fmt: skip
MARKERS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
DOC = (
    "<|im_start|>user\nWhich experts does the router pick for 3.14159?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nThe quick brown fox jumps over the lazy dog.\n</think>\n"
    '{"name": "launch retro", "items": [1, 2, 3]}<|im_end|>\n'
)


def _bpe(tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def test_grown_tokenizer_is_a_deterministic_valid_bpe_over_the_tiny_one():
    base = train_tiny_tokenizer()
    grown = grown_tokenizer(base, 20_000)
    assert grown.get_vocab_size() == 20_000
    assert grown.to_str() == grown_tokenizer(base, 20_000).to_str()
    assert grown.to_str() != grown_tokenizer(base, 20_000, seed=1).to_str()
    vocab, merges = _bpe(grown)
    base_vocab, base_merges = _bpe(base)
    assert merges[: len(base_merges)] == base_merges  # the trained merges keep their ranks
    assert all(vocab[t] == i for t, i in base_vocab.items())
    for left, right in merges:  # BPE: both parts and the result are tokens
        assert left in vocab and right in vocab and left + right in vocab
    assert len(set(merges)) == len(merges)
    ids = sorted(grown.get_vocab().values())
    assert ids == list(range(20_000))  # contiguous, as GGUF needs
    for marker in MARKERS:  # special and user-defined markers stay single tokens
        assert grown.encode(marker).ids == [grown.token_to_id(marker)]
    assert grown.token_to_id("</think>") == 19_999  # added tokens move to the end
    with pytest.raises(TokenizerError, match="smaller than the base tokenizer"):
        grown_tokenizer(base, 100)


def test_a_20k_vocabulary_model_loads_tokenizes_chatml_finds_windows_and_runs(tmp_path):
    path = write_random_model(tmp_path / "v20k.gguf", vocab_size=20_000, **SHAPE)
    model = open_model(path)
    assert model.hparams.n_vocab == 20_000
    assert model.tensor("token_embd.weight").shape == (20_000, 64)
    assert model.tensor("output.weight").shape == (20_000, 64)
    tokenizer = model.tokenizer()  # rebuilt from the GGUF's metadata
    reference = grown_tokenizer(train_tiny_tokenizer(), 20_000)
    ids = tokenizer.encode(DOC).ids
    assert ids == reference.encode(DOC).ids
    assert max(ids) >= 384  # grown merges are in use, not only the tiny tokenizer's
    assert tokenizer.decode(ids, skip_special_tokens=False) == DOC
    for marker in MARKERS:
        assert ids.count(tokenizer.token_to_id(marker)) == DOC.count(marker)
    corpus = load_corpus("demo")
    windows = make_windows(corpus, tokenizer, parity_split(corpus))
    assert {"think", "answer"} <= {w.kind for w in windows}
    logits = np.asarray(forward(model, [np.asarray(ids, np.int32)]).logits[0])
    assert logits.shape == (len(ids), 20_000) and np.all(np.isfinite(logits))
    assert np.std(logits[:, 384:]) > 0.1  # the grown rows are real rows of the head


@pytest.mark.slow
def test_a_qwen_size_vocabulary_loads_in_llama_cpp_with_the_same_tokens_and_logits(tmp_path):
    """151,936 entries, Qwen1.5/Qwen3's n_vocab: llama.cpp reads the tokenizer metadata,
    tokenizes a ChatML document as healsweep does, and its logits match our forward."""
    pytest.importorskip("llama_cpp")
    from test_llama_reference import TOLERANCE, _llama_logits, _relative_rms

    model = open_model(write_random_model(tmp_path / "v152k.gguf", vocab_size=151_936, **SHAPE))
    assert model.hparams.n_vocab == 151_936
    ids = np.asarray(model.tokenizer().encode(DOC).ids, np.int32)
    script = (
        "import sys, json\nfrom llama_cpp import Llama\n"
        "llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
        "print(json.dumps(llm.tokenize(sys.argv[2].encode(), add_bos=False, special=True)))\n"
    )
    import subprocess
    import sys

    found = subprocess.run([sys.executable, "-c", script, str(model.path), DOC], check=True,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert json.loads(found.stdout) == ids.tolist()
    ours = np.asarray(forward(model, [ids]).logits[0])
    assert _relative_rms(ours, _llama_logits(model.path, ids, tmp_path)) <= TOLERANCE
