"""Metadata arrays held as their stored bytes, read item by item.

A GGUF array of 130 million uint8 values is 130 MB in the file; as a Python list (gguf-py's
``.tolist()``) it is 1.3 GB, and a string array of short strings costs 60 to 80 bytes per item.
Arrays are therefore kept as the bytes the file stores (numbers: a numpy array; strings: the
stored bytes and one 8-byte offset per item, no more than the 8-byte length prefix each string
has in the file), so an array costs at most twice its bytes; an item becomes a Python value when
it is read. Both are read-only :class:`~collections.abc.Sequence` objects: ``len``, indexing,
iteration, ``in`` and ``==`` with a list work as they did on the lists.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

_CHUNK = 1 << 16  # items turned into Python values at once while iterating


class HeaderProblem(Exception):
    """Something a GGUF header says that cannot be (a duplicate name, dims that overflow, an
    array longer than the file); the message names it."""


class _Array(Sequence):
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like a list

    def __repr__(self) -> str:
        head = ", ".join(repr(v) for v in self[:4])
        return f"[{head}{', ...' if len(self) > 4 else ''}] ({len(self)} items)"


class NumericArray(_Array):
    """A metadata array of numbers (or booleans), held as a read-only numpy array."""

    def __init__(self, items: np.ndarray) -> None:
        self._items = items
        self._items.flags.writeable = False

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._items[index].tolist()
        return self._items[index].item()

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self._items), _CHUNK):
            yield from self._items[start : start + _CHUNK].tolist()

    def to_numpy(self) -> np.ndarray:
        """The stored values (read-only)."""
        return self._items


class StringArray(_Array):
    """A metadata array of UTF-8 strings: the stored bytes (length prefixes included) and where
    each string starts; an item is decoded when it is read (each was checked to decode)."""

    def __init__(self, stored: bytes, starts: np.ndarray, prefix: int) -> None:
        self._stored, self._starts, self._prefix = stored, starts, prefix  # starts: n + 1

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("metadata array index out of range")
        start, end = int(self._starts[index]), int(self._starts[index + 1])
        return self._stored[start + self._prefix : end].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def lengths(self) -> np.ndarray:
        """Each string's length in bytes."""
        return np.diff(self._starts) - self._prefix


MAX_STRINGS = 1 << 22  # items of one string array (the largest vocabularies: ~260,000 tokens)
_CHECK_STRINGS = 1 << 20  # strings whose UTF-8 is checked at once


def read_strings(buf: Any, pos: int, count: int, order: str) -> tuple[StringArray, int]:
    """``count`` length-prefixed UTF-8 strings from ``buf`` at ``pos``; returns the array and
    the position after it. Raises EOFError for a string that runs past ``buf``,
    UnicodeDecodeError for one that is not UTF-8, and HeaderProblem past :data:`MAX_STRINGS`
    (the positions chain through each string's length, so reading costs a Python step per
    string: about a second per million)."""
    if count > MAX_STRINGS:
        raise HeaderProblem(
            f"an array of {count:,} strings, over the {MAX_STRINGS:,} healsweep reads"
        )
    unpack, size = struct.Struct(order + "Q").unpack_from, len(buf)
    starts = array("q")
    at = pos
    for _ in range(count):
        starts.append(at - pos)
        at += 8 + unpack(buf, at)[0]
        if at > size:
            raise EOFError("a string of a metadata array runs past the end of the file")
    starts.append(at - pos)
    stored = bytes(buf[pos:at])
    offsets = np.frombuffer(starts, np.int64)
    for first in range(0, count, _CHECK_STRINGS):
        _check_utf8(stored, offsets[first : first + _CHECK_STRINGS + 1])
    return StringArray(stored, offsets, 8), at


def _check_utf8(stored: bytes, starts: np.ndarray) -> None:
    """The strings between ``starts`` decode: their bytes together decode, and none starts
    inside a character (a continuation byte, 0b10xxxxxx), so no boundary splits one."""
    base = int(starts[0])
    raw = np.frombuffer(stored, np.uint8, int(starts[-1]) - base, base)
    keep = np.ones(len(raw), bool)
    for offset in range(8):  # the 8-byte length prefixes are not text
        keep[starts[:-1] - base + offset] = False
    raw[keep].tobytes().decode("utf-8")
    firsts = starts[:-1] - base + 8
    nonempty = firsts < starts[1:] - base
    if np.any((raw[firsts[nonempty]] & 0xC0) == 0x80):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "a string starts inside a character")
