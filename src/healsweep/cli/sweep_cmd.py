"""`healsweep sweep` commands: run a sweep spec, resume an interrupted sweep, show its status."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from healsweep.cache import parse_gb
from healsweep.cli._apps import CacheMaxGb, sweep_app
from healsweep.errors import ResultsError
from healsweep.ray_orphans import stop_sessions

_SPEC = typer.Argument(..., help="Sweep spec YAML (see sweeps/).")
_SWEEP_DIR = typer.Argument(..., help="A sweep's results folder, RESULTS/<sweep name>.")
_ADDRESS = typer.Option(
    None,
    "--address",
    help="Ray cluster HEAD:PORT (default: an embedded local Ray on this machine).",
)
_RESULTS = typer.Option(None, "--results", help="Results root (default: the spec's `results`).")
_CPUS = typer.Option(
    None, "--num-cpus", help="CPUs of the embedded local Ray (default: enough for max_concurrent)."
)
_CACHE_ROOT = typer.Option(
    None,
    "--cache-root",
    help="A stage-cache folder every worker mounts at this path (overrides the spec's cache_root).",
)


_QUIET = typer.Option(
    False, "--quiet", help="No progress lines; only the summary at the end (errors still print)."
)
_JSON = typer.Option(
    False,
    "--json",
    help="Print one JSON object at the end (trials by status, the reference and external rows, "
    "the best trial, windows scored, the results folder) instead of the text summary; progress "
    "still goes to stderr unless --quiet.",
)


class _Printer:
    """The live progress view on stderr: one rewritten line on a terminal (re-drawn every second
    with the elapsed time, so it moves from the first second), a line per event in logs."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last: tuple | None = None
        self.started = time.time()
        self.latest: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.tty:
            threading.Thread(target=self._tick, daemon=True, name="progress-tick").start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if self.latest is not None and not self.latest.final:
                    self._draw(self.latest)

    def _draw(self, progress: Any) -> None:
        shown = dataclasses.replace(progress, elapsed_s=time.time() - self.started)
        if self.tty:  # one line, rewritten in place
            typer.echo("\r\033[K" + shown.line(), err=True, nl=progress.final)
        else:  # a log: one plain line per event
            typer.echo(shown.line(), err=True)

    def __call__(self, progress: Any) -> None:
        with self._lock:
            self.latest = progress
            if self.tty:
                self._draw(progress)
                return
            # in a log: a line whenever something changed (a row started or ended, a phase)
            key = (progress.phase, progress.note, progress.fixed_done, progress.fixed_running,
                   progress.completed, progress.pruned, progress.failed, progress.running)
            if key != self.last or progress.final:
                self.last = key
                self._draw(progress)

    def close(self) -> None:
        self._stop.set()


def _note(line: str) -> None:
    """A line of the sweep's own work before its trials (the allocator's sensitivity pass)."""
    typer.echo(line, err=True)


def _quiet(progress: Any) -> None:
    """The sink of --quiet: nothing."""


def run_summary(run: Any, elapsed_s: float) -> dict[str, Any]:
    """The end of a ``sweep run``/``resume`` as one JSON-ready object."""
    # lazy: heavy (pyarrow)
    from healsweep.results.aggregate import window_counts
    from healsweep.results.schema import TrialStatus, best_trial, row_role
    from healsweep.results.store import read_windows

    trials = [t for t in run.trials if row_role(t).tuned]
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial["status"]] = counts.get(trial["status"], 0) + 1
    best = best_trial(trials)
    baseline = next((t for t in trials if t["is_baseline"]), None)
    rel = None
    if best is not None and baseline is not None and baseline["kld_mean"]:
        rel = best["kld_mean"] / baseline["kld_mean"] - 1
    unfinished = sum(n for status, n in counts.items() if TrialStatus(status).unfinished)
    return {
        "sweep": run.sweep_dir.name,
        "folder": str(run.sweep_dir),
        "trials": len(trials),
        "by_status": counts,
        "fixed": [
            {"trial_id": t["trial_id"], "role": str(row_role(t)), "label": t["label"],
             "status": t["status"], "kld_mean": t["kld_mean"]}
            for t in run.trials if not row_role(t).tuned
        ],  # fmt: skip
        "best": None if best is None else {
            "trial_id": best["trial_id"], "kld_mean": best["kld_mean"], "vs_baseline": rel,
            "is_baseline": bool(best["is_baseline"]),
        },  # fmt: skip
        "windows": window_counts(read_windows(run.sweep_dir).to_pylist()),
        "elapsed_s": round(elapsed_s, 1),
        "unfinished": unfinished,
        "next": f"healsweep report {run.sweep_dir}",
    }


