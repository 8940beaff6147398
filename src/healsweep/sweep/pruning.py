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
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

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
        self._study: Any = None
        self._live: dict[str, Any] = {}  # tune trial id -> its running optuna.trial.Trial
        self._steps: dict[str, dict[int, float]] = {}  # tune trial id -> its reports by step
        self._done: set[str] = set()  # tune trial ids told their end (pruned: also in .pruned)
        self.pruned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_study=None, _live={}, _steps={}, _done=set())  # reopened from the journal
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
        self.__dict__.update(state)

    # The study -----------------------------------------------------------------------------

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
                pruner=self.strategy.pruner(),
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

    def _optuna_trial(self, trial: Trial, result: dict[str, Any]) -> Any:
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

    def _tell(self, trial: Trial, value: float | None = None, state: str | None = None) -> None:
        self.study.tell(self._live.pop(trial.trial_id), value, state=state and TrialState[state])
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
        self.study  # noqa: B018 - opens the journal: a restored scheduler learns what was told
        if trial.trial_id not in self._live:
            return
        if scored_all(result.get("windows_done", 0), result.get("windows_total")):
            self._tell(trial, float(result[TARGET_METRIC]))
        else:
            self._tell(trial, state="PRUNED")

    def on_trial_error(self, tune_controller: Any, trial: Trial) -> None:
        """A trial that will not be retried is told ``FAIL``; a retried one keeps its history."""
        super().on_trial_error(tune_controller, trial)
        self.study  # noqa: B018 - opens the journal (see on_trial_complete)
        if trial.trial_id in self._live and not trial.should_recover():
            self._tell(trial, state="FAIL")
