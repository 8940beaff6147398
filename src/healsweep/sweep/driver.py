"""Running, resuming and inspecting a sweep: the Ray Tune experiment around the trainable.

A sweep's folder ``RESULTS/<name>/`` is at once Tune's experiment directory (``storage_path`` =
the results root, ``name`` = the sweep name) and the home of the Parquet results, the manifest
and the pruning journal. A driver holds an exclusive lock on the folder while it runs, so a
second driver (a second ``run`` of the same name, or a ``resume`` while it runs) is refused and
sweeps in other folders of the same root are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import ray
from optuna.trial import TrialState
from ray import tune
from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from healsweep.cache import cache_limit
from healsweep.cluster import connect
from healsweep.errors import ResultsError, SpecError
from healsweep.heal.knobs import Knobs
from healsweep.results.schema import scored_all
from healsweep.results.store import (
    LOCK_FILE,
    SPEC_FILE,
    read_manifest,
    read_trials,
    record_over_budget,
    write_allocator,
)
from healsweep.score.runner import teacher_ahead_on
from healsweep.sweep.budget import MAX_ASKS, BudgetGate, split_grid
from healsweep.sweep.devices import cpu_share
from healsweep.sweep.fixed import build_externals, run_fixed
from healsweep.sweep.holders import open_holders, prior_holders
from healsweep.sweep.manifest import read_spec, start_manifest
from healsweep.sweep.progress import ProgressSink, register_sink
from healsweep.sweep.pruning import JOURNAL_FILE, WindowPruningScheduler, repair_journal
from healsweep.sweep.recorder import CacheStop, ResultsRecorder
from healsweep.sweep.sensitivity import (
    IDENTITY_KEYS,
    Say,
    SensitivityTable,
    allocator_record,
    proposals_of,
    run_sensitivity,
)
from healsweep.sweep.space import GRIDDED, baseline_point, optuna_space
from healsweep.sweep.spec import RAY_RESOURCE_NAMES, SweepSpec
from healsweep.sweep.spec_files import check_paths
from healsweep.sweep.status import driver_running
from healsweep.sweep.trial import (
    COORDINATOR_RESOURCES,
    TARGET_METRIC,
    open_book,
    prior_windows,
    sweep_trial,
)
from healsweep.sweep.work import WorkFn, run_trial_work, sweep_identity

log = logging.getLogger(__name__)
MAX_REPEATS = 100  # already-scored proposals in a row before a search is declared finished


class PruneAwareOptunaSearch(OptunaSearch):
    """Ray's ``OptunaSearch``, except that only a trial that scored every window is told to the
    sampler's study as ``COMPLETE`` with its pooled KLD. Ray's class tells a trial's last running
    mean as its final value even when the trial was pruned after a few windows or failed; here a
    pruned trial is told ``PRUNED`` (TPE ranks it below the finished trials by its last
    intermediate value, as Optuna intends) and a failed one ``FAIL``."""

    def __init__(self, *args: Any, gate: BudgetGate | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = gate

    def suggest(self, trial_id: str) -> dict | str | None:
        """The sampler's next new point inside the budget, so that ``num_samples`` counts
        configs scored, not proposals:

        - a point over the budget is told to the study as ``PRUNED`` without a value (TPE ranks
          it below every scored trial), recorded by the gate, and the sampler asked again
          (:mod:`healsweep.sweep.budget`);
        - a point the study already finished (TPE proposes one again and again on a space of
          choices: 9 of the 24 trials of medium-cpu-file-budget) is told ``COMPLETE`` with that
          trial's value, and the sampler asked again. A point still running or pruned goes
          through: its trial replays the rows recorded so far.

        Neither takes a trial slot. After ``MAX_ASKS`` such points in a row, or ``MAX_REPEATS``
        already scored in a row (the sampler has little new left to propose), the search ends."""

        repeats = 0
        for _ in range(MAX_ASKS):
            point = super().suggest(trial_id)
            if not isinstance(point, dict):
                return point
            if self._gate is not None and not self._gate.admits(point):
                self._ot_study.tell(self._ot_trials.pop(trial_id), state=TrialState.PRUNED)
                continue
            done = self._finished(self._ot_trials[trial_id].params)
            if done is None:
                return point
            self._ot_study.tell(self._ot_trials.pop(trial_id), done.values)
            repeats += 1
            if repeats >= MAX_REPEATS:
                log.warning("the sampler proposed %d configs already scored in a row; search "
                            "ended", MAX_REPEATS)  # fmt: skip
                return Searcher.FINISHED
        log.warning("the sampler proposed %d configs over the budget or already scored in a "
                    "row; search ended", MAX_ASKS)  # fmt: skip
        return Searcher.FINISHED

    def _finished(self, params: dict[str, Any]) -> optuna.trial.FrozenTrial | None:
        """The study's finished trial with these parameters, if any."""
        finished = self._ot_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return next((t for t in finished if t.params == params), None)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        """Tell the study how the trial ended (see the class)."""
        if result and (
            error or not scored_all(result.get("windows_done", 0), result.get("windows_total"))
        ):
            result = None  # OptunaSearch tells a valueless trial FAIL with error, else PRUNED
        super().on_trial_complete(trial_id, result, error)


