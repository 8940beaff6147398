"""One class per GGUF storage format: every fact healsweep uses about a type, in one place.

A format's class says, for the ggml types it serves (``ids`` in its class statement):

- its block geometry: its row of :data:`healsweep.kernels.ggml_types.STORED_TYPES`, the one
  table of block sizes and scale offsets (the in-graph decoders and the scale fold read it too);
- :meth:`~StorageFormat.encode` (float32 rows to what a GGUF writer takes: healsweep's codec
  where it has one, else gguf-py's), :meth:`~StorageFormat.encode_ggml` (ggml's quantizer with
  an importance row) and :meth:`~StorageFormat.decode` (stored to float32);
- :meth:`~StorageFormat.requantize`: any tensor into the type, with the values a reader will
  decode, so the student runs on what is written (Part B's shared expert, the type knobs);
- for a routed expert stack in the type (``Q2Packed``/``Q2Weight`` or ``GGMLWeight``, each with
  its ggml id as ``qtype``): how Part A's alpha folds into its fp16 scales
  (:meth:`~StorageFormat.fold_alpha`) and how it is written into a GGUF
  (:meth:`~StorageFormat.gguf_type`, :meth:`~StorageFormat.gguf_rows`: Q2_0's type-42 packing).

:func:`format_of` finds the class of a type id. :class:`StorageFormat` itself serves every block
type no subclass claims, through gguf-py and ggml, so a new ggml type needs only its table row
and decoder; a type with a codec of healsweep's own is one subclass here (see
``docs/architecture.md``, "Where to add a type or a quantizer"). As in :mod:`healsweep.quant._base`,
nothing is kept at module level: the table is read off the subclasses when asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from healsweep import kernels  # its modules load on first use: the knobs read this one
from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import QUANT_SIZES, TensorType, fold_scale, q2_0_type
from healsweep.gguf_io._ggml_lib import quantize_rows
from healsweep.kernels.ggml_types import ggml_type, stored_type

GGML_Q2_0 = ggml_type("q2_0").ggml_id


def _geometry(qtype: int) -> tuple[int, int]:
    """``(weights, bytes)`` of a block of ``qtype``: the table's row, else gguf-py's sizes."""
    try:
        kind = stored_type(qtype)
    except GGUFFormatError:
        found = QUANT_SIZES.get(TensorType(int(qtype)))
        if found is None:
            raise
        return found
    return kind.block_weights, kind.block_bytes


def _check_rows(name: str, shape: tuple[int, ...], qtype: int) -> None:
    """:class:`GGUFFormatError` unless rows of ``shape`` fill whole blocks of ``qtype``."""
    block, _ = _geometry(qtype)
    if shape[-1] % block:
        raise GGUFFormatError(
            f"cannot requantize {name} {tuple(shape)} to {TensorType(int(qtype)).name}: rows "
            f"of {shape[-1]} are not a multiple of its block size {block}"
        )


def registered() -> Iterator[type[StorageFormat]]:
    """Every subclass of :class:`StorageFormat` defined so far."""
    todo = list(StorageFormat.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        yield cls


class StorageFormat:
    """A block type through gguf-py (encode, decode) and ggml (encode with importance); the base
    of the formats healsweep has its own codec for."""

    ids: ClassVar[tuple[int, ...]] = ()

    def __init_subclass__(cls, *, ids: tuple[int, ...] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for qtype in ids:
            taken = next((c for c in registered() if c is not cls and qtype in c.ids), None)
            if taken is not None:
                raise TypeError(f"{cls.__name__}: ggml type {qtype} is {taken.__name__}'s")
        cls.ids = tuple(ids)

    @classmethod
    def encode(cls, name: str, values: np.ndarray, qtype: int) -> np.ndarray:
        """``values`` float32 ``[rows, cols]`` as the GGUF writer takes them (bytes of blocks)."""
        # lazy: heavy (gguf)
        from gguf.quants import quantize

        try:
            return quantize(values, TensorType(int(qtype)))
        except NotImplementedError:
            raise GGUFFormatError(
                f"cannot requantize {name} to {TensorType(int(qtype)).name}: neither healsweep "
                "nor gguf-py quantizes that type; store the shared experts as F16, Q8_0 or "
                "IQ4_NL, or run with `ridge: false`"
            ) from None

    @classmethod
    def encode_ggml(
        cls, values: np.ndarray, qtype: int, importance: np.ndarray | None
    ) -> np.ndarray:
        """``values`` float32 ``[rows, cols]`` by ggml's quantizer with the importance row
        ``importance`` ``[cols]`` (or none): uint8 ``[rows, row_bytes]``."""

        return quantize_rows(np.ascontiguousarray(values, np.float32), int(qtype), importance)

    @classmethod
    def decode(cls, raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
        """The float32 values ``shape`` of ``raw`` as :meth:`encode` returned it."""
        # lazy: heavy (gguf)
        from gguf.quants import dequantize

        return np.asarray(dequantize(raw, TensorType(int(qtype))), np.float32).reshape(shape)

    @classmethod
    def requantize(cls, name: str, values: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
        """(raw for the writer, dequantized float32) of ``values`` ``[rows, cols]`` (tensor
        ``name``) in ``qtype``; :class:`GGUFFormatError` where its rows do not fill blocks."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        _check_rows(name, values.shape, qtype)
        raw = cls.encode(name, values, qtype)
        return raw, cls.decode(raw, qtype, values.shape)

    @classmethod
    def requantize_on_device(cls, name: str, values: Any, qtype: int) -> tuple[np.ndarray, Any]:
        """:meth:`requantize` of a device array ``values``: (raw for the writer, on the host;
        the values a reader decodes, float32 on the device). Here through the host codec (the
        values cross to the host and back); the formats with a device codec keep them there
        and send back the bytes alone."""
        raw, stored = cls.requantize(name, np.asarray(values), qtype)
        return raw, kernels.requant.on_device(stored)

    @classmethod
    def fold_alpha(cls, stack: Any, factor: float | np.ndarray) -> Any:
        """``stack`` with ``factor`` (a scalar, or one per expert ``[E]``) folded into its fp16
        scales: it decodes to ``factor`` times what ``stack`` decodes to, up to the fp16
        rounding of each scale. A factor of exactly 1 returns ``stack`` itself."""
        factor = np.asarray(factor, np.float32)
        if factor.ndim == 0 and factor == 1.0:
            return stack
        return cls.scale_stack(stack, factor)

    @classmethod
    def scale_stack(cls, stack: Any, factor: np.ndarray) -> Any:
        """:meth:`fold_alpha` of a float32 ``factor`` other than 1: a ``GGMLWeight``'s rows with
        every block's fp16 scale(s) rewritten."""

        raw = fold_scale(np.asarray(stack.raw), stack.qtype, factor)
        return kernels.ggml_decode.GGMLWeight(raw, stack.qtype, stack.n_in)

    @classmethod
    def gguf_type(cls, stack: Any) -> TensorType:
        """The ggml type an expert stack is written as."""
        return TensorType(int(stack.qtype))

    @classmethod
    def gguf_shape(cls, stack: Any) -> tuple[int, ...]:
        """The shape of :meth:`gguf_rows`, without building them."""
        return tuple(stack.raw.shape)

    @classmethod
    def gguf_rows(cls, stack: Any) -> np.ndarray:
        """An expert stack as the GGUF stores it: uint8 ``[..., out, row_bytes]``."""
        return np.asarray(stack.raw, np.uint8)


