"""Pooling of window metrics, paired comparison of two configs, and the decision rule.

Means are token-pooled: ``sum(kld_sum) / sum(kld_count)`` over windows, never a mean of window
means (a short window must not weigh as much as a long one). A paired comparison runs both
configs on the *same* windows and resamples windows (not tokens: tokens of one window are
correlated) with replacement, ``n_boot`` times with a seeded generator, to get a percentile
confidence interval of the relative change of pooled KLD and of the top-1 change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from healsweep.score.record import WindowMetrics

_BOOT_CELLS = 4_000_000  # resample indices held at once: bounds memory to ~32 MB


def _columns(metrics: Sequence[WindowMetrics]) -> dict[str, np.ndarray]:
    return {
        "kld": np.array([m.kld_sum for m in metrics], dtype=np.float64),
        "n": np.array([m.kld_count for m in metrics], dtype=np.float64),
        "top1": np.array([m.top1_count for m in metrics], dtype=np.float64),
        "dp": np.array([m.delta_p_mean * m.kld_count for m in metrics], dtype=np.float64),
        "nll_t": np.array([m.teacher_nll_sum for m in metrics], dtype=np.float64),
        "nll_s": np.array([m.student_nll_sum for m in metrics], dtype=np.float64),
        "jac": np.array([m.router_jaccard for m in metrics], dtype=np.float64),
    }


def _pool(cols: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, Any]:
    n = cols["n"][mask].sum()
    jac = cols["jac"][mask]
    weights = cols["n"][mask]
    has_jac = ~np.isnan(jac)
    return {
        "n_windows": int(mask.sum()),
        "n_tokens": int(n),
        "kld_mean": float(cols["kld"][mask].sum() / n),
        "top1": float(cols["top1"][mask].sum() / n),
        "delta_p_mean": float(cols["dp"][mask].sum() / n),
        "teacher_ppl": math.exp(cols["nll_t"][mask].sum() / n),
        "student_ppl": math.exp(cols["nll_s"][mask].sum() / n),
        "router_jaccard": (
            float(np.average(jac[has_jac], weights=weights[has_jac]))
            if has_jac.any()
            else float("nan")
        ),
    }


def pooled(metrics: Sequence[WindowMetrics], strata: Sequence[str] | None = None) -> dict[str, Any]:
    """Token-pooled figures over windows, plus per-stratum figures and macro means over strata.

    Returns ``n_windows, n_tokens, kld_mean, top1, delta_p_mean, teacher_ppl, student_ppl,
    router_jaccard`` and, when ``strata`` is given, ``per_stratum: {name: same keys}``,
    ``kld_macro`` and ``top1_macro`` (unweighted means over strata).
    """
    if not metrics:
        raise ValueError("pooled: no window metrics to pool")
    cols = _columns(metrics)
    result = _pool(cols, np.ones(len(metrics), dtype=bool))
    if strata is not None:
        labels = _labels(strata, len(metrics), "pooled")
        per = {s: _pool(cols, labels == s) for s in sorted(set(labels.tolist()))}
        result["per_stratum"] = per
        result["kld_macro"] = float(np.mean([p["kld_mean"] for p in per.values()]))
        result["top1_macro"] = float(np.mean([p["top1"] for p in per.values()]))
    return result


def _labels(strata: Sequence[str], n: int, where: str) -> np.ndarray:
    labels = np.asarray(list(strata), dtype=object)
    if labels.shape != (n,):
        raise ValueError(f"{where}: {labels.shape[0]} strata for {n} windows")
    return labels


@dataclass(frozen=True)
class StratumChange:
    """Point estimates of one stratum in a paired comparison."""

    n_windows: int
    n_tokens: int
    base_kld: float
    variant_kld: float
    rel_change: float
    top1_delta_points: float


@dataclass(frozen=True)
class Comparison:
    """A variant against a base on the same windows (``rel_change < 0`` = variant better).

    ``boot_rel_change`` and ``boot_top1_delta`` hold the bootstrap replicates so that any CI
    level can be read off later with :meth:`rel_change_ci` / :meth:`top1_delta_ci`.
    """

    n_windows: int
    n_tokens: int
    base_kld: float
    variant_kld: float
    rel_change: float
    base_top1: float
    variant_top1: float
    top1_delta_points: float
    wins: int
    losses: int
    ties: int
    per_stratum: dict[str, StratumChange]
    n_boot: int
    seed: int
    boot_rel_change: np.ndarray = field(repr=False)
    boot_top1_delta: np.ndarray = field(repr=False)

    def rel_change_ci(self, level: float = 0.95) -> tuple[float, float]:
        """Percentile bootstrap CI of the relative change of pooled KLD."""
        return percentile_ci(self.boot_rel_change, level)

    def top1_delta_ci(self, level: float = 0.95) -> tuple[float, float]:
        """Percentile bootstrap CI of the pooled top-1 change, in points."""
        return percentile_ci(self.boot_top1_delta, level)

    def to_dict(self, level: float = 0.95) -> dict[str, Any]:
        """JSON-ready summary with CIs at ``level`` (replicates left out)."""
        return {
            "n_windows": self.n_windows,
            "n_tokens": self.n_tokens,
            "base_kld": self.base_kld,
            "variant_kld": self.variant_kld,
            "rel_change": self.rel_change,
            "rel_change_ci": list(self.rel_change_ci(level)),
            "base_top1": self.base_top1,
            "variant_top1": self.variant_top1,
            "top1_delta_points": self.top1_delta_points,
            "top1_delta_ci": list(self.top1_delta_ci(level)),
            "wins": self.wins,
            "losses": self.losses,
            "ties": self.ties,
            "ci_level": level,
            "n_boot": self.n_boot,
            "seed": self.seed,
            "per_stratum": {k: vars(v) for k, v in self.per_stratum.items()},
        }


def percentile_ci(replicates: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile bootstrap CI at ``level`` of ``replicates``."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"ci level must be in (0, 1), got {level}")
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(replicates, [tail, 1.0 - tail])
    return float(lo), float(hi)


def _rel(variant_sum: np.ndarray | float, base_sum: np.ndarray | float) -> np.ndarray | float:
    """``variant / base - 1``; 0 where both are 0 (no change), inf/NaN where only base is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.divide(variant_sum, base_sum) - 1.0
    both_zero = np.logical_and(np.asarray(variant_sum) == 0, np.asarray(base_sum) == 0)
    return np.where(both_zero, 0.0, rel)


