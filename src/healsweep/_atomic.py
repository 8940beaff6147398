"""Atomic file writes: readers see the old file or the whole new one, never a part.

Every writer of a file that must survive a crash whole (results, the ledger head, cache entries,
GGUF outputs, corpora) goes through :func:`atomic_path`: a temp file in the target's folder
(so the rename cannot cross file systems), written by the caller, fsynced, renamed over the
target, then the folder fsynced so the rename itself is durable where the platform allows it. On
any error, ``KeyboardInterrupt`` included, the temp file is removed and the target keeps its old
content.

Temp names start with ``.tmp-`` (pyarrow skips dot-files, and ``results.store`` sweeps
``.tmp-*`` left by a killed process). Files get the permissions ``open`` would give them
(``0o666`` less the umask), not ``mkstemp``'s ``0o600``.

This module imports nothing from healsweep, so any layer may use it.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMP_PREFIX = ".tmp-"
_NOT_SUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}


def _create_temp(target: Path) -> Path:
    """A new empty file beside ``target``, created exclusively with open()'s permissions."""
    for _ in range(100):
        tmp = target.with_name(f"{TEMP_PREFIX}{target.name}-{secrets.token_hex(6)}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temp name", str(target))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename into it) durable; a no-op where the platform
    cannot open or fsync a folder (Windows, some network file systems)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NOT_SUPPORTED:
            raise
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[Path]:
    """Yield a temp path beside ``path`` for the caller to write and close; on normal exit it is
    fsynced and renamed over ``path``, on any error removed (``path`` keeps its old content).

    For writers that open the file themselves (``gguf.GGUFWriter``, ``pyarrow.parquet``).
    ``durable=False`` skips the fsyncs (the rename stays atomic for readers): for files that
    check themselves when read, like stage-cache entries, where a power loss may cost a
    recomputation but never a wrong result.
    """
    target = Path(path)
    tmp = _create_temp(target)
    try:
        yield tmp
        if durable:
            _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)


@contextmanager
def atomic_file(
    path: str | os.PathLike[str],
    mode: str = "wb",
    *,
    encoding: str | None = None,
    newline: str | None = None,
    durable: bool = True,
) -> Iterator[IO[Any]]:
    """Yield ``path``'s replacement opened for writing (``"wb"`` or ``"w"``); it takes the place
    of ``path`` only if the block finishes (see :func:`atomic_path`)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file: mode must be 'wb' or 'w', got {mode!r}")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    with (
        atomic_path(path, durable=durable) as tmp,
        open(tmp, mode, encoding=encoding, newline=newline) as handle,
    ):
        yield handle


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically; returns ``path``."""
    with atomic_file(path, "wb") as handle:
        handle.write(data)
    return Path(path)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, encoding: str = "utf-8", newline: str | None = None
) -> Path:
    """Replace ``path`` with ``text`` atomically; returns ``path``."""
    with atomic_file(path, "w", encoding=encoding, newline=newline) as handle:
        handle.write(text)
    return Path(path)
