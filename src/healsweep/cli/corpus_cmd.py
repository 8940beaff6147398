"""`healsweep corpus` commands."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from healsweep._inputs import check_output
from healsweep.cli._apps import corpus_app
from healsweep.data.chatml import import_chatml_files
from healsweep.data.corpus import load_corpus, validate_documents, write_corpus


@corpus_app.command("import")
def corpus_import(
    files: Annotated[
        list[Path], typer.Argument(help="ChatML text files (documents joined by blank lines).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Corpus JSONL to write.")],
    source: Annotated[
        str | None, typer.Option("--source", help="Source name (default: each file's stem).")
    ] = None,
    stratum: Annotated[
        str | None, typer.Option("--stratum", help="Stratum (default: the source).")
    ] = None,
    pool: Annotated[str, typer.Option("--pool", help="eval, calibration or train.")] = "eval",
) -> None:
    """Convert ChatML transcript files into a corpus JSONL."""

    check_output(out, "corpus")
    documents = import_chatml_files(files, source=source, stratum=stratum, pool=pool)
    validate_documents(documents, str(out))
    write_corpus(documents, out)
    typer.echo(f"wrote {len(documents)} documents from {len(files)} file(s) to {out}")
    for name, count in sorted(Counter(d.source for d in documents).items()):
        typer.echo(f"  {name}: {count}")


@corpus_app.command("info")
def corpus_info(
    corpus: Annotated[str, typer.Argument(help="Corpus JSONL path, or `demo`.")],
) -> None:
    """Documents per pool, source and stratum, split by index parity (odd = dev, even = test)."""

    loaded = load_corpus(corpus)
    rows = Counter((d.pool, d.source, d.stratum, d.index % 2) for d in loaded)
    typer.echo(f"{loaded.path}: {len(loaded)} documents")
    typer.echo(f"{'pool':<12}{'source':<16}{'stratum':<12}{'odd':>6}{'even':>6}")
    for pool, source, stratum in sorted({(p, s, t) for p, s, t, _ in rows}):
        odd, even = rows[(pool, source, stratum, 1)], rows[(pool, source, stratum, 0)]
        typer.echo(f"{pool:<12}{source:<16}{stratum:<12}{odd:>6}{even:>6}")
