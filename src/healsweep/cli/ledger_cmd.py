"""`healsweep ledger` commands: show the ledger of test-split openings, verify its chain."""

from __future__ import annotations

from pathlib import Path

import typer

from healsweep.cli._apps import ledger_app
from healsweep.ledger import Ledger

_RESULTS = typer.Option(
    Path("results"), "--results",
    help="Results root: its ledger.jsonl, and the sweeps whose recorded heads it must extend.",
)  # fmt: skip
_LEDGER = typer.Option(
    None, "--ledger", help="A ledger file elsewhere (e.g. the tracked ledger/ledger.jsonl)."
)


def _checked(results: Path, ledger_path: Path | None) -> tuple[object, list[dict]]:
    """The ledger (--ledger, else RESULTS/ledger.jsonl) and its entries, verified and checked
    against every head recorded for it under the results root."""
    # lazy: heavy (pyarrow)
    from healsweep.ledger_heads import checked_ledger

    ledger = Ledger(ledger_path) if ledger_path else Ledger.in_results(results)
    return ledger, checked_ledger(ledger, roots=[results, ledger.path.parent])


@ledger_app.command("show")
def show(
    results: Path = _RESULTS,
    ledger_path: Path | None = _LEDGER,
) -> None:
    """A table of the ledger's entries (verified first)."""
    ledger, entries = _checked(results, ledger_path)
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
    ledger_path: Path | None = _LEDGER,
) -> None:
    """Check the hash chain and that the ledger extends every head the sweeps under the results
    root recorded for it (not removed, replaced or cut back), then each other ledger those sweeps
    name; exit 0 with "ledger OK: N entries", or 1 with the reason."""
    # lazy: heavy (pyarrow)
    from healsweep.ledger_heads import checked_ledger, ledgers_named

    ledger, entries = _checked(results, ledger_path)
    typer.echo(f"ledger OK: {len(entries)} entries")
    for other in ledgers_named(results):
        if other != ledger.path.resolve():
            n = len(checked_ledger(Ledger(other), roots=[results, other.parent]))
            typer.echo(f"ledger OK: {n} entries ({other})")


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
