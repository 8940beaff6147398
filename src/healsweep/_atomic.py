"""Atomic file writes: readers see the old file or the whole new one, never a part.

Every writer of a file that must survive a crash whole (results, the ledger head, cache entries,
GGUF outputs, corpora) goes through :func:`atomic_path`: a temp file in the target's folder
(so the rename cannot cross file systems), written by the caller, fsynced, renamed over the
target, then the folder fsynced so the rename itself is durable where the platform allows it. On
any error, ``KeyboardInterrupt`` included, the temp file is removed and the target keeps its old
content.

Temp names are ``.tmp-NAME-PID-HEX`` (pyarrow skips dot-files, and ``results.store`` sweeps
``.tmp-*`` left by a killed process). Files get the permissions ``open`` would give them
(``0o666`` less the umask), not ``mkstemp``'s ``0o600``.

A killed write leaves its temp file behind (a multi-GB GGUF, say). The next write to the same
target removes such leftovers, and only those that are surely dead: the temp name of this
target, a writer pid that no longer runs on this machine, and no writer holding the file's
``flock`` (each writer holds one on its temp file until the rename, which covers a writer on
another machine of a shared file system, whose pid means nothing here).

This module imports nothing from healsweep, so any layer may use it.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # Windows: no flock, so no temp file is ever judged dead
    fcntl = None  # type: ignore[assignment]

TEMP_PREFIX = ".tmp-"
_NOT_SUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}


def _create_temp(target: Path) -> tuple[Path, int]:
    """A new empty file beside ``target``, created exclusively with open()'s permissions, and a
    descriptor of it holding its ``flock`` (the writer is alive while it is held)."""
    for _ in range(100):
        tmp = target.with_name(f"{TEMP_PREFIX}{target.name}-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            _lock(fd, blocking=True)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return tmp, fd
    raise FileExistsError(errno.EEXIST, "no free temp name", str(target))


def _lock(fd: int, *, blocking: bool) -> bool:
    """Take ``fd``'s exclusive flock; False if another holds it (and ``blocking`` is off).
    Without flock (Windows) a non-blocking take fails, so no temp file is judged dead; on a
    file system without locks it succeeds, and the pid check alone decides."""
    if fcntl is None:
        return not blocking
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as exc:  # a file system without locks: the pid check alone must do
        if exc.errno not in _NOT_SUPPORTED | {errno.ENOLCK}:
            raise
    return True


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale_temps(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the temp files a killed write to ``target`` left beside it (see the module
    docstring for which are surely dead); returns those removed. Never raises for a temp file
    it cannot inspect or remove: it leaves it."""
    target = Path(target)
    pattern = re.compile(rf"{re.escape(TEMP_PREFIX + target.name)}-(\d+)-[0-9a-f]{{12}}")
    removed = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or int(match[1]) == os.getpid() or _running(int(match[1])):
            continue
        path = target.parent / name
        if _remove_if_unlocked(path):
            removed.append(path)
    return removed


def _remove_if_unlocked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        if fcntl is None or not _lock(fd, blocking=False):
            return False
        if os.fstat(fd).st_ino != os.lstat(path).st_ino:  # replaced since the listing
            return False
        path.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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
    remove_stale_temps(target)
    tmp, lock = _create_temp(target)
    try:
        yield tmp
        if durable:
            _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(lock)  # releases the flock: after the rename, or after the removal
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
