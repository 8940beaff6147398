"""Files the user names, read with bounds; output paths checked before the work that fills them.

Every loader of a user's file (knob files, sweep specs, split configs, corpora, ledgers,
tokenizer files, GGUF models) goes through here, so one rule holds for all of them:

- only a regular file is read: a FIFO (which would block the open), a device, a folder or a
  socket is refused in one line, and so is a file whose bytes differ from its size (a ``/proc``
  or ``/sys`` file says size 0 and gives more);
- a file is read only up to its kind's limit, stated in the message with the setting that
  raises it;
- text is strict UTF-8, and a byte that is not names the file, the byte offset and the line;
- a value from the file quoted in a message is cut to a few hundred characters
  (:func:`quoted`), so a message never grows with the input.

Opening never blocks: the descriptor is opened non-blocking and checked with ``fstat`` before a
byte is read (a check of the path first would race a swap of the file). ``OSError`` from the
open itself (no such file, permission denied) propagates, for the caller to word as before.

Base layer: the standard library and ``healsweep.errors`` only.
"""

from __future__ import annotations

import os
import reprlib
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from healsweep.errors import HealsweepError, SettingError

QUOTE_LIMIT = 200  # characters of an input value a message quotes
MIB = 1 << 20

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISSOCK, "a socket"),
)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)


class InputError(HealsweepError):
    """A file the user named is not a regular file, is too large, or is not UTF-8 text."""


class OutputError(HealsweepError):
    """An output path cannot be written (its folder is missing, read-only or not a folder)."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_regular(path: Path, mode: int, what: str, error: type[HealsweepError]) -> HealsweepError:
    return error(
        f"{path} is {_kind(mode)}, not a regular file; a {what} is read only from a regular "
        "file: pass the file itself"
    )


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a file (``"no such file"``, ``"it is a FIFO (named pipe),
    not a regular file"``), or None when it is a regular file; for a check of a path named in
    a settings file, before its loader (which checks again on the descriptor) runs."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return "no such file" if isinstance(exc, FileNotFoundError) else _reason(exc)
    return None if stat.S_ISREG(st.st_mode) else f"it is {_kind(st.st_mode)}, not a regular file"


@contextmanager
def open_regular(
    path: str | os.PathLike[str],
    what: str,
    *,
    max_bytes: int | None = None,
    setting: str | None = None,
    error: type[HealsweepError] = InputError,
) -> Iterator[IO[bytes]]:
    """``path`` opened for binary reading once it is known to be a regular file of at most
    ``max_bytes`` (``setting`` names what raises that limit); the open never blocks."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(Path(path), st.st_mode, what, error)
        if max_bytes is not None and st.st_size > max_bytes:
            raise error(_too_large(Path(path), st.st_size, max_bytes, what, setting))
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


def _too_large(path: Path, size: int, limit: int, what: str, setting: str | None) -> str:
    raise_it = f"; for a larger {what} raise {setting}" if setting else ""
    return (
        f"{path} holds {size:,} bytes, over the {_size_words(limit)} limit of a {what}{raise_it}"
    )


def _size_words(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n:,} bytes"