def _finish(run: Any, elapsed_s: float, as_json: bool) -> None:
    # lazy: heavy (pyarrow)
    from healsweep.results.schema import TrialStatus

    info = run_summary(run, elapsed_s)
    counts = info["by_status"]
    if as_json:
        typer.echo(json.dumps(info, indent=2))
    else:
        summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        line = f"sweep {info['sweep']}: {info['trials']} trials ({summary})"
        if info["fixed"]:
            rows = ", ".join(f"{t['role']} {t['label']} {t['status']}" for t in info["fixed"])
            line += f"; {rows}"
        typer.echo(line)
        best = info["best"]
        if best is not None:
            vs = "" if best["vs_baseline"] is None else f", {best['vs_baseline']:+.2%} vs baseline"
            typer.echo(f"best: trial {best['trial_id']} pooled KLD {best['kld_mean']:.5f}{vs}")
        windows = info["windows"]
        typer.echo(f"windows scored: {windows['scored']} in {int(elapsed_s // 60)}m"
                   f"{int(elapsed_s % 60):02d}s")  # fmt: skip
        typer.echo(f"results: {run.sweep_dir}")
        if info["unfinished"]:
            typer.echo(f"interrupted: finish it with `healsweep sweep resume {run.sweep_dir}`")
        typer.echo(f"next: {info['next']}")
    if counts.get(TrialStatus.ERROR):
        raise ResultsError(
            f"{counts[TrialStatus.ERROR]} of {len(run.trials)} trials failed (their errors are in "
            f"{run.sweep_dir}/trial_<id>/error.txt); fix the cause, then `healsweep sweep resume "
            f"{run.sweep_dir}` retries them"
        )


@sweep_app.command("run")
def run(
    spec: Path = _SPEC,
    address: str | None = _ADDRESS,
    results: Path | None = _RESULTS,
    num_cpus: int | None = _CPUS,
    cache_root: Path | None = _CACHE_ROOT,
    cache_max_gb: CacheMaxGb = None,
    quiet: bool = _QUIET,
    as_json: bool = _JSON,
) -> None:
    """Run every trial of a sweep spec; results land in RESULTS/<name>/ as they arrive."""
    # lazy: heavy (pyarrow)
    from healsweep.sweep.spec_files import load_spec

    limit = parse_gb(cache_max_gb, "--cache-max-gb")
    loaded = load_spec(spec)  # a bad spec is refused before Ray and the driver are imported
    # lazy: heavy (gguf, jax, optuna, pyarrow, ray)
    from healsweep.sweep.driver import run_sweep

    if cache_root is not None:  # a location, like --results: not part of the spec's hash
        loaded = loaded.model_copy(update={"cache_root": str(cache_root.resolve())})
    if limit is not None:  # over the spec's cache_max_gb; not part of the spec's hash either
        loaded = loaded.model_copy(update={"cache_max_gb": limit})
    root = results or Path(loaded.results)
    say = (lambda line: None) if quiet else (lambda line: typer.echo(line, err=as_json))
    say(f"sweep {loaded.name}: {loaded.sampler.type} sampler, pruner {loaded.pruner.type}, "
        f"results in {root / loaded.name}")  # fmt: skip
    fixed = [*loaded.reference_names(), *(e.name for e in loaded.external)]
    if fixed:
        say(f"reference and external rows first: {', '.join(fixed)}")
    started, printer = time.time(), (None if quiet else _Printer())
    try:
        outcome = run_sweep(loaded, results_root=root, address=address, num_cpus=num_cpus,
                            on_progress=printer or _quiet,
                            on_note=(lambda line: None) if quiet else _note)  # fmt: skip
    finally:
        if printer is not None:
            printer.close()
    _finish(outcome, time.time() - started, as_json)


