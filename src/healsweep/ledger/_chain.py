"""The hash chain of the ledger: canonical entry hashing and verification of a list of lines.

Pure functions over text; the file, its lock and its head record live in ``_store``.

Every entry is one JSON object on one line with ``seq`` (0, 1, 2, ...), ``kind``, ``prev_hash``
(the previous entry's ``hash``; 64 zeros for the first) and ``hash`` = sha256 of the canonical
JSON (sorted keys, no whitespace) of the entry without its ``hash`` field. An edit breaks the
entry's own hash (or, if the editor recomputed it, the next entry's ``prev_hash``); a reorder or
deletion breaks ``seq`` and ``prev_hash``; a removed tail is caught by the head record.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from healsweep.errors import LedgerError

GENESIS_HASH = "0" * 64
KINDS = ("confirm-open", "confirm-resume", "confirm-result")
_REQUIRED = {
    "confirm-open": ("time", "user", "split_lock_id", "milestone", "config_hashes", "trial_ids"),
    "confirm-resume": ("time", "user", "open_hash"),
    "confirm-result": ("time", "user", "open_hash", "result_hash"),
}
MAX_LINE = 1 << 20  # characters of one entry (an opening of 1,000 configs is ~150 KB)
MAX_DEPTH = 4  # entries are objects of strings, numbers and lists of strings: depth 2
_HEX64 = re.compile(r"[0-9a-f]{64}")
_STR, _STRS, _HASH, _SEQ = "a string", "a list of strings", "a 64-digit hex hash", "an integer"
FIELD_TYPES = {  # every field healsweep writes or reads, and its type
    "kind": _STR, "time": _STR, "user": _STR, "split_lock_id": _STR, "milestone": _STR,
    "replaces_split_lock_id": _STR, "result_hash": _STR, "open_hash": _STR,
    "config_hashes": _STRS, "trial_ids": _STRS, "seq": _SEQ, "hash": _HASH, "prev_hash": _HASH,
}  # fmt: skip
_IS = {
    _STR: lambda v: isinstance(v, str),
    _STRS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    _HASH: lambda v: isinstance(v, str) and _HEX64.fullmatch(v) is not None,
    _SEQ: lambda v: isinstance(v, int) and not isinstance(v, bool),
}
RESTORE_HINT = (
    "restore the ledger from a backup or version control, then run `healsweep ledger verify`"
)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys, no whitespace and UTF-8 text: the form that is hashed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def entry_hash(entry: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``entry`` without its ``hash`` field."""
    body = {k: v for k, v in entry.items() if k != "hash"}
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def seal(body: Mapping[str, Any], seq: int, prev_hash: str) -> dict[str, Any]:
    """A complete entry: ``body`` plus ``seq``, ``prev_hash`` and its own ``hash``."""
    entry = dict(body)
    entry["seq"] = seq
    entry["prev_hash"] = prev_hash
    entry["hash"] = entry_hash(entry)
    return entry


def _bad(where: str, line_no: int, problem: str) -> LedgerError:
    return LedgerError(f"{where} line {line_no}: {problem}; {RESTORE_HINT}")


def parse_lines(text: str, where: str) -> list[dict[str, Any]]:
    """Parse the ledger text into entries and check the chain; raises on the first bad line."""
    if text and not text.endswith("\n"):
        n = text.count("\n") + 1
        raise _bad(where, n, "the last line is cut off (no newline at its end: truncated)")
    entries: list[dict[str, Any]] = []
    prev = GENESIS_HASH
    for line_no, line in enumerate(text.splitlines(), start=1):
        entry = _parsed(line, where, line_no)
        if entry_hash(entry) != entry["hash"]:
            raise _bad(where, line_no, "its hash does not match its content (the entry was edited)")
        if entry.get("seq") != line_no - 1:
            raise _bad(
                where,
                line_no,
                f"sequence number {entry.get('seq')!r} where {line_no - 1} belongs "
                "(entries were reordered or deleted)",
            )
        if entry.get("prev_hash") != prev:
            raise _bad(
                where,
                line_no,
                "prev_hash does not match the entry before it "
                "(an earlier entry was edited, reordered or deleted)",
            )
        _check_fields(entry, where, line_no)
        entries.append(entry)
        prev = entry["hash"]
    _check_semantics(entries, where)
    return entries


def _parsed(line: str, where: str, line_no: int) -> dict[str, Any]:
    """One line as an entry whose every known field has its type, before anything hashes or
    compares it (a list where a string belongs used to end in a TypeError)."""
    if len(line) > MAX_LINE:
        raise _bad(where, line_no, f"a line of {len(line):,} characters, over the "
                                   f"{MAX_LINE:,} a ledger entry may have")  # fmt: skip
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError; nesting past the parser's stack
        raise _bad(where, line_no, "not a JSON object (edited or truncated)") from None
    if _depth(entry) > MAX_DEPTH:
        raise _bad(where, line_no, f"values nested more than {MAX_DEPTH} deep (not a ledger entry)")
    if not isinstance(entry, dict) or not isinstance(entry.get("hash"), str):
        raise _bad(where, line_no, "not a ledger entry (no hash field)")
    for field, kind in FIELD_TYPES.items():
        if field in entry and not _IS[kind](entry[field]):
            shown = canonical_json(entry[field])
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise _bad(where, line_no, f"field {field!r} is {shown}; expected {kind}")
    return entry


def _depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (1 for a flat object), counted without
    recursion and stopping past :data:`MAX_DEPTH`."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict)
                                                       else item)]  # fmt: skip
    return deepest


def _check_fields(entry: Mapping[str, Any], where: str, line_no: int) -> None:
    kind = entry.get("kind")
    if kind not in KINDS:
        raise _bad(where, line_no, f"unknown entry kind {kind!r} (expected one of {list(KINDS)})")
    missing = [f for f in _REQUIRED[kind] if f not in entry]
    if missing:
        raise _bad(where, line_no, f"{kind} entry lacks {missing}")


def _check_semantics(entries: Sequence[Mapping[str, Any]], where: str) -> None:
    """Opens are unique per (split lock id, milestone); resumes and results follow their open."""
    opens: dict[str, Mapping[str, Any]] = {}
    keys: set[tuple[str, str]] = set()
    closed: set[str] = set()
    for line_no, entry in enumerate(entries, start=1):
        if entry["kind"] == "confirm-open":
            key = (entry["split_lock_id"], entry["milestone"])
            if key in keys:
                raise _bad(where, line_no, f"a second confirm-open of milestone {key[1]!r}")
            keys.add(key)
            opens[entry["hash"]] = entry
            continue
        target = entry["open_hash"]
        if target not in opens:
            raise _bad(where, line_no, f"{entry['kind']} refers to no earlier confirm-open")
        if target in closed:
            raise _bad(where, line_no, f"{entry['kind']} after the milestone's result was recorded")
        if entry["kind"] == "confirm-result":
            closed.add(target)


def head_of(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The head record of a chain: its entry count and last hash."""
    return {"entries": len(entries), "hash": entries[-1]["hash"] if entries else GENESIS_HASH}
