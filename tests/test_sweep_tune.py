"""The sweep machinery on a real Ray cluster with real Tune and Optuna.

The trial work here is the test's own: a deterministic function of the knobs and the window
(``toy_work``) with the signature of ``healsweep.sweep.work.run_trial_work``, so these tests
exercise the orchestration (trainable, retries, search, pruning, Parquet results,
resume) independently of the healer and the scorer. Every scored window is appended to a log
file, which is how "never scored twice" is checked.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from _raycluster import local_ray
from healsweep.errors import ResultsError
from healsweep.score.record import WindowRecord
from healsweep.sweep.driver import run_sweep
from healsweep.sweep.space import config_hash, trial_identity
from healsweep.sweep.spec_files import spec_from_dict
from healsweep.sweep.trial import trial_seed
from healsweep.sweep.work import trial_order

N_WINDOWS = 12
STRATA = ("ops", "chat", "ja")
HERE = Path(__file__).resolve().parent

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _u(*parts: object) -> float:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


WINDOW_IDS = sorted(hashlib.sha256(f"win{i}".encode()).hexdigest()[:16] for i in range(N_WINDOWS))


def toy_kld(knobs, window_id: str) -> float:
    """Window KLD of a config: worse away from gain_d 0.3 and without alpha; window-dependent."""
    base = 0.05 + 0.3 * (knobs.gain_d - 0.3) ** 2 + (0.03 if knobs.alpha == "none" else 0.0)
    return base * (0.5 + _u("w", window_id)) * (1 + 0.02 * _u("n", window_id, knobs.gain_d))


def toy_tokens(window_id: str) -> int:
    return 20 + int(30 * _u("len", window_id))


def toy_work(spec, knobs, done, seed, *, log: str, delay: float = 0.0, fail_after: int = 0):
    """Score the toy windows not in ``done`` in the trial's order; log each one."""
    chash = config_hash(knobs)
    marker = Path(f"{log}.failed-{chash}")
    scored = 0
    for position, wi in enumerate(trial_order(N_WINDOWS, seed)):
        window_id = WINDOW_IDS[wi]
        if window_id in done:
            continue
        if fail_after and scored == fail_after and not marker.exists():
            marker.write_text("x")
            raise RuntimeError("injected worker failure")
        time.sleep(delay)
        n, kld = toy_tokens(window_id), toy_kld(knobs, window_id)
        with open(log, "a") as f:
            f.write(f"{chash} {window_id}\n")
        scored += 1
        metrics = {
            "kld_sum": kld * n,
            "kld_count": n,
            "kld_mean": kld,
            "top1": 0.9,
            "top1_count": int(0.9 * n),
            "delta_p_mean": -0.01,
            "teacher_nll_sum": 1.0 * n,
            "student_nll_sum": 1.1 * n,
            "router_jaccard": 0.8,
            "router_jaccard_layers": [0.8, 0.8],
        }
        stratum = STRATA[wi % 3]
        yield WindowRecord(
            window_id, wi, position, N_WINDOWS, stratum, "toy", f"d{wi}", "text", metrics
        )


def toy_identity(spec):
    return {"model_fingerprint": "toy-model", "split_lock_id": "toy-split"}


