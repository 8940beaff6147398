"""Live progress of a sweep: trials running/done/pruned/failed, windows scored, best, ETA.

:class:`ProgressCallback` follows Tune's hooks on the driver and hands a :class:`Progress`
snapshot to a *sink* (a function the caller registers for the sweep's folder, e.g. the CLI's
printer). Sinks are looked up at call time from a process-local registry rather than stored on
the callback, because Tune pickles callbacks into the experiment folder and restores them on
resume: the restored callback then finds the sink of the process that resumed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.tune import Callback

from healsweep.results.schema import row_role
from healsweep.results.store import read_trials

ProgressSink = Callable[["Progress"], None]
_SINKS: dict[str, ProgressSink] = {}


def register_sink(sweep_dir: str | Path, sink: ProgressSink | None) -> None:
    """Send progress of the sweep in ``sweep_dir`` to ``sink`` (``None`` unregisters)."""
    key = str(Path(sweep_dir).resolve())
    if sink is None:
        _SINKS.pop(key, None)
    else:
        _SINKS[key] = sink


@dataclass
class Progress:
    """A snapshot of a sweep's progress."""

    planned: int
    running: int = 0
    completed: int = 0
    pruned: int = 0
    failed: int = 0
    windows_scored: int = 0  # scored in this session (replays excluded)
    windows_total: int = 0  # windows per trial
    best_kld: float = math.nan
    best_trial: str = ""
    baseline_kld: float = math.nan
    eta_s: float = math.nan
    elapsed_s: float = 0.0
    final: bool = False
    done_trials: dict[str, str] = field(default_factory=dict, repr=False)

    def line(self) -> str:
        """One human line: ``trials 3/12 running 2 pruned 1 failed 0 | windows 130 | best ...``."""
        finished = self.completed + self.pruned + self.failed
        best = "-" if math.isnan(self.best_kld) else f"{self.best_kld:.5f} ({self.best_trial})"
        if (
            not math.isnan(self.best_kld)
            and not math.isnan(self.baseline_kld)
            and self.baseline_kld
        ):
            best += f" {self.best_kld / self.baseline_kld - 1:+.1%} vs baseline"
        eta = "-" if math.isnan(self.eta_s) else _duration(self.eta_s)
        return (
            f"trials {finished}/{self.planned} done (running {self.running}, completed "
            f"{self.completed}, pruned {self.pruned}, failed {self.failed}) | windows scored "
            f"{self.windows_scored} | best KLD {best} | elapsed {_duration(self.elapsed_s)} | ETA {eta}"
        )


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ProgressCallback(Callback):
    """Keeps a :class:`Progress` up to date and sends it to the registered sink."""

    def __init__(self, sweep_dir: str | Path, planned: int, interval_s: float = 2.0) -> None:
        self.sweep_dir = str(Path(sweep_dir).resolve())
        self.planned = planned
        self.interval_s = interval_s
        self._init_state()

    def _init_state(self) -> None:
        self.progress = Progress(planned=self.planned)
        self._running: dict[str, tuple[int, int]] = {}  # trial id -> (windows done, total)
        self._start = time.time()
        self._last_sent = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {"sweep_dir": self.sweep_dir, "planned": self.planned, "interval_s": self.interval_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_state()

    def setup(self, **info: Any) -> None:
        """Seed the counts from ``trials.parquet`` (non-empty on resume)."""
        self._init_state()
        for row in read_trials(self.sweep_dir).to_pylist():
            if row_role(row) in ("reference", "external"):  # not trials of the experiment
                continue
            if row["status"] in ("completed", "pruned", "error"):
                self._finish(row["trial_id"], row["status"], row["kld_mean"], row["is_baseline"])
            if row["windows_total"]:
                self.progress.windows_total = int(row["windows_total"])

    def _finish(self, trial_id: str, status: str, kld: float | None, baseline: bool) -> None:
        p = self.progress
        previous = p.done_trials.get(trial_id)
        if previous == status:
            return
        if previous is not None:
            setattr(p, _COUNTER[previous], getattr(p, _COUNTER[previous]) - 1)
        p.done_trials[trial_id] = status
        setattr(p, _COUNTER[status], getattr(p, _COUNTER[status]) + 1)
        if status == "completed" and kld is not None:
            if baseline:
                p.baseline_kld = kld
            if math.isnan(p.best_kld) or kld < p.best_kld:
                p.best_kld, p.best_trial = kld, trial_id

    def _send(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_sent < self.interval_s:
            return
        self._last_sent = now
        p = self.progress
        p.running = len(self._running)
        p.elapsed_s = now - self._start
        p.eta_s = self._eta(now)
        sink = _SINKS.get(self.sweep_dir)
        if sink is not None:
            sink(p)

    def _eta(self, now: float) -> float:
        p = self.progress
        if not p.windows_scored or not p.windows_total:
            return math.nan
        started = len(self._running) + len(p.done_trials)
        left = sum(total - done for done, total in self._running.values())
        left += max(0, p.planned - started) * p.windows_total
        return left * (now - self._start) / p.windows_scored

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._running.setdefault(trial.trial_id, (0, self.progress.windows_total))
        self._send(force=True)

    def on_trial_result(
        self, iteration: int, trials: list, trial: Any, result: dict, **info: Any
    ) -> None:
        if "window_id" not in result:
            return
        total = int(result["windows_total"])
        self.progress.windows_total = total
        self._running[trial.trial_id] = (int(result["windows_done"]), total)
        if not result.get("replayed"):
            self.progress.windows_scored += 1
        self._send()

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        done, total = self._running.pop(trial.trial_id, (0, 0))
        last = trial.last_result or {}
        pruned = bool(total) and int(last.get("windows_done", done)) < total
        kld = last.get("running_kld_mean")
        self._finish(
            trial.trial_id, "pruned" if pruned else "completed", kld, bool(last.get("is_baseline"))
        )
        self._send(force=True)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._running.pop(trial.trial_id, None)
        self._finish(trial.trial_id, "error", None, False)
        self._send(force=True)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.progress.final = True
        self._send(force=True)


_COUNTER = {"completed": "completed", "pruned": "pruned", "error": "failed"}

__all__ = ["Progress", "ProgressCallback", "ProgressSink", "register_sink"]
