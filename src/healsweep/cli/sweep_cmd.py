"""`healsweep sweep` commands: run a sweep spec, resume an interrupted sweep, show its status."""

from __future__ import annotations

import math
import sys
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


class _Printer:
    """The live progress view: one rewritten line on a terminal, a line per trial event in logs."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last_finished = -1

    def __call__(self, progress: Any) -> None:
        line = progress.line()
        if self.tty:
            typer.echo("\r\033[K" + line, err=True, nl=progress.final)
            return
        finished = progress.completed + progress.pruned + progress.failed
        if finished != self.last_finished or progress.final:
            self.last_finished = finished
            typer.echo(line, err=True)


def _note(line: str) -> None:
    """A line of the sweep's own work before its trials (the allocator's sensitivity pass)."""
    typer.echo(line, err=True)


def _finish(run: Any) -> None:
    # lazy: heavy (pyarrow)
    from healsweep.results.schema import TrialStatus, row_role

    trials = [t for t in run.trials if row_role(t).tuned]
    fixed = [t for t in run.trials if not row_role(t).tuned]
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial["status"]] = counts.get(trial["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    line = f"sweep {run.sweep_dir.name}: {len(trials)} trials ({summary})"
    if fixed:
        rows = ", ".join(f"{row_role(t)} {t['label']} {t['status']}" for t in fixed)
        line += f"; {rows}"
    typer.echo(line)
    typer.echo(f"results: {run.sweep_dir}")
    unfinished = sum(n for status, n in counts.items() if TrialStatus(status).unfinished)
    if unfinished:
        typer.echo(f"interrupted: finish it with `healsweep sweep resume {run.sweep_dir}`")
    typer.echo(f"next: healsweep report {run.sweep_dir}")
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
) -> None:
    """Run every trial of a sweep spec; results land in RESULTS/<name>/ as they arrive."""
    # lazy: heavy (gguf, jax, optuna, pyarrow, ray)
    from healsweep.sweep.driver import run_sweep

    # lazy: heavy (pyarrow)
    from healsweep.sweep.spec_files import load_spec

    limit = parse_gb(cache_max_gb, "--cache-max-gb")
    loaded = load_spec(spec)
    if cache_root is not None:  # a location, like --results: not part of the spec's hash
        loaded = loaded.model_copy(update={"cache_root": str(cache_root.resolve())})
    if limit is not None:  # over the spec's cache_max_gb; not part of the spec's hash either
        loaded = loaded.model_copy(update={"cache_max_gb": limit})
    root = results or Path(loaded.results)
    typer.echo(f"sweep {loaded.name}: {loaded.sampler.type} sampler, pruner {loaded.pruner.type}, "
               f"results in {root / loaded.name}")  # fmt: skip
    fixed = [*loaded.reference_names(), *(e.name for e in loaded.external)]
    if fixed:
        typer.echo(f"reference and external rows first: {', '.join(fixed)}")
    outcome = run_sweep(
        loaded, results_root=root, address=address, num_cpus=num_cpus, on_progress=_Printer(),
        on_note=_note,
    )
    _finish(outcome)


@sweep_app.command("resume")
def resume(
    sweep_dir: Path = _SWEEP_DIR,
    address: str | None = _ADDRESS,
    num_cpus: int | None = _CPUS,
    cache_max_gb: CacheMaxGb = None,
) -> None:
    """Finish an interrupted sweep without re-running finished trials or re-scoring windows.

    The Ray processes that this sweep's killed driver left on this machine (its dashboard and
    runtime-env agents outlive a SIGKILL and ignore SIGTERM) are stopped first."""
    # lazy: heavy (gguf, jax, optuna, pyarrow, ray)
    from healsweep.sweep.driver import resume_sweep
    from healsweep.sweep.manifest import recorded_ray_sessions

    limit = parse_gb(cache_max_gb, "--cache-max-gb")
    for line in stop_sessions(recorded_ray_sessions(sweep_dir)):
        typer.echo(line, err=True)
    outcome = resume_sweep(sweep_dir, address=address, num_cpus=num_cpus, on_progress=_Printer(),
                           cache_max_gb=limit, on_note=_note)  # fmt: skip
    _finish(outcome)


@sweep_app.command("status")
def status(sweep_dir: Path = _SWEEP_DIR) -> None:
    """Trials by status, windows recorded, best config so far, and whether a driver is running."""
    # lazy: heavy (pyarrow)
    from healsweep.sweep.status import sweep_status

    info = sweep_status(sweep_dir)
    trials = ", ".join(f"{n} {s}" for s, n in sorted(info["trials"].items())) or "none started"
    typer.echo(f"sweep {info['sweep']} ({info['folder']})")
    typer.echo(f"driver: {info['driver'] or 'not running'}; runs so far: {info['runs']}")
    typer.echo(f"trials: {sum(info['trials'].values())}/{info['planned_trials']} ({trials})")
    for label, row in info["fixed"].items():
        kld = "" if row["kld_mean"] is None else f", pooled KLD {row['kld_mean']:.5f}"
        typer.echo(f"{row['role']} {label}: {row['status']}{kld}")
    typer.echo(f"windows recorded: {info['windows_recorded']}")
    if info["pool"]:
        # lazy: heavy (pyarrow)
        from healsweep.results.placement import pool_line

        typer.echo(f"pool: {pool_line(info['pool'])}")
    progress = info["progress"]
    if progress.best_trial:
        rel = progress.best_kld / progress.baseline_kld - 1 if progress.baseline_kld else math.nan
        vs = "" if math.isnan(rel) else f", {rel:+.2%} vs baseline"
        typer.echo(f"best: trial {progress.best_trial} pooled KLD {progress.best_kld:.5f}{vs}")
