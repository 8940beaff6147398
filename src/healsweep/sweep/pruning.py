"""Per-window pruning as a Ray Tune scheduler that owns an Optuna study.

Ray's ``OptunaSearch`` has no pruner hook and keys intermediate values by
``training_iteration``, so pruning lives here instead. Every Tune trial maps to one trial of an
Optuna study kept in a journal file in the experiment directory; a resumed sweep reopens the same
journal and keeps its pruning history (the Tune trial id is stored as a user attribute). What
each window's result tells the study, and which Optuna pruner judges a trial (the futility rule
is a pruner wrapping the Wilcoxon one), is the spec's strategy
(:mod:`healsweep.sweep.pruners`); the scheduler only asks it.

The baseline is never pruned, and no trial is pruned on its last window (nothing left to save).
A pruned trial is told ``PRUNED`` to the study at once; its windows stay in the results.

Under a size budget with tiers (``budget: {routed_bpw: [2.0625, 2.3125]}``) a trial is judged
only against the trials of its own tier (the smallest limit it fits, sent with each result as
``budget_tier``): each tier has its own study in the journal, so a config at 2.06 bits is never
pruned for being worse than the best one at 2.31, which is not its competitor.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from healsweep.results.schema import scored_all
from healsweep.sweep.pruners import Strategy, strategy_of
from healsweep.sweep.spec import PrunerSpec
from healsweep.sweep.trial import TARGET_METRIC

STUDY_NAME = "healsweep-pruning"
JOURNAL_FILE = "optuna-pruning.journal"


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
    """A FIFO scheduler that stops trials its strategy's Optuna pruner judges worse than the
    best trial."""

    def __init__(self, journal_path: str | Path, pruner: PrunerSpec):
        """``pruner``: the spec's, of type ``wilcoxon`` or ``median``."""
        super().__init__()
        self.journal_path = str(journal_path)
        self.strategy: Strategy = strategy_of(pruner)
        self._studies: dict[str, Any] | None = None  # study name -> Optuna study (lazily)
        self._storage: Any = None
        self._live: dict[str, Any] = {}  # tune trial id -> its running optuna.trial.Trial
        self._live_in: dict[str, str] = {}  # tune trial id -> the name of that trial's study
        self._steps: dict[str, dict[int, float]] = {}  # tune trial id -> its reports by step
        self._done: set[str] = set()  # tune trial ids told their end (pruned: also in .pruned)
        self.pruned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(  # reopened from the journal
            _studies=None, _storage=None, _live={}, _live_in={}, _steps={}, _done=set()
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "kind" in state:  # pickled by a healsweep before strategies (a sweep still running)
            futility = state.pop("futility")
            state["strategy"] = strategy_of(
                PrunerSpec(
                    type=state.pop("kind"),
                    p_threshold=state.pop("p_threshold"),
                    n_startup_steps=state.pop("n_startup_steps"),
                    futility=futility if futility is not None else False,
                )
            )
        state.pop("_study", None)  # one study, pickled by a healsweep before budget tiers
        state.setdefault("_studies", None)
        state.setdefault("_storage", None)
        state.setdefault("_live_in", {})
        self.__dict__.update(state)

    # The study -----------------------------------------------------------------------------

    @property
    def study(self) -> Any:
        """The Optuna study of the trials outside any budget tier (a sweep without a budget:
        every trial)."""
        return self._study_named(STUDY_NAME)

    def study_of(self, tier: float | None) -> Any:
        """The study of the trials of budget tier ``tier`` (None: no budget)."""
        return self._study_named(STUDY_NAME if tier is None else f"{STUDY_NAME}-tier-{tier:g}")

    def _study_named(self, name: str) -> Any:
        self._reopen()
        if name not in self._studies:
            self._open(name)
        return self._studies[name]

    def _reopen(self) -> None:
        """On first use, open the journal and every pruning study it holds."""
        if self._studies is None:

            optuna.logging.set_verbosity(logging.WARNING)
            self._storage = JournalStorage(JournalFileBackend(self.journal_path))
            self._studies = {}
            for found in optuna.get_all_study_names(self._storage):
                if found == STUDY_NAME or found.startswith(f"{STUDY_NAME}-tier-"):
                    self._open(found)

    def _open(self, name: str) -> None:
        """Open (or create) study ``name``.

        Only Optuna's public API: a trial still running in the journal (the driver stopped
        while it ran) cannot be reported to again, so it is told ``FAIL`` and a new trial takes
        its place, carrying its attributes and every value it had reported."""

        study = self._studies[name] = optuna.create_study(
            storage=self._storage,
            study_name=name,
            direction="minimize",
            pruner=self.strategy.pruner(),
            load_if_exists=True,
        )
        trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        latest = {  # tune trial id -> its latest Optuna trial (a replaced one came first)
            t.user_attrs["tune_trial_id"]: t for t in trials if "tune_trial_id" in t.user_attrs
        }
        for tune_id, frozen in latest.items():
            if frozen.state.name != "RUNNING":
                self._done.add(tune_id)
                if frozen.state.name == "PRUNED":
                    self.pruned.add(tune_id)
                continue
            study.tell(frozen.number, state=TrialState.FAIL)
            self._live[tune_id] = self._new_trial(study, frozen.user_attrs)
            self._live_in[tune_id] = name
            for step, value in sorted(frozen.intermediate_values.items()):
                self._live[tune_id].report(value, step)
            self._steps[tune_id] = dict(frozen.intermediate_values)

    @staticmethod
    def _new_trial(study: Any, attrs: dict[str, Any]) -> Any:
        created = study.ask()
        for name, value in attrs.items():
            created.set_user_attr(name, value)
        return created

    def _optuna_trial(self, trial: Trial, result: dict[str, Any]) -> Any:
        """The running Optuna trial of a Tune trial (asked for on its first result), or None
        once it has been told its end."""
        self._reopen()  # a restored scheduler learns what was told
        if trial.trial_id in self._done:
            return None
        if trial.trial_id not in self._live:
            tier = result.get("budget_tier")
            study = self.study_of(tier)
            self._live[trial.trial_id] = self._new_trial(
                study,
                {
                    "tune_trial_id": trial.trial_id,
                    "config_hash": str(result.get("config_hash", "")),
                    "is_baseline": bool(result.get("is_baseline", False)),
                },
            )
            self._live_in[trial.trial_id] = study.study_name
            self._steps[trial.trial_id] = {}
        return self._live[trial.trial_id]

    def _tell(self, trial: Trial, value: float | None = None, state: str | None = None) -> None:
        study = self._study_named(self._live_in.pop(trial.trial_id))
        study.tell(self._live.pop(trial.trial_id), value, state=state and TrialState[state])
        self._done.add(trial.trial_id)
        if state == "PRUNED":
            self.pruned.add(trial.trial_id)

    # Tune hooks ----------------------------------------------------------------------------

    def on_trial_result(self, tune_controller: Any, trial: Trial, result: dict[str, Any]) -> str:
        """Record the window's value and decide CONTINUE or STOP (pruned)."""
        if "window_index" not in result or "kld_mean" not in result:
            return TrialScheduler.CONTINUE
        ot_trial = self._optuna_trial(trial, result)
        if ot_trial is None:
            return TrialScheduler.STOP if trial.trial_id in self.pruned else TrialScheduler.CONTINUE
        step, value = self.strategy.observation(result)
        if step not in self._steps[trial.trial_id]:
            ot_trial.report(value, step)
            self._steps[trial.trial_id][step] = value
        if result.get("is_baseline") or scored_all(result["windows_done"], result["windows_total"]):
            return TrialScheduler.CONTINUE
        if ot_trial.should_prune():
            self._tell(trial, state="PRUNED")
            return TrialScheduler.STOP
        return TrialScheduler.CONTINUE

    def on_trial_complete(self, tune_controller: Any, trial: Trial, result: dict[str, Any]) -> None:
        """Tell the study the trial's pooled KLD (a trial stopped by the pruner is already told)."""
        super().on_trial_complete(tune_controller, trial, result)
        if not result or TARGET_METRIC not in result:
            return
        self._reopen()  # a restored scheduler learns what was told
        if trial.trial_id not in self._live:
            return
        if scored_all(result.get("windows_done", 0), result.get("windows_total")):
            self._tell(trial, float(result[TARGET_METRIC]))
        else:
            self._tell(trial, state="PRUNED")

    def on_trial_error(self, tune_controller: Any, trial: Trial) -> None:
        """A trial that will not be retried is told ``FAIL``; a retried one keeps its history."""
        super().on_trial_error(tune_controller, trial)
        self._reopen()
        if trial.trial_id in self._live and not trial.should_recover():
            self._tell(trial, state="FAIL")
