"""`healsweep split` commands: make a parity split config for a corpus, show a split's counts."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from healsweep._inputs import check_output
from healsweep.cli._apps import split_app
from healsweep.data.corpus import load_corpus
from healsweep.data.split import (
    Exclusion,
    corpus_reference,
    dump_split,
    load_split,
    parity_split,
    resolve_split,
)
from healsweep.errors import SplitError

_SPLITS = ("dev", "test", "calibration", "canary", "excluded")
_CORPUS_ARG = typer.Argument(..., help="Corpus JSONL, or 'demo'.")
_OUT = typer.Option(..., "--out", help="Where to write the split YAML.")
_CANARY = typer.Option([], "--canary", help="Doc id to set aside as a canary (repeatable).")
_BURNED = typer.Option(
    [], "--burned", help="Doc id already seen while tuning: kept out of dev and test (repeatable)."
)
_FORCE = typer.Option(False, "--force", help="Overwrite an existing split file.")
_SPLIT_ARG = typer.Argument(..., help="Split YAML.")
_CORPUS_OPT = typer.Option(
    None, "--corpus", help="Corpus to apply it to (default: the one the file names)."
)


@split_app.command("make")
def make(
    corpus: str = _CORPUS_ARG,
    out: Path = _OUT,
    canary: list[str] = _CANARY,
    burned: list[str] = _BURNED,
    force: bool = _FORCE,
) -> None:
    """Write a split config: per source odd index -> dev, even -> test; calibration pool apart."""

    if out.exists() and not force:
        raise SplitError(
            f"{out} exists; a new split changes the split lock id: pass --force to overwrite"
        )
    check_output(out, "split config", make_folder=True)
    docs = load_corpus(corpus)
    reference = corpus if corpus == "demo" else _relative(Path(corpus), out)
    config = parity_split(docs, corpus=reference)
    exclusions = {doc_id: Exclusion(reason="burned") for doc_id in burned}
    config = config.model_copy(update={"canary": tuple(canary), "exclusions": exclusions})
    resolved = resolve_split(config, docs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_split(config, lock_id=resolved.lock_id), encoding="utf-8")
    counts = _totals(resolved)
    summary = ", ".join(f"{name} {counts[name]}" for name in _SPLITS)
    typer.echo(f"wrote {out}: {summary}")
    typer.echo(f"split lock id: {resolved.lock_id}")


@split_app.command("show")
def show(
    split: Path = _SPLIT_ARG,
    corpus: str | None = _CORPUS_OPT,
) -> None:
    """Per source and stratum counts of dev/test/calibration/canary/excluded, and the lock id."""

    config = load_split(split)
    ref = corpus or corpus_reference(config, split)
    if ref is None:
        raise SplitError(f"{split} names no corpus; pass --corpus PATH (or --corpus demo)")
    resolved = resolve_split(config, load_corpus(ref))
    typer.echo(f"split {split} on corpus {ref} ({len(resolved.documents)} documents)")
    for line in _table(resolved):
        typer.echo(line)
    typer.echo(f"split lock id: {resolved.lock_id}")


def _relative(corpus: Path, out: Path) -> str:
    try:
        return os.path.relpath(corpus.resolve(), out.resolve().parent)
    except ValueError:  # another drive on Windows
        return str(corpus.resolve())


def _totals(resolved) -> dict[str, int]:
    totals = dict.fromkeys(_SPLITS, 0)
    for split in resolved.assignments.values():
        totals[split] += 1
    return totals


def _table(resolved) -> list[str]:
    counts = resolved.counts()
    keys = sorted(counts)
    w_src = max([len("source"), *(len(s) for s, _ in keys)])
    w_str = max([len("stratum"), *(len(t) for _, t in keys)])
    header = f"{'source':<{w_src}}  {'stratum':<{w_str}}" + "".join(
        f"  {name:>{len(name)}}" for name in _SPLITS
    )
    lines = [header, "-" * len(header)]
    for source, stratum in keys:
        row = counts[(source, stratum)]
        cells = "".join(f"  {row.get(name, 0):>{len(name)}}" for name in _SPLITS)
        lines.append(f"{source:<{w_src}}  {stratum:<{w_str}}{cells}")
    totals = _totals(resolved)
    cells = "".join(f"  {totals[name]:>{len(name)}}" for name in _SPLITS)
    lines.append(f"{'total':<{w_src}}  {'':<{w_str}}{cells}")
    return lines