def _log_lines(log: Path) -> list[tuple[str, str]]:
    if not log.exists():
        return []
    return [tuple(line.split()) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(2) as address:
        yield address


GRID = {"alpha": ["gaussian", "none"], "gain_d": [0.3, 0.0]}


def test_grid_sweep_writes_every_window_once_with_its_knobs(ray_cluster, tmp_path):
    spec = spec_from_dict(
        {
            "name": "grid",
            "search_space": GRID,
            "max_concurrent": 2,
            "references": False,  # the Tune trials alone (reference rows: the tpe test below)
        }
    )
    log = tmp_path / "scored.log"
    seen = []
    run = run_sweep(
        spec,
        results_root=tmp_path,
        work_fn=functools.partial(toy_work, log=str(log)),
        identity_fn=toy_identity,
        on_progress=seen.append,
    )
    sweep_dir = tmp_path / "grid"
    rows = pq.read_table(sweep_dir / "windows").to_pylist()
    assert len(rows) == 4 * N_WINDOWS
    assert len({(r["config_hash"], r["window_id"]) for r in rows}) == len(rows)
    assert sorted(_log_lines(log)) == sorted((r["config_hash"], r["window_id"]) for r in rows)
    for row in rows:  # every knob column says which config scored the row; metrics are its own
        knobs = trial_identity(
            {"knobs": {k[5:]: v for k, v in row.items() if k.startswith("knob_")}},
            spec.baseline,
            spec.fixed,
            spec.model,
        ).knobs
        assert config_hash(knobs) == row["config_hash"]
        assert row["kld_mean"] == pytest.approx(toy_kld(knobs, row["window_id"]), rel=1e-12)
        assert row["window_index"] == WINDOW_IDS.index(row["window_id"])
        assert not row["pruned"] and row["stratum"] == STRATA[row["window_index"] % 3]
        assert row["scored_node_ip"] and row["scored_at"] <= row["written_at"]
    # each trial scored its windows in its own seeded order
    by_trial: dict[str, list] = {}
    for row in sorted(rows, key=lambda r: r["position"]):
        by_trial.setdefault(row["config_hash"], []).append(row["window_index"])
    for chash, indices in by_trial.items():
        assert indices == trial_order(N_WINDOWS, trial_seed(spec.seed, chash))
    assert len({tuple(v) for v in by_trial.values()}) == 4
    # trials.parquet: pooled KLD recomputed independently in float64 from the toy formula
    trials = {t["config_hash"]: t for t in run.trials}
    assert [t["status"] for t in run.trials] == ["completed"] * 4
    assert sum(t["is_baseline"] for t in run.trials) == 1
    for trial in trials.values():
        knobs = trial_identity(
            {"knobs": {k[5:]: v for k, v in trial.items() if k.startswith("knob_")}},
            spec.baseline,
            spec.fixed,
            spec.model,
        ).knobs
        n = np.array([toy_tokens(w) for w in WINDOW_IDS], dtype=np.float64)
        k = np.array([toy_kld(knobs, w) for w in WINDOW_IDS], dtype=np.float64)
        assert trial["kld_mean"] == pytest.approx((k * n).sum() / n.sum(), rel=1e-9)
        assert trial["windows_scored"] == N_WINDOWS == trial["windows_total"]
    # what is finished is the Parquet rows alone: no trial keeps a Tune checkpoint
    assert not list(sweep_dir.glob("trial_*/checkpoint_*"))
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert manifest["model_fingerprint"] == "toy-model" and manifest["split_lock_id"] == "toy-split"
    assert manifest["planned_trials"] == 4 and manifest["seeds"] == {
        "window_order": 0,
        "sampler": 0,
    }
    assert seen and seen[-1].final and seen[-1].completed == 4 and seen[-1].windows_scored == 48
    # the same name again is refused: resume it instead
    with pytest.raises(ResultsError, match="already holds sweep grid"):
        run_sweep(spec, results_root=tmp_path, work_fn=toy_work, identity_fn=toy_identity)


def test_a_failed_trial_is_retried_without_rescoring(ray_cluster, tmp_path):
    # The trial fails after 5 windows; the driver's window book knows all 5, so the retry
    # replays them and scores only the 7 left.
    spec = spec_from_dict(
        {
            "name": "retry",
            "search_space": {"gain_d": [0.3]},
            "max_failures": 1,
            "max_concurrent": 1,
            "references": False,
        }
    )
    log = tmp_path / "scored.log"
    run = run_sweep(
        spec,
        results_root=tmp_path,
        work_fn=functools.partial(toy_work, log=str(log), fail_after=5),
        identity_fn=toy_identity,
    )
    (trial,) = run.trials
    assert trial["status"] == "completed" and trial["n_failures"] == 1
    lines = _log_lines(log)
    assert len(lines) == len(set(lines)) == N_WINDOWS
    assert pq.read_table(tmp_path / "retry" / "windows").num_rows == N_WINDOWS


def test_tpe_with_wilcoxon_prunes_losers_but_never_the_baseline_nor_a_reference(
    ray_cluster, tmp_path
):
    spec = spec_from_dict(
        {
            "name": "tune",
            "search_space": {"gain_d": {"low": 0.0, "high": 1.5}},
            "sampler": {"type": "tpe", "seed": 3},
            "pruner": {"type": "wilcoxon", "p_threshold": 0.1, "n_startup_steps": 4},
            "num_samples": 6,
            "max_concurrent": 1,
        }
    )
    log = tmp_path / "scored.log"
    run = run_sweep(
        spec,
        results_root=tmp_path,
        work_fn=functools.partial(toy_work, log=str(log)),
        identity_fn=toy_identity,
    )
    trials = [t for t in run.trials if t["role"] in ("trial", "baseline")]
    assert len(trials) == 6
    # the reference rows (alpha none: worse than the baseline on every window here) scored
    # every window, were never pruned, and are not trials of the pruner's study
    references = {t["label"]: t for t in run.trials if t["role"] == "reference"}
    assert set(references) == {"unhealed", "plain"} and len(run.trials) == 8
    for ref in references.values():
        assert ref["status"] == "completed" and not ref["pruned"]
        assert ref["windows_scored"] == N_WINDOWS and ref["kld_mean"] > 0
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from healsweep.sweep.pruning import STUDY_NAME

    journal = JournalStorage(JournalFileBackend(str(tmp_path / "tune" / "optuna-pruning.journal")))
    study = optuna.load_study(study_name=STUDY_NAME, storage=journal)
    assert len(study.trials) == 6
    (baseline,) = [t for t in trials if t["is_baseline"]]
    assert baseline["status"] == "completed" and baseline["knob_gain_d"] == 0.3
    assert trials[0]["is_baseline"]  # enqueued as the first point, and run alone first
    assert run.trials[0]["role"] == "reference"  # the fixed rows run before the experiment
    pruned = [t for t in trials if t["status"] == "pruned"]
    assert pruned, "no trial was pruned"
    rows = pq.read_table(tmp_path / "tune" / "windows").to_pylist()
    assert sum(r["role"] == "reference" and not r["pruned"] for r in rows) == 2 * N_WINDOWS
    for trial in trials:
        mine = [r for r in rows if r["trial_id"] == trial["trial_id"]]
        assert len(mine) == trial["windows_scored"]
        assert all(r["pruned"] == (trial["status"] == "pruned") for r in mine)
        if trial["status"] == "pruned":
            assert 4 <= trial["windows_scored"] < N_WINDOWS
            # pruned only when worse than the best finished trial on the shared windows
            best = min(
                (t for t in trials if t["status"] == "completed"), key=lambda t: t["kld_mean"]
            )
            best_rows = {
                r["window_id"]: r["kld_mean"] for r in rows if r["trial_id"] == best["trial_id"]
            }
            diffs = [r["kld_mean"] - best_rows[r["window_id"]] for r in mine]
            assert np.mean(diffs) > 0
    assert sum(t["windows_scored"] for t in trials) < 6 * N_WINDOWS
    assert len(_log_lines(log)) == len(rows)
    assert (tmp_path / "tune" / "optuna-pruning.journal").stat().st_size > 0


def test_only_a_finished_trial_reaches_the_sampler_with_a_final_value():
    # The sampler's study (TPE's history) must not take a pruned trial's running mean over a
    # few windows (or a failed trial's) for a final value; only a trial that scored every window is.
    import optuna

    from healsweep.sweep.driver import PruneAwareOptunaSearch
    from healsweep.sweep.trial import TARGET_METRIC

    search = PruneAwareOptunaSearch(
        space={"gain_d": optuna.distributions.FloatDistribution(0.0, 1.5)},
        metric=TARGET_METRIC,
        mode="min",
        sampler=optuna.samplers.RandomSampler(seed=0),
    )
    runs = {"finished": (12, 0.21), "pruned": (5, 0.35), "failed": (3, 0.30)}
    for trial_id, (done, mean) in runs.items():
        assert "gain_d" in search.suggest(trial_id)
        for step in range(1, done + 1):
            result = {TARGET_METRIC: mean, "training_iteration": step}
            search.on_trial_result(trial_id, {**result, "windows_done": step})
        last = {TARGET_METRIC: mean, "windows_done": done, "windows_total": 12}
        search.on_trial_complete(trial_id, last, error=trial_id == "failed")
    by_id = dict(zip(runs, search._ot_study.get_trials(deepcopy=False), strict=True))
    assert by_id["finished"].state.name == "COMPLETE" and by_id["finished"].value == 0.21
    # PRUNED, so TPE ranks it after every finished trial, by its last step and intermediate value
    assert by_id["pruned"].state.name == "PRUNED"
    assert max(by_id["pruned"].intermediate_values) == 5
    assert by_id["failed"].state.name == "FAIL"


def test_the_sampler_is_asked_again_for_a_config_already_scored(monkeypatch):
    # TPE proposes points of a space of choices again and again (9 of the 24 trials of the
    # first medium-cpu-file-budget run repeated a finished config): each is told the value it
    # scored and the sampler asked again, so every suggestion is a config not yet finished, and
    # a space whose every config is finished ends the search.
    import optuna
    from ray.tune.search import Searcher

    from healsweep.sweep import driver
    from healsweep.sweep.driver import PruneAwareOptunaSearch
    from healsweep.sweep.trial import TARGET_METRIC

    monkeypatch.setattr(driver, "MAX_REPEATS", 20)
    choices = ["iq1_m", "iq2_xxs", "iq2_xs"]
    search = PruneAwareOptunaSearch(
        space={"type_d": optuna.distributions.CategoricalDistribution(choices)},
        metric=TARGET_METRIC,
        mode="min",
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=1),
    )
    proposed = []
    for n in range(len(choices)):
        point = search.suggest(f"t{n}")
        proposed.append(point["type_d"])
        last = {TARGET_METRIC: 0.1 * (1 + choices.index(point["type_d"])), "windows_done": 4,
                "windows_total": 4, "training_iteration": 4}  # fmt: skip
        search.on_trial_complete(f"t{n}", last)
    assert sorted(proposed) == sorted(choices)  # three suggestions, three configs
    assert search.suggest("t3") == Searcher.FINISHED
    told = search._ot_study.get_trials(deepcopy=False)
    assert len(told) >= 3 + 20 and all(t.state.name == "COMPLETE" for t in told)
    for repeat in told:  # each repeat carries the value its config scored
        assert repeat.value == pytest.approx(0.1 * (1 + choices.index(repeat.params["type_d"])))


