"""The driver's record of a sweep, for the Tune trials (as a Tune callback) and the fixed rows
alike: each window row written atomically under ``windows/`` before the next result is processed
(a crash of the driver loses no window that reached it; a replayed window is not written twice),
``trials.parquet``, and the live progress. The Parquet rows are the record of what is finished:
``setup`` rebuilds everything from the folder (docs/contracts.md, "Sweeps and results").
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ray.tune import Callback
from ray.tune.experiment import Trial

from healsweep.errors import CacheError
from healsweep.results.schema import (
    KNOB_PREFIX,
    PLACEMENT_COLUMNS,
    TrialStatus,
    end_status,
    student_of,
    to_table,
    trial_schema,
)
from healsweep.results.store import (
    TRIALS_FILE,
    WINDOWS_DIR,
    atomic_write_table,
    consolidate_trial,
    next_seq,
    part_files,
    read_trials,
    read_windows,
    tidy_windows_dir,
    write_windows,
)
from healsweep.sweep.budget import planned_trials
from healsweep.sweep.progress import Phase, Progress, progress_sink
from healsweep.sweep.space import trial_identity
from healsweep.sweep.spec import SweepSpec
from healsweep.sweep.trial import RunningPool

PROGRESS_EVERY_S = 2.0
# The columns of a window row that say who scored it (with the knob columns).
_CONFIG = ("sweep", "trial_id", "config_hash", "is_baseline", "role", "label")
# What setup reads of the window rows: their keys and what a trial's row sums.
_COUNTED = [
    *("trial_id", "config_hash", "window_id", "windows_total", "scored_node_ip"),
    *("kld_sum", "kld_count", "top1", "top1_count", "role", "is_baseline"),
]


# What the stage cache raises when it cannot write (cache.py): a full, over-quota or read-only disk
# under its root. Every later trial on that node would fail the same way.
_CACHE_UNWRITABLE = re.compile(r"cannot write cache entry under (.+?): ([^;\n]+); free disk space")


class CacheStop(CacheError):
    """A trial's stage cache cannot be written: raised by the recorder to stop the sweep."""


def cache_unwritable(error: str | None) -> tuple[str, str] | None:
    """(cache root, reason) when a trial's error (the worker's traceback as Tune keeps it) is
    the stage cache failing to write, else None."""
    found = _CACHE_UNWRITABLE.search(error) if error else None
    return (found.group(1), found.group(2).strip()) if found else None


def _last_error(trial: Trial) -> str | None:
    """The text of the trial's latest failure: Tune appends each to the trial's local error
    file before it calls back (the pickled copy reaches storage later)."""
    path = trial.error_file
    try:
        text = Path(path).read_text(errors="replace") if path else None
    except OSError:
        return None
    return text.rsplit("Failure # ", 1)[-1] if text else None


