"""`healsweep report`: the Markdown/HTML report of a sweep with its plots."""

from __future__ import annotations

from pathlib import Path

import typer

from healsweep.cli._apps import app

_SWEEP_DIR = typer.Argument(..., help="A sweep's results folder, RESULTS/<sweep name>.")
_BOOT = typer.Option(10_000, "--n-boot", min=100, help="Paired-bootstrap resamples per config.")
_SEED = typer.Option(0, "--seed", help="Seed of the bootstrap.")


@app.command("report")
def report(sweep_dir: Path = _SWEEP_DIR, n_boot: int = _BOOT, seed: int = _SEED) -> None:
    """Leaderboard vs the baseline with CIs and verdicts, strata, knob effects, pruning, plots."""
    # lazy: heavy (pyarrow)
    from healsweep.confirm import read_confirmed

    # lazy: heavy (gguf, pyarrow)
    from healsweep.results.aggregate import summarize
    from healsweep.results.report import leaderboard, write_report

    summary = summarize(sweep_dir, n_boot=n_boot, seed=seed)
    paths = write_report(sweep_dir, summary=summary, confirmed=read_confirmed(sweep_dir))
    header, rows = leaderboard(summary)
    shown = ("#", "config", "status", "pooled KLD", "hit rate", "MiB/token", "top-1", "verdict")
    keep = [i for i, h in enumerate(header) if h in shown or h.startswith("Δ KLD")]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in keep]
    for row in [header, *rows]:
        typer.echo("  ".join(row[i].ljust(w) for i, w in zip(keep, widths, strict=True)))
    typer.echo(f"wrote {paths['markdown']} and {paths['html']}")
