"""The header of a GGUF file: metadata fields and tensor infos, read with the raw type ids.

gguf-py's reader turns every tensor's type id into its own enum while it opens a file and fails
on an id it does not name (Q2_0, type 42, in gguf-py 0.19), so healsweep reads the header itself
(the layout gguf-py's reader and writer implement: magic, version, counts, key/value fields,
tensor infos, aligned data) with gguf-py's constants, and maps tensor types to
:class:`TensorType`. Only the header's pages are read; tensor data is read by the caller.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType, Keys

from healsweep.gguf_io._arrays import HeaderProblem, NumericArray, read_strings
from healsweep.gguf_io._ggml_types import QUANT_SIZES, TensorType

_SUPPORTED_VERSIONS = (2, 3)
# GGUFValueType → struct format of the scalar types
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}  # fmt: skip


class UnknownTensorType(Exception):
    """A tensor of a ggml type id that neither gguf-py nor healsweep knows."""

    def __init__(self, name: str, qtype: int):
        super().__init__(name, qtype)
        self.name, self.qtype = name, qtype


class TruncatedTensor(Exception):
    """A tensor's data runs past the end of the file."""

    def __init__(self, name: str, end: int, size: int):
        super().__init__(name, end, size)
        self.name, self.end, self.size = name, end, size


class Field(NamedTuple):
    """One metadata field: its bytes span ``[offset, end)`` of the file, its value type (and the
    item type of an array) and its value (str, int, float, bool or a list of them)."""

    name: str
    offset: int
    end: int
    type: GGUFValueType
    item_type: GGUFValueType | None
    value: Any


