"""Live progress of a sweep: the external files being built, the reference and external rows,
then trials running/done/pruned/failed, windows scored, best, ETA.

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
from enum import StrEnum
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


def notify(sweep_dir: str | Path, progress: Progress) -> None:
    """Hand ``progress`` to the sweep's sink, if one is registered."""
    sink = progress_sink(sweep_dir)
    if sink is not None:
        sink(progress)


class Phase(StrEnum):
    """Where a sweep run is: building llama.cpp's files, scoring the reference and external
    rows, running the trials."""

    EXTERNALS = "externals"
    FIXED = "fixed"
    TRIALS = "trials"


@dataclass
class Progress:
    """A snapshot of a sweep's progress.

    ``windows_scored`` counts what the report and ``sweep status`` count: distinct (student,
    window) pairs recorded in the folder (a window a student scored once and another row of
    the same student replays is not counted twice), earlier runs of a resumed sweep included.
    The ETA is shown only once a trial has finished, from this run's rate
    (``scored_now`` windows in ``elapsed_s``): before that the rate mixes in the first trial's
    cold start (the teacher trace, the first quantizations) and says nothing useful.
    """

    planned: int
    running: int = 0
    completed: int = 0
    pruned: int = 0
    failed: int = 0
    windows_scored: int = 0  # distinct (student, window) pairs in the folder
    windows_total: int = 0  # windows per trial
    best_kld: float = math.nan
    best_trial: str = ""
    baseline_kld: float = math.nan
    eta_s: float = math.nan
    elapsed_s: float = 0.0
    final: bool = False
    phase: Phase = Phase.TRIALS
    fixed_done: int = 0  # reference and external rows completed
    fixed_total: int = 0
    fixed_running: tuple[str, ...] = ()  # their labels
    note: str = ""  # what the phase is doing now, in words

    @classmethod
    def of(
        cls,
        rows: Sequence[Mapping[str, Any]],
        planned: int,
        windows_scored: int,
        elapsed_s: float,
        final: bool = False,
        *,
        scored_now: int | None = None,
        phase: Phase = Phase.TRIALS,
        note: str = "",
    ) -> Progress:
        """The progress shown by ``trials.parquet`` rows (reference and external rows are not
        trials of the experiment, and are counted apart) with ``windows_scored`` windows
        recorded, ``scored_now`` of them (default: all) scored by this run in ``elapsed_s``
        seconds; the best trial by :func:`~healsweep.results.schema.best_trial`."""
        trials = [t for t in rows if row_role(t).tuned]
        fixed = [t for t in rows if not row_role(t).tuned]
        status = Counter(TrialStatus(t["status"]) for t in trials)
        running = [t for t in trials if t["status"] in (TrialStatus.RUNNING, TrialStatus.RETRYING)]
        best = best_trial(trials)
        baseline = next(
            (t for t in trials if t["is_baseline"] and t["status"] == TrialStatus.COMPLETED), None
        )
        total = max((t["windows_total"] or 0 for t in trials), default=0)
        left = sum(total - (t["windows_scored"] or 0) for t in running)
        left += max(0, planned - len(trials)) * total
        finished = status[TrialStatus.COMPLETED] + status[TrialStatus.PRUNED]
        finished += status[TrialStatus.ERROR]
        rate_windows = windows_scored if scored_now is None else scored_now
        eta = math.nan
        if finished and rate_windows and total and elapsed_s > 0 and phase == Phase.TRIALS:
            eta = left * elapsed_s / rate_windows
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
            eta_s=eta,
            elapsed_s=elapsed_s,
            final=final,
            phase=phase,
            fixed_done=sum(t["status"] == TrialStatus.COMPLETED for t in fixed),
            fixed_total=len(fixed),
            fixed_running=tuple(
                str(t["label"]) for t in fixed if t["status"] == TrialStatus.RUNNING
            ),
            note=note,
        )

    def line(self) -> str:
        """One human line: ``trials 3/12 done (running 2, ...) | windows scored 130 | ...``;
        before the trials, what the reference and external rows are doing."""
        elapsed = f"elapsed {_duration(self.elapsed_s)}"
        if self.phase == Phase.EXTERNALS:
            return f"{self.note or 'building the external files'} | {elapsed}"
        if self.phase == Phase.FIXED:
            running = ", ".join(self.fixed_running) or "-"
            note = f" | {self.note}" if self.note else ""
            return (
                f"reference and external rows {self.fixed_done}/{self.fixed_total} done "
                f"(running: {running}){note} | windows scored {self.windows_scored} | {elapsed}"
            )
        finished = self.completed + self.pruned + self.failed
        best = "-" if math.isnan(self.best_kld) else f"{self.best_kld:.5f} ({self.best_trial})"
        if self.baseline_kld and math.isfinite(ratio := self.best_kld / self.baseline_kld):
            best += f" {ratio - 1:+.1%} vs baseline"
        if self.final:
            eta = ""
        elif math.isnan(self.eta_s):
            eta = " | ETA after the first trial"
        else:
            eta = f" | ETA {_duration(self.eta_s)}"
        return (
            f"trials {finished}/{self.planned} done (running {self.running}, completed "
            f"{self.completed}, pruned {self.pruned}, failed {self.failed}) | windows scored "
            f"{self.windows_scored} | best KLD {best} | {elapsed}{eta}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``sweep status --json``, ``sweep run --json``): NaN as None."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["phase"] = str(self.phase)
        out["fixed_running"] = list(self.fixed_running)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
