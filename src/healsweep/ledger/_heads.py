"""Ledger heads recorded elsewhere: what stops a ledger from being silently reset.

The chain and its ``.head`` file catch an edited, reordered or truncated ledger, but not one that
was removed, replaced by an empty file, or cut back with its ``.head`` rewritten to match: each of
those is a valid chain again, and a milestone it no longer lists could be opened a second time.
So every sweep manifest and every confirm records the head it saw (:func:`head_record`: the
ledger's path relative to the recording folder, its entry count and last hash), and a ledger is
accepted only if it *extends* every head recorded for it (:func:`check_extends`): at least that
many entries, the same hash at that position. A missing ledger extends only empty heads.

What remains: a local hash chain cannot stop someone who rewrites everything, the manifests and
confirm summaries included. The project keeps its own ledger in a tracked file
(``ledger/ledger.jsonl``, which its sweep specs name), so its history is also git's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from healsweep.errors import LedgerError
from healsweep.ledger._chain import RESTORE_HINT, head_of

Head = Mapping[str, Any]  # {"path": str, "entries": int, "hash": str, ...}


def head_record(ledger: Any, relative_to: str | os.PathLike) -> dict[str, Any]:
    """The head of ``ledger`` (a :class:`Ledger`, verified as it is read) as a record for a file
    in ``relative_to``: ``{"path": the ledger relative to that folder, "entries", "hash"}``."""
    entries = ledger.entries()
    path = os.path.relpath(Path(ledger.path).resolve(), Path(relative_to).resolve())
    return {"path": path, **head_of(entries)}


def names(head: Head, recorded_in: str | os.PathLike, ledger_path: str | os.PathLike) -> bool:
    """Whether ``head`` (recorded in folder ``recorded_in``) is a head of the ledger at
    ``ledger_path``."""
    path = head.get("path")
    if not isinstance(path, str):
        return False
    return (Path(recorded_in) / path).resolve() == Path(ledger_path).resolve()


def check_extends(ledger: Any, heads: Iterable[tuple[str, Head]]) -> list[dict[str, Any]]:
    """The ledger's entries once it is verified and found to extend every head; ``heads`` are
    ``(where it was recorded, head)``. Raises :class:`LedgerError` naming the first head it does
    not extend (the ledger is missing, shorter, or has another entry at that position)."""
    path = Path(ledger.path)
    entries = ledger.entries()
    recorded = [(where, *_recorded(where, head)) for where, head in heads]
    # the longest head first: it says most about what is missing
    for where, n, expected in sorted(recorded, key=lambda h: -h[1]):
        if n <= 0:
            continue
        if not path.exists():
            raise LedgerError(
                f"{path} is missing, but {where} recorded it with {n} entries (head "
                f"{str(expected)[:12]}...): the ledger was removed or moved; {RESTORE_HINT}"
            )
        if len(entries) < n:
            raise LedgerError(
                f"{path} has {len(entries)} entries, but {where} recorded it with {n} (head "
                f"{str(expected)[:12]}...): entries were removed or the ledger was replaced; "
                f"{RESTORE_HINT}"
            )
        if entries[n - 1]["hash"] != expected:
            raise LedgerError(
                f"{path} line {n}: not the entry {where} recorded as the ledger's head "
                f"({str(expected)[:12]}...): the ledger was rewritten or replaced; {RESTORE_HINT}"
            )
    return entries


def _recorded(where: str, head: Head) -> tuple[int, str | None]:
    """``(entries, hash)`` of a recorded head, each of its type, before either is compared."""
    n, digest = head.get("entries", 0), head.get("hash")
    if (not isinstance(n, int) or isinstance(n, bool) or n < 0
            or (n > 0 and not isinstance(digest, str))):  # fmt: skip
        shown = repr(n) if isinstance(n, int | str) else type(n).__name__
        raise LedgerError(
            f"{where} records a ledger head with entries {shown[:40]} and a hash of type "
            f"{type(digest).__name__} (expected a count and a hex hash): the file was edited; "
            f"{RESTORE_HINT}"
        )
    return n, digest
