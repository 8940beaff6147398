"""`healsweep export`: a sweep's trial as a deployable GGUF (experts as healed by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from healsweep._inputs import check_output
from healsweep.cache import StageCache
from healsweep.cli._apps import CacheMaxGb, app


@app.command("export")
def export(
    sweep_dir: Annotated[Path, typer.Argument(help="A sweep's results folder, RESULTS/<name>.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the GGUF.")],
    trial: Annotated[
        str | None, typer.Option("--trial", help="Trial id to export (see `sweep status`).")
    ] = None,
    best: Annotated[
        bool,
        typer.Option(
            "--best",
            help="Export the best completed trial that the decision rule accepts against the "
            "baseline (the default without --trial); refused when none is accepted.",
        ),
    ] = False,
    allow_rejected: Annotated[
        bool,
        typer.Option(
            "--allow-rejected",
            help="With --best: when no trial passes the decision rule, export the best by dev "
            "KLD anyway (the baseline when nothing beat it), saying so.",
        ),
    ] = False,
    experts: Annotated[
        str,
        typer.Option(
            "--experts",
            help="Routed experts as healed (each tensor in its healed type: Q2_0 as ggml type "
            "42, the others as theirs), q2_0 (the same, refused unless all are Q2_0) or f16.",
        ),
    ] = "healed",
    cache: Annotated[
        Path | None,
        typer.Option(
            "--cache", help="Stage cache (default: $HEALSWEEP_CACHE or ~/.cache/healsweep)."
        ),
    ] = None,
    cache_max_gb: CacheMaxGb = None,
) -> None:
    """Rebuild a trial's student from the stage cache (recomputing what is missing) and write it.

    A trial confirmed on the test split records its milestone and ledger entry hash in the file's
    metadata; an unconfirmed trial is exported with a one-line note saying so.
    """
    # lazy: heavy (gguf, jax, pyarrow): --help stays instant
    from healsweep.deliver import export_trial

    # lazy: heavy (gguf)
    from healsweep.heal.export import EXPERT_FORMATS

    # lazy: heavy (pyarrow)
    from healsweep.results.schema import row_role

    check_output(out, "GGUF")
    stage_cache = StageCache(cache, cache_max_gb)
    if trial is not None and best:
        raise typer.BadParameter("pass --trial ID or --best, not both", param_hint="--trial")
    if trial is not None and allow_rejected:
        raise typer.BadParameter(
            "--allow-rejected goes with --best; a trial named with --trial is exported as it is",
            param_hint="--allow-rejected",
        )
    if experts not in EXPERT_FORMATS:
        raise typer.BadParameter(
            f"{experts!r}: choose one of {', '.join(EXPERT_FORMATS)}", param_hint="--experts"
        )

    def progress(stage: str, message: str) -> None:
        typer.echo(f"[{stage}] {message}")

    result = export_trial(
        sweep_dir, out, trial_id=trial, experts=experts, cache=stage_cache, progress=progress,
        allow_rejected=allow_rejected,
    )
    row = result.trial
    kld = "-" if row["kld_mean"] is None else f"{row['kld_mean']:.5f}"
    label = row_role(row)
    typer.echo(f"[trial] {label} {row['trial_id']} (config {row['config_hash']}, dev KLD {kld})")
    typer.echo(f"[knobs] {' '.join(f'{k}={v}' for k, v in result.knobs.model_dump().items())}")
    for note in result.notes:
        typer.echo(f"[note] {note}")
    conf = result.confirmation
    if conf is None:
        typer.echo(
            f"[test] not confirmed: trial {row['trial_id']} was never scored on the test split; "
            f"its quality is a dev estimate (`healsweep confirm {sweep_dir} --milestone M "
            f"--trial {row['trial_id']}` opens the test split once)"
        )
    else:
        verdict = {None: "baseline", True: "accepted", False: "not accepted"}[conf.accepted]
        typer.echo(
            f"[test] confirmed in milestone {conf.milestone!r} ({verdict} vs the baseline); "
            f"ledger entry {conf.result_entry_hash}"
        )
    typer.echo(f"[write] {result.path} (routed experts {experts})")
