"""`healsweep ledger` commands: show the ledger of test-split openings, verify its chain."""

from __future__ import annotations

from pathlib import Path

import typer

from healsweep.cli._apps import ledger_app

_RESULTS = typer.Option(Path("results"), "--results", help="Results root holding ledger.jsonl.")


@ledger_app.command("show")
def show(
    results: Path = _RESULTS,
) -> None:
    """A table of the ledger's entries (verified first)."""
    from healsweep.ledger import Ledger

    ledger = Ledger.in_results(results)
    entries = ledger.entries()
    if not entries:
        typer.echo(f"{ledger.path}: no entries (the test split was never opened)")
        return
    rows = [_row(entry) for entry in entries]
    header = ("seq", "time", "kind", "user", "milestone", "split lock", "detail")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    typer.echo("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for row in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    typer.echo(f"ledger OK: {len(entries)} entries ({ledger.path})")


@ledger_app.command("verify")
def verify(
    results: Path = _RESULTS,
) -> None:
    """Check the hash chain; exit 0 with "ledger OK: N entries", or 1 with the reason."""
    from healsweep.ledger import Ledger

    n = Ledger.in_results(results).verify()
    typer.echo(f"ledger OK: {n} entries")


def _row(entry: dict) -> tuple[str, ...]:
    by_hash = entry.get("open_hash", "")
    if entry["kind"] == "confirm-open":
        detail = f"{len(entry['config_hashes'])} configs, trials {','.join(entry['trial_ids'])}"
        if entry.get("replaces_split_lock_id"):
            detail += f"; new split, replaces {entry['replaces_split_lock_id'][:12]}"
    elif entry["kind"] == "confirm-result":
        detail = f"result {entry['result_hash'][:12]} for open {by_hash[:12]}"
    else:
        detail = f"resumes open {by_hash[:12]}"
    return (
        str(entry["seq"]),
        entry["time"],
        entry["kind"],
        entry["user"],
        entry.get("milestone", ""),
        entry.get("split_lock_id", "")[:12],
        detail,
    )