@dataclass(frozen=True)
class SweepRun:
    """What a finished (or interrupted) ``run``/``resume`` leaves: its folder and trial rows."""

    sweep_dir: Path
    trials: list[dict[str, Any]]


def trial_dirname(trial: Trial) -> str:
    """Tune trial folder names: ``trial_<id>`` (the config lives in Parquet, not in the name)."""
    return f"trial_{trial.trial_id}"


def _unwritable(folder: Path, exc: OSError) -> ResultsError:
    return ResultsError(
        f"cannot write to {folder}: {exc.strerror or exc}; pass a writable "
        "results root with --results (or fix its permissions or free space)"
    )


def require_writable(folder: Path) -> None:
    """Create ``folder`` and write a probe file in it, or raise ``ResultsError`` (one line)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as exc:
        raise _unwritable(folder, exc) from None


@contextlib.contextmanager
def sweep_lock(sweep_dir: Path) -> Iterator[None]:
    """Hold the sweep folder's exclusive lock, or raise ``ResultsError`` if another holds it."""
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        handle = open(sweep_dir / LOCK_FILE, "a+")
    except OSError as exc:
        raise _unwritable(sweep_dir, exc) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise _being_run(sweep_dir, handle.read().strip() or "another process") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        yield


def _being_run(sweep_dir: Path, owner: str) -> ResultsError:
    return ResultsError(
        f"sweep {sweep_dir.name} is being run by {owner}; wait for it to finish or stop it "
        "before starting or resuming it again"
    )


