"""Per-window pruning as a Ray Tune scheduler that owns an Optuna study.

Ray's ``OptunaSearch`` has no pruner hook and keys intermediate values by
``training_iteration``, so pruning lives here instead. Every Tune trial maps to one trial of an
Optuna study kept in a journal file in the experiment directory; a resumed sweep reopens the same
journal and keeps its pruning history (the Tune trial id is stored as a user attribute).

- ``wilcoxon``: after each window the trial reports that window's mean KLD with ``step`` = the
  window's index in the sweep's fixed global order. ``optuna.pruners.WilcoxonPruner`` pairs those
  values with the best *completed* trial's values at the same steps (windows both have scored)
  and prunes when the trial is significantly worse. Trials score windows in shuffled orders, so
  the pairs are a random subset of windows that grows as the trial runs.
- ``median``: ``optuna.pruners.MedianPruner`` on the running pooled KLD with ``step`` = windows
  scored so far (it compares one step across trials, so it is given the running mean).
- ``futility`` (with ``wilcoxon``): a trial is also stopped once it can no longer end up
  demonstrably better than the best completed trial (see :func:`futile`).

The baseline is never pruned, and no trial is pruned on its last window (nothing left to save).
A pruned trial is told ``PRUNED`` to the study at once; its windows stay in the results.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from optuna.trial import TrialState
from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from healsweep.sweep.spec import PrunerSpec
from healsweep.sweep.trial import TARGET_METRIC

STUDY_NAME = "healsweep-pruning"
JOURNAL_FILE = "optuna-pruning.journal"


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


def repair_journal(path: str | Path) -> None:
    """Make a journal readable after a crash: drop a half-written last line and a stale lock.

    Call only while no other process writes to the journal (the driver holds the sweep lock).
    """
    path = Path(path)
    Path(f"{path}.lock").unlink(missing_ok=True)  # a symlink (Optuna's lock) or a file
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())


class WindowPruningScheduler(FIFOScheduler):
    """A FIFO scheduler that stops trials an Optuna pruner judges worse than the best trial."""

    def __init__(self, journal_path: str | Path, pruner: PrunerSpec):
        """``pruner``: the spec's, of type ``wilcoxon`` or ``median``."""
        super().__init__()
        self.journal_path = str(journal_path)
        self.kind = pruner.type
        self.p_threshold = pruner.p_threshold
        self.n_startup_steps = pruner.n_startup_steps
        self.futility = pruner.futility and pruner.futility.model_dump()
        self._study: Any = None
        self._live: dict[str, Any] = {}  # tune trial id -> its running optuna.trial.Trial
        self._steps: dict[str, dict[int, float]] = {}  # tune trial id -> its reports by step
        self._done: set[str] = set()  # tune trial ids told their end (pruned: also in .pruned)
        self.pruned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_study=None, _live={}, _steps={}, _done=set())  # reopened from the journal
        return state

    # The study -----------------------------------------------------------------------------

    def _pruner(self) -> Any:
        import optuna

        if self.kind == "wilcoxon":  # "experimental" since optuna 3.6; the API is what we use
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.pruners.WilcoxonPruner(
                    p_threshold=self.p_threshold, n_startup_steps=self.n_startup_steps
                )
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=self.n_startup_steps)

    @property
    def study(self) -> Any:
        """The Optuna study (opened lazily from the journal).

        Only Optuna's public API: a trial still running in the journal (the driver stopped
        while it ran) cannot be reported to again, so it is told ``FAIL`` and a new trial takes
        its place, carrying its attributes and every value it had reported."""
        if self._study is None:
            import optuna
            from optuna.storages import JournalStorage
            from optuna.storages.journal import JournalFileBackend

            optuna.logging.set_verbosity(logging.WARNING)
            storage = JournalStorage(JournalFileBackend(self.journal_path))
            self._study = optuna.create_study(
                storage=storage,
                study_name=STUDY_NAME,
                direction="minimize",
                pruner=self._pruner(),
                load_if_exists=True,
            )
            trials = sorted(self._study.get_trials(deepcopy=False), key=lambda t: t.number)
            latest = {  # tune trial id -> its latest Optuna trial (a replaced one came first)
                t.user_attrs["tune_trial_id"]: t for t in trials if "tune_trial_id" in t.user_attrs
            }
            for tune_id, frozen in latest.items():
                if frozen.state.name != "RUNNING":
                    self._done.add(tune_id)
                    if frozen.state.name == "PRUNED":
                        self.pruned.add(tune_id)
                    continue
                self._study.tell(frozen.number, state=TrialState.FAIL)
                self._live[tune_id] = self._new_trial(frozen.user_attrs)
                for step, value in sorted(frozen.intermediate_values.items()):
                    self._live[tune_id].report(value, step)
                self._steps[tune_id] = dict(frozen.intermediate_values)
        return self._study

    def _new_trial(self, attrs: dict[str, Any]) -> Any:
        created = self.study.ask()
        for name, value in attrs.items():
            created.set_user_attr(name, value)
        return created

    def _optuna_trial(self, trial: Any, result: dict[str, Any]) -> Any:
        """The running Optuna trial of a Tune trial (asked for on its first result), or None
        once it has been told its end."""
        self.study  # noqa: B018 - opens the journal: a restored scheduler learns what was told
        if trial.trial_id in self._done:
            return None
        if trial.trial_id not in self._live:
            self._live[trial.trial_id] = self._new_trial(
                {
                    "tune_trial_id": trial.trial_id,
                    "config_hash": str(result.get("config_hash", "")),
                    "is_baseline": bool(result.get("is_baseline", False)),
                }
            )
            self._steps[trial.trial_id] = {}
        return self._live[trial.trial_id]

    def _tell(self, trial: Any, value: float | None = None, state: str | None = None) -> None:
        self.study.tell(self._live.pop(trial.trial_id), value, state=state and TrialState[state])
        self._done.add(trial.trial_id)
        if state == "PRUNED":
            self.pruned.add(trial.trial_id)

    # Tune hooks ----------------------------------------------------------------------------

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        """Record the window's value and decide CONTINUE or STOP (pruned)."""
        if "window_index" not in result or "kld_mean" not in result:
            return TrialScheduler.CONTINUE
        ot_trial = self._optuna_trial(trial, result)
        if ot_trial is None:
            return TrialScheduler.STOP if trial.trial_id in self.pruned else TrialScheduler.CONTINUE
        if self.kind == "wilcoxon":
            step, value = int(result["window_index"]), float(result["kld_mean"])
        else:
            step, value = int(result["windows_done"]), float(result[TARGET_METRIC])
        if step not in self._steps[trial.trial_id]:
            ot_trial.report(value, step)
            self._steps[trial.trial_id][step] = value
        if result.get("is_baseline") or result["windows_done"] >= result["windows_total"]:
            return TrialScheduler.CONTINUE
        if ot_trial.should_prune() or self._futile(trial, int(result["windows_total"])):
            self._tell(trial, state="PRUNED")
            return TrialScheduler.STOP
        return TrialScheduler.CONTINUE

    def _futile(self, trial: Any, windows_total: int) -> bool:
        if self.futility is None:
            return False
        try:
            best = self.study.best_trial
        except ValueError:  # no completed trial yet
            return False
        from healsweep.score.stats import DecisionRule

        return futile(self._steps[trial.trial_id], best.intermediate_values, windows_total,
                      ci_level=DecisionRule().ci_level, **self.futility)  # fmt: skip

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> None:
        """Tell the study the trial's pooled KLD (a trial stopped by the pruner is already told)."""
        super().on_trial_complete(tune_controller, trial, result)
        if not result or TARGET_METRIC not in result:
            return
        self.study  # noqa: B018 - opens the journal: a restored scheduler learns what was told
        if trial.trial_id not in self._live:
            return
        if result.get("windows_done", 0) >= result.get("windows_total", 1):
            self._tell(trial, float(result[TARGET_METRIC]))
        else:
            self._tell(trial, state="PRUNED")

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        """A trial that will not be retried is told ``FAIL``; a retried one keeps its history."""
        super().on_trial_error(tune_controller, trial)
        self.study  # noqa: B018 - opens the journal (see on_trial_complete)
        if trial.trial_id in self._live and not trial.should_recover():
            self._tell(trial, state="FAIL")
