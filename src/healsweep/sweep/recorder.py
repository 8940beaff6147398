"""The driver-side Tune callback that turns reported windows into Parquet rows as they arrive.

Each window result becomes one row written atomically under ``windows/`` before the next result
is processed, so a crash of the driver loses no window that reached it. A row already present
for the same ``(config_hash, window_id)`` (a replay after a retry or a resume) is not written
again. When a trial ends its rows are consolidated with the final ``pruned`` flag, and
``trials.parquet`` is rewritten. All state is reloaded from the folder in ``setup``, so a
restored sweep picks up where the files left off.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from healsweep.results.schema import (
    Q2_0_BPW,
    knob_columns,
    row_role,
    to_table,
    trial_schema,
    window_schema,
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
)
from healsweep.sweep.space import baseline_knobs, config_hash, resolve_knobs


class ResultsRecorder(Callback):
    """Writes the windows dataset and ``trials.parquet`` of one sweep (see module docstring)."""

    def __init__(self, sweep_dir: str | Path, spec: Any) -> None:
        self.sweep_dir = Path(sweep_dir)
        self.spec = spec
        self._reset()

    def _reset(self) -> None:
        self.trials: dict[str, dict[str, Any]] = {}
        self._seen: set[tuple[str, str]] = set()
        self._seq: dict[str, int] = {}
        self.rows_written = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"sweep_dir": self.sweep_dir, "spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def windows_dir(self) -> Path:
        """``RESULTS/<sweep>/windows``."""
        return self.sweep_dir / WINDOWS_DIR

    # Loading -------------------------------------------------------------------------------

    def setup(self, **info: Any) -> None:
        """Reload everything from the folder (a fresh sweep finds it empty)."""
        self._reset()
        self.windows_dir.mkdir(parents=True, exist_ok=True)
        tidy_windows_dir(self.windows_dir)
        for row in read_trials(self.sweep_dir).to_pylist():
            row["windows"] = {}
            row["node_set"] = set(filter(None, (row.get("nodes") or "").split(",")))
            self.trials[row["trial_id"]] = row
        rows = read_windows(self.sweep_dir)
        for row in rows.select(
            [
                "trial_id",
                "config_hash",
                "window_id",
                "kld_sum",
                "kld_count",
                "top1_count",
                "windows_total",
            ]
        ).to_pylist():
            self._seen.add((row["config_hash"], row["window_id"]))
            trial = self.trials.get(row["trial_id"])
            if trial is not None:
                trial["windows"][row["window_id"]] = _sums(row)
        for trial_id, paths in part_files(self.windows_dir).items():
            self._seq[trial_id] = next_seq(paths)

    def _trial(self, trial: Any) -> dict[str, Any]:
        row = self.trials.get(trial.trial_id)
        if row is None:
            knobs = resolve_knobs(self.spec, trial.config)
            chash = config_hash(knobs)
            is_baseline = chash == config_hash(baseline_knobs(self.spec))
            row = {
                "sweep": self.spec.name,
                "trial_id": trial.trial_id,
                "config_hash": chash,
                "is_baseline": is_baseline,
                "role": "baseline" if is_baseline else "trial",
                "routed_bpw": Q2_0_BPW,
                **knob_columns(knobs.model_dump()),
                "status": "pending",
                "pruned": False,
                "windows_total": None,
                "n_failures": 0,
                "started_at": None,
                "ended_at": None,
                "windows": {},
                "node_set": set(),
            }
            self.trials[trial.trial_id] = row
        return row

    # Tune hooks ----------------------------------------------------------------------------

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        row = self._trial(trial)
        row["status"] = "running"
        row["started_at"] = row["started_at"] or time.time()
        self._write_trials()

    def on_trial_result(
        self, iteration: int, trials: list, trial: Any, result: dict, **info: Any
    ) -> None:
        if "window_id" not in result:
            return
        row = self._trial(trial)
        row["status"] = "running"
        row["windows_total"] = int(result["windows_total"])
        row["windows"][result["window_id"]] = _sums(result)
        if result.get("scored_node_ip"):
            row["node_set"].add(str(result["scored_node_ip"]))
        key = (str(result["config_hash"]), str(result["window_id"]))
        if key in self._seen:
            return
        record = {
            **result,
            "sweep": self.spec.name,
            "trial_id": trial.trial_id,
            "role": row_role(row),
            **{k: v for k, v in row.items() if k.startswith("knob_")},
            "pruned": False,
            "written_at": time.time(),
        }
        seq = self._seq.get(trial.trial_id, 0)
        path = self.windows_dir / f"part-{trial.trial_id}-{seq:06d}.parquet"
        atomic_write_table(to_table([record], window_schema()), path)
        self._seq[trial.trial_id] = seq + 1
        self._seen.add(key)
        self.rows_written += 1

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        row = self._trial(trial)
        total = row["windows_total"]
        row["pruned"] = total is not None and len(row["windows"]) < total
        row["status"] = "pruned" if row["pruned"] else "completed"
        self._finish(trial, row)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        row = self._trial(trial)
        row["status"] = "error"
        row["n_failures"] = int(getattr(trial, "num_failures", row["n_failures"] + 1))
        self._finish(trial, row)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        row = self._trial(trial)
        row["n_failures"] = int(getattr(trial, "num_failures", row["n_failures"] + 1))
        row["status"] = "retrying"
        self._write_trials()

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self._write_trials()

    # Writing -------------------------------------------------------------------------------

    def _finish(self, trial: Any, row: dict[str, Any]) -> None:
        row["ended_at"] = time.time()
        consolidate_trial(self.windows_dir, trial.trial_id, pruned=row["pruned"])
        self._seq.pop(trial.trial_id, None)
        self._write_trials()

    def trial_rows(self) -> list[dict[str, Any]]:
        """The rows of ``trials.parquet`` as they stand."""
        out = []
        for row in self.trials.values():
            sums = row["windows"].values()
            kld = sum(s[0] for s in sums)
            count = sum(s[1] for s in sums)
            top1 = sum(s[2] for s in sums)
            out.append(
                {
                    **{k: v for k, v in row.items() if k not in ("windows", "node_set")},
                    "windows_scored": len(row["windows"]),
                    "kld_sum": kld,
                    "kld_count": count,
                    "top1_count": top1,
                    "kld_mean": kld / count if count else None,
                    "top1": top1 / count if count else None,
                    "nodes": ",".join(sorted(row["node_set"])),
                }
            )
        return out

    def _write_trials(self) -> None:
        table = to_table(self.trial_rows(), trial_schema())
        atomic_write_table(table, self.sweep_dir / TRIALS_FILE)


def _sums(record: dict[str, Any]) -> tuple[float, int, int]:
    count = int(record["kld_count"])
    top1 = record.get("top1_count")
    if top1 is None:
        top1 = round(float(record["top1"]) * count)
    return float(record["kld_sum"]), count, int(top1)


__all__ = ["ResultsRecorder"]