@sweep_app.command("resume")
def resume(
    sweep_dir: Path = _SWEEP_DIR,
    address: str | None = _ADDRESS,
    num_cpus: int | None = _CPUS,
    cache_max_gb: CacheMaxGb = None,
    quiet: bool = _QUIET,
    as_json: bool = _JSON,
) -> None:
    """Finish an interrupted sweep without re-running finished trials or re-scoring windows.

    The Ray processes that this sweep's killed driver left on this machine (its dashboard and
    runtime-env agents outlive a SIGKILL and ignore SIGTERM) are stopped first."""
    # lazy: heavy (gguf, jax, optuna, pyarrow, ray)
    from healsweep.sweep.driver import resume_sweep
    from healsweep.sweep.manifest import recorded_ray_sessions

    limit = parse_gb(cache_max_gb, "--cache-max-gb")
    if not quiet:
        for line in stop_sessions(recorded_ray_sessions(sweep_dir)):
            typer.echo(line, err=True)
    else:
        stop_sessions(recorded_ray_sessions(sweep_dir))
    started, printer = time.time(), (None if quiet else _Printer())
    try:
        outcome = resume_sweep(sweep_dir, address=address, num_cpus=num_cpus,
                               on_progress=printer or _quiet, cache_max_gb=limit,
                               on_note=(lambda line: None) if quiet else _note)  # fmt: skip
    finally:
        if printer is not None:
            printer.close()
    _finish(outcome, time.time() - started, as_json)


@sweep_app.command("status")
def status(
    sweep_dir: Path = _SWEEP_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Trials by status, windows scored, best config so far, and whether a driver is running."""
    # lazy: heavy (pyarrow)
    from healsweep.sweep.status import sweep_status

    info = sweep_status(sweep_dir)
    if as_json:
        typer.echo(json.dumps({**info, "progress": info["progress"].to_dict()}, indent=2))
        return
    trials = ", ".join(f"{n} {s}" for s, n in sorted(info["trials"].items())) or "none started"
    typer.echo(f"sweep {info['sweep']} ({info['folder']})")
    typer.echo(f"driver: {info['driver'] or 'not running'}; runs so far: {info['runs']}")
    typer.echo(f"trials: {sum(info['trials'].values())}/{info['planned_trials']} ({trials})")
    for label, row in info["fixed"].items():
        kld = "" if row["kld_mean"] is None else f", pooled KLD {row['kld_mean']:.5f}"
        typer.echo(f"{row['role']} {label} ({row['trial_id']}): {row['status']}{kld}")
    windows = info["windows"]
    again = f" ({windows['replayed']} more rows replay a student's windows)" if windows[
        "replayed"] else ""  # fmt: skip
    typer.echo(f"windows scored: {windows['scored']}{again}")
    if info["pool"]:
        # lazy: heavy (pyarrow)
        from healsweep.results.placement import pool_line

        typer.echo(f"pool: {pool_line(info['pool'])}")
    progress = info["progress"]
    if progress.best_trial:
        rel = progress.best_kld / progress.baseline_kld - 1 if progress.baseline_kld else math.nan
        vs = "" if math.isnan(rel) else f", {rel:+.2%} vs baseline"
        typer.echo(f"best: trial {progress.best_trial} pooled KLD {progress.best_kld:.5f}{vs}")
