"""Grants: the only key to the test split, issued by the ledger when a confirm is opened.

A :class:`Grant` names the ledger file and the hash of the ``confirm-open`` entry that issued it.
Its constructor refuses callers other than the ledger, but that is a courtesy: the real check is
:func:`healsweep.ledger._ledger.require_grant`, which re-reads the ledger on every use and
accepts the grant only if that entry is in a valid chain, opens this split lock id and milestone,
and has no result recorded yet.
So a hand-made grant either points at a real, recorded opening or fails.

A grant cannot be pickled: a Ray Tune trainable (or any other process) can never receive one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from healsweep.errors import TestSplitSealed

_ISSUER = object()  # only the ledger passes this; see Ledger.open_milestone
CONFIRM_HINT = (
    "test windows open only through `healsweep confirm RESULTS/<sweep> --milestone NAME`, "
    "which records the opening in RESULTS/ledger.jsonl first; tune on split=dev"
)


def _sealed(reason: str) -> TestSplitSealed:
    return TestSplitSealed(f"the test split is sealed: {reason}; {CONFIRM_HINT}")


class Grant:
    """Permission to materialize one split lock id's test windows for one milestone."""

    __slots__ = ("ledger_path", "entry_hash", "split_lock_id", "milestone", "config_hashes")
    ledger_path: str
    entry_hash: str
    split_lock_id: str
    milestone: str
    config_hashes: tuple[str, ...]

    def __init__(
        self,
        *,
        ledger_path: str | Path,
        entry_hash: str,
        split_lock_id: str,
        milestone: str,
        config_hashes: tuple[str, ...],
        _issuer: object = None,
    ) -> None:
        if _issuer is not _ISSUER:
            raise _sealed("grants are issued only by the ledger (Ledger.open_milestone)")
        values = {
            "ledger_path": str(Path(ledger_path).resolve()),
            "entry_hash": entry_hash,
            "split_lock_id": split_lock_id,
            "milestone": milestone,
            "config_hashes": tuple(config_hashes),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Grant is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("a Grant is immutable")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _sealed(
            "a ledger grant cannot be pickled or sent to another process such as a sweep "
            "trainable; materialize the test windows in the process that opened the milestone"
        )

    def __copy__(self) -> Grant:
        return self

    def __deepcopy__(self, memo: dict) -> Grant:
        return self

    def __repr__(self) -> str:
        return (
            f"Grant(milestone={self.milestone!r}, split_lock_id={self.split_lock_id[:12]}..., "
            f"entry={self.entry_hash[:12]}...)"
        )


def check_against_entries(grant: Grant, entries: list[dict[str, Any]]) -> None:
    """The ledger half of :func:`~healsweep.ledger._ledger.require_grant`, on entries already
    read and verified."""
    opened = next((e for e in entries if e["hash"] == grant.entry_hash), None)
    if opened is None or opened["kind"] != "confirm-open":
        raise _sealed(f"no confirm-open entry {grant.entry_hash[:12]}... in {grant.ledger_path}")
    recorded = (opened["split_lock_id"], opened["milestone"], tuple(opened["config_hashes"]))
    if recorded != (grant.split_lock_id, grant.milestone, grant.config_hashes):
        raise _sealed("the grant does not match the ledger entry it names (forged)")
    if any(e["kind"] == "confirm-result" and e["open_hash"] == grant.entry_hash for e in entries):
        raise _sealed(f"milestone {grant.milestone!r} already has its result recorded")


def issue(ledger_path: Path, entry: dict[str, Any]) -> Grant:
    """The grant for a ``confirm-open`` entry the ledger has just appended (ledger use only)."""
    return Grant(
        ledger_path=ledger_path,
        entry_hash=entry["hash"],
        split_lock_id=entry["split_lock_id"],
        milestone=entry["milestone"],
        config_hashes=tuple(entry["config_hashes"]),
        _issuer=_ISSUER,
    )
