"""KLD kernel against float64 numpy and closed forms, on toy and random logits."""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.conformance.references import kld as _np_kld
from healsweep.conformance.references import log_softmax as _np_log_softmax
from healsweep.kernels.kld import log_softmax, token_stats, topk_jaccard


def _random_logits(rng, n_tok=9, n_vocab=1000, scale=3.0):
    t = (rng.standard_normal((n_tok, n_vocab)) * scale).astype(np.float32)
    s = (t + rng.standard_normal((n_tok, n_vocab)) * 0.5).astype(np.float32)
    return t, s, rng.integers(0, n_vocab, n_tok).astype(np.int32)


def test_kld_of_a_distribution_with_itself_is_exactly_zero():
    t, _, ids = _random_logits(np.random.default_rng(0))
    stats = token_stats(t, t, ids)
    np.testing.assert_array_equal(np.asarray(stats.kld), 0.0)
    assert np.asarray(stats.top1_agree).all()
    np.testing.assert_array_equal(stats.teacher_logp_next, stats.student_logp_next)


def test_kld_is_nonnegative_and_matches_float64_numpy_with_odd_chunks():
    rng = np.random.default_rng(1)
    t, s, ids = _random_logits(rng, n_tok=17, n_vocab=1003)
    ref = _np_kld(t, s)
    assert (ref > 0).all()
    for chunk in (1003, 256, 97):  # 97 does not divide 1003: a ragged last chunk
        stats = token_stats(t, s, ids, chunk=chunk)
        kld = np.asarray(stats.kld)
        assert (kld >= 0).all()
        np.testing.assert_allclose(kld, ref, rtol=2e-5, atol=1e-7)
        np.testing.assert_array_equal(stats.teacher_argmax, t.argmax(axis=1))
        np.testing.assert_array_equal(stats.student_argmax, s.argmax(axis=1))
        lt, ls = _np_log_softmax(t), _np_log_softmax(s)
        rows = np.arange(len(ids))
        np.testing.assert_allclose(stats.teacher_logp_next, lt[rows, ids], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stats.student_logp_next, ls[rows, ids], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p,q", [(0.5, 0.5), (0.9, 0.6), (0.01, 0.3), (0.999, 0.5)])
def test_two_point_distributions_match_the_bernoulli_closed_form(p, q):
    # logits [0, logit(p)] give the distribution [1-p, p]
    t = np.array([[0.0, np.log(p / (1 - p))]], dtype=np.float32)
    s = np.array([[0.0, np.log(q / (1 - q))]], dtype=np.float32)
    closed = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    kld = float(np.asarray(token_stats(t, s, np.array([1], np.int32), chunk=1).kld)[0])
    assert kld == pytest.approx(closed, rel=1e-4, abs=1e-7)


def test_uniform_teacher_against_a_point_mass_like_student():
    # KL(uniform over V || softmax(s)) = -log V - mean_v log q_v in closed form
    n_vocab = 64
    s = np.zeros((1, n_vocab), dtype=np.float32)
    s[0, 5] = 8.0
    logq = _np_log_softmax(s)[0]
    closed = -np.log(n_vocab) - logq.mean()
    t = np.zeros((1, n_vocab), dtype=np.float32)
    kld = float(np.asarray(token_stats(t, s, np.array([5], np.int32), chunk=10).kld)[0])
    assert kld == pytest.approx(closed, rel=1e-5)


def test_huge_logits_stay_finite_and_shift_invariant():
    rng = np.random.default_rng(2)
    t, s, ids = _random_logits(rng, n_tok=5, n_vocab=300, scale=1.0)
    big_t, big_s = t * 1000 + 5e4, s * 1000 - 5e4  # exp would overflow without max-shift
    kld = np.asarray(token_stats(big_t, big_s, ids, chunk=64).kld)
    assert np.isfinite(kld).all()
    np.testing.assert_allclose(kld, _np_kld(big_t, big_s), rtol=1e-4, atol=1e-6)
    # adding a constant to every logit of a row changes nothing
    moved = np.asarray(token_stats(big_t - 5e4, big_s + 5e4, ids, chunk=64).kld)
    np.testing.assert_allclose(moved, kld, rtol=1e-4, atol=1e-6)


def test_tiny_kld_keeps_relative_precision():
    # A Q8_0-like perturbation: KL around 1e-6, where sum p (log p - log q) in float32 has an
    # absolute error of the same order. The kernel must stay within 1% of float64.
    rng = np.random.default_rng(5)
    t = (rng.standard_normal((8, 5000)) * 4.0).astype(np.float32)
    s = (t + rng.standard_normal((8, 5000)).astype(np.float32) * 2e-3).astype(np.float32)
    ref = _np_kld(t, s)
    assert ref.max() < 1e-5
    kld = np.asarray(token_stats(t, s, np.zeros(8, np.int32), chunk=1024).kld)
    np.testing.assert_allclose(kld, ref, rtol=1e-2)


def test_log_probs_in_place_of_logits_give_the_same_kld():
    t, s, ids = _random_logits(np.random.default_rng(3))
    logp_t = np.asarray(log_softmax(t, chunk=128))
    np.testing.assert_allclose(logp_t, _np_log_softmax(t), atol=2e-6)
    a = np.asarray(token_stats(t, s, ids).kld)
    b = np.asarray(token_stats(logp_t, s, ids).kld)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_zero_probability_teacher_tokens_contribute_nothing():
    t = np.array([[0.0, -np.inf, 1.0, -np.inf]], dtype=np.float32)
    s = np.array([[0.5, 0.2, 0.1, -1.0]], dtype=np.float32)
    p = np.exp(_np_log_softmax(t[:, [0, 2]]))[0]
    logq = _np_log_softmax(s)[0]
    closed = p[0] * (np.log(p[0]) - logq[0]) + p[1] * (np.log(p[1]) - logq[2])
    kld = float(np.asarray(token_stats(t, s, np.array([2], np.int32), chunk=3).kld)[0])
    assert np.isfinite(kld) and kld == pytest.approx(closed, rel=1e-5)


def test_ties_resolve_to_the_first_index_across_chunks():
    t = np.zeros((1, 10), dtype=np.float32)
    t[0, [3, 8]] = 2.0  # tie across the chunk boundary at 5
    s = np.zeros((1, 10), dtype=np.float32)
    s[0, 3] = 2.0
    stats = token_stats(t, s, np.array([0], np.int32), chunk=5)
    assert int(stats.teacher_argmax[0]) == 3 and bool(stats.top1_agree[0])


def test_topk_jaccard_matches_python_sets():
    rng = np.random.default_rng(4)
    a = np.stack([rng.choice(16, 4, replace=False) for _ in range(50)]).astype(np.int32)
    b = np.stack([rng.choice(16, 4, replace=False) for _ in range(50)]).astype(np.int32)
    b[:5] = a[:5][:, ::-1]  # same sets, other order
    ref = [len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in zip(a, b, strict=True)]
    got = np.asarray(topk_jaccard(a, b))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert (got[:5] == 1.0).all()


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="same"):
        token_stats(
            np.zeros((2, 5), np.float32), np.zeros((2, 6), np.float32), np.zeros(2, np.int32)
        )


def test_student_zero_where_teacher_has_mass_gives_infinite_kld():
    t = np.array([[0.0, 1.0, -np.inf]], dtype=np.float32)
    s = np.array([[0.0, -np.inf, -np.inf]], dtype=np.float32)
    assert np.isinf(np.asarray(token_stats(t, s, np.zeros(1, np.int32)).kld)[0])
