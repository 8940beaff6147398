"""The ledger of test-split openings: ``RESULTS/ledger.jsonl``.

Entry kinds (every entry also has ``seq``, ``prev_hash`` and ``hash``; see ``_chain``):

- ``confirm-open``: time, user, split lock id, milestone, config hashes, trial ids. Appended
  *before* any test window is scored; it issues the :class:`Grant`. One per (split lock id,
  milestone).
- ``confirm-resume``: a confirm that crashed before recording its result may be resumed for the
  *same* frozen config hashes; the resume is on record and re-issues the grant.
- ``confirm-result``: the hash of the test results and the hash of the open entry. It closes the
  milestone; its grant no longer opens anything.

Every mutating call takes the exclusive lock, verifies the whole ledger and refuses to write on
a tampered one.

Changed split: the *current split lineage* is the split lock id of the latest ``confirm-open``.
Opening a milestone under another lock id is refused unless ``allow_split_change=True``, which
records the lock id it replaces in the entry. :func:`split_drift` reports the same condition for
reports (test results confirmed under a split that is no longer the current one).
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from healsweep.errors import LedgerError, TestSplitSealed
from healsweep.ledger import _store
from healsweep.ledger._grant import Grant, _sealed, check_against_entries, issue

LEDGER_NAME = "ledger.jsonl"
_MILESTONE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX = re.compile(r"^[0-9a-f]{16,128}$")


@dataclass(frozen=True)
class Milestone:
    """One opening of a test split, as the ledger records it."""

    milestone: str
    split_lock_id: str
    open_hash: str
    time: str
    user: str
    config_hashes: tuple[str, ...]
    trial_ids: tuple[str, ...]
    result_hash: str | None  # None while open (confirm running or crashed)

    @property
    def closed(self) -> bool:
        return self.result_hash is not None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _user(user: str | None) -> str:
    if user:
        return user
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER", "unknown")


class Ledger:
    """An append-only, hash-chained JSON-lines ledger at ``path`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, lock_timeout: float = 120.0) -> None:
        self.path = Path(path)
        self.lock_timeout = lock_timeout

    @classmethod
    def in_results(cls, results_dir: str | os.PathLike) -> Ledger:
        """The ledger of a results root: ``RESULTS/ledger.jsonl``."""
        return cls(Path(results_dir) / LEDGER_NAME)

    def entries(self) -> list[dict[str, Any]]:
        """All entries, oldest first, after verification (raises :class:`LedgerError`)."""
        if not self.path.parent.exists():
            return []
        with _store.locked(self.path, exclusive=False, timeout=self.lock_timeout):
            return _store.read_verified(self.path)

    def verify(self) -> int:
        """Check the chain, the head record and entry semantics; return the entry count.

        Detects an edited, reordered, deleted or truncated entry and raises :class:`LedgerError`
        naming the first bad line and what to do.
        """
        return len(self.entries())

    def milestones(self) -> list[Milestone]:
        """Every opened milestone, oldest first, with its result hash when recorded."""
        return _milestones(self.entries())

    def milestones_for(self, split_lock_id: str) -> list[Milestone]:
        """The milestones opened under ``split_lock_id``."""
        return [m for m in self.milestones() if m.split_lock_id == split_lock_id]

    def open_milestone(
        self,
        split_lock_id: str,
        milestone: str,
        config_hashes: list[str] | tuple[str, ...],
        trial_ids: list[str] | tuple[str, ...],
        user: str | None = None,
        *,
        allow_split_change: bool = False,
    ) -> Grant:
        """Record the opening of the test split for ``milestone`` and return its grant.

        Refuses (``LedgerError``) a tampered ledger, a second open of the same split lock id and
        milestone, and a split lock id other than the current lineage's unless
        ``allow_split_change``.
        """
        _check_open_args(split_lock_id, milestone, config_hashes, trial_ids)
        with _store.locked(self.path, exclusive=True, timeout=self.lock_timeout):
            entries = _store.read_verified(self.path)
            known = _milestones(entries)
            if any(m.split_lock_id == split_lock_id and m.milestone == milestone for m in known):
                raise LedgerError(
                    f"milestone {milestone!r} was already confirmed on split lock "
                    f"{split_lock_id[:12]}... ({self.path}); the test split opens once per "
                    "milestone: pick a new milestone name"
                )
            body: dict[str, Any] = {
                "kind": "confirm-open",
                "time": _now(),
                "user": _user(user),
                "split_lock_id": split_lock_id,
                "milestone": milestone,
                "config_hashes": list(config_hashes),
                "trial_ids": [str(t) for t in trial_ids],
            }
            drift = _drift(known, split_lock_id)
            if drift is not None:
                if not allow_split_change:
                    raise LedgerError(_drift_message(drift, split_lock_id, self.path))
                body["replaces_split_lock_id"] = drift.split_lock_id
            entry = _store.append_entry(self.path, entries, body)
        return issue(self.path, entry)

    def resume_milestone(
        self,
        split_lock_id: str,
        milestone: str,
        config_hashes: list[str] | tuple[str, ...],
        user: str | None = None,
    ) -> Grant:
        """Re-issue the grant of an open milestone whose confirm died before its result.

        Only for the same frozen config hashes; refused once the result is recorded. The resume
        is appended to the ledger.
        """
        with _store.locked(self.path, exclusive=True, timeout=self.lock_timeout):
            entries = _store.read_verified(self.path)
            match = [
                m
                for m in _milestones(entries)
                if m.split_lock_id == split_lock_id and m.milestone == milestone
            ]
            if not match:
                raise LedgerError(f"milestone {milestone!r} was never opened in {self.path}")
            found = match[0]
            if found.closed:
                raise LedgerError(
                    f"milestone {milestone!r} is closed (its result is recorded in {self.path}); "
                    "open a new milestone"
                )
            if tuple(config_hashes) != found.config_hashes:
                raise LedgerError(
                    f"milestone {milestone!r} was opened for other configs; a resume must confirm "
                    "exactly the configs frozen at the opening"
                )
            body = {
                "kind": "confirm-resume",
                "time": _now(),
                "user": _user(user),
                "open_hash": found.open_hash,
                "split_lock_id": split_lock_id,
                "milestone": milestone,
            }
            _store.append_entry(self.path, entries, body)
            opened = next(e for e in entries if e["hash"] == found.open_hash)
        return issue(self.path, opened)

    def record_result(self, grant: Grant, result_hash: str, user: str | None = None) -> dict:
        """Close the grant's milestone with the hash of its test results; returns the entry."""
        if not isinstance(result_hash, str) or not _HEX.match(result_hash):
            raise LedgerError(f"result hash {result_hash!r} is not a lowercase hex digest")
        if not isinstance(grant, Grant) or Path(grant.ledger_path) != self.path.resolve():
            raise LedgerError(f"the grant was not issued by the ledger {self.path}")
        with _store.locked(self.path, exclusive=True, timeout=self.lock_timeout):
            entries = _store.read_verified(self.path)
            # The lock is held, so the check and the append see the same ledger.
            try:
                check_against_entries(grant, entries)
            except TestSplitSealed as exc:
                raise LedgerError(f"cannot record the result: {exc}") from exc
            body = {
                "kind": "confirm-result",
                "time": _now(),
                "user": _user(user),
                "open_hash": grant.entry_hash,
                "result_hash": result_hash,
                "split_lock_id": grant.split_lock_id,
                "milestone": grant.milestone,
            }
            return _store.append_entry(self.path, entries, body)


def _check_open_args(
    split_lock_id: str, milestone: str, config_hashes: Any, trial_ids: Any
) -> None:
    if not isinstance(split_lock_id, str) or not _HEX.match(split_lock_id):
        raise LedgerError(f"split lock id {split_lock_id!r} is not a hex digest")
    if not isinstance(milestone, str) or not _MILESTONE.match(milestone):
        raise LedgerError(
            f"milestone name {milestone!r} is not allowed; use 1-64 letters, digits, '.', '_', '-'"
        )
    if isinstance(config_hashes, str) or not all(isinstance(h, str) for h in config_hashes):
        raise LedgerError("config hashes must be a list of strings")
    if not config_hashes:
        raise LedgerError("a confirm must freeze at least one config hash")
    if isinstance(trial_ids, str):
        raise LedgerError("trial ids must be a list, not one string")


def _milestones(entries: list[dict[str, Any]]) -> list[Milestone]:
    results = {e["open_hash"]: e["result_hash"] for e in entries if e["kind"] == "confirm-result"}
    return [
        Milestone(
            milestone=e["milestone"],
            split_lock_id=e["split_lock_id"],
            open_hash=e["hash"],
            time=e["time"],
            user=e["user"],
            config_hashes=tuple(e["config_hashes"]),
            trial_ids=tuple(e["trial_ids"]),
            result_hash=results.get(e["hash"]),
        )
        for e in entries
        if e["kind"] == "confirm-open"
    ]


def _drift(known: list[Milestone], current_lock_id: str) -> Milestone | None:
    latest = known[-1] if known else None
    return latest if latest is not None and latest.split_lock_id != current_lock_id else None


def _drift_message(latest: Milestone, current: str, path: Path) -> str:
    return (
        f"the split changed after a confirm: milestone {latest.milestone!r} opened the test split "
        f"under split lock {latest.split_lock_id[:12]}... ({latest.time}, {path}), the current "
        f"split's lock is {current[:12]}...; restore that split and corpus, or pass --new-split "
        "to record a deliberate new split"
    )


def split_drift(ledger: Ledger, current_lock_id: str) -> Milestone | None:
    """The latest milestone if it was opened under a split lock id other than the current one.

    None when the ledger is empty or the current split is the lineage's split. Reports use it to
    warn that test results were confirmed under another split.
    """
    return _drift(ledger.milestones(), current_lock_id)


def require_split_unchanged(ledger: Ledger, current_lock_id: str) -> None:
    """Raise :class:`LedgerError` when the split changed since the latest confirm."""
    latest = split_drift(ledger, current_lock_id)
    if latest is not None:
        raise LedgerError(_drift_message(latest, current_lock_id, ledger.path))


def require_grant(grant: Any, split_lock_id: str, *, ledger: Any = None) -> None:
    """Accept ``grant`` for the test windows of ``split_lock_id`` or raise ``TestSplitSealed``.

    Refused when the grant is None or not a :class:`Grant`, when it is for another split lock
    id, when ``ledger`` (a ``Ledger`` or path) is given and the grant is from another file, when
    its ledger fails verification, when its ``confirm-open`` entry is missing or does not match
    it, or when that milestone's result is already recorded (a grant opens the test split once).
    """
    if grant is None:
        raise _sealed("no ledger grant was given")
    if not isinstance(grant, Grant):
        raise _sealed(f"a {type(grant).__name__} is not a ledger grant")
    if grant.split_lock_id != split_lock_id:
        raise _sealed(
            f"the grant is for split lock {grant.split_lock_id[:12]}... but these windows belong "
            f"to split lock {split_lock_id[:12]}... (the split or corpus changed)"
        )
    if ledger is not None:
        expected = Path(getattr(ledger, "path", ledger)).resolve()
        if Path(grant.ledger_path) != expected:
            raise _sealed(f"the grant comes from {grant.ledger_path}, not from {expected}")
    try:
        entries = Ledger(grant.ledger_path).entries()
    except LedgerError as exc:
        raise _sealed(f"its ledger does not verify ({exc})") from exc
    check_against_entries(grant, entries)
