"""The calibration trace: multi-chunk, nothing dropped, equal to direct captures, cached by content."""

from __future__ import annotations

import json

import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.data.corpus import load_corpus
from healsweep.errors import CorpusError
from healsweep.heal import knobs, ridge
from healsweep.heal.knobs import CalibrationConfig
from healsweep.heal.trace import (
    LAYER_STAGE,
    budget_takes,
    budgeted,
    calibration_trace,
    layer_key,
    make_chunks,
    run_trace,
    trace_key,
)
from healsweep.model import forward, open_model
from healsweep.model.synthetic import write_random_model

TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "json.dumps"}}\n</tool_call>'


def write_corpus(path, extra_text=""):
    docs = [
        {
            "doc_id": "cal-a",
            "source": "cal",
            "index": 0,
            "stratum": "prose",
            "pool": "calibration",
            "text": "The quick brown fox jumps over the lazy dog. " * 6 + extra_text,
        },
        {
            "doc_id": "ev-1",
            "source": "ev",
            "index": 1,
            "stratum": "prose",
            "text": "An evaluation document that calibration must never read.",
        },
        {
            "doc_id": "cal-b",
            "source": "cal",
            "index": 1,
            "stratum": "tool",
            "pool": "calibration",
            "messages": [
                {"role": "user", "content": "Find json.dumps."},
                {"role": "assistant", "content": TOOL_CALL},
                {"role": "tool", "content": "json.dumps(obj) serializes obj to a JSON string."},
                {"role": "assistant", "content": "It serializes an object to JSON."},
            ],
        },
        {
            "doc_id": "cal-c",
            "source": "cal",
            "index": 2,
            "stratum": "prose",
            "pool": "calibration",
            "text": "Mixture-of-experts models route every token to a few experts. " * 3,
        },
    ]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_model(tmp_path_factory.mktemp("m") / "tiny.gguf", n_layer=2)
    return open_model(path)


@pytest.fixture()
def corpus(tmp_path):
    return load_corpus(write_corpus(tmp_path / "corpus.jsonl"))


def test_chunks_cover_every_calibration_token_and_count_tool_content(model, corpus):
    tok = model.tokenizer()
    cfg = CalibrationConfig(chunk_length=16)
    chunks, info = make_chunks(corpus.pool("calibration"), tok, budgeted(model, cfg))
    lengths = {
        d.doc_id: len(tok.encode(d.render(), add_special_tokens=False).ids)
        for d in corpus.pool("calibration")
    }
    assert info["tokens_used"] == info["tokens_available"] == sum(lengths.values())
    assert sum(len(c.tokens) for c in chunks) == info["tokens_used"]
    assert all(len(c.tokens) <= 16 for c in chunks)
    assert {c.doc_id for c in chunks} == {"cal-a", "cal-b", "cal-c"}  # never the eval document
    for doc_id, n in lengths.items():
        ids = np.concatenate([c.tokens for c in chunks if c.doc_id == doc_id])
        assert len(ids) == n
    tool = sum(c.tool_tokens for c in chunks if c.doc_id == "cal-b")
    inside = len(tok.encode(TOOL_CALL, add_special_tokens=False).ids) + len(
        tok.encode("json.dumps(obj) serializes obj to a JSON string.", add_special_tokens=False).ids
    )
    assert abs(tool - inside) <= 4
    assert sum(c.tool_tokens for c in chunks if c.doc_id != "cal-b") == 0


def test_the_night_budget_is_sized_from_the_trace_entries_it_writes(model, corpus, tmp_path):
    """``max_tokens: night`` (the default) keeps one layer's trace entry within 4 GB / 24, so a
    24-layer Qwen1.5-MoE-A2.7B trace (D 2048, top-4 of 60 experts of 1408) stays within 4 GB:
    the bytes per token and per layer it assumes are those of real entries on disk."""
    cache = StageCache(tmp_path)
    sizes = {}
    for tokens in (60, 120):
        trace = calibration_trace(model, CalibrationConfig(max_tokens=tokens, chunk_length=32),
                                  cache, corpus)  # fmt: skip
        assert trace.report["tokens_used"] == tokens
        sizes[tokens] = cache.path(LAYER_STAGE, layer_key(trace.key, 0)).stat().st_size
    hp = model.hparams
    per_token = knobs.trace_token_bytes(hp.n_embd, hp.n_expert_used)
    assert abs(sizes[120] - sizes[60] - 60 * per_token) <= 64 * 8  # each array 64-aligned
    fixed = knobs.trace_layer_fixed_bytes(hp.n_expert, hp.n_embd, hp.n_ff_exp)
    assert 0 < sizes[60] - 60 * per_token <= fixed
    a27b = knobs.night_tokens(2048, 4, 60, 1408)
    assert a27b == CalibrationConfig().for_model(2048, 4, 60, 1408).max_tokens == 13_451
    assert 24 * (a27b * knobs.trace_token_bytes(2048, 4)
                 + knobs.trace_layer_fixed_bytes(60, 2048, 1408)) <= 4 * 10**9  # fmt: skip
    # a small model's night is its whole pool here: what the default traces is what null does
    night = calibration_trace(model, CalibrationConfig(chunk_length=32), cache, corpus)
    every = calibration_trace(model, CalibrationConfig(max_tokens=None, chunk_length=32), cache,
                              corpus)  # fmt: skip
    assert night.report["tokens_used"] == every.report["tokens_used"]
    assert budgeted(model, CalibrationConfig()).max_tokens == knobs.night_tokens(
        hp.n_embd, hp.n_expert_used, hp.n_expert, hp.n_ff_exp
    )


