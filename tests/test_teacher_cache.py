"""The compact teacher cache: the KL estimate against float64 numpy, its draws, keys and formats."""

from __future__ import annotations

import os

import numpy as np
import pytest

from healsweep.conformance.references import kld as _np_kld
from healsweep.conformance.references import log_softmax as _np_log_softmax
from healsweep.errors import CacheError, SpecError
from healsweep.kernels.kld import log_softmax
from healsweep.score.compact import (
    TeacherCacheFormat,
    cache_format,
    compact_record,
    draw_tail,
    record_bytes,
)
from healsweep.score.metrics import compact_window_metrics, window_metrics

N_TOK, N_VOCAB = 4, 40


def _case(seed: int = 0, n_tok: int = N_TOK, n_vocab: int = N_VOCAB):
    rng = np.random.default_rng(seed)
    t = (rng.standard_normal((n_tok, n_vocab)) * 2.0).astype(np.float32)
    s = (t + rng.standard_normal((n_tok, n_vocab)) * 0.7).astype(np.float32)
    ids = rng.integers(0, n_vocab, n_tok).astype(np.int32)
    return np.asarray(log_softmax(t)), s, ids


def _router(n_tok: int = N_TOK) -> np.ndarray:
    return np.zeros((n_tok, 2, 2), dtype=np.int32)


def _estimates(logprobs, student, ids, fmt, tail, n_seeds):
    """Per-seed KL sums over the positions, ``[n_seeds]`` float64."""
    sums = []
    for seed in range(n_seeds):
        record = compact_record(logprobs, ids, _router(len(ids)), f"window-{seed}", fmt)
        sums.append(compact_window_metrics(record, student, ids, tail=tail).kld_sum)
    return np.array(sums)


@pytest.mark.parametrize("tail", ["adaptive", "plain", "cv"])
def test_the_estimate_is_unbiased_over_many_seeds(tail):
    logprobs, student, ids = _case()
    exact = float(_np_kld(logprobs, student).sum())
    fmt = TeacherCacheFormat("compact", top_k=3, tail_samples=2)  # most mass in a sampled tail
    sums = _estimates(logprobs, student, ids, fmt, tail, n_seeds=600)
    spread = sums.std(ddof=1)
    assert spread > 1e-3 * exact  # the tail really is sampled: single draws scatter
    # the mean of 600 independent draws is within 4 standard errors of the float64 KL
    assert abs(sums.mean() - exact) < 4 * spread / np.sqrt(len(sums))


def test_the_control_variate_is_left_out_where_the_teacher_has_zero_probability_tokens():
    logprobs, student, ids = _case(seed=6)
    masked = np.full_like(logprobs, -np.inf)
    masked[:, :20] = np.asarray(log_softmax(logprobs[:, :20]))  # p = 0 on half the vocabulary
    ids = ids % 20
    exact = float(_np_kld(masked, student).sum())
    fmt = TeacherCacheFormat("compact", top_k=3, tail_samples=2)
    assert not compact_record(masked, ids, _router(), "w", fmt).tail_full.any()
    sums = _estimates(masked, student, ids, fmt, "adaptive", n_seeds=300)
    assert abs(sums.mean() - exact) < 4 * sums.std(ddof=1) / np.sqrt(len(sums))


def test_the_adaptive_tail_is_much_tighter_than_the_plain_one_for_a_close_student():
    logprobs, _, ids = _case(seed=7, n_tok=16)
    rng = np.random.default_rng(8)
    close = (logprobs + rng.standard_normal(logprobs.shape) * 0.05).astype(np.float32)
    fmt = TeacherCacheFormat("compact", top_k=4, tail_samples=4)
    spread = {
        tail: _estimates(logprobs, close, ids, fmt, tail, n_seeds=60).std(ddof=1)
        for tail in ("plain", "adaptive")
    }
    assert spread["adaptive"] < 0.25 * spread["plain"]


def test_the_lumped_tail_is_biased_low_where_the_estimates_are_not():
    logprobs, student, ids = _case()
    exact = float(_np_kld(logprobs, student).sum())
    record = compact_record(logprobs, ids, _router(), "w", TeacherCacheFormat("compact", 3, 2))
    lumped = compact_window_metrics(record, student, ids, tail="lumped").kld_sum
    assert lumped < 0.9 * exact  # lumping the tail hides the divergence inside it