def test_a_placed_task_scores_no_more_than_its_credits_ahead_of_its_trial(ray_cluster, tmp_path):
    """A trial's work as a placed Ray task (the multi-node path) waits for its coordinator: the
    task of a trial that reported 3 windows and was then stopped scored at most AHEAD - 1 more
    (before credits it ran the whole trial ahead of Tune's pruner)."""
    from healsweep.heal.knobs import Knobs
    from healsweep.sweep.holders import open_holders
    from healsweep.sweep.placed import AHEAD, PlacedWork

    spec = spec_from_dict({"name": "paced", "search_space": GRID})
    log = tmp_path / "scored.log"
    job = functools.partial(toy_work, spec, Knobs(), set(), 0, log=str(log))
    work = PlacedWork(spec, open_holders({}, spec.trial_resources()), Knobs())
    records = work.records(job)
    reported = [next(records) for _ in range(3)]
    time.sleep(3.0)  # an unpaced task scores all 12 windows in this time
    assert len(_log_lines(log)) == 3 + AHEAD - 1
    records.close()  # the trial is stopped: its task is cancelled
    time.sleep(1.0)
    assert len(_log_lines(log)) == 3 + AHEAD - 1 < N_WINDOWS
    assert [r.window_id for r in reported] == [w for _, w in _log_lines(log)[:3]]
    assert work.columns["placed_node"] and work.columns["cache_detail"]


