"""Pooling, paired bootstrap and decision rule against numpy/scipy re-implementations."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from healsweep.score.metrics import WindowMetrics
from healsweep.score.stats import DecisionRule, decision, paired_compare, pooled


def _wm(
    kld_sum: float,
    n: int,
    top1_count: int,
    nll_t: float = 1.0,
    nll_s: float = 1.5,
    jac: float = 1.0,
) -> WindowMetrics:
    return WindowMetrics(
        kld_sum=kld_sum,
        kld_count=n,
        kld_mean=kld_sum / n,
        top1=top1_count / n,
        top1_count=top1_count,
        delta_p_mean=-0.01,
        teacher_nll_sum=nll_t * n,
        student_nll_sum=nll_s * n,
        router_jaccard=jac,
        kld_p50=0.0,
        kld_p90=0.0,
        kld_p99=0.0,
        kld_p999=0.0,
        kld_max=0.0,
    )


def _simulate(rng, n_win=80, effect_log=-0.22, sd=0.25):
    """Paired windows whose true pooled-KLD ratio is exp(effect_log + sd^2/2)."""
    n = rng.integers(20, 129, n_win)
    per_tok = rng.gamma(2.0, 0.1, n_win)
    base_sum = n * per_tok
    ratio = np.exp(rng.normal(effect_log, sd, n_win))
    top_b = rng.binomial(n, 0.8)
    top_v = np.clip(top_b + rng.binomial(n, 0.05) - rng.binomial(n, 0.05), 0, n)
    base = [_wm(float(k), int(c), int(t)) for k, c, t in zip(base_sum, n, top_b, strict=True)]
    var = [
        _wm(float(k * r), int(c), int(t))
        for k, r, c, t in zip(base_sum, ratio, n, top_v, strict=True)
    ]
    return base, var


def test_pooled_is_token_weighted_with_strata_and_macro():
    ms = [_wm(1.0, 10, 5), _wm(6.0, 30, 27), _wm(2.0, 100, 50)]
    strata = ["a", "a", "b"]
    out = pooled(ms, strata)
    assert out["kld_mean"] == pytest.approx(9.0 / 140)
    assert out["top1"] == pytest.approx(82 / 140)
    assert out["n_tokens"] == 140 and out["n_windows"] == 3
    assert out["per_stratum"]["a"]["kld_mean"] == pytest.approx(7.0 / 40)
    assert out["per_stratum"]["b"]["top1"] == pytest.approx(0.5)
    assert out["kld_macro"] == pytest.approx((7.0 / 40 + 2.0 / 100) / 2)
    assert out["teacher_ppl"] == pytest.approx(np.exp(1.0))
    assert out["student_ppl"] == pytest.approx(np.exp(1.5))


def test_self_comparison_is_zero_change_and_not_accepted():
    base, _ = _simulate(np.random.default_rng(0), n_win=30)
    comp = paired_compare(base, base, ["s"] * 30, n_boot=500)
    assert comp.rel_change == 0.0 and comp.rel_change_ci() == (0.0, 0.0)
    assert comp.ties == 30 and comp.wins == comp.losses == 0
    verdict = decision(comp)
    assert not verdict.accepted and not verdict.checks["kld_improves"]


def test_point_estimates_wins_and_strata_match_numpy():
    rng = np.random.default_rng(1)
    base, var = _simulate(rng, n_win=40)
    strata = ["x" if i % 3 else "y" for i in range(40)]
    comp = paired_compare(base, var, strata, n_boot=200, seed=3)
    kb = np.array([m.kld_sum for m in base])
    kv = np.array([m.kld_sum for m in var])
    n = np.array([m.kld_count for m in base])
    assert comp.rel_change == pytest.approx((kv.sum() / n.sum()) / (kb.sum() / n.sum()) - 1)
    assert comp.wins == int((kv / n < kb / n).sum())
    assert comp.wins + comp.losses + comp.ties == 40
    y = np.array(strata) == "y"
    assert comp.per_stratum["y"].rel_change == pytest.approx(kv[y].sum() / kb[y].sum() - 1)
    tb = np.array([m.top1_count for m in base])
    tv = np.array([m.top1_count for m in var])
    assert comp.top1_delta_points == pytest.approx(100 * (tv.sum() - tb.sum()) / n.sum())


def test_bootstrap_ci_agrees_with_scipy_paired_percentile_bootstrap():
    base, var = _simulate(np.random.default_rng(2), n_win=60)
    kb = np.array([m.kld_sum for m in base])
    kv = np.array([m.kld_sum for m in var])
    n = np.array([m.kld_count for m in base], dtype=float)
    ref = sps.bootstrap(
        (kb, kv, n),
        lambda b, v, c, axis=-1: (v.sum(axis) / c.sum(axis)) / (b.sum(axis) / c.sum(axis)) - 1,
        paired=True,
        vectorized=True,
        n_resamples=10_000,
        method="percentile",
        random_state=7,
        confidence_level=0.95,
    ).confidence_interval
    comp = paired_compare(base, var, ["s"] * 60)  # 10,000 resamples, seed 0
    lo, hi = comp.rel_change_ci(0.95)
    width = ref.high - ref.low
    assert abs(lo - ref.low) < 0.05 * width and abs(hi - ref.high) < 0.05 * width
    assert comp.boot_rel_change.shape == (10_000,)


def test_same_seed_same_ci_other_seed_close():
    base, var = _simulate(np.random.default_rng(3), n_win=25)
    a = paired_compare(base, var, ["s"] * 25, n_boot=2000, seed=11)
    b = paired_compare(base, var, ["s"] * 25, n_boot=2000, seed=11)
    c = paired_compare(base, var, ["s"] * 25, n_boot=2000, seed=12)
    assert a.rel_change_ci() == b.rel_change_ci()
    assert a.rel_change_ci() != c.rel_change_ci()
    assert np.allclose(a.rel_change_ci(), c.rel_change_ci(), atol=0.03)


def test_bootstrap_ci_covers_the_true_effect_about_95_percent_of_the_time():
    rng = np.random.default_rng(4)
    effect_log, sd = np.log(0.8), 0.25
    truth = np.exp(effect_log + sd**2 / 2) - 1  # E[ratio] - 1, ratio independent of sums
    hits = 0
    for sim in range(400):
        base, var = _simulate(rng, n_win=80, effect_log=effect_log, sd=sd)
        lo, hi = paired_compare(base, var, ["s"] * 80, n_boot=400, seed=sim).rel_change_ci()
        hits += lo <= truth <= hi
    assert 0.90 <= hits / 400 <= 0.99


@pytest.fixture
def clear_win():
    base, var = _simulate(np.random.default_rng(5), n_win=60, effect_log=np.log(0.7), sd=0.1)
    return base, var


def test_decision_accepts_a_clear_improvement(clear_win):
    base, var = clear_win
    verdict = decision(paired_compare(base, var, ["a", "b"] * 30, n_boot=2000))
    assert verdict.accepted, verdict.reasons
    assert len(verdict.reasons) == 3 and all(r.endswith("pass") for r in verdict.reasons)


def test_decision_rejects_when_the_ci_includes_zero():
    base, var = _simulate(np.random.default_rng(6), n_win=40, effect_log=0.0, sd=0.3)
    verdict = decision(paired_compare(base, var, ["a"] * 40, n_boot=2000))
    assert not verdict.checks["kld_improves"] and not verdict.accepted


def test_decision_rejects_a_regressing_stratum_unless_the_threshold_allows_it(clear_win):
    base, var = clear_win
    var = list(var)
    strata = ["good"] * 50 + ["bad"] * 10
    for i in range(50, 60):  # the 'bad' stratum gets 15% worse
        m = base[i]
        var[i] = _wm(m.kld_sum * 1.15, m.kld_count, m.top1_count)
    comp = paired_compare(base, var, strata, n_boot=2000)
    strict = decision(comp)
    assert comp.per_stratum["bad"].rel_change == pytest.approx(0.15)
    assert not strict.accepted and not strict.checks["no_stratum_regression"]
    assert "bad +15.0%" in strict.reasons[1]
    assert decision(comp, DecisionRule(max_stratum_regression=0.2)).accepted


def test_decision_rejects_a_top1_drop_beyond_the_allowed_points(clear_win):
    base, var = clear_win
    var = [
        _wm(v.kld_sum, v.kld_count, b.top1_count - int(0.03 * b.kld_count) - 1)
        for b, v in zip(base, var, strict=True)
    ]  # ~3 pt worse top-1
    comp = paired_compare(base, var, ["a"] * 60, n_boot=2000)
    assert comp.top1_delta_points < -3.0
    verdict = decision(comp)
    assert not verdict.accepted and not verdict.checks["top1_noninferior"]
    assert decision(comp, DecisionRule(max_top1_drop_points=5.0)).accepted


def test_mismatched_windows_are_rejected():
    base, var = _simulate(np.random.default_rng(7), n_win=5)
    with pytest.raises(ValueError, match="same"):
        paired_compare(base, var[:4], ["s"] * 5)
    with pytest.raises(ValueError, match="token counts"):
        paired_compare(base, [_wm(1.0, m.kld_count + 1, 0) for m in base], ["s"] * 5)
    with pytest.raises(ValueError, match="ci_level"):
        DecisionRule(ci_level=1.5)