@pytest.mark.parametrize("tail", ["adaptive", "plain", "cv", "lumped"])
def test_an_empty_tail_gives_the_exact_kl(tail):
    logprobs, student, ids = _case(seed=1)
    record = compact_record(logprobs, ids, _router(), "w", TeacherCacheFormat("compact", 64, 8))
    assert record.top_ids.shape == (N_TOK, N_VOCAB)  # K capped at the vocabulary
    np.testing.assert_array_equal(record.tail_mass, 0.0)
    stats = compact_window_metrics(record, student, ids, tail=tail)
    assert stats.kld_sum == pytest.approx(float(_np_kld(logprobs, student).sum()), rel=1e-5)


def test_a_teacher_without_mass_outside_its_top_k_has_an_empty_tail():
    logprobs, student, ids = _case(seed=2)
    masked = np.full_like(logprobs, -np.inf)
    masked[:, :5] = logprobs[:, :5]  # support of 5 tokens, K = 5
    ids = ids % 5
    record = compact_record(masked, ids, _router(), "w", TeacherCacheFormat("compact", 5, 4))
    np.testing.assert_array_equal(record.tail_mass, 0.0)
    m = compact_window_metrics(record, student, ids)
    assert m.kld_sum == pytest.approx(float(_np_kld(masked, student).sum()), rel=1e-5)


@pytest.mark.parametrize("tail", ["adaptive", "plain", "cv"])
def test_kl_of_the_teacher_with_itself_is_exactly_zero(tail):
    logprobs, _, ids = _case(seed=3)
    record = compact_record(logprobs, ids, _router(), "w", TeacherCacheFormat("compact", 4, 4))
    assert (record.tail_mass > 0.05).all()
    m = compact_window_metrics(record, logprobs, ids, tail=tail)
    assert m.kld_sum == 0.0 and m.kld_max == 0.0 and m.top1 == 1.0


def test_top1_delta_p_and_nll_equal_the_exact_cache():
    logprobs, student, ids = _case(seed=4, n_tok=9, n_vocab=300)
    student[2] = student[2].max() + 1.0  # a tie across the whole row: the argmax is token 0
    exact = window_metrics(logprobs, student, ids)
    for fmt in (TeacherCacheFormat("compact", 1, 1), TeacherCacheFormat("compact", 16, 16)):
        m = compact_window_metrics(
            compact_record(logprobs, ids, _router(9), "w", fmt), student, ids
        )
        assert m.top1_count == exact.top1_count
        assert m.delta_p_mean == exact.delta_p_mean
        assert m.teacher_nll_sum == exact.teacher_nll_sum
        assert m.student_nll_sum == exact.student_nll_sum


def test_draws_come_from_the_tail_and_repeat_for_the_same_window():
    logprobs, _, ids = _case(seed=5, n_tok=6, n_vocab=200)
    fmt = TeacherCacheFormat("compact", 8, 32)
    a = compact_record(logprobs, ids, _router(6), "window-a", fmt)
    again = compact_record(logprobs, ids, _router(6), "window-a", fmt)
    other = compact_record(logprobs, ids, _router(6), "window-b", fmt)
    for name, array in a._asdict().items():
        np.testing.assert_array_equal(array, getattr(again, name), err_msg=name)
    assert (a.tail_ids != other.tail_ids).any()
    for row in range(6):
        assert not set(a.tail_ids[row]) & set(a.top_ids[row])
    lp = _np_log_softmax(logprobs)
    np.testing.assert_allclose(a.tail_logp, np.take_along_axis(lp, a.tail_ids, 1), atol=1e-5)
    p = np.exp(lp)
    tail_mass = 1.0 - np.take_along_axis(p, a.top_ids, 1).sum(axis=1)
    np.testing.assert_allclose(a.tail_mass, tail_mass, rtol=1e-5)


def test_stratified_draws_follow_the_tail_distribution():
    p = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    logp = np.log(p)[None, :].astype(np.float32)
    ids, mass, full = draw_tail(logp, np.array([[0]]), n_samples=1000, seed=7)
    assert full[0]
    assert mass[0] == pytest.approx(0.5, rel=1e-6)
    counts = np.bincount(ids[0], minlength=5) / 1000
    np.testing.assert_allclose(counts, [0, 0.6, 0.2, 0.12, 0.08], atol=2e-3)  # strata: +-1/S