def threads_work(spec, knobs, done, seed, *, log: str):
    """toy_work that first writes what the trial's process gives its host work, as JSON."""
    from healsweep.threads import seen

    Path(f"{log}.threads-{config_hash(knobs)}").write_text(json.dumps(seen()))
    yield from toy_work(spec, knobs, done, seed, log=log)


@pytest.mark.parametrize("concurrent", [1, 2])
def test_a_trial_s_host_work_runs_on_the_cores_it_holds(ray_cluster, tmp_path, concurrent):
    """Ray starts a worker with OMP_NUM_THREADS = the task's num_cpus; a spec without a cpu of
    its own gives each trial its node's share (2 cores ÷ the trials at once), and the work sees
    that many threads in BLAS, the environment and XLA's CPU client, and its row records it."""
    from healsweep.threads import cores

    spec = spec_from_dict(
        {"name": f"threads{concurrent}", "search_space": GRID, "references": False,
         "max_concurrent": concurrent}
    )  # fmt: skip
    log = tmp_path / "scored.log"
    run_sweep(spec, results_root=tmp_path, identity_fn=toy_identity,
              work_fn=functools.partial(threads_work, log=str(log)))  # fmt: skip
    expected = min(cores(), 2 // concurrent)
    found = [json.loads(p.read_text()) for p in tmp_path.glob("scored.log.threads-*")]
    assert len(found) == 4
    for seen in found:
        assert seen["threads"] == expected
        assert seen["omp_num_threads"] == str(expected)
        assert seen["xla_cpu_threads"] == expected
        assert seen["blas_threads"] and set(seen["blas_threads"]) == {expected}
    rows = pq.read_table(tmp_path / f"threads{concurrent}" / "trials.parquet").to_pylist()
    assert sorted(r["threads"] for r in rows) == [expected] * 4
    # a trial worked in its own process on this one node still names its quantization (what
    # bench night tells a follow-up from a quantization change by): one per gain_d of the grid
    assert len({r["quantization"] for r in rows}) == 2 and all(r["quantization"] for r in rows)