def read_bytes(
    path: str | os.PathLike[str],
    what: str,
    max_bytes: int,
    *,
    setting: str | None = None,
    error: type[HealsweepError] = InputError,
) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them (see
    :func:`open_regular`); a file that gives other than its size is refused (``/proc``)."""
    with open_regular(path, what, max_bytes=max_bytes, setting=setting, error=error) as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(max_bytes + 1)
    if len(data) != size:
        raise error(
            f"{path} gave {len(data):,} bytes where its size says {size:,}: it changed while "
            f"read, or is a /proc or /sys file; a {what} is read only from a regular file on "
            "disk"
        )
    return data


def read_text(
    path: str | os.PathLike[str],
    what: str,
    max_bytes: int,
    *,
    setting: str | None = None,
    error: type[HealsweepError] = InputError,
) -> str:
    """:func:`read_bytes` decoded as strict UTF-8 (:func:`decode_utf8`)."""
    data = read_bytes(path, what, max_bytes, setting=setting, error=error)
    return decode_utf8(data, str(path), what, error=error)


def decode_utf8(
    data: bytes,
    where: str,
    what: str,
    *,
    offset: int = 0,
    line: int = 1,
    error: type[HealsweepError] = InputError,
) -> str:
    """``data`` as UTF-8 text, or ``error`` naming ``where``, the byte offset (``data`` starts
    at ``offset`` of the file, on ``line``), its line and the byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = line + data.count(b"\n", 0, exc.start)
        raise error(
            f"{where}: not UTF-8 text: byte {offset + exc.start:,} (line {at}) is "
            f"0x{data[exc.start]:02x} ({exc.reason}); save the {what} as UTF-8"
        ) from None


_QUOTE = reprlib.Repr()
_QUOTE.maxstring = QUOTE_LIMIT
_QUOTE.maxother = QUOTE_LIMIT
_QUOTE.maxlong = 40
_QUOTE.maxlevel = 3
for _name in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_QUOTE, _name, 8)


def quoted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` cut to about ``limit`` characters, in time and memory bounded whatever
    ``value`` holds (a long string, a deep or aliased structure, an int of a million digits):
    what an error message may show of a user's input."""
    try:
        text = _QUOTE.repr(value)
    except Exception:  # a value whose repr fails still gets a line
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = f"{text[: limit - 3]}..."
    return text


def size_setting(name: str, default_mib: float) -> int:
    """The byte limit a ``HEALSWEEP_*_MIB`` setting states (``default_mib`` when unset)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return int(default_mib * MIB)
    try:
        mib = float(raw)
    except ValueError:
        mib = float("nan")
    if not 0 < mib < float("inf"):
        raise SettingError(f"{name}={quoted(raw)} is not a positive number of MiB; fix or unset it")
    return max(1, int(mib * MIB))


def check_output(
    path: str | os.PathLike[str],
    what: str,
    *,
    make_folder: bool = False,
    error: type[HealsweepError] = OutputError,
) -> Path:
    """Check, before any work, that ``path`` can be written: its folder exists (or, with
    ``make_folder``, is made), is a folder this process can create files in (a probe file is
    created and removed), and ``path`` is not a folder or other non-regular file. Returns
    ``path``."""
    target = Path(path)
    try:
        st = os.stat(target)
    except OSError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise error(
            f"cannot write the {what} {target}: it is {_kind(st.st_mode)}, and the {what} is "
            "a file; pass a file path"
        )
    check_output_folder(target.parent, what, make=make_folder, target=target, error=error)
    return target


def check_output_folder(
    folder: str | os.PathLike[str],
    what: str,
    *,
    make: bool = False,
    target: Path | None = None,
    error: type[HealsweepError] = OutputError,
) -> Path:
    """Check, before any work, that files can be created in ``folder`` (made first with
    ``make``): it is a folder, and a probe file is created in it and removed (the only test
    that a read-only mount, an ACL or a full inode table cannot fool). Returns ``folder``."""
    folder = Path(folder)
    writing = f"the {what} {target}" if target is not None else f"the {what} into {folder}"
    hint = "pass another path, or fix the folder's permissions or free space"
    if make:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise error(f"cannot write {writing}: {_reason(exc)} making {folder}; {hint}") from None
    if not folder.exists():
        raise error(
            f"cannot write {writing}: its output folder {folder} does not exist; create it or "
            "pass another path"
        )
    if not folder.is_dir():
        raise error(f"cannot write {writing}: {folder} is not a folder; pass another path")
    probe = folder / f".tmp-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise error(f"cannot write {writing}: {_reason(exc)} in {folder}; {hint}") from None
    probe.unlink(missing_ok=True)
    return folder


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
