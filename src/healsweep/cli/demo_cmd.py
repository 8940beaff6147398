"""`healsweep demo` commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from healsweep.cli._apps import demo_app


@demo_app.command("corpus")
def demo_corpus(
    out: Annotated[Path, typer.Option("--out", help="Corpus JSONL to write.")] = Path(
        "demo-corpus.jsonl"
    ),
    tokenizer_out: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer-out",
            help="tokenizer.json to write (default: demo-tokenizer.json next to --out).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the partition and wording.")] = 0,
) -> None:
    """Build the demo corpus and its tokenizer from the Python standard library (no network)."""
    from healsweep.demo.corpus_builder import (
        BUILT_WITH,
        DemoCorpusConfig,
        build_demo_corpus,
        write_demo_assets,
    )

    tokenizer_path = tokenizer_out or out.with_name("demo-tokenizer.json")
    build = build_demo_corpus(DemoCorpusConfig(seed=seed))
    write_demo_assets(build, out, tokenizer_path)
    report = build.report
    if report["python"] != BUILT_WITH:
        typer.echo(
            f"note: built with {report['python']}; the shipped assets came from {BUILT_WITH}"
        )
    typer.echo(f"wrote {len(build.documents)} documents to {out}, tokenizer to {tokenizer_path}")
    typer.echo(f"{'pool/stratum':<22}{'documents':>10}")
    for key, count in report["documents"].items():
        typer.echo(f"{key:<22}{count:>10}")
    for pool, tokens in report["tokens"].items():
        typer.echo(f"tokens {pool:<15}{tokens:>10}")
    typer.echo(
        f"calibration candidates dropped for a shared 16-gram: {report['calibration_dropped']}; "
        f"vocab {report['vocab_size']}; {report['seconds']} s"
    )
