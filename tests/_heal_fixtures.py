"""Shared set-up of the healing tests: a small random qwen2moe and a calibration corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest

from healsweep.data.corpus import load_corpus
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model


def _corpus_file(path):
    lines = []
    texts = ["The quick brown fox jumps over the lazy dog. " * 5,
             "Mixture-of-experts models route every token to a few experts. " * 4,
             '{"name": "launch retro", "items": [1, 2, 3]} ' * 6,
             "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 " * 4]
    for i, text in enumerate(texts):
        lines.append({"doc_id": f"cal-{i}", "source": "cal", "index": i,
                      "stratum": "a" if i % 2 else "b", "pool": "calibration", "text": text})
    lines.append({"doc_id": "ev-0", "source": "ev", "index": 0, "stratum": "a", "text": "eval"})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


@pytest.fixture(scope="module")
def heal_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("heal")
    model = open_model(write_random_model(root / "m.gguf", n_layer=2, n_ff_exp=64,
                                          types={"ffn_down_shexp.weight": "Q8_0"}))
    return model, load_corpus(_corpus_file(root / "corpus.jsonl"))


def correlated_layer(seed, n_exp=3, n_out=32, n_in=192, n_tokens=1500):
    """Random expert weights [E, out, in] and second moments H [E, in, in] of correlated inputs
    whose channels differ widely in size (as in an LLM), float32."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_exp, n_out, n_in)).astype(np.float32)
    mix = np.eye(n_in) + 0.4 * rng.standard_normal((n_exp, n_in, n_in)) / np.sqrt(n_in)
    scales = np.exp(rng.standard_normal(n_in))  # channels of very different size, as in an LLM
    x = rng.standard_normal((n_exp, n_tokens, n_in)) * scales @ mix
    h = np.einsum("eti,etj->eij", x, x).astype(np.float32)
    return w, h