@pytest.mark.parametrize("budget", [1, 7, 25, 26, 40, 59, 60, 1000, None])
def test_a_budget_takes_documents_of_every_stratum_in_turn(budget):
    """An independent re-statement of the rule: walk the strata in turn (first-appearance
    order), each stratum's documents in pool order, taking whole documents, the last one cut."""
    strata = ["a", "a", "a", "b", "b", "c", "a", "c"]
    lengths = [5, 9, 4, 12, 3, 8, 11, 8]
    takes = budget_takes(strata, lengths, budget)
    want, left = [0] * len(lengths), sum(lengths) if budget is None else budget
    order = [0, 3, 5, 1, 4, 7, 2, 6]  # a1 b1 c1 a2 b2 c2 a3 a4
    for i in order:
        want[i] = min(lengths[i], max(left, 0))
        left -= want[i]
    assert takes == want
    assert sum(takes) == min(sum(lengths), budget or sum(lengths))
    if budget is None or budget > 5 + 12:  # past the first document of a and of b: c too
        assert {strata[i] for i, t in enumerate(takes) if t} == {"a", "b", "c"}
    smaller = budget_takes(strata, lengths, max(1, (budget or 60) // 2))
    assert all(s <= t for s, t in zip(smaller, takes, strict=True))  # a prefix of its documents


def test_max_tokens_cut_is_reported(model, corpus):
    chunks, info = make_chunks(
        corpus.pool("calibration"),
        model.tokenizer(),
        CalibrationConfig(max_tokens=50, chunk_length=16),
    )
    assert info["tokens_used"] == 50 == sum(len(c.tokens) for c in chunks)
    assert info["document_cut_by_max_tokens"]["kept"] < info["document_cut_by_max_tokens"]["of"]


def test_trace_equals_direct_captures_chunk_by_chunk(model, corpus, tmp_path):
    cfg = CalibrationConfig(chunk_length=32, min_tokens_per_expert=4)
    cache = StageCache(tmp_path / "cache")
    trace = calibration_trace(model, cfg, cache, corpus)
    chunks, _ = make_chunks(corpus.pool("calibration"), model.tokenizer(), budgeted(model, cfg))
    direct = [forward(model, [c.tokens], capture=True).captures for c in chunks]
    n_tokens = sum(len(c.tokens) for c in chunks)
    for layer in range(model.hparams.n_layer):
        arrays = trace.layer(layer)
        for name, field in (
            ("x", "ffn_input"),
            ("y_ref", "routed_output"),
            ("gate", "shexp_gate"),
            ("weights", "topk_weights"),
        ):
            want = np.concatenate([getattr(d[layer], field) for d in direct])
            tol = 2**-11 if name == "x" else 2e-4  # x is stored in float16
            np.testing.assert_allclose(arrays[name], want, rtol=tol, atol=2e-5)
        ids = np.concatenate([d[layer].topk_ids for d in direct])
        np.testing.assert_array_equal(arrays["ids"], ids)
        assert arrays["x"].shape[0] == n_tokens and arrays["x"].dtype == np.float16
        assert arrays["counts"].sum() == n_tokens * model.hparams.n_expert_used
        assert "z" not in arrays  # the shared expert's down input is recomputed from x
        # Part B's Z' from the stored x is silu(x·Wgᵀ)·(x·Wuᵀ)·gate (float64 reference), and
        # within float16 rounding of the one the f32 captures give.
        wg, wu = (
            model.tensor(f"blk.{layer}.ffn_{n}_shexp.weight").astype(np.float64)
            for n in ("gate", "up")
        )
        gate = np.concatenate([d[layer].shexp_gate for d in direct]).astype(np.float64)
        got = np.asarray(ridge.layer_design(model, layer, arrays)(0, n_tokens))
        for x, rtol in (
            (arrays["x"], 1e-4),
            (np.concatenate([d[layer].ffn_input for d in direct]), 0),
        ):
            x = x.astype(np.float64)
            want = (x @ wg.T) / (1 + np.exp(-(x @ wg.T))) * (x @ wu.T) * gate[:, None]
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=rtol, atol=(1e-5 if rtol else 2e-3) * scale)
    report = trace.report
    assert report["tokens_used"] == n_tokens
    assert sum(report["tokens_per_stratum"].values()) == n_tokens
    assert report["tool_call_tokens_per_stratum"]["tool"] > 0
    assert report["tool_call_tokens_per_stratum"]["prose"] == 0
    assert trace.tokens_per_expert.shape == (2, model.hparams.n_expert)


def test_trace_streams_layers_in_chunk_order_whatever_the_batching(model, corpus, tmp_path):
    chunks, _ = make_chunks(
        corpus.pool("calibration"), model.tokenizer(), CalibrationConfig(max_tokens=None, chunk_length=40)
    )
    runs = []
    # one batch; then one or two chunks per batch, buckets interleaved; then every chunk padded
    # to the longest chunk's bucket (one shape: what accelerators get)
    for budget, uniform in ((4096, False), (128, False), (128, True)):
        layers: list[int] = []
        got: dict[int, dict] = {}

        def sink(layer, arrays, layers=layers, got=got):
            layers.append(layer)
            got[layer] = arrays

        counts = run_trace(model, chunks, sink, batch_tokens=budget, uniform=uniform)
        assert layers == [0, 1]  # every layer once, in order (layer-major)
        runs.append((got, counts))
    (one, counts_one), *others = runs
    for many, counts_many in others:
        np.testing.assert_array_equal(counts_one, counts_many)
        for layer in (0, 1):
            assert set(one[layer]) == set(many[layer])
            for name in one[layer]:
                rtol = 2**-10 if name == "x" else 2e-4  # float16: one rounding step either way
                np.testing.assert_allclose(
                    many[layer][name], one[layer][name], rtol=rtol, atol=2e-5
                )


def test_trace_is_cached_by_content_and_rebuilt_when_a_layer_entry_is_damaged(model, tmp_path):
    cache = StageCache(tmp_path / "cache")
    cfg = CalibrationConfig(chunk_length=32, min_tokens_per_expert=4)
    corpus = load_corpus(write_corpus(tmp_path / "c1.jsonl"))
    first = calibration_trace(model, cfg, cache, corpus)
    again = calibration_trace(model, cfg, cache, corpus)
    assert cache.computed["calib_trace"] == 1 and again.key == first.key
    assert (
        calibration_trace(model, cfg.model_copy(update={"corpus": "elsewhere"}), cache, corpus).key
        == first.key
    )  # the corpus path is not part of the key
    docs = corpus.pool("calibration")
    edited = load_corpus(write_corpus(tmp_path / "c2.jsonl", extra_text="One more sentence."))
    assert trace_key(model, cfg, edited.pool("calibration")) != first.key
    assert trace_key(model, CalibrationConfig(chunk_length=48), docs) != first.key
    assert trace_key(model, cfg, docs[::-1]) != first.key
    other = open_model(write_random_model(tmp_path / "other.gguf", n_layer=2, seed=1))
    assert trace_key(other, cfg, docs) != first.key
    before = first.layer(1)["y_ref"]
    path = cache.path(LAYER_STAGE, layer_key(first.key, 1))
    path.write_bytes(path.read_bytes()[:-10])  # a truncated entry fails its checksum
    computed = cache.computed["calib_trace"]
    np.testing.assert_array_equal(again.layer(1)["y_ref"], before)
    assert cache.computed["calib_trace"] == computed + 1
    assert cache.corrupt[LAYER_STAGE] == 1


def test_empty_calibration_pool_is_a_corpus_error(model, tmp_path):
    corpus = load_corpus(write_corpus(tmp_path / "c.jsonl"))
    cfg = CalibrationConfig(exclude_doc_ids=("cal-a", "cal-b", "cal-c"))
    with pytest.raises(CorpusError, match="no calibration documents"):
        calibration_trace(model, cfg, StageCache(tmp_path / "cache"), corpus)
