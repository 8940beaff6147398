"""Live progress of a sweep: trials running/done/pruned/failed, windows scored, best, ETA.

The results recorder (:mod:`~healsweep.sweep.recorder`) makes a :class:`Progress` from its trial
rows and hands it to a *sink*, a function the caller registers for the sweep's folder (the CLI's
printer). Sinks are looked up at call time in the process's runtime
(:attr:`healsweep.runtime.Runtime.progress_sinks`) rather than stored on the recorder, because
Tune pickles callbacks into the experiment folder and restores them on resume: the restored
recorder then finds the sink of the process that resumed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from healsweep.results.schema import TrialStatus, best_trial, row_role
from healsweep.runtime import current

ProgressSink = Callable[["Progress"], None]


def register_sink(sweep_dir: str | Path, sink: ProgressSink | None) -> None:
    """Send progress of the sweep in ``sweep_dir`` to ``sink`` (``None`` unregisters)."""
    key, sinks = str(Path(sweep_dir).resolve()), current().progress_sinks
    if sink is None:
        sinks.pop(key, None)
    else:
        sinks[key] = sink


def progress_sink(sweep_dir: str | Path) -> ProgressSink | None:
    """The sink registered for the sweep in ``sweep_dir``, if any."""
    return current().progress_sinks.get(str(Path(sweep_dir).resolve()))


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

    @classmethod
    def of(
        cls,
        rows: Sequence[Mapping[str, Any]],
        planned: int,
        windows_scored: int,
        elapsed_s: float,
        final: bool = False,
    ) -> Progress:
        """The progress shown by ``trials.parquet`` rows (reference and external rows are not
        trials of the experiment) after ``windows_scored`` windows in ``elapsed_s`` seconds;
        the best trial by :func:`~healsweep.results.schema.best_trial`."""
        trials = [t for t in rows if row_role(t).tuned]
        status = Counter(TrialStatus(t["status"]) for t in trials)
        running = [t for t in trials if t["status"] in (TrialStatus.RUNNING, TrialStatus.RETRYING)]
        best = best_trial(trials)
        baseline = next(
            (t for t in trials if t["is_baseline"] and t["status"] == TrialStatus.COMPLETED), None
        )
        total = max((t["windows_total"] or 0 for t in trials), default=0)
        left = sum(total - t["windows_scored"] for t in running)
        left += max(0, planned - len(trials)) * total
        return cls(
            planned=planned,
            running=len(running),
            completed=status[TrialStatus.COMPLETED],
            pruned=status[TrialStatus.PRUNED],
            failed=status[TrialStatus.ERROR],
            windows_scored=windows_scored,
            windows_total=total,
            best_kld=math.nan if best is None else best["kld_mean"],
            best_trial="" if best is None else best["trial_id"],
            baseline_kld=math.nan if baseline is None else baseline["kld_mean"],
            eta_s=left * elapsed_s / windows_scored if windows_scored and total else math.nan,
            elapsed_s=elapsed_s,
            final=final,
        )

    def line(self) -> str:
        """One human line: ``trials 3/12 running 2 pruned 1 failed 0 | windows 130 | best ...``."""
        finished = self.completed + self.pruned + self.failed
        best = "-" if math.isnan(self.best_kld) else f"{self.best_kld:.5f} ({self.best_trial})"
        if self.baseline_kld and math.isfinite(ratio := self.best_kld / self.baseline_kld):
            best += f" {ratio - 1:+.1%} vs baseline"
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