@contextlib.contextmanager
def ray_session(spec: SweepSpec, address: str | None, num_cpus: int | None) -> Iterator[None]:
    """Use a running Ray, connect to ``address``, or start an embedded local one (and stop it);
    then refuse a cluster that cannot give a trial the resources the spec asks for."""

    # Tune's own console table: our progress view replaces it (a user can still set these
    # variables to turn it back on).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    started = not ray.is_initialized()
    if started and address:  # one-line errors for an unreachable head or a refused join

        connect(address)
    elif started:
        # An embedded cluster is this process's own: Ray's notice that it enabled token
        # authentication by default (it did; nothing to act on) is noise on the sweep's console.
        # It reaches the console through the handlers of Ray's public "ray" logger (its own
        # loggers propagate to it), so the filter sits on those while the cluster starts.
        notice = "Token authentication is enabled for this Ray cluster"

        def drop_notice(record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(notice)

        # A trial without a cpu of its own takes its node's share of the cores: every core
        # is the cluster's (sweep.devices.cpu_share).
        per_trial = max(1, int(spec.trial_resources()["cpu"]))
        wanted = spec.max_concurrent * per_trial if spec.cpu_given() else os.cpu_count() or 1
        local = num_cpus or max(1, min(os.cpu_count() or 1, wanted))
        handlers = list(logging.getLogger("ray").handlers)
        for handler in handlers:
            handler.addFilter(drop_notice)
        try:
            ray.init(
                num_cpus=local,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        finally:
            for handler in handlers:
                handler.removeFilter(drop_notice)
    try:
        available = ray.cluster_resources()
        for name, amount in spec.trial_resources().items():
            have = available.get(RAY_RESOURCE_NAMES.get(name, name), 0)
            if amount > 0 and have < amount:
                raise SpecError(
                    f"field 'resources.{name}' = {amount}: the Ray cluster offers {have} {name}; "
                    "join workers that provide it (see metal/README.md) or lower the request"
                )
        yield
    finally:
        if started:
            ray.shutdown()


def _trainable(spec: SweepSpec, prior: dict, holders: Any, work_fn: WorkFn) -> Any:
    """The trainable. On a pool of several nodes: a coordinator on the head node; each trial's
    work is a Ray task with the spec's resources (``healsweep.sweep.placed``), so Tune's
    ``max_concurrent`` bounds the trials at work while Ray places each where its stage entries
    are. On one node there is nowhere else to place the work, and a task streaming ahead of
    the pruner would score windows a pruned trial never records: the trainable holds the
    trial's resources and works in its own process, a window at a time (``sweep_trial`` reads
    the resources it holds)."""

    trainable = tune.with_parameters(
        sweep_trial, spec=spec, book=open_book(prior), holders=holders, work_fn=work_fn
    )
    if sum(1 for node in ray.nodes() if node.get("Alive")) <= 1:
        return tune.with_resources(trainable, spec.trial_resources())
    return tune.with_resources(trainable, COORDINATOR_RESOURCES)


def _search(
    spec: SweepSpec, sweep_dir: Path, proposals: Sequence[Knobs] = ()
) -> tuple[Any, dict[str, Any], int]:
    """(search algorithm or None, param space, num_samples); a grid's configs (and the
    allocator's ``proposals`` after them) over the budget are recorded and left out, a
    sampler's are refused as it proposes them."""
    if spec.sampler.type in GRIDDED:
        inside, over = split_grid(spec, proposals)
        record_over_budget(sweep_dir, over)
        configs = [knobs.model_dump() for knobs in inside]  # Tune's config is data
        return None, {"knobs": tune.grid_search(configs)}, 1

    optuna.logging.set_verbosity(logging.WARNING)  # no "study created" lines on the console
    samplers = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
    sampler = samplers[spec.sampler.type](seed=spec.sampler.seed)
    search = PruneAwareOptunaSearch(
        space=optuna_space(spec),
        metric=TARGET_METRIC,
        mode="min",
        points_to_evaluate=[baseline_point(spec)],
        sampler=sampler,
        gate=BudgetGate(spec, sweep_dir) if spec.budget is not None else None,
    )
    return search, {}, int(spec.num_samples or 1)


def _scheduler(spec: SweepSpec, sweep_dir: Path) -> Any:

    if spec.pruner.type == "none":
        return FIFOScheduler()
    return WindowPruningScheduler(sweep_dir / JOURNAL_FILE, spec.pruner)


def _new_tuner(
    spec: SweepSpec, sweep_dir: Path, trainable: Any, proposals: Sequence[Knobs] = ()
) -> Any:
    search, space, samples = _search(spec, sweep_dir, proposals)
    return tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            metric=TARGET_METRIC,
            mode="min",
            search_alg=search,
            scheduler=_scheduler(spec, sweep_dir),
            num_samples=samples,
            max_concurrent_trials=spec.max_concurrent,
            trial_dirname_creator=trial_dirname,
            reuse_actors=True,  # a new trial's coordinator keeps its process
        ),
        run_config=tune.RunConfig(
            name=sweep_dir.name,
            storage_path=str(sweep_dir.parent),
            failure_config=tune.FailureConfig(max_failures=spec.max_failures),
            callbacks=[ResultsRecorder(sweep_dir, spec)],
            verbose=0,
        ),
    )


