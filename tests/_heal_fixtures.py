"""Shared set-up of the healing tests: a small random qwen2moe and a calibration corpus."""

from __future__ import annotations

import json

import pytest

from healsweep.data.corpus import load_corpus
from healsweep.gguf_io import open_model
from healsweep.gguf_io.synthetic import write_random_model


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