class TensorInfo(NamedTuple):
    """One tensor: ggml ``ne`` (``dims``), type, absolute data offset and stored bytes."""

    name: str
    dims: tuple[int, ...]
    type: TensorType
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Numpy shape in weights (reversed ggml ``ne``)."""
        return tuple(reversed(self.dims))

    def stored(self) -> tuple[np.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of the stored data: float/int arrays as such, block types as
        uint8 ``[..., row bytes]`` (as gguf-py maps them)."""
        plain = _PLAIN_DTYPES.get(self.type.name)
        if plain is not None:
            return np.dtype(plain), self.shape
        block, size = QUANT_SIZES[self.type]
        return np.dtype(np.uint8), (*self.shape[:-1], self.shape[-1] // block * size)


_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


class GGUFHeader(NamedTuple):
    """A GGUF file's header; ``fields`` in file order, keyed by name."""

    path: Path
    version: int
    little_endian: bool
    alignment: int
    data_offset: int
    kv_end: int  # where the tensor infos start
    fields: dict[str, Field]
    tensors: list[TensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value, or ``default`` when the file has no such key."""
        field = self.fields.get(key)
        return default if field is None else field.value


class _Cursor:
    def __init__(self, buf: Any, order: str):
        self.buf, self.pos, self.order = buf, 0, order

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        if len(raw) != n:
            raise EOFError("string past the end of the file")
        self.pos += n
        return raw.decode("utf-8")

    def value(self, value_type: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
        if value_type == GGUFValueType.STRING:
            return self.string(), None
        if value_type in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[value_type]), None
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {int(value_type)}")
        item_type = GGUFValueType(self.scalar("I"))
        count = self.scalar("Q")
        fmt = SCALAR_FORMATS.get(item_type)
        smallest = struct.calcsize(fmt) if fmt else 8  # a string's or an array's length prefix
        if count > (len(self.buf) - self.pos) // smallest:
            raise HeaderProblem(f"an array of {count:,} items runs past the end of the file")
        if fmt is not None:  # kept as stored: see _arrays
            dtype = np.dtype(fmt).newbyteorder(self.order)
            items = np.frombuffer(self.buf, dtype, count, self.pos).astype(dtype.newbyteorder("="))
            self.pos += items.nbytes
            return NumericArray(items), item_type
        if item_type == GGUFValueType.STRING:
            strings, self.pos = read_strings(self.buf, self.pos, count, self.order)
            return strings, item_type
        return [self.value(item_type)[0] for _ in range(count)], item_type


def read_header(path: Path) -> GGUFHeader:
    """Parse the header of the GGUF file at ``path``.

    Raises :class:`UnknownTensorType` and :class:`TruncatedTensor` by name; anything else that
    is wrong with the bytes raises what parsing them raised (the caller words the error).
    """
    size = path.stat().st_size
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        order = "<"
        if version & 0xFFFF == 0:  # written for the other byte order
            order, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported")
        cur = _Cursor(buf, order)
        cur.pos = 8
        n_tensors, n_fields = cur.scalar("Q"), cur.scalar("Q")
        fields: dict[str, Field] = {}
        for _ in range(n_fields):
            offset = cur.pos
            name = cur.string()
            value_type = GGUFValueType(cur.scalar("I"))
            value, item_type = cur.value(value_type)
            if name in fields:
                raise HeaderProblem(f"metadata key {_quoted(name)} appears twice")
            fields[name] = Field(name, offset, cur.pos, value_type, item_type, value)
        kv_end = cur.pos
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            if n_dims > _MAX_DIMS:
                raise HeaderProblem(f"tensor {_quoted(name)} has {n_dims} dims; ggml has at most 4")
            dims = tuple(cur.scalar("Q") for _ in range(n_dims))
            qtype, offset = cur.scalar("I"), cur.scalar("Q")
            infos.append((name, dims, qtype, offset))
        header_end = cur.pos
    alignment = GGUF_DEFAULT_ALIGNMENT
    align_field = fields.get(Keys.General.ALIGNMENT)
    if align_field is not None:
        alignment = align_field.value
        if (
            align_field.type != GGUFValueType.UINT32
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise ValueError("general.alignment is not a power of two stored as uint32")
    data_offset = header_end + (-header_end % alignment)
    tensors, names = [], set()
    for name, dims, qtype, offset in infos:
        if qtype not in _TYPE_IDS:
            raise UnknownTensorType(name, qtype)
        if name in names:
            raise HeaderProblem(f"tensor {_quoted(name)} appears twice")
        names.add(name)
        n_bytes = _stored_bytes(name, dims, TensorType(qtype), size)
        start = data_offset + offset
        if start + n_bytes > size:
            raise TruncatedTensor(name, start + n_bytes, size)
        tensors.append(TensorInfo(name, dims, TensorType(qtype), start, n_bytes))
    return GGUFHeader(path, version, order == "<", alignment, data_offset, kv_end, fields,
                      tensors)  # fmt: skip


_TYPE_IDS = frozenset(int(t) for t in QUANT_SIZES)
_MAX_DIMS = 4  # GGML_MAX_DIMS


def _quoted(name: str) -> str:
    """A name from the file, for a message: quoted, at most 80 characters of it."""
    return repr(name if len(name) <= 80 else name[:77] + "...")


def _stored_bytes(name: str, dims: tuple[int, ...], qtype: TensorType, size: int) -> int:
    """Bytes a tensor of ``dims`` stores, in exact integers: refused when a dim is 0, the rows
    do not hold whole blocks, or the count passes 2**63 or the file's size (a product of
    uint64 dims overflowed int64 in numpy before, and a negative size passed every check)."""
    block, type_size = QUANT_SIZES[qtype]
    elements = math.prod(dims)
    if not dims or elements == 0 or elements >= 1 << 63:
        raise HeaderProblem(f"tensor {_quoted(name)} has dims {_dims(dims)}: "
                            f"{elements:,} elements (expected 1 to 2**63 - 1)")  # fmt: skip
    if dims[0] % block:
        raise HeaderProblem(f"tensor {_quoted(name)} has rows of {dims[0]:,} values, not a "
                            f"multiple of the {block}-value blocks of its type {qtype.name}")  # fmt: skip
    n_bytes = elements // block * type_size
    if n_bytes > size:
        raise HeaderProblem(f"tensor {_quoted(name)} has dims {_dims(dims)}: {n_bytes:,} bytes "
                            f"of data, more than the file's {size:,} bytes")  # fmt: skip
    return n_bytes


def _dims(dims: tuple[int, ...]) -> str:
    return "(" + ", ".join(f"{d:,}" if d < 1 << 20 else f"{d:.3g}" for d in dims) + ")"
