"""score_windows on small random GGUFs: independent float64 recomputation, cache reuse, students."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.conformance.references import log_softmax as _np_log_softmax
from healsweep.data.corpus import Document, Message, load_corpus, write_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.errors import TokenizerError
from healsweep.model import LayerReplacement, forward, open_model
from healsweep.model.synthetic import write_random_model
from healsweep.score import pooled, score_windows
from healsweep.score.compact import DEFAULT_TAIL_SAMPLES, DEFAULT_TOP_K, CompactTeacher
from healsweep.score.report import check_same_tokenizer
from healsweep.score.teacher_cache import STAGE, teacher_key

BATCH = 4
ANSWER = '<think>\nMixture-of-experts models route every token {i}.\n</think>\n\n{{"name": "{i}"}}'


@dataclass
class HealedStudent:
    """What the heal pipeline hands the scorer: the teacher's GGUF plus layer replacements."""

    base: object
    replacements: dict


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = {
        "ref": write_random_model(root / "ref.gguf", seed=3),
        "q8": write_random_model(root / "q8.gguf", seed=3, types="Q8_0"),
        "q4": write_random_model(root / "q4.gguf", seed=3, types="Q4_0"),
    }
    return {name: open_model(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def windows(models, tmp_path_factory):
    docs = []
    for i in range(1, 6, 2):  # odd index: dev
        question = "The quick brown fox jumps over the lazy dog? " * (1 + i)
        messages = (Message("user", question), Message("assistant", ANSWER.format(i=i)))
        docs.append(Document(f"c{i}", "chat", i, "chat", messages=messages))
        text = f"Numbers: {i} 2 3 4 5 6 7 8 9 {i}. " * 6
        docs.append(Document(f"t{i}", "docs", i, "docs", text=text))
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    write_corpus(docs, path)
    corpus = load_corpus(path)
    tokenizer = models["ref"].tokenizer()
    found = make_windows(
        corpus,
        tokenizer,
        parity_split(corpus),
        max_scored=24,
        max_context=40,
        max_windows_per_doc=2,
    )
    assert len(found) == 12
    return found[:8]  # two batches of BATCH: few shapes to compile


def _independent(teacher, student_model, window, replacements=None):
    """KLD sum, top-1 count, NLL sums and router Jaccard from full forwards, in float64 numpy."""
    t = forward(teacher, [window.tokens])
    s = forward(student_model, [window.tokens], replacements=replacements)
    pos = np.arange(window.n_scored) + window.scored_from - 1
    lt, ls = _np_log_softmax(t.logits[0][pos]), _np_log_softmax(s.logits[0][pos])
    nxt = window.scored_tokens
    rows = np.arange(len(pos))
    jac = [
        len(set(a) & set(b)) / len(set(a) | set(b))
        for a, b in zip(
            t.router[0][pos].reshape(-1, t.router[0].shape[-1]),
            s.router[0][pos].reshape(-1, s.router[0].shape[-1]),
            strict=True,
        )
    ]
    return {
        "kld_sum": float((np.exp(lt) * (lt - ls)).sum()),
        "top1_count": int((lt.argmax(1) == ls.argmax(1)).sum()),
        "teacher_nll_sum": float(-lt[rows, nxt].sum()),
        "student_nll_sum": float(-ls[rows, nxt].sum()),
        "delta_p_mean": float((np.exp(ls[rows, nxt]) - np.exp(lt[rows, nxt])).mean()),
        "router_jaccard": float(np.mean(jac)),
    }


# The compact cache's KLD is an unbiased estimate (tests/test_teacher_cache.py checks the bias);
# one draw on these windows lands within a few percent of the float64 value.
KLD_REL = {"exact": 1e-3, "compact": 0.05}


@pytest.mark.parametrize("teacher_cache", ["exact", "compact"])
def test_metrics_match_an_independent_float64_recomputation(
    models, windows, tmp_path, teacher_cache
):
    cache = StageCache(tmp_path / "cache")
    scored = list(
        score_windows(
            models["ref"], models["q4"], windows, cache, batch=BATCH, teacher_cache=teacher_cache
        )
    )
    assert [w.window_id for w, _ in scored] == [w.window_id for w in windows]
    for window, m in scored[:3]:
        ref = _independent(models["ref"], models["q4"], window)
        assert m.kld_count == window.n_scored
        assert m.kld_sum == pytest.approx(ref["kld_sum"], rel=KLD_REL[teacher_cache])
        assert m.top1_count == ref["top1_count"]
        assert m.teacher_nll_sum == pytest.approx(ref["teacher_nll_sum"], rel=1e-4)
        assert m.student_nll_sum == pytest.approx(ref["student_nll_sum"], rel=1e-4)
        assert m.delta_p_mean == pytest.approx(ref["delta_p_mean"], rel=1e-3, abs=1e-7)
        assert m.router_jaccard == pytest.approx(ref["router_jaccard"], rel=1e-6)
        assert m.kld_p50 <= m.kld_p90 <= m.kld_p99 <= m.kld_p999 <= m.kld_max
        assert m.router_jaccard_layers.shape == (models["ref"].hparams.n_layer,)


def test_self_is_zero_and_quantization_orders_q8_below_q4(models, windows, tmp_path):
    cache = StageCache(tmp_path / "cache")
    results = {
        name: pooled(
            [m for _, m in score_windows(models["ref"], models[name], windows, cache, batch=BATCH)]
        )
        for name in ("ref", "q8", "q4")
    }
    # the compact estimate sums p (log p - log q) of float32 log-probs: rounding stays < 1e-8
    assert results["ref"]["kld_mean"] < 1e-8
    assert results["ref"]["top1"] == 1.0 and results["ref"]["router_jaccard"] == 1.0
    assert 0 < results["q8"]["kld_mean"] < results["q4"]["kld_mean"]
    assert results["q8"]["top1"] >= results["q4"]["top1"]


def test_a_second_run_reuses_the_cached_teacher(models, windows, tmp_path):
    first = StageCache(tmp_path / "cache")
    a = [m for _, m in score_windows(models["ref"], models["q8"], windows, first, batch=BATCH)]
    assert first.computed[STAGE] == len(windows) and first.hits[STAGE] == 0
    second = StageCache(tmp_path / "cache")  # a new process would build a new one
    b = [m for _, m in score_windows(models["ref"], models["q4"], windows, second, batch=BATCH)]
    c = [m for _, m in score_windows(models["ref"], models["q8"], windows, second, batch=1)]
    assert second.computed[STAGE] == 0 and second.hits[STAGE] == 2 * len(windows)
    for x, y in zip(a, c, strict=True):
        assert y.kld_sum == pytest.approx(x.kld_sum, rel=1e-4) and y.top1 == x.top1
    assert sum(m.kld_sum for m in b) > sum(m.kld_sum for m in a)
    # a compact entry holds a fixed-size record per scored position: int32 ids, float32 log-probs
    n, n_layer = windows[0].n_scored, models["ref"].hparams.n_layer
    entry = second.get(STAGE, next(iter(_keys(models["ref"], windows[:1]))))[0]
    assert entry["top_ids"].dtype == entry["tail_ids"].dtype == np.int32
    assert entry["top_logp"].dtype == entry["tail_logp"].dtype == np.float32
    assert entry["top_ids"].shape == entry["top_logp"].shape == (n, DEFAULT_TOP_K)
    assert entry["tail_ids"].shape == entry["tail_logp"].shape == (n, DEFAULT_TAIL_SAMPLES)
    assert entry["tail_mass"].shape == entry["logp_next"].shape == (n,)
    assert entry["topk_ids"].dtype == np.uint8 and entry["topk_ids"].shape[:2] == (n, n_layer)
    # an exact entry holds exactly the scored positions' log-softmax, in float32
    list(score_windows(models["ref"], models["q8"], windows[:1], second, teacher_cache="exact"))
    exact = second.get(STAGE, teacher_key(models["ref"], windows[0], "exact"))[0]
    assert exact["logprobs"].dtype == np.float32
    assert exact["logprobs"].shape == (n, models["ref"].hparams.n_vocab)


def _keys(model, ws):
    return [teacher_key(model, w) for w in ws]


def test_exact_and_compact_entries_coexist_and_agree_on_all_but_kld(models, windows, tmp_path):
    from healsweep.score.teacher_cache import teacher_outputs

    cache = StageCache(tmp_path / "cache")
    run = {
        fmt: [m for _, m in score_windows(models["ref"], models["q4"], windows, cache,
                                           batch=BATCH, teacher_cache=fmt)]
        for fmt in ("exact", "compact", "compact:8:8")
    }  # fmt: skip
    assert cache.computed[STAGE] == 3 * len(windows)  # three keys per window, none overwritten
    for name, rel in (("compact", 0.05), ("compact:8:8", 0.25)):  # one draw of 8 windows
        for e, c in zip(run["exact"], run[name], strict=True):
            assert c.top1_count == e.top1_count and c.delta_p_mean == e.delta_p_mean
            assert c.teacher_nll_sum == e.teacher_nll_sum
            assert c.student_nll_sum == e.student_nll_sum
            assert c.router_jaccard == e.router_jaccard
        total = sum(m.kld_sum for m in run[name])
        assert total == pytest.approx(sum(m.kld_sum for m in run["exact"]), rel=rel)
    # a second build of the same windows in another batching (one forward of all of them, not
    # batches of 4) gives the same record bit for bit: each window is computed as if alone
    again = teacher_outputs(models["ref"], windows, StageCache(tmp_path / "other"), "compact")
    first = teacher_outputs(models["ref"], windows, cache, "compact")
    for a, b in zip(first, again, strict=True):
        for field in CompactTeacher._fields:
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_window_s_record_does_not_depend_on_which_neighbours_another_trial_stored(
    models, windows, tmp_path
):
    """Two trials score the same batch at once: whichever of its entries the other stored
    first, this one's are those of a fresh build of the whole batch, bit for bit."""
    from healsweep.score.compact import CompactTeacher
    from healsweep.score.teacher_cache import teacher_outputs

    batch = windows[:BATCH]
    fresh = teacher_outputs(models["ref"], batch, StageCache(tmp_path / "fresh"), "compact")
    cache = StageCache(tmp_path / "shared")
    # the other trial stored the first window (a batch without it rounds the rest differently)
    teacher_outputs(models["ref"], batch[:1], cache, "compact")
    served = teacher_outputs(models["ref"], batch, cache, "compact")
    assert cache.computed[STAGE] == BATCH  # its one, then the rest; none overwritten
    for i in range(1, BATCH):
        for field in CompactTeacher._fields:
            np.testing.assert_array_equal(getattr(served[i], field), getattr(fresh[i], field))


def test_a_corrupt_teacher_entry_is_recomputed(models, windows, tmp_path):
    cache = StageCache(tmp_path / "cache")
    list(score_windows(models["ref"], models["q8"], windows[:BATCH], cache, batch=BATCH))
    path = cache.path(STAGE, _keys(models["ref"], windows[:1])[0])
    path.write_bytes(path.read_bytes()[:-100])
    again = StageCache(tmp_path / "cache")
    list(score_windows(models["ref"], models["q8"], windows[:BATCH], again, batch=BATCH))
    assert again.computed[STAGE] == 1 and again.corrupt[STAGE] == 1
    assert again.hits[STAGE] == BATCH - 1


@pytest.mark.parametrize("fmt", ["compact", "exact"])
def test_a_rebuilt_teacher_entry_equals_a_cold_build_bit_for_bit(models, windows, tmp_path, fmt):
    """Issue 40: a corrupt entry was recomputed alone while the original had been computed in
    its batch, and a batched forward rounds by its batch (pooled KLD 0.1601324 became 0.1601277
    on the demo; a cold cache reproduced the original). Now every entry is a function of its
    window: whatever else is in the cache, and in whatever batch the rebuild runs, its file is
    the cold build's, byte for byte."""
    from healsweep.score.teacher_cache import teacher_outputs

    cold = StageCache(tmp_path / "cold")
    teacher_outputs(models["ref"], windows, cold, fmt)  # one forward of all of them
    cache = StageCache(tmp_path / "cache")
    for start in range(0, len(windows), BATCH):  # as a sweep fills it, batch by batch
        teacher_outputs(models["ref"], windows[start : start + BATCH], cache, fmt)
    key = teacher_key(models["ref"], windows[1], fmt)
    entry = cache.path(STAGE, key)
    blob = bytearray(entry.read_bytes())
    blob[-40:-24] = bytes(16)  # payload bytes flipped, checksum kept: caught on read
    entry.write_bytes(bytes(blob))
    rebuild = StageCache(tmp_path / "cache")
    # rebuilt in another company: the window with two others, one of them also missing
    cache.path(STAGE, teacher_key(models["ref"], windows[5], fmt)).unlink()
    teacher_outputs(models["ref"], [windows[5], windows[1], windows[6]], rebuild, fmt)
    assert rebuild.corrupt[STAGE] == 1 and rebuild.computed[STAGE] == 2
    for w in (windows[1], windows[5]):  # arrays and metadata byte for byte (the header's
        k = teacher_key(models["ref"], w, fmt)  # recompute seconds are timings: not compared)
        (arrays, meta), (cold_arrays, cold_meta) = cache.get(STAGE, k), cold.get(STAGE, k)
        assert meta == cold_meta and sorted(arrays) == sorted(cold_arrays)
        for name, array in arrays.items():
            assert array.dtype == cold_arrays[name].dtype
            assert np.asarray(array).tobytes() == np.asarray(cold_arrays[name]).tobytes(), name


def test_a_healed_student_runs_the_base_with_its_replacements(models, windows, tmp_path):
    base = models["ref"]
    down = base.layer(1)["ffn_down_exps.weight"]
    same = HealedStudent(base, {1: LayerReplacement(down_exps=down)})
    bent = HealedStudent(base, {1: LayerReplacement(down_exps=down * 1.5)})
    cache = StageCache(tmp_path / "cache")
    zero = [m for _, m in score_windows(base, same, windows[:BATCH], cache, batch=BATCH)]
    assert max(m.kld_mean for m in zero) < 1e-7  # float32 rounding of the compact record
    scored = score_windows(base, bent, windows[:BATCH], cache, batch=BATCH, teacher_cache="exact")
    window, m = next(scored)
    ref = _independent(base, base, window, replacements=bent.replacements)
    assert m.kld_sum > 0 and m.kld_sum == pytest.approx(ref["kld_sum"], rel=1e-3)


def test_models_with_other_tokenizers_are_refused(models, tmp_path):
    from healsweep.model.synthetic import train_tiny_tokenizer

    other = train_tiny_tokenizer(("completely different text for another vocabulary",) * 3)
    stranger = open_model(write_random_model(tmp_path / "o.gguf", tokenizer=other))
    with pytest.raises(TokenizerError, match="differ"):
        check_same_tokenizer(models["ref"], stranger)
    assert check_same_tokenizer(models["ref"], models["q4"]) == models["ref"].hparams.n_vocab
