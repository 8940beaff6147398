"""The pruning scheduler: paired Wilcoxon and futility decisions against the best completed
trial (checked against scipy), the baseline never pruned, and a journal that outlives the
scheduler object."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import optuna
import pytest
from ray.tune.schedulers import TrialScheduler
from scipy import stats

from healsweep.sweep.pruners import futile
from healsweep.sweep.pruning import JOURNAL_FILE, WindowPruningScheduler, repair_journal
from healsweep.sweep.spec import FutilitySpec, PrunerSpec


@dataclass
class _TuneTrial:
    """The two attributes of a Tune trial the scheduler reads (a stand-in for Ray's class)."""

    trial_id: str
    recover: bool = False

    def should_recover(self) -> bool:
        return self.recover


N_WINDOWS = 40
RNG = np.random.default_rng(7)
WINDOW_DIFFICULTY = RNG.uniform(0.02, 0.2, N_WINDOWS)


def _result(index: int, kld: float, done: int, baseline: bool = False) -> dict:
    return {
        "window_id": f"w{index:03d}",
        "window_index": index,
        "kld_mean": kld,
        "windows_done": done,
        "windows_total": N_WINDOWS,
        "running_kld_mean": kld,
        "is_baseline": baseline,
        "config_hash": "base" if baseline else "cand",
    }


def _scheduler_of(tmp_path, kind, p_threshold, n_startup_steps, futility=False):
    """A scheduler with a journal in ``tmp_path`` (futility off unless given)."""
    pruner = PrunerSpec(
        type=kind, p_threshold=p_threshold, n_startup_steps=n_startup_steps, futility=futility
    )
    return WindowPruningScheduler(tmp_path / JOURNAL_FILE, pruner)


def _run_complete(sched, trial, values, baseline=False):
    for done, (index, value) in enumerate(values, start=1):
        decision = sched.on_trial_result(None, trial, _result(index, value, done, baseline))
        assert decision == TrialScheduler.CONTINUE
    pooled = float(np.mean([v for _, v in values]))
    sched.on_trial_complete(None, trial, {**_result(0, 0, N_WINDOWS), "running_kld_mean": pooled})


def test_worse_trial_is_pruned_exactly_when_scipy_says_so(tmp_path):
    sched = _scheduler_of(tmp_path, "wilcoxon", 0.05, 5)
    base = _TuneTrial("base")
    _run_complete(sched, base, list(enumerate(WINDOW_DIFFICULTY)), baseline=True)

    worse = _TuneTrial("worse")
    order = RNG.permutation(N_WINDOWS)
    noise = RNG.normal(0, 0.01, N_WINDOWS)
    candidate = WINDOW_DIFFICULTY * 1.15 + noise
    stopped_at = None
    for done, index in enumerate(order, start=1):
        decision = sched.on_trial_result(
            None, worse, _result(int(index), float(candidate[index]), done)
        )
        seen = order[:done]
        diffs = candidate[seen] - WINDOW_DIFFICULTY[seen]
        # Optuna's rule: p < threshold on the paired differences, unless the best trial's mean
        # over all its windows is no better than this trial's mean so far (its safety check).
        expect_prune = (
            done >= 5
            and stats.wilcoxon(diffs, alternative="greater", zero_method="zsplit").pvalue < 0.05
            and WINDOW_DIFFICULTY.mean() < candidate[seen].mean()
        )
        assert (decision == TrialScheduler.STOP) == expect_prune, done
        if decision == TrialScheduler.STOP:
            stopped_at = done
            break
    assert stopped_at is not None and stopped_at < N_WINDOWS // 2
    assert "worse" in sched.pruned
    study = sched.study
    states = {t.user_attrs["tune_trial_id"]: t.state.name for t in study.get_trials()}
    assert states == {"base": "COMPLETE", "worse": "PRUNED"}
    # intermediate values are keyed by the window's global index, not by report count
    worse_trial = next(t for t in study.get_trials() if t.user_attrs["tune_trial_id"] == "worse")
    assert set(worse_trial.intermediate_values) == {int(i) for i in order[:stopped_at]}


def test_baseline_is_never_pruned_and_last_window_never_pruned(tmp_path):
    futility = {"confidence": 0.9, "min_windows": 2}
    sched = _scheduler_of(tmp_path, "wilcoxon", 0.5, 2, futility)
    _run_complete(sched, _TuneTrial("best"), list(enumerate(WINDOW_DIFFICULTY * 0.5)))
    base = _TuneTrial("base")
    for done, index in enumerate(range(N_WINDOWS), start=1):
        decision = sched.on_trial_result(None, base, _result(index, 5.0, done, baseline=True))
        assert decision == TrialScheduler.CONTINUE
    late = _TuneTrial("late")
    last = _result(0, 9.0, N_WINDOWS)  # first report of a resumed trial, already at the end
    assert sched.on_trial_result(None, late, last) == TrialScheduler.CONTINUE


def test_journal_keeps_the_history_across_a_restored_scheduler(tmp_path):
    journal = tmp_path / JOURNAL_FILE
    sched = _scheduler_of(tmp_path, "wilcoxon", 0.05, 3)
    _run_complete(sched, _TuneTrial("base"), list(enumerate(WINDOW_DIFFICULTY)), baseline=True)
    running = _TuneTrial("running")
    for done, index in enumerate(range(3), start=1):
        sched.on_trial_result(None, running, _result(index, float(WINDOW_DIFFICULTY[index]), done))
    restored = pickle.loads(pickle.dumps(sched))  # what Tune keeps in tuner.pkl
    assert restored._studies is None
    # simulate a kill during an append: a half-written last line and a stale lock
    with open(journal, "ab") as f:
        f.write(b'{"op_code": 5, "worker_id": "x", "trial_id": 1, "ste')
    (tmp_path / f"{JOURNAL_FILE}.lock").symlink_to(tmp_path / "nowhere")
    repair_journal(journal)
    study = restored.study
    # Public Optuna API only: the trial left running cannot be reported to again, so it is told
    # FAIL and a new trial (later number) carries its attributes and reported values.
    by_number = sorted(study.get_trials(), key=lambda t: t.number)
    trials = {t.user_attrs["tune_trial_id"]: t for t in by_number}  # the latest per tune id
    assert trials["base"].state.name == "COMPLETE"
    assert trials["running"].state.name == "RUNNING"
    assert set(trials["running"].intermediate_values) == {0, 1, 2}
    replaced = [t for t in by_number if t.user_attrs["tune_trial_id"] == "running"][0]
    assert replaced.state.name == "FAIL" and replaced.number < trials["running"].number
    # the resumed trial's reports go to the new Optuna trial; a repeated step is not re-added
    restored.on_trial_result(None, running, _result(2, 99.0, 3))
    restored.on_trial_result(None, running, _result(3, float(WINDOW_DIFFICULTY[3]), 4))
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    again = optuna.load_study(study_name="healsweep-pruning", storage=storage)
    values = max(
        (t for t in again.get_trials() if t.user_attrs["tune_trial_id"] == "running"),
        key=lambda t: t.number,
    )
    assert values.intermediate_values[2] == float(WINDOW_DIFFICULTY[2])
    assert set(values.intermediate_values) == {0, 1, 2, 3}
    # a scheduler restored again finds the replacement, not the failed one
    third = pickle.loads(pickle.dumps(restored))
    assert third.on_trial_result(None, running, _result(4, 0.0, 5)) == TrialScheduler.CONTINUE
    assert "running" in third._live and "running" not in third._done


def test_median_pruner_uses_running_mean(tmp_path):
    sched = _scheduler_of(tmp_path, "median", 0.1, 3)
    _run_complete(sched, _TuneTrial("a"), list(enumerate(WINDOW_DIFFICULTY)))
    bad = _TuneTrial("bad")
    decisions = [
        sched.on_trial_result(None, bad, {**_result(i, 1.0, i + 1), "running_kld_mean": 1.0})
        for i in range(4)
    ]
    # steps 1-2 are warm-up; at step 3 the trial is pruned and stays pruned
    assert decisions == [TrialScheduler.CONTINUE] * 2 + [TrialScheduler.STOP] * 2


FUTILITY = {"confidence": 0.9, "min_windows": 8}


def _futile_by_scipy(diffs: np.ndarray, best: np.ndarray, confidence: float) -> bool:
    """The rule from scipy's one-sample t interval: the most the trial can be better than the
    best (relative to the best's mean) vs what a 95% CI over all windows needs to exclude 0."""
    rel = diffs / best.mean()
    low = stats.ttest_1samp(rel, 0.0, alternative="greater").confidence_interval(confidence).low
    needed = stats.norm.ppf(0.975) * rel.std(ddof=1) / np.sqrt(N_WINDOWS)
    return -low < needed


def _wilcoxon_prunes(diffs: np.ndarray, seen_values: np.ndarray, p: float) -> bool:
    return (
        stats.wilcoxon(diffs, alternative="greater", zero_method="zsplit").pvalue < p
        and WINDOW_DIFFICULTY.mean() < seen_values.mean()
    )


def _race(sched, name, candidate, order):
    """Report ``candidate`` window by window; yield (windows done, decision)."""
    trial = _TuneTrial(name)
    for done, index in enumerate(order, start=1):
        result = _result(int(index), float(candidate[index]), done)
        yield done, sched.on_trial_result(None, trial, result)


def test_futility_stops_a_slightly_worse_trial_before_it_is_significantly_worse(tmp_path):
    sched = _scheduler_of(tmp_path, "wilcoxon", 0.1, 4, FUTILITY)
    _run_complete(sched, _TuneTrial("base"), list(enumerate(WINDOW_DIFFICULTY)), baseline=True)
    rng = np.random.default_rng(11)
    order = rng.permutation(N_WINDOWS)
    candidate = WINDOW_DIFFICULTY * 1.01 + rng.normal(0, 0.004, N_WINDOWS)  # 1% worse, noisy
    stopped_at = None
    for done, decision in _race(sched, "close", candidate, order):
        seen = order[:done]
        diffs = candidate[seen] - WINDOW_DIFFICULTY[seen]
        significant = done >= 4 and _wilcoxon_prunes(diffs, candidate[seen], 0.1)
        futility = done >= 8 and _futile_by_scipy(diffs, WINDOW_DIFFICULTY[seen], 0.9)
        assert (decision == TrialScheduler.STOP) == (significant or futility), done
        if decision == TrialScheduler.STOP:
            stopped_at = done
            assert not significant  # stopped by futility, not by the Wilcoxon test
            break
    assert stopped_at is not None and stopped_at < N_WINDOWS // 2
    states = {t.user_attrs["tune_trial_id"]: t.state.name for t in sched.study.get_trials()}
    assert states == {"base": "COMPLETE", "close": "PRUNED"}


def test_futility_never_stops_a_trial_that_can_still_reach_the_needed_improvement(tmp_path):
    sched = _scheduler_of(tmp_path, "wilcoxon", 0.1, 4, FUTILITY)
    _run_complete(sched, _TuneTrial("base"), list(enumerate(WINDOW_DIFFICULTY)), baseline=True)
    rng = np.random.default_rng(12)
    order = rng.permutation(N_WINDOWS)
    for name, factor in (("better", 0.9), ("twin", 1.0)):
        candidate = WINDOW_DIFFICULTY * factor + rng.normal(0, 0.004, N_WINDOWS)
        windows = order[:-1] if name == "twin" else order  # the last window is never pruned
        for done, decision in _race(sched, name, candidate, windows):
            seen = order[:done]
            diffs = candidate[seen] - WINDOW_DIFFICULTY[seen]
            if name == "better":  # 10% better: its bound reaches the need at every window
                assert decision == TrialScheduler.CONTINUE, done
            else:  # a copy of the best: stopped exactly when scipy's bound says it cannot reach
                futility = done >= 8 and _futile_by_scipy(diffs, WINDOW_DIFFICULTY[seen], 0.9)
                assert (decision == TrialScheduler.STOP) == futility, done
                if futility:
                    break
    assert "better" not in sched.pruned and "twin" in sched.pruned


@pytest.mark.parametrize(
    ("trial", "best", "expected"),
    [
        ({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0, 2: 3.0}, False),  # fewer shared windows than min
        ({i: 0.2 for i in range(10)}, {i: 0.1 for i in range(10)}, True),  # worse everywhere
        ({i: 0.1 for i in range(10)}, {i: 0.2 for i in range(10)}, False),  # better everywhere
        ({i: float("nan") for i in range(10)}, {i: 0.1 for i in range(10)}, False),  # bad data
        ({i: 0.1 for i in range(10)}, {i: 0.0 for i in range(10)}, False),  # a perfect best
    ],
)
def test_futile_edge_cases(trial, best, expected):
    assert futile(trial, best, 40, confidence=0.9, min_windows=8, ci_level=0.95) is expected


def test_the_specs_futility_reaches_the_scheduler(tmp_path):
    from healsweep.sweep.driver import _scheduler
    from healsweep.sweep.spec_files import spec_from_dict

    on = spec_from_dict(
        {"name": "x", "pruner": {"type": "wilcoxon", "futility": {"min_windows": 5}}}
    )
    assert _scheduler(on, tmp_path).strategy.futility == FutilitySpec(min_windows=5)
    off = spec_from_dict({"name": "x", "pruner": {"type": "wilcoxon", "futility": False}})
    assert _scheduler(off, tmp_path).strategy.futility is None


def test_futility_wraps_any_optuna_pruner_in_a_plain_study():
    """FutilityPruner is an Optuna pruner like PatientPruner: on a plain study it prunes what
    the wrapped pruner prunes, and a trial that is futile against the best completed one."""
    from healsweep.sweep.pruners import FutilityPruner

    spec = FutilitySpec(confidence=0.9, min_windows=8)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    never = optuna.create_study(pruner=FutilityPruner(optuna.pruners.NopPruner(), spec, 0.95))
    best = never.ask()
    for step, value in enumerate(WINDOW_DIFFICULTY):
        best.report(float(value), step)
    never.tell(best, float(WINDOW_DIFFICULTY.mean()))
    rng = np.random.default_rng(3)
    worse = WINDOW_DIFFICULTY * 1.2 + rng.normal(0, 0.004, N_WINDOWS)
    trial = never.ask()
    for step in range(12):
        trial.report(float(worse[step]), step)
        expected = futile(
            {s: float(worse[s]) for s in range(step + 1)},
            dict(enumerate(map(float, WINDOW_DIFFICULTY))),
            N_WINDOWS, confidence=0.9, min_windows=8, ci_level=0.95,
        )  # fmt: skip
        assert trial.should_prune() is expected, step
    assert expected  # 20% worse on 12 windows: futile by then
    # the wrapped pruner's decision passes through before any trial has completed
    threshold = optuna.pruners.ThresholdPruner(upper=1.0)
    study = optuna.create_study(pruner=FutilityPruner(threshold, spec, 0.95))
    first = study.ask()
    first.report(0.5, 0)
    assert not first.should_prune()
    first.report(2.0, 1)
    assert first.should_prune()


@pytest.mark.parametrize("kind", ["wilcoxon", "median"])
def test_a_scheduler_pickled_before_pruner_strategies_restores(tmp_path, kind):
    """A running sweep's tuner.pkl holds the scheduler as pickled by the healsweep that started
    it; these two were pickled by b05fe56 (kind/p_threshold/n_startup_steps/futility attributes,
    wilcoxon with futility {0.8, 6} and one pruned trial; median with 2 startup steps). They
    restore with the same pruning rule and keep pruning."""
    from pathlib import Path

    from healsweep.sweep.pruners import PairedWindows, RunningMedian

    fixture = Path(__file__).parent / "fixtures" / "pickles" / f"scheduler-{kind}-b05fe56.pkl"
    sched = pickle.loads(fixture.read_bytes())
    sched.journal_path = str(tmp_path / JOURNAL_FILE)  # pickled relative to its sweep folder
    if kind == "median":
        assert sched.strategy == RunningMedian(n_startup_steps=2)
        return
    futility = FutilitySpec(confidence=0.8, min_windows=6)
    assert sched.strategy == PairedWindows(0.05, 3, futility)
    assert sched.pruned == {"worse"} and not hasattr(sched, "kind")
    _run_complete(sched, _TuneTrial("base"), list(enumerate(WINDOW_DIFFICULTY)), baseline=True)
    bad = _TuneTrial("bad")
    decisions = [
        sched.on_trial_result(None, bad, _result(i, float(WINDOW_DIFFICULTY[i]) * 3, i + 1))
        for i in range(8)
    ]
    assert TrialScheduler.STOP in decisions
    again = pickle.loads(pickle.dumps(sched))  # and the restored one pickles in the new shape
    assert again.strategy == sched.strategy and again.pruned == sched.pruned | {"bad"}


def test_a_trial_is_judged_only_within_its_budget_tier(tmp_path):
    """A config of the 2.06-bit tier 15% worse than the best 2.31-bit config is not pruned (it
    competes at 2.06, where nothing better has finished); the same values in the 2.31 tier are,
    and both tiers' studies survive a restored scheduler."""
    sched = _scheduler_of(tmp_path, "wilcoxon", 0.05, 5)

    def tiered(tier):
        return lambda index, kld, done, baseline=False: {
            **_result(index, kld, done, baseline), "budget_tier": tier
        }  # fmt: skip

    best = _TuneTrial("best-2.31")
    for done, index in enumerate(range(N_WINDOWS), start=1):
        result = tiered(2.3125)(index, float(WINDOW_DIFFICULTY[index]), done)
        assert sched.on_trial_result(None, best, result) == TrialScheduler.CONTINUE
    sched.on_trial_complete(None, best, {**tiered(2.3125)(0, 0, N_WINDOWS),
                                          "running_kld_mean": float(WINDOW_DIFFICULTY.mean())})  # fmt: skip
    worse = WINDOW_DIFFICULTY * 1.15 + RNG.normal(0, 0.002, N_WINDOWS)
    for tier, name, pruned in ((2.0625, "cheap", False), (2.3125, "rival", True)):
        trial, stopped = _TuneTrial(name), False
        for done, index in enumerate(range(N_WINDOWS - 1), start=1):
            result = tiered(tier)(index, float(worse[index]), done)
            if sched.on_trial_result(None, trial, result) == TrialScheduler.STOP:
                stopped = True
                break
        assert stopped is pruned, name
    assert sched.pruned == {"rival"}
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal = JournalStorage(JournalFileBackend(str(tmp_path / JOURNAL_FILE)))
    names = sorted(optuna.get_all_study_names(journal))
    assert names == ["healsweep-pruning-tier-2.0625", "healsweep-pruning-tier-2.3125"]
    restored = pickle.loads(pickle.dumps(sched))
    restored.study_of(2.0625)  # reopens the journal: every tier's study, its running trials
    assert restored.pruned == {"rival"} and "cheap" in restored._live
