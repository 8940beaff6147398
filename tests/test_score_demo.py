"""Acceptance on the packaged demo model: self KLD is 0; its Q8_0 re-encoding scores below Q4_0.

This file needs ``assets/demo-moe.gguf`` (built by ``healsweep demo build``) and fails loudly when
it is missing. The re-encodings are written here with the gguf writer from the demo's own
dequantized tensors, so they share its tokenizer and layout exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.data.corpus import load_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import first_windows, make_windows
from healsweep.gguf_io._tokenizer import tokenizer_metadata_from_gguf
from healsweep.model import open_model, write_model
from healsweep.score import pooled, score_windows
from healsweep.score.report import check_same_tokenizer
from healsweep.score.teacher_cache import STAGE

N_WINDOWS = 8  # the first 8 by id (a spread over strata), one batch: one forward shape
MAX_CONTEXT = 128  # keeps the file well under a minute; the CLI default is 896
BATCH = 8


def _reencode(model, path, qtype: str):
    """The model with every 2-D+ tensor whose rows split into 32-blocks stored as ``qtype``."""
    from gguf import GGMLQuantizationType

    types = {
        name: GGMLQuantizationType[qtype]
        for name in model.tensor_names
        if len(model.tensor_shape(name)) >= 2 and model.tensor_shape(name)[-1] % 32 == 0
    }
    meta = tokenizer_metadata_from_gguf(model.metadata, str(model.path))
    write_model(path, model.arch, model.hparams, model.tensors(), types, meta, name=f"demo-{qtype}")
    return open_model(path)


@pytest.fixture(scope="module")
def demo():
    return open_model("demo")  # GGUFFormatError naming `healsweep demo build` if missing


@pytest.fixture(scope="module")
def windows(demo):
    corpus = load_corpus("demo")
    every = make_windows(corpus, demo.tokenizer(), parity_split(corpus), max_context=MAX_CONTEXT)
    return first_windows(every, N_WINDOWS)


def test_demo_self_is_zero_and_q8_scores_below_q4(demo, windows, tmp_path):
    q8 = _reencode(demo, tmp_path / "demo-q8_0.gguf", "Q8_0")
    q4 = _reencode(demo, tmp_path / "demo-q4_0.gguf", "Q4_0")
    assert check_same_tokenizer(demo, q4) == demo.hparams.n_vocab
    cache = StageCache(tmp_path / "cache")
    strata = [w.stratum for w in windows]
    result = {
        name: pooled(
            [m for _, m in score_windows(demo, model, windows, cache, batch=BATCH)], strata
        )
        for name, model in (("self", demo), ("q8", q8), ("q4", q4))
    }
    assert cache.computed[STAGE] == len(windows)  # the teacher ran once per window, not thrice
    assert cache.hits[STAGE] == 2 * len(windows)
    assert result["self"]["kld_mean"] < 1e-7 and result["self"]["top1"] == 1.0
    assert 0 < result["q8"]["kld_mean"] < result["q4"]["kld_mean"]
    assert len(result["q4"]["per_stratum"]) >= 2
    for stratum, figures in result["q4"]["per_stratum"].items():
        assert figures["kld_mean"] > result["q8"]["per_stratum"][stratum]["kld_mean"], stratum
    assert np.isfinite(result["q4"]["student_ppl"])
