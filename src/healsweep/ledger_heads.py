"""A ledger checked against every head recorded for it under a results root.

Sweep manifests (``ledger_heads``: at each run, resume, confirm opening and confirm result) and
confirm summaries (``test/<milestone>/confirm.json``: ``ledger_head``) record the ledger head they
saw (:mod:`healsweep.ledger._heads`). :func:`checked_ledger` accepts a ledger only if it extends
each of them:

- the heads of the sweeps being confirmed or exported, whatever ledger they name: a sweep is bound
  to the chain it saw, so confirming it into another (an empty folder's, say) is refused once its
  chain has entries;
- the heads under a results root that name this ledger: ``ledger verify`` and ``confirm`` refuse
  a ledger that is missing, shorter than, or not extending any of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from healsweep._inputs import MIB, read_text
from healsweep.errors import ResultsError
from healsweep.ledger import Ledger, check_extends, names
from healsweep.results.store import MANIFEST_FILE

SUMMARY_GLOB = "test/*/confirm.json"  # confirm's summaries in a sweep folder
SUMMARY_HEAD = "ledger_head"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_text(path, "head record", 64 * MIB, error=ResultsError))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ResultsError(
            f"{path} is unreadable ({detail}); it records a ledger head, so the ledger cannot be "
            "checked without it: restore it"
        ) from None
    return data if isinstance(data, dict) else {}


def heads_in(sweep_dir: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """``(recording file, head)`` for every head a sweep folder records."""
    sweep_dir = Path(sweep_dir)
    found: list[tuple[Path, dict[str, Any]]] = []
    manifest = sweep_dir / MANIFEST_FILE
    if manifest.is_file():
        recorded = _read(manifest).get("ledger_heads")
        found += [(manifest, h) for h in (recorded if isinstance(recorded, list) else [])
                  if isinstance(h, dict)]  # fmt: skip
    for summary in sorted(sweep_dir.glob(SUMMARY_GLOB)):
        head = _read(summary).get(SUMMARY_HEAD)
        if isinstance(head, dict):
            found.append((summary, head))
    return found


def heads_under(root: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """The heads of every sweep folder directly under a results root."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [h for child in sorted(root.iterdir()) if child.is_dir() for h in heads_in(child)]


def _named(heads: Iterable[tuple[Path, dict[str, Any]]], ledger: Ledger) -> list:
    return [(f, h) for f, h in heads if names(h, f.parent, ledger.path)]


def checked_ledger(
    ledger: Ledger, *, sweeps: Iterable[str | Path] = (), roots: Iterable[str | Path] = ()
) -> list[dict[str, Any]]:
    """The ledger's entries, once it verifies and extends every head of ``sweeps`` and every
    head under ``roots`` that names it; :class:`~healsweep.errors.LedgerError` otherwise."""
    heads = [h for sweep in sweeps for h in heads_in(sweep)]
    seen = {Path(r).resolve() for r in roots}
    heads += [h for root in seen for h in _named(heads_under(root), ledger)]
    return check_extends(ledger, [(str(f), h) for f, h in heads])


def ledgers_named(root: str | Path) -> list[Path]:
    """Every ledger file the heads under a results root name, resolved, in first-seen order."""
    paths: dict[Path, None] = {}
    for recorded, head in heads_under(root):
        if isinstance(head.get("path"), str):
            paths[(recorded.parent / head["path"]).resolve()] = None
    return list(paths)