class Float32(StorageFormat, ids=(int(TensorType.F32),)):
    """F32: the values themselves."""

    @classmethod
    def encode(cls, name: str, values: np.ndarray, qtype: int) -> np.ndarray:
        return values

    @classmethod
    def decode(cls, raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(raw, np.float32).reshape(shape)

    @classmethod
    def requantize_on_device(cls, name: str, values: Any, qtype: int) -> tuple[np.ndarray, Any]:
        return np.asarray(values, np.float32), values


class Float16(StorageFormat, ids=(int(TensorType.F16),)):
    """F16: the values rounded once to half precision."""

    @classmethod
    def encode(cls, name: str, values: np.ndarray, qtype: int) -> np.ndarray:
        return values.astype(np.float16)

    @classmethod
    def decode(cls, raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(raw, np.float16).astype(np.float32).reshape(shape)

    @classmethod
    def requantize_on_device(cls, name: str, values: Any, qtype: int) -> tuple[np.ndarray, Any]:
        half, stored = kernels.requant.round_half(values)
        return np.asarray(half), stored


class Q8_0(StorageFormat, ids=(int(TensorType.Q8_0),)):
    """Q8_0: blocks of 32 int8 codes and an fp16 scale, by healsweep's device codec
    (:mod:`healsweep.kernels.requant`, gguf-py's bytes bit for bit) on whatever device holds the
    values: the host's rows go through the CPU backend, a device array stays on its device."""

    @classmethod
    def encode(cls, name: str, values: np.ndarray, qtype: int) -> np.ndarray:
        return np.asarray(kernels.requant.encode_q8_0(values)[0])

    @classmethod
    def requantize_on_device(cls, name: str, values: Any, qtype: int) -> tuple[np.ndarray, Any]:
        _check_rows(name, values.shape, qtype)
        raw, stored = kernels.requant.encode_q8_0(values)
        return np.asarray(raw), stored


class IQ4NL(StorageFormat, ids=(int(TensorType.IQ4_NL),)):
    """IQ4_NL through healsweep's own codec (gguf-py cannot quantize it)."""

    @classmethod
    def encode(cls, name: str, values: np.ndarray, qtype: int) -> np.ndarray:
        rows, cols = values.shape
        d, idx = kernels.iq4_nl.quantize(values.reshape(-1, 32))
        return np.asarray(kernels.iq4_nl.pack(d, idx), np.uint8).reshape(rows, cols // 32 * 18)

    @classmethod
    def decode(cls, raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
        d, idx = kernels.iq4_nl.unpack(np.asarray(raw, np.uint8).reshape(-1, 18))
        return np.asarray(kernels.iq4_nl.dequantize(d, idx), np.float32).reshape(shape)


class Q2_0(StorageFormat, ids=(GGML_Q2_0,)):
    """Q2_0 (ggml type 42, which gguf-py does not name): blocks of 64 weights, an fp16 ``d``
    then 16 bytes of 2-bit codes ``c = q + 1``, code ``j`` at bits ``2*(j%4)`` of byte ``j//4``;
    value ``(c - 1) * d``. An expert stack is a ``Q2Packed`` or ``Q2Weight``, alpha scales ``d``
    (rounded to fp16 from float32, as it always has been)."""

    @classmethod
    def encode(cls, name: str, values: np.ndarray, qtype: int) -> np.ndarray:
        """The codec's signed-scale search without importance or gain."""

        return cls.gguf_rows(kernels.q2_0.quantize_matrix(values, None, 0.0, packed=True))

    @classmethod
    def decode(cls, raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
        rows = np.asarray(raw, np.uint8).reshape(shape[0], -1)
        return np.asarray(kernels.ggml_decode.decode_rows(rows, GGML_Q2_0, shape[-1]), np.float32).reshape(shape)

    @classmethod
    def scale_stack(cls, stack: Any, factor: np.ndarray) -> Any:
        # Q2Packed / Q2Weight: d [E, out, in/64]
        return stack.scale_d(factor if factor.ndim == 0 else factor[:, None, None])

    @classmethod
    def gguf_type(cls, stack: Any) -> TensorType:
        return q2_0_type()

    @classmethod
    def gguf_shape(cls, stack: Any) -> tuple[int, ...]:
        *lead, nb = np.shape(stack.d)  # [..., out, in/64]
        return (*lead, nb * stored_type(GGML_Q2_0).block_bytes)

    @classmethod
    def gguf_rows(cls, stack: Any) -> np.ndarray:
        """A Q2_0 expert stack as ggml type-42 rows: uint8 ``[..., out, in/64 * 18]``.

        ``stack`` is a ``Q2Packed`` (``d`` fp16 ``[..., out, in/64]``, ``codes`` uint8
        ``[..., out, in/4]``, already in ggml's code order) or a ``Q2Weight`` (``q`` int8
        ``[..., out, in]``, packed here). Each block is its fp16 ``d`` (little-endian) followed
        by its 16 code bytes.
        """
        kind = stored_type(GGML_Q2_0)
        codes_per_block = kind.block_bytes - 2  # after the fp16 d
        d = np.ascontiguousarray(np.asarray(stack.d, np.float16))  # [..., out, nb]
        codes = getattr(stack, "codes", None)
        if codes is None:
            c = (np.asarray(stack.q, np.int16) + 1).astype(np.uint8)  # [..., out, in]
            c = c.reshape(*c.shape[:-1], -1, 4)
            codes = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
        codes = np.asarray(codes, np.uint8)  # [..., out, in/4]
        nb = d.shape[-1]
        if codes.shape[:-1] != d.shape[:-1] or codes.shape[-1] != nb * codes_per_block:
            raise ValueError(
                f"type42_rows: codes {codes.shape} do not match scales {d.shape} "
                f"({codes_per_block} bytes a block)"
            )
        blocks = np.empty((*d.shape, kind.block_bytes), np.uint8)  # [..., out, nb, 18]
        blocks[..., :2] = d.astype("<f2")[..., None].view(np.uint8)
        blocks[..., 2:] = codes.reshape(*d.shape, codes_per_block)
        return blocks.reshape(*d.shape[:-1], nb * kind.block_bytes)


def format_of(qtype: int) -> type[StorageFormat]:
    """The class of ggml type ``qtype``: the subclass that claims it, else the base."""
    qtype = int(qtype)
    return next((cls for cls in registered() if qtype in cls.ids), StorageFormat)


def stack_qtype(stack: Any) -> int:
    """The ggml type id of a routed expert stack; :class:`GGUFFormatError` for a dense one."""
    qtype = getattr(stack, "qtype", None)
    if qtype is None:
        raise GGUFFormatError("a healed expert stack is dense; write it with experts='f16'")
    return int(qtype)


def stack_format(stack: Any) -> type[StorageFormat]:
    """The class of a routed expert stack's storage type."""
    return format_of(stack_qtype(stack))


def stack_type_name(stack: Any) -> str:
    """The routed-expert type name of a stack (``q2_0``, ``iq2_xs``, ...)."""
    return ggml_type(stack_qtype(stack)).name


def requantize(name: str, values: np.ndarray, qtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """(raw for the writer, dequantized float32) of ``values`` [rows, cols] in ``qtype``."""
    return format_of(qtype).requantize(name, values, qtype)


def requantize_on_device(name: str, values: Any, qtype: Any) -> tuple[np.ndarray, Any]:
    """(raw for the writer, on the host; dequantized float32, on the device) of the device array
    ``values`` [rows, cols] in ``qtype``: :meth:`StorageFormat.requantize_on_device`."""
    return format_of(qtype).requantize_on_device(name, values, qtype)


def requantize_ggml(
    values: np.ndarray, qtype: Any, importance: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes, dequantized float32) of ``values`` [rows, cols] in ``qtype`` by ggml's
    quantizer with the importance row ``importance`` [cols] (or none): how a group type knob
    (``type_shexp``) stores Part B's healed shared-expert down."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    found = format_of(qtype)
    raw = found.encode_ggml(values, qtype, importance)
    return raw, found.decode(raw, qtype, values.shape)


def dequantized(raw: np.ndarray, qtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values [rows, cols] of ``raw`` as :func:`requantize` returned it in
    ``qtype``: bit for bit the values it returned beside it (it computes them here)."""
    return format_of(qtype).decode(raw, qtype, shape)
