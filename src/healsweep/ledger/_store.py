"""The ledger's files: the JSON-lines chain, its head record and the lock file beside it.

``ledger.jsonl`` holds the chain. ``ledger.jsonl.head`` records the entry count and the last hash,
so removing whole lines from the end is detected (the chain alone cannot see that).
``ledger.jsonl.lock`` is held with ``fcntl.flock``: exclusive while appending, shared while
reading, so concurrent confirms in different processes are serialized and none is lost.

An append writes the head with a ``pending`` record of the state it is about to create, appends
and fsyncs the line, then writes the final head. A crash between the steps therefore leaves a
ledger that matches either the head or its pending record, both of which verify.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from healsweep._atomic import atomic_file
from healsweep._inputs import MIB, read_bytes, read_text
from healsweep.errors import LedgerError
from healsweep.ledger._chain import RESTORE_HINT, head_of, parse_lines, seal

LEDGER_LIMIT = 64 * MIB  # an entry per milestone opening: a few hundred bytes each


def head_path(path: Path) -> Path:
    """The head record beside a ledger file."""
    return path.with_name(path.name + ".head")


def lock_path(path: Path) -> Path:
    """The lock file beside a ledger file."""
    return path.with_name(path.name + ".lock")


def _open_lock_file(path: Path, exclusive: bool) -> int | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if not exclusive:
            return None  # a read-only results folder: nobody appends there, reading is safe
        raise LedgerError(
            f"cannot create the ledger lock file {lock_path(path)} ({exc.strerror}); "
            "make the results folder writable"
        ) from exc


@contextmanager
def locked(path: Path, exclusive: bool, timeout: float) -> Iterator[None]:
    """Hold the ledger's flock (exclusive or shared), polling up to ``timeout`` seconds."""
    fd = _open_lock_file(path, exclusive)
    if fd is None:
        yield
        return
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LedgerError(
                        f"the ledger {path} stayed locked by another process for {timeout:.0f} s "
                        f"(lock file {lock_path(path).name}); wait for the other confirm to finish"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _read_head(path: Path) -> dict[str, Any] | None:
    hp = head_path(path)
    try:
        # bytes, so bad UTF-8 is reported below with the advice to restore the record
        head = json.loads(read_bytes(hp, "ledger head record", _HEAD_BYTES, error=LedgerError))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON
        detail = exc.strerror if isinstance(exc, OSError) else type(exc).__name__
        raise LedgerError(
            f"the ledger head record {hp} is unreadable ({detail}); {RESTORE_HINT}"
        ) from None
    if not _is_head(head) or ("pending" in head and not _is_head(head["pending"])):
        raise LedgerError(
            f"the ledger head record {hp} is malformed (expected an entry count and a 64-digit "
            f"hex hash); {RESTORE_HINT}"
        )
    return head


_HEAD_BYTES = 4096  # a head record is ~200 bytes


def _is_head(record: Any) -> bool:
    """``{"entries": n >= 0, "hash": 64 hex digits, ...}``."""
    if not isinstance(record, dict):
        return False
    entries, digest = record.get("entries"), record.get("hash")
    return (isinstance(entries, int) and not isinstance(entries, bool) and entries >= 0
            and isinstance(digest, str) and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest))  # fmt: skip


def _same(state: Mapping[str, Any], record: Mapping[str, Any] | None) -> bool:
    return bool(record) and (state["entries"], state["hash"]) == (record["entries"], record["hash"])


def check_head(path: Path, entries: list[dict[str, Any]], head: dict[str, Any] | None) -> None:
    """Compare the chain with its head record; raise naming the first line that is off."""
    state = head_of(entries)
    if head is None:
        if entries:
            raise LedgerError(
                f"{path}: the head record {head_path(path).name} is missing while the ledger has "
                f"{len(entries)} entries; {RESTORE_HINT}"
            )
        return
    if _same(state, head) or _same(state, head.get("pending")):
        return
    n, expected = len(entries), int(head["entries"])
    if n < expected:
        problem = f"the ledger ends after {n} entries but its head records {expected}"
        raise LedgerError(f"{path} line {n + 1}: {problem} (lines were removed); {RESTORE_HINT}")
    if n == expected:
        raise LedgerError(
            f"{path} line {n}: the last entry is not the one its head records (edited); "
            f"{RESTORE_HINT}"
        )
    raise LedgerError(
        f"{path} line {expected + 1}: entries beyond the {expected} its head records were added "
        f"outside healsweep; {RESTORE_HINT}"
    )


def read_verified(path: Path) -> list[dict[str, Any]]:
    """The entries of a ledger after checking the chain and the head (no locking here)."""
    try:
        text = read_text(path, "ledger", LEDGER_LIMIT, error=LedgerError)
    except FileNotFoundError:
        text = ""
    head = _read_head(path)
    if not path.exists() and head is not None and int(head["entries"]) > 0:
        raise LedgerError(
            f"{path} is missing but its head record lists {head['entries']} entries; {RESTORE_HINT}"
        )
    entries = parse_lines(text, str(path))
    check_head(path, entries, head)
    return entries


def _write_head(path: Path, record: Mapping[str, Any]) -> None:
    with atomic_file(head_path(path), "w", encoding="utf-8") as fh:
        json.dump(dict(record), fh, sort_keys=True)


def append_entry(path: Path, entries: list[dict[str, Any]], body: Mapping[str, Any]) -> dict:
    """Seal ``body`` onto the verified ``entries`` and append it durably.

    The caller holds the exclusive lock and has just read ``entries`` with :func:`read_verified`.
    """
    current = head_of(entries)
    entry = seal(body, seq=current["entries"], prev_hash=current["hash"])
    after = head_of([*entries, entry])
    _write_head(path, {**current, "pending": after})
    line = (json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    _write_head(path, after)
    return entry