_DISK_ERRORS = {code: os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)}


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and its causes (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _disk_error(exc: BaseException | None) -> str | None:
    """The full or read-only disk behind a failed ``fit`` (Tune wraps it in a TuneError whose
    text holds the original traceback), or None when the failure was something else."""
    for cause in _chain(exc):
        if isinstance(cause, OSError) and cause.errno in _DISK_ERRORS:
            return _DISK_ERRORS[cause.errno]
        reason = next((r for r in _DISK_ERRORS.values() if r in str(cause)), None)
        if reason is not None:
            return reason
    return None


def _fit(tuner: Any, sweep_dir: Path) -> None:
    """``tuner.fit()``; a disk that fills up or turns read-only mid-sweep is one ResultsError."""
    try:
        tuner.fit()
    except Exception as exc:
        # Tune wraps what a callback raises in a TuneError
        stop = next((c for c in _chain(exc) if isinstance(c, CacheStop)), None)
        if stop is not None:
            raise CacheStop(str(stop)) from None
        reason = _disk_error(exc)
        if reason is None:
            raise
        raise ResultsError(
            f"cannot write to {sweep_dir}: {reason}; the windows recorded so far are kept: "
            f"free space (or fix the folder), then `healsweep sweep resume {sweep_dir}`"
        ) from None


def run_sweep(
    spec: SweepSpec,
    *,
    results_root: str | Path | None = None,
    address: str | None = None,
    num_cpus: int | None = None,
    work_fn: WorkFn = run_trial_work,
    identity_fn: Callable[[SweepSpec], dict[str, Any]] = sweep_identity,
    on_progress: ProgressSink | None = None,
    on_note: Say | None = None,
) -> SweepRun:
    """Run a new sweep into ``RESULTS/<spec.name>/``; refuse a folder that already holds one.
    ``on_note`` gets the lines of the allocator's sensitivity pass (sampler allocator)."""
    cache_limit(spec.cache_max_gb, "cache_max_gb")  # a bad HEALSWEEP_CACHE_MAX_GB: refused now
    teacher_ahead_on()  # a bad HEALSWEEP_TEACHER_AHEAD too, before every trial fails on it
    root = Path(results_root or spec.results).resolve()
    sweep_dir = root / spec.name
    _refuse_existing(sweep_dir, spec.name)
    _refuse_foreign(sweep_dir)
    require_writable(root)  # before Ray starts: a read-only or full root is refused at once
    identity = identity_fn(spec)
    # Connect and check resources before the folder is created, so a refused start leaves none.
    with ray_session(spec, address, num_cpus):
        with sweep_lock(sweep_dir):
            _refuse_existing(sweep_dir, spec.name)  # another `run` of this name got here first
            start_manifest(sweep_dir, spec, identity, kind="run")
            return _run(spec, sweep_dir, work_fn, on_progress, on_note)


def _refuse_existing(sweep_dir: Path, name: str) -> None:
    if sweep_dir.is_symlink():
        raise ResultsError(
            f"{sweep_dir} is a symbolic link (to {os.readlink(sweep_dir)}); a sweep writes only "
            "into a folder of its own under the results root: remove the link or give the sweep "
            "another name"
        )
    if (sweep_dir / SPEC_FILE).exists():
        raise ResultsError(
            f"{sweep_dir} already holds sweep {name}; resume it with `healsweep sweep resume "
            f"{sweep_dir}` or give the new sweep another name"
        )


def _refuse_foreign(sweep_dir: Path) -> None:
    """A new sweep's folder is new or empty: one holding other files is someone else's."""
    if sweep_dir.exists() and (not sweep_dir.is_dir() or any(sweep_dir.iterdir())):
        raise ResultsError(
            f"{sweep_dir} already exists and is not a sweep folder (no {SPEC_FILE}); a sweep "
            "writes only into a folder of its own: move it away or give the sweep another name"
        )


def resume_sweep(
    sweep_dir: str | Path,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    work_fn: WorkFn = run_trial_work,
    on_progress: ProgressSink | None = None,
    cache_max_gb: float | None = None,
    on_note: Say | None = None,
) -> SweepRun:
    """Finish an interrupted sweep: finished trials are not re-run, finished windows not
    re-scored (they are replayed from the Parquet rows). ``cache_max_gb``: the stage caches'
    size limit for this run (default: the stored spec's)."""
    sweep_dir = Path(sweep_dir).resolve()
    owner = driver_running(sweep_dir)  # first: a starting sweep has its spec before its manifest
    if owner is not None:
        raise _being_run(sweep_dir, owner)
    spec = read_spec(sweep_dir)
    check_paths(spec, str(sweep_dir / SPEC_FILE))  # what it names may have moved since the run
    if cache_max_gb is not None:  # like the cache's location, not part of the spec's hash
        spec = spec.model_copy(update={"cache_max_gb": cache_max_gb})
    cache_limit(spec.cache_max_gb, "cache_max_gb")  # a bad HEALSWEEP_CACHE_MAX_GB: refused now
    teacher_ahead_on()  # and a bad HEALSWEEP_TEACHER_AHEAD
    with sweep_lock(sweep_dir), ray_session(spec, address, num_cpus):
        start_manifest(sweep_dir, spec, None, kind="resume")
        repair_journal(sweep_dir / JOURNAL_FILE)
        return _run(spec, sweep_dir, work_fn, on_progress, on_note)


def _allocate(
    spec: SweepSpec, sweep_dir: Path, work_fn: WorkFn, holders: Any, say: Say | None
) -> list[Knobs]:
    """The allocator's proposals: the sensitivity pass (cached configs read, the others scored
    as placed tasks) and the allocations it predicts best per budget limit, recorded in
    ``allocator.json``."""
    manifest = read_manifest(sweep_dir)
    identity = {k: manifest.get(k) for k in IDENTITY_KEYS}
    table = run_sensitivity(spec, identity, work_fn=work_fn, holders=holders, say=say)
    proposals = proposals_of(spec, table)
    write_allocator(sweep_dir, allocator_record(table, proposals))
    if say is not None:
        for p in proposals:
            say(f"allocator, within {spec.budget.budget().label(p.limit)}: "
                f"{p.knobs.type_gu}/{p.knobs.type_d} {p.knobs.layer_types or ''} at "
                f"{p.size.routed_bpw:.4g} bpw, predicted ΔKLD {p.predicted_kld:+.5f}")  # fmt: skip
    return [p.knobs for p in proposals]


def sensitivity_pass(
    spec: SweepSpec,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    work_fn: WorkFn = run_trial_work,
    identity_fn: Callable[[SweepSpec], dict[str, Any]] = sweep_identity,
    say: Say | None = None,
    base_only: bool = False,
) -> tuple[SensitivityTable, list[Any]]:
    """The allocator's sensitivity pass of ``spec`` outside a sweep (``healsweep
    sensitivity``): on a Ray session as ``run`` uses, into the stage cache a sweep of the same
    inputs reads; returns the table and, with a budget, the allocator's proposals. With
    ``base_only``, the base config's scores alone (no moves, no proposals)."""
    identity = identity_fn(spec)
    with ray_session(spec, address, num_cpus):
        holders = open_holders({}, spec.trial_resources())
        table = run_sensitivity(spec, identity, work_fn=work_fn, holders=holders, say=say,
                                base_only=base_only)  # fmt: skip
    proposals = proposals_of(spec, table) if spec.budget is not None and not base_only else []
    return table, proposals


def _run(
    spec: SweepSpec,
    sweep_dir: Path,
    work_fn: WorkFn,
    on_progress: ProgressSink | None,
    on_note: Say | None = None,
) -> SweepRun:
    """Score the fixed rows not completed yet, then run the Tune experiment: a new one, or the
    saved one restored (a resumed sweep killed before Tune saved any state starts over,
    replaying what the Parquet rows hold)."""


    alive = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    spec = spec.with_cpu_share(cpu_share(spec.resources, spec.max_concurrent, alive))
    # An unpicklable work function (a ledger grant inside, say) fails here with its own error,
    # not as a Ray serialization error of a task, nor lingering in Tune's process-wide parameter
    # registry to break every later ray.init in this process.
    ray.cloudpickle.dumps(work_fn)
    # where earlier runs left entries, and how many trials a node runs at once
    holders = open_holders(prior_holders(sweep_dir), spec.trial_resources())
    register_sink(sweep_dir, on_progress)  # progress from the first file built on
    try:
        build_externals(spec, sweep_dir)  # llama recipes: once, into the sweep folder
        run_fixed(spec, sweep_dir, work_fn, holders)  # references, externals: before the trials
        prior = prior_windows(sweep_dir)  # with the fixed rows': a trial of their student replays
        trainable = _trainable(spec, prior, holders, work_fn)
        saved = any(sweep_dir.glob("experiment_state-*.json"))  # tuner.pkl alone is no state
        if saved and tune.Tuner.can_restore(str(sweep_dir)):
            tuner = tune.Tuner.restore(
                str(sweep_dir),
                trainable=trainable,
                resume_unfinished=True,
                resume_errored=True,
            )
        else:
            proposals: list[Knobs] = []
            if spec.sampler.type == "allocator":
                proposals = _allocate(spec, sweep_dir, work_fn, holders, on_note)
            tuner = _new_tuner(spec, sweep_dir, trainable, proposals)
        _fit(tuner, sweep_dir)
    finally:
        register_sink(sweep_dir, None)
    return SweepRun(sweep_dir, read_trials(sweep_dir).to_pylist())
