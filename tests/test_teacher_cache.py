"""The compact teacher cache: the KL estimate against float64 numpy, its draws, keys and formats."""

from __future__ import annotations

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


def test_the_estimate_is_unbiased_across_many_blocks_of_the_vocabulary():
    """As above on a vocabulary of three levels of the device sampler's tree (its
    inverse CDF), a peaked teacher whose tail spans orders of magnitude."""
    from healsweep.kernels.tail_draws import FANOUT

    logprobs, student, ids = _case(seed=9, n_tok=6, n_vocab=FANOUT**2 + 500)
    logprobs = np.asarray(log_softmax(logprobs * 2.5))
    exact = float(_np_kld(logprobs, student).sum())
    fmt = TeacherCacheFormat("compact", top_k=8, tail_samples=4)
    sums = _estimates(logprobs, student, ids, fmt, "plain", n_seeds=300)
    assert sums.std(ddof=1) > 1e-3 * exact
    assert abs(sums.mean() - exact) < 4 * sums.std(ddof=1) / np.sqrt(len(sums))


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


def _reference_draws(logp: np.ndarray, top: np.ndarray, strata: np.ndarray):
    """Float64 numpy inverse-CDF draws, row by row: (ids, mass, full, cdf rows)."""
    ids, mass, full, cdfs = [], [], [], []
    for row in range(len(logp)):
        p = np.exp(logp[row].astype(np.float64))
        p[top[row]] = 0.0
        cdf = np.cumsum(p)
        cdfs.append(cdf)
        mass.append(cdf[-1])
        full.append(np.isfinite(np.delete(logp[row], np.unique(top[row]))).all())
        if cdf[-1] <= 0.0:
            ids.append(np.full(strata.shape[1], top[row, 0]))
            continue
        picked = np.searchsorted(cdf, strata[row] * cdf[-1], "right")
        ids.append(np.minimum(picked, np.flatnonzero(p)[-1]))
    return np.array(ids), np.array(mass), np.array(full), cdfs


@pytest.mark.parametrize("n_vocab", [300, 20_000])
def test_device_draws_match_a_float64_inverse_cdf(n_vocab):
    """The device's float32 two-level inverse CDF draws the token a float64 one draws, except
    where the target falls within float32 rounding of a token's edge; then the drawn token's
    float64 interval still holds the target to that rounding. Rows cover the corner cases: a
    tail of zero probabilities, a top list with a repeated id, no tail mass at all, and (at
    20,000 tokens) a peaked row whose tail holds tokens far below eps32 of the tail mass."""
    from healsweep.kernels.tail_draws import tail_draws
    from healsweep.score.compact import tail_strata

    rng = np.random.default_rng(3)
    n, k, n_samples = 37, 6, 64
    logits = rng.standard_normal((n, n_vocab)) * 3
    logits[4, 40:] = -np.inf  # p = 0 beyond token 40: the tail is not full
    logits[6] = -np.inf
    logits[6, :k] = 0.0  # all of p in the top-K: no tail mass
    logits[7] *= 8  # peaked: most tail tokens below 1e-12 of the tail mass
    logp = (logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)).astype(np.float32)
    top = np.argsort(-logp, axis=1, kind="stable")[:, :k].astype(np.int32)
    top[9, 1] = top[9, 0]  # a repeated id leaves one more token in the tail
    strata = tail_strata(11, n, n_samples)
    ids, tail_logp, mass, full = (np.asarray(a) for a in tail_draws(logp, top, strata))
    want_ids, want_mass, want_full, cdfs = _reference_draws(logp, top, strata)
    np.testing.assert_allclose(mass, want_mass, rtol=2e-6)
    np.testing.assert_array_equal(full, want_full)
    np.testing.assert_array_equal(tail_logp, np.take_along_axis(logp, ids, axis=1))
    assert not full[4] and full[3] and mass[6] == 0.0 and full[9]
    np.testing.assert_array_equal(ids[6], top[6, 0])  # the placeholder of an empty tail
    same = ids == want_ids
    assert same.mean() > 0.99, same.mean()
    for row, draw in zip(*np.nonzero(~same), strict=True):
        cdf, token = cdfs[row], ids[row, draw]
        assert token not in top[row] and np.exp(np.float64(logp[row, token])) > 0
        target = strata[row, draw] * cdf[-1]
        low = cdf[token - 1] if token else 0.0
        assert low - 1e-5 * cdf[-1] <= target <= cdf[token] + 1e-5 * cdf[-1], (row, draw)


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