def test_tail_draws_are_the_same_bits_on_any_number_of_threads(monkeypatch):
    """The rows are shared among the host's threads; each row's float64 sums are computed
    alone, so the ids, masses and flags are identical however the rows are split, and equal a
    plain one-row-at-a-time float64 reference. Rows cover the corner cases: a tail of zero
    probabilities, a top list with a repeated id, and no tail mass at all."""
    from healsweep.runtime import Runtime, use
    from healsweep.threads import THREAD_ENV, XLA_THREADS_ENV, use_threads

    for name in (*THREAD_ENV, XLA_THREADS_ENV):  # use_threads sets them: restored afterwards
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    rng = np.random.default_rng(3)
    n, n_vocab, k, n_samples = 37, 300, 6, 16
    logits = rng.standard_normal((n, n_vocab)) * 3
    logits[4, 40:] = -np.inf  # p = 0 beyond token 40: the tail is not full
    logits[6] = -np.inf
    logits[6, :k] = 0.0  # all of p in the top-K: no tail mass
    logp = (logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)).astype(np.float32)
    top = np.argsort(-logp, axis=1, kind="stable")[:, :k].astype(np.int32)
    top[9, 1] = top[9, 0]  # a repeated id leaves one more token in the tail

    def reference(row: int) -> tuple[np.ndarray, float, bool]:
        p = np.exp(logp[row].astype(np.float64))
        p[top[row]] = 0.0
        cdf = np.cumsum(p)
        u = np.random.default_rng(11).random((n, n_samples))[row]
        if cdf[-1] <= 0.0:
            return np.full(n_samples, top[row, 0]), 0.0, False
        picked = np.searchsorted(cdf, (np.arange(n_samples) + u) / n_samples * cdf[-1], "right")
        full = np.count_nonzero(p) == n_vocab - len(set(top[row]))
        return np.minimum(picked, np.flatnonzero(p)[-1]), cdf[-1], full

    runs = []
    for threads in (1, 3):
        with use(Runtime()):
            use_threads(threads)
            runs.append(draw_tail(logp, top, n_samples, seed=11))
    for one, many in zip(*runs, strict=True):
        np.testing.assert_array_equal(one, many)
    ids, mass, full = runs[0]
    for row in range(n):
        want_ids, want_mass, want_full = reference(row)
        np.testing.assert_array_equal(ids[row], want_ids, err_msg=str(row))
        assert mass[row] == want_mass and full[row] == want_full, row
    assert not full[4] and full[3] and mass[6] == 0.0 and full[9]


def test_formats_keys_and_sizes():
    assert cache_format("exact").kind == "exact"
    assert cache_format("compact") == TeacherCacheFormat()
    assert cache_format("compact:8:16") == TeacherCacheFormat("compact", 8, 16)
    for bad in ("approx", "compact:8", "compact:0:4", "exact:1:1"):
        with pytest.raises(CacheError, match="teacher cache"):
            cache_format(bad)
    assert record_bytes(TeacherCacheFormat(), 151_936) == 8 * (128 + 128) + 9 <= 3072
    assert record_bytes(cache_format("exact"), 151_936) == 4 * 151_936


def test_the_cache_key_names_format_and_size():
    from types import SimpleNamespace

    from healsweep.score.teacher_cache import teacher_key

    model = SimpleNamespace(fingerprint="f" * 64)
    window = SimpleNamespace(tokens=np.arange(10), scored_from=4, n_scored=6, window_id="w1")
    keys = {
        choice: teacher_key(model, window, choice)
        for choice in ("exact", "compact", "compact:32:32", "compact:64:32")
    }
    assert len(set(keys.values())) == 4
    assert keys["compact"] == teacher_key(model, window)  # compact is the default
    moved = SimpleNamespace(**{**vars(window), "window_id": "w2"})
    assert teacher_key(model, moved, "exact") == keys["exact"]  # the seed only keys compact
    assert teacher_key(model, moved, "compact") != keys["compact"]


def test_the_sweep_spec_takes_the_cache_choice_and_refuses_others():
    from healsweep.sweep.spec_files import spec_from_dict

    assert spec_from_dict({"name": "s"}).scoring.teacher_cache == "compact"
    spec = spec_from_dict({"name": "s", "scoring": {"teacher_cache": "exact"}})
    assert spec.scoring.teacher_cache == "exact"
    with pytest.raises(SpecError, match="teacher_cache"):
        spec_from_dict({"name": "s", "scoring": {"teacher_cache": "approx"}})