def bootstrap_replicates(
    base: dict[str, np.ndarray], variant: dict[str, np.ndarray], n_boot: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Window-resampled replicates of (relative KLD change, top-1 delta in points), ``[n_boot]``.

    Columns are per-window sums (``kld``, ``top1``) and token counts (``n``) as float64.
    Resampling is vectorised in blocks so memory stays bounded for many windows.
    """
    rng = np.random.default_rng(seed)
    n_win = base["n"].shape[0]
    block = max(1, _BOOT_CELLS // max(n_win, 1))
    rel, top1 = [], []
    for start in range(0, n_boot, block):
        rows = min(block, n_boot - start)
        idx = rng.integers(0, n_win, size=(rows, n_win))  # [B, N]
        n_tok = base["n"][idx].sum(axis=1)  # [B]
        kb, kv = base["kld"][idx].sum(axis=1), variant["kld"][idx].sum(axis=1)
        rel.append(_rel(kv / n_tok, kb / n_tok))
        tb, tv = base["top1"][idx].sum(axis=1), variant["top1"][idx].sum(axis=1)
        top1.append(100.0 * (tv - tb) / n_tok)
    return np.concatenate(rel), np.concatenate(top1)


def paired_compare(
    base: Sequence[WindowMetrics],
    variant: Sequence[WindowMetrics],
    strata: Sequence[str],
    n_boot: int = 10_000,
    seed: int = 0,
) -> Comparison:
    """Compare ``variant`` with ``base`` window by window (same windows, same order)."""
    if len(base) != len(variant) or not base:
        raise ValueError(
            f"paired_compare: needs the same non-empty windows, got {len(base)} base and "
            f"{len(variant)} variant"
        )
    cb, cv = _columns(base), _columns(variant)
    if not np.array_equal(cb["n"], cv["n"]):
        raise ValueError("paired_compare: base and variant score different token counts per window")
    labels = _labels(strata, len(base), "paired_compare")
    n_tok = cb["n"].sum()
    boot_rel, boot_top1 = bootstrap_replicates(cb, cv, n_boot, seed)
    mean_b, mean_v = cb["kld"] / cb["n"], cv["kld"] / cv["n"]
    per = {}
    for s in sorted(set(labels.tolist())):
        m = labels == s
        nt = cb["n"][m].sum()
        per[s] = StratumChange(
            n_windows=int(m.sum()),
            n_tokens=int(nt),
            base_kld=float(cb["kld"][m].sum() / nt),
            variant_kld=float(cv["kld"][m].sum() / nt),
            rel_change=float(_rel(cv["kld"][m].sum(), cb["kld"][m].sum())),
            top1_delta_points=float(100.0 * (cv["top1"][m].sum() - cb["top1"][m].sum()) / nt),
        )
    return Comparison(
        n_windows=len(base),
        n_tokens=int(n_tok),
        base_kld=float(cb["kld"].sum() / n_tok),
        variant_kld=float(cv["kld"].sum() / n_tok),
        rel_change=float(_rel(cv["kld"].sum(), cb["kld"].sum())),
        base_top1=float(cb["top1"].sum() / n_tok),
        variant_top1=float(cv["top1"].sum() / n_tok),
        top1_delta_points=float(100.0 * (cv["top1"].sum() - cb["top1"].sum()) / n_tok),
        wins=int((mean_v < mean_b).sum()),
        losses=int((mean_v > mean_b).sum()),
        ties=int((mean_v == mean_b).sum()),
        per_stratum=per,
        n_boot=n_boot,
        seed=seed,
        boot_rel_change=boot_rel,
        boot_top1_delta=boot_top1,
    )


@dataclass(frozen=True)
class DecisionRule:
    """Thresholds of the acceptance rule (DESIGN.md): all three checks must pass.

    (i) the CI of the pooled-KLD relative change at ``ci_level`` lies entirely below 0;
    (ii) no stratum's pooled KLD rises by more than ``max_stratum_regression`` (relative);
    (iii) pooled top-1 drops by at most ``max_top1_drop_points`` percentage points.
    """

    max_stratum_regression: float = 0.10
    max_top1_drop_points: float = 1.0
    ci_level: float = 0.95

    def __post_init__(self) -> None:
        if self.max_stratum_regression < 0 or self.max_top1_drop_points < 0:
            raise ValueError("DecisionRule: thresholds must be >= 0")
        if not 0.0 < self.ci_level < 1.0:
            raise ValueError(f"DecisionRule: ci_level must be in (0, 1), got {self.ci_level}")


@dataclass(frozen=True)
class Verdict:
    """Outcome of the decision rule: ``accepted`` and one reason line per check."""

    accepted: bool
    checks: dict[str, bool]
    reasons: tuple[str, ...]


def decision(comparison: Comparison, rule: DecisionRule | None = None) -> Verdict:
    """Apply the decision rule to a paired comparison (variant vs base)."""
    rule = rule or DecisionRule()
    pct = int(round(rule.ci_level * 100))
    lo, hi = comparison.rel_change_ci(rule.ci_level)
    kld_ok = bool(np.isfinite(hi) and hi < 0.0)
    checks = {"kld_improves": kld_ok}
    reasons = [
        f"pooled KLD {comparison.rel_change:+.2%} [{pct}% CI {lo:+.2%}, {hi:+.2%}] "
        + ("excludes 0: pass" if kld_ok else "does not lie below 0: fail")
    ]
    worst = _worst_strata(comparison.per_stratum.items(), rule.max_stratum_regression)
    checks["no_stratum_regression"] = not worst
    reasons.append(
        f"no stratum regresses by more than {rule.max_stratum_regression:.0%}: pass"
        if not worst
        else "strata regress by more than "
        f"{rule.max_stratum_regression:.0%}: " + ", ".join(worst) + ": fail"
    )
    t_lo, t_hi = comparison.top1_delta_ci(rule.ci_level)
    top1_ok = comparison.top1_delta_points >= -rule.max_top1_drop_points
    checks["top1_noninferior"] = top1_ok
    reasons.append(
        f"top-1 {comparison.top1_delta_points:+.2f} pt [{pct}% CI {t_lo:+.2f}, {t_hi:+.2f}] "
        f"vs allowed drop {rule.max_top1_drop_points:.2f} pt: " + ("pass" if top1_ok else "fail")
    )
    return Verdict(accepted=all(checks.values()), checks=checks, reasons=tuple(reasons))


def _worst_strata(items: Iterable[tuple[str, StratumChange]], limit: float) -> list[str]:
    bad = [
        (name, ch.rel_change)
        for name, ch in items
        if not np.isfinite(ch.rel_change) or ch.rel_change > limit
    ]
    return [f"{name} {change:+.1%}" for name, change in sorted(bad, key=lambda x: -x[1])]


__all__ = [
    "Comparison",
    "DecisionRule",
    "StratumChange",
    "Verdict",
    "bootstrap_replicates",
    "decision",
    "paired_compare",
    "pooled",
]
