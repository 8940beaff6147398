"""`healsweep report`: the Markdown/HTML report of a sweep with its plots."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from healsweep._inputs import check_output_folder
from healsweep.cli._apps import app

_SWEEP_DIR = typer.Argument(..., help="A sweep's results folder, RESULTS/<sweep name>.")
_BOOT = typer.Option(10_000, "--n-boot", min=100, help="Paired-bootstrap resamples per config.")
_SEED = typer.Option(0, "--seed", help="Seed of the bootstrap.")
_JSON = typer.Option(
    False,
    "--json",
    help="Print one JSON object (what the sweep found, the leaderboard, the files written) "
    "instead of the text tables; the report files are written all the same.",
)
_BESIDE = typer.Option(
    None,
    "--beside",
    metavar="<path>",
    help="Another sweep's results folder (repeatable), of the same model and split: its best "
    "uniform and tpe/random configs of each budget tier go beside the allocator's choice.",
)


@app.command("report")
def report(
    sweep_dir: Path = _SWEEP_DIR,
    n_boot: int = _BOOT,
    seed: int = _SEED,
    as_json: bool = _JSON,
    beside: list[Path] | None = _BESIDE,
) -> None:
    """What the sweep found, the leaderboard vs the baseline with CIs and verdicts, strata, knob
    effects, pruning, plots: report/report.md and report/report.html."""
    # lazy: heavy (pyarrow)
    from healsweep.confirm import read_confirmed

    # lazy: heavy (gguf, pyarrow)
    from healsweep.results.aggregate import summarize
    from healsweep.results.findings import findings, to_json
    from healsweep.results.report import counts_line, found_lines, leaderboard, write_report
    from healsweep.results.store import read_manifest

    for folder in [sweep_dir, *(beside or [])]:
        read_manifest(folder)  # a clear error when this is not a sweep folder
    check_output_folder(sweep_dir, "report")  # it goes to SWEEP/report/, after the bootstrap
    summary = summarize(sweep_dir, n_boot=n_boot, seed=seed)
    paths = write_report(sweep_dir, summary=summary, confirmed=read_confirmed(sweep_dir),
                         beside=beside or [])  # fmt: skip
    header, rows = leaderboard(summary)
    if as_json:
        found = to_json(summary, findings(summary), str(sweep_dir))
        out = {
            "sweep": summary.name,
            "counts": {"rows": summary.rows, "windows": summary.window_counts,
                       "windows_per_config": summary.windows_total},  # fmt: skip
            "findings": found,
            "leaderboard": [dict(zip(header, row, strict=True)) for row in rows],
            "files": {name: str(path) for name, path in paths.items()},
        }
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo(counts_line(summary))
    typer.echo("")
    for line in found_lines(summary, str(sweep_dir)):
        typer.echo(line)
    typer.echo("")
    shown = ("#", "config", "trial", "status", "pooled KLD", "hit rate", "MiB/token", "top-1",
             "verdict")  # fmt: skip
    keep = [i for i, h in enumerate(header) if h in shown or h.startswith("Δ KLD")]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in keep]
    for row in [header, *rows]:
        typer.echo("  ".join(row[i].ljust(w) for i, w in zip(keep, widths, strict=True)))
    typer.echo(f"wrote {paths['markdown']} and {paths['html']}")
