"""`healsweep confirm`: open the sealed test split once per milestone and score frozen configs."""

from __future__ import annotations

from pathlib import Path

import typer

from healsweep._inputs import check_output_folder
from healsweep.cache import parse_gb
from healsweep.cli._apps import CacheMaxGb, app

_SWEEP_DIR = typer.Argument(..., help="A finished sweep's results folder, RESULTS/<sweep name>.")
_MILESTONE = typer.Option(
    ..., "--milestone", help="Milestone name (letters, digits, . _ -); opens the test split once."
)
_TRIAL = typer.Option(
    None,
    "--trial",
    help="Trial id to confirm (repeatable). Default: the best completed dev trial (refused when "
    "that is the baseline: nothing to test against it). The baseline is always confirmed too.",
)
_ROOT = typer.Option(
    None,
    "--results-root",
    help="Folder holding the ledger.jsonl to record in (default: the ledger the sweep recorded: "
    "its spec's `ledger`, else the sweep folder's parent's); it must extend every ledger head "
    "the sweep recorded.",
)
_MAX = typer.Option(
    None, "--max-windows", min=1, help="Score the first N test windows by window id (as a sweep)."
)
_RESUME = typer.Option(
    False,
    "--resume",
    help="Continue a confirm of this milestone that stopped before recording its result "
    "(same frozen configs; appends a confirm-resume entry).",
)
_NEW_SPLIT = typer.Option(
    False, "--new-split", help="Record a deliberate new split (the ledger's latest differs)."
)
_BOOT = typer.Option(10_000, "--n-boot", min=100, help="Paired-bootstrap resamples.")
_QUIET = typer.Option(
    False, "--quiet", help="Print only the result: no progress lines (the ledger is still written)."
)
_VERBOSE = typer.Option(
    False, "--verbose", help="Also print every test window's KLD as it is scored."
)
_PAIR = typer.Option(
    None,
    "--pair",
    help="TRIAL:OTHER (repeatable): also compare TRIAL against OTHER on the test windows, with "
    "the decision rule's verdict; name both with --trial (e.g. a healed config against the "
    "unhealed config that writes llama.cpp's own file).",
)


@app.command("confirm")
def confirm(
    sweep_dir: Path = _SWEEP_DIR,
    milestone: str = _MILESTONE,
    trial: list[str] | None = _TRIAL,
    results_root: Path | None = _ROOT,
    max_windows: int | None = _MAX,
    resume: bool = _RESUME,
    new_split: bool = _NEW_SPLIT,
    n_boot: int = _BOOT,
    quiet: bool = _QUIET,
    verbose: bool = _VERBOSE,
    pair: list[str] | None = _PAIR,
    cache_max_gb: CacheMaxGb = None,
) -> None:
    """Freeze configs, record the opening in the ledger, score them on the test split, record the
    result hash; prints pooled KLD per config and the verdict of each config vs the baseline
    (progress by config; every window with --verbose; nothing but the result with --quiet)."""
    # lazy: heavy (pyarrow)
    from healsweep.confirm import confirm as run_confirm
    from healsweep.results.store import read_manifest

    if quiet and verbose:
        raise typer.BadParameter("pass --quiet or --verbose, not both", param_hint="--quiet")
    parse_gb(cache_max_gb, "--cache-max-gb")  # a bad value: refused before the ledger is read
    read_manifest(sweep_dir)  # a clear error when this is not a sweep folder
    check_output_folder(sweep_dir, "confirm record")  # before the test windows are scored

    def progress(message: str) -> None:
        window = message.startswith("  window")
        if verbose or not (quiet or window):
            typer.echo(message)

    summary = run_confirm(
        sweep_dir,
        milestone,
        trial_ids=trial or None,
        results_root=results_root,
        max_windows=max_windows,
        resume=resume,
        allow_split_change=new_split,
        n_boot=n_boot,
        progress=progress,
        pairs=pair or (),
        cache_max_gb=cache_max_gb,
    )
    typer.echo(f"milestone {milestone!r}: {summary['windows']} test windows")
    for config in summary["configs"]:
        name = "baseline" if config["is_baseline"] else f"trial {config['trial_id']}"
        line = (
            f"  {name:<24} pooled KLD {config['pooled']['kld_mean']:.5f}  "
            f"top-1 {config['pooled']['top1']:.2%}"
        )
        comp = config["comparison"]
        if comp is not None:
            lo, hi = comp["rel_change_ci"]
            verdict = "ACCEPT" if config["verdict"]["accepted"] else "reject"
            line += f"  Δ {comp['rel_change']:+.2%} [{lo:+.2%}, {hi:+.2%}]  {verdict}"
        typer.echo(line)
    for entry in summary.get("pairs", []):
        comp = entry["comparison"]
        lo, hi = comp["rel_change_ci"]
        verdict = "ACCEPT" if entry["verdict"]["accepted"] else "reject"
        typer.echo(
            f"  trial {entry['trial_id']} vs trial {entry['against']}: "
            f"Δ {comp['rel_change']:+.2%} [{lo:+.2%}, {hi:+.2%}]  {verdict}"
        )