class ResultsRecorder(Callback):
    """Writes the windows dataset and ``trials.parquet`` of one sweep (see module docstring)."""

    def __init__(self, sweep_dir: str | Path, spec: SweepSpec) -> None:
        self.sweep_dir = Path(sweep_dir)
        self.spec = spec
        self._reset()

    def _reset(self) -> None:
        self.windows_dir = self.sweep_dir / WINDOWS_DIR
        self.trials: dict[str, dict[str, Any]] = {}  # trial id -> its trials.parquet row
        self.pools: dict[str, RunningPool] = {}  # trial id -> its recorded windows
        self._seen: set[tuple[str, str]] = set()  # (config hash, window id) of every row
        self._seq: dict[str, int] = {}  # trial id -> number of its next part file
        self._planned = planned_trials(self.spec)
        self._started = time.time()
        self._scored = 0  # windows scored in this session (replays excluded)
        self._sent = 0.0
        self._pairs: set[tuple[str, str]] = set()  # (student, window id) recorded: the count
        self._students: dict[str, str] = {}  # config hash -> student
        self.phase = Phase.TRIALS  # run_fixed's recorder reports the fixed rows' phase

    def __getstate__(self) -> dict[str, Any]:
        return {"sweep_dir": self.sweep_dir, "spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def setup(self, **info: Any) -> None:
        """Reload everything from the folder (a fresh sweep finds it empty)."""
        self._reset()
        self.windows_dir.mkdir(parents=True, exist_ok=True)
        tidy_windows_dir(self.windows_dir)
        self.trials = {row["trial_id"]: row for row in read_trials(self.sweep_dir).to_pylist()}
        table = read_windows(self.sweep_dir)
        knobs = [name for name in table.column_names if name.startswith(KNOB_PREFIX)]
        for row in table.select([*_COUNTED, *knobs]).to_pylist():
            self.pool(row["trial_id"]).add(row)
            self._seen.add((row["config_hash"], row["window_id"]))
            self._pairs.add((self._student(row), row["window_id"]))
        self._seq = {
            trial: next_seq(paths) for trial, paths in part_files(self.windows_dir).items()
        }

    def _student(self, row: Mapping[str, Any]) -> str:
        """The student of a row with config columns (its knobs read once per config)."""
        chash = row["config_hash"]
        if chash not in self._students:
            self._students[chash] = student_of(row)
        return self._students[chash]

    def pool(self, trial_id: str) -> RunningPool:
        """The windows recorded for ``trial_id``."""
        return self.pools.setdefault(trial_id, RunningPool())

    def open(self, trial_id: str, config: Mapping[str, Any]) -> dict[str, Any]:
        """The ``trials.parquet`` row of ``trial_id``, made from its ``config`` columns (config
        hash, role, knobs, ...) when it has none yet."""
        if trial_id not in self.trials:
            status = TrialStatus.PENDING
            new = {"sweep": self.spec.name, "trial_id": trial_id, **config, "status": status}
            self.trials[trial_id] = {**new, "pruned": False, "n_failures": 0, "started_at": None}
        return self.trials[trial_id]

    def record(self, trial_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Count window rows (flat window records) of an open trial and write those not
        recorded yet as one part file, with the trial's config columns and its running figures
        (those of the row when it has them, as a Tune result does)."""
        trial = self.trials[trial_id]
        pool = self.pool(trial_id)
        config = {k: v for k, v in trial.items() if k in _CONFIG or k.startswith(KNOB_PREFIX)}
        new, keys = [], set()
        student = self._student(trial)
        for row in rows:
            pool.add(row)
            self._pairs.add((student, row["window_id"]))
            key = (trial["config_hash"], row["window_id"])
            if key not in self._seen and key not in keys:
                keys.add(key)
                written = {"pruned": False, "written_at": time.time()}
                new.append({**pool.summary(), **row, **config, **written})
        if not new:
            return
        seq = self._seq.get(trial_id, 0)
        write_windows(new, self.windows_dir / f"part-{trial_id}-{seq:06d}.parquet")
        self._seq[trial_id] = seq + 1
        self._seen.update(keys)

    def count_scored(self, n: int) -> None:
        """``n`` windows were scored (not replayed) by this run: the ETA's rate."""
        self._scored += n

    def start(self, trial_id: str) -> None:
        """Mark an open row running (a fixed row whose task was just placed) and say so."""
        row = self.trials[trial_id]
        row.update(status=TrialStatus.RUNNING, started_at=row.get("started_at") or time.time())
        self._progress(force=True)

    def finish(self, trial_id: str, status: TrialStatus) -> None:
        """End a trial with ``status``: consolidate its rows, rewrite ``trials.parquet``."""
        row = self.trials[trial_id]
        row.update(status=status, pruned=status == TrialStatus.PRUNED, ended_at=time.time())
        consolidate_trial(self.windows_dir, trial_id, pruned=row["pruned"])
        self._seq.pop(trial_id, None)
        self._write_trials()

    def trial_rows(self) -> list[dict[str, Any]]:
        """The rows of ``trials.parquet`` as they stand."""
        return [{**row, **self.pool(tid).totals()} for tid, row in self.trials.items()]

    def _write_trials(self, final: bool = False) -> None:
        table = to_table(self.trial_rows(), trial_schema())
        atomic_write_table(table, self.sweep_dir / TRIALS_FILE)
        self._progress(force=True, final=final)

    def _progress(self, force: bool = False, final: bool = False) -> None:
        now = time.time()
        sink = progress_sink(self.sweep_dir)
        if sink is None or (not force and now - self._sent < PROGRESS_EVERY_S):
            return
        self._sent = now
        elapsed = now - self._started
        rows = self.trial_rows()
        sink(Progress.of(rows, self._planned, len(self._pairs), elapsed, final,
                         scored_now=self._scored, phase=self.phase))  # fmt: skip

    # Tune hooks ----------------------------------------------------------------------------

    def _tune_trial(self, trial: Trial) -> dict[str, Any]:
        if trial.trial_id not in self.trials:  # its columns, from the trial's one identity
            self.open(trial.trial_id, trial_identity(trial.config, self.spec.baseline, self.spec.fixed, self.spec.model).columns())
        return self.trials[trial.trial_id]

    def on_trial_start(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        row = self._tune_trial(trial)
        row["status"] = TrialStatus.RUNNING
        row["started_at"] = row["started_at"] or time.time()
        self._write_trials()

    def on_trial_result(
        self, iteration: int, trials: list, trial: Trial, result: dict, **info: Any
    ) -> None:
        if "window_id" not in result:
            return
        row = self._tune_trial(trial)
        row["status"] = TrialStatus.RUNNING
        # Where its work runs and what its caches did so far (a result replayed before the
        # work started carries none of it).
        row.update({k: result[k] for k in PLACEMENT_COLUMNS if result.get(k) is not None})
        self.record(trial.trial_id, [result])
        self.count_scored(not result.get("replayed"))
        self._progress()

    def on_trial_complete(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        self._tune_trial(trial)
        pool = self.pool(trial.trial_id)
        self.finish(trial.trial_id, end_status(len(pool.window_ids), pool.total))

    def on_trial_error(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        row = self._tune_trial(trial)
        row["n_failures"] = int(getattr(trial, "num_failures", row["n_failures"] + 1))
        self.finish(trial.trial_id, TrialStatus.ERROR)
        self._stop_on_unwritable_cache(trial)

    def on_trial_recover(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        row = self._tune_trial(trial)
        row["n_failures"] = int(getattr(trial, "num_failures", row["n_failures"] + 1))
        row["status"] = TrialStatus.RETRYING
        self._write_trials()
        self._stop_on_unwritable_cache(trial)

    def _stop_on_unwritable_cache(self, trial: Trial) -> None:
        """A trial that failed because its node's stage cache cannot be written stops the sweep
        (raised out of Tune's loop, as a killed driver would stop): retrying it, or starting the
        next trial, would fail the same way, each after recomputing what it could not keep."""
        found = cache_unwritable(_last_error(trial))
        if found is None:
            return
        root, reason = found
        raise CacheStop(
            f"a trial cannot write the stage cache under {root}: {reason}; the sweep stopped "
            f"and the windows recorded so far are kept: free space there (or lower the cache's "
            f"limit with --cache-max-gb, or point HEALSWEEP_CACHE at a larger disk), then "
            f"`healsweep sweep resume {self.sweep_dir}`"
        )

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self._write_trials(final=True)
