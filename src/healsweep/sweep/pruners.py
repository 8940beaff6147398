"""What the pruning scheduler asks of each trial (:mod:`healsweep.sweep.pruning`): one small
class per pruning strategy, and the futility rule as an Optuna pruner that wraps another (the
shape of ``optuna.pruners.PatientPruner``).

A strategy says which value of a window's result the Optuna study is told, at which step, and
which Optuna pruner judges the trial:

- :class:`PairedWindows` (``wilcoxon``): each window's mean KLD at ``step`` = the window's index
  in the sweep's fixed global order; ``optuna.pruners.WilcoxonPruner`` pairs those values with
  the best *completed* trial's at the same steps (windows both have scored) and prunes when the
  trial is significantly worse. Trials score windows in shuffled orders, so the pairs are a
  random subset of windows that grows as the trial runs. With ``futility`` it is wrapped in a
  :class:`FutilityPruner`.
- :class:`RunningMedian` (``median``): ``optuna.pruners.MedianPruner`` on the running pooled KLD
  at ``step`` = windows scored so far (it compares one step across trials).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.pruners import BasePruner

from healsweep.score.stats import DecisionRule
from healsweep.sweep.spec import FutilitySpec, PrunerSpec
from healsweep.sweep.trial import TARGET_METRIC


def futile(
    trial_values: Mapping[int, float],
    best_values: Mapping[int, float],
    windows_total: int,
    confidence: float,
    min_windows: int,
    ci_level: float,
) -> bool:
    """True when a trial can no longer beat the best completed trial by what the decision rule
    needs: a relative improvement whose ``ci_level`` CI over ``windows_total`` windows excludes 0,
    about ``z * sd / sqrt(N)``. The best, not the baseline: the rule judges against the baseline,
    but a sweep's answer is its best config, and the baseline is a completed trial too, so the
    best is never worse. On the ``n`` shared windows ``d = (trial - best) / mean(best)`` (pooled
    relative change, delta method); the one-sided ``confidence`` Student-t upper bound of the
    improvement, ``-mean(d) + t * sd(d) / sqrt(n)``, is closed-form and fair for window means at
    n >= ~10 (a Hoeffding bound would need a KLD range that does not exist)."""
    shared = sorted(set(trial_values) & set(best_values))
    n = len(shared)
    if n < max(min_windows, 2):
        return False
    # lazy: heavy (scipy)
    from scipy import stats

    trial = np.array([trial_values[s] for s in shared], dtype=np.float64)
    best = np.array([best_values[s] for s in shared], dtype=np.float64)
    scale = best.mean()
    if not (np.isfinite(trial).all() and np.isfinite(best).all() and scale > 0):
        return False  # bad data: never stop a trial on it
    rel = (trial - best) / scale  # [n]
    sd = rel.std(ddof=1)
    upper = -rel.mean() + stats.t.ppf(confidence, n - 1) * sd / np.sqrt(n)
    needed = stats.norm.ppf(0.5 + ci_level / 2) * sd / np.sqrt(max(windows_total, n))
    return bool(upper < needed)


class FutilityPruner(BasePruner):
    """Prunes what ``wrapped`` prunes, and also a trial that is :func:`futile` against the
    study's best completed trial. Its per-window values are the steps of both; the windows a
    trial has (``N`` of the decision rule) are those the best completed trial reported, since
    a completed trial reported every window."""

    def __init__(self, wrapped: BasePruner, futility: FutilitySpec, ci_level: float) -> None:
        self._wrapped = wrapped
        self._futility = futility
        self._ci_level = ci_level

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        """``wrapped``'s decision, or futility once a trial has completed."""
        if self._wrapped.prune(study, trial):
            return True
        try:
            best = study.best_trial
        except ValueError:  # no completed trial yet
            return False
        return futile(
            trial.intermediate_values,
            best.intermediate_values,
            len(best.intermediate_values),
            self._futility.confidence,
            self._futility.min_windows,
            self._ci_level,
        )


@dataclass(frozen=True)
class PairedWindows:
    """``wilcoxon``: each window's KLD, paired with the best trial's by window (module doc)."""

    p_threshold: float
    n_startup_steps: int
    futility: FutilitySpec | None

    def observation(self, result: Mapping[str, Any]) -> tuple[int, float]:
        """``(step, value)`` the study is told for a window's result."""
        return int(result["window_index"]), float(result["kld_mean"])

    def pruner(self) -> BasePruner:
        """The Optuna pruner that judges a trial."""

        with warnings.catch_warnings():  # "experimental" since optuna 3.6; the API is what we use
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            paired = optuna.pruners.WilcoxonPruner(
                p_threshold=self.p_threshold, n_startup_steps=self.n_startup_steps
            )
        if self.futility is None:
            return paired
        return FutilityPruner(paired, self.futility, DecisionRule().ci_level)


@dataclass(frozen=True)
class RunningMedian:
    """``median``: the running pooled KLD against the median of the trials at that step."""

    n_startup_steps: int

    def observation(self, result: Mapping[str, Any]) -> tuple[int, float]:
        """``(step, value)`` the study is told for a window's result."""

        return int(result["windows_done"]), float(result[TARGET_METRIC])

    def pruner(self) -> BasePruner:
        """The Optuna pruner that judges a trial."""
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=self.n_startup_steps)


Strategy = PairedWindows | RunningMedian


def strategy_of(spec: PrunerSpec) -> Strategy:
    """The strategy of a spec's pruner (of type ``wilcoxon`` or ``median``)."""
    if spec.type == "wilcoxon":
        return PairedWindows(spec.p_threshold, spec.n_startup_steps, spec.futility)
    if spec.type == "median":
        return RunningMedian(spec.n_startup_steps)
    raise ValueError(f"strategy_of: pruner type {spec.type!r} prunes nothing")
