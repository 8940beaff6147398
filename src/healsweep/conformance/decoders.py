"""One case per in-graph GGUF decoder (``kernels.ggml_decode.IN_GRAPH_TYPES``, so a decoder
added later is checked without a change here).

Inputs are rows of uniformly random bytes: every bit pattern is a valid block, fp16 fields
included (some decode to infinities and NaNs, which must come out where the reference has them).
The reference is gguf-py's ``gguf.quants.dequantize`` (numpy), or, for Q2_0 (type 42), which
gguf-py cannot read, the float64 decoder of :mod:`healsweep.conformance.references`; the
decoders are bit-identical to it. Where llama-cpp-python is installed, ggml's own ``to_float``
is a second reference.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from healsweep.conformance import references as ref
from healsweep.conformance.run import KernelCase, max_rel_err
from healsweep.errors import SettingError
from healsweep.gguf_io import TensorType, _ggml_lib
from healsweep.kernels import ggml_decode
from healsweep.kernels.ggml_decode import block_geometry, decode_rows, row_bytes

ROWS = 16
GGML_RTOL = 1e-6  # ggml's C decoders against ours: the same float32 products, compiled by gcc


def type_name(qtype: int) -> str:
    """The name of ggml type ``qtype`` (gguf-py's, or Q2_0 from healsweep's table), else
    ``type<id>``."""

    try:
        return TensorType(qtype).name
    except ValueError:
        return f"type{qtype}"


def _row_weights(qtype: int) -> int:
    block, _ = block_geometry(qtype)
    return block * max(1, 256 // block)


def _inputs(qtype: int, rng: np.random.Generator) -> tuple[np.ndarray]:
    n_bytes = row_bytes(qtype, _row_weights(qtype))
    return (rng.integers(0, 256, (ROWS, n_bytes), dtype=np.uint8),)


def _decode(qtype: int, raw):
    return decode_rows(raw, qtype, _row_weights(qtype))


def gguf_reference(qtype: int, raw: np.ndarray) -> np.ndarray:
    """The rows as gguf-py decodes them (Q2_0: the float64 spec decoder); for a type gguf-py
    cannot decode, ggml's ``to_float``, and a ``ValueError`` saying so where neither can."""
    if qtype == 42:
        return ref.q2_0_from_bytes(raw)
    # lazy: heavy (gguf)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        with np.errstate(invalid="ignore", over="ignore"):
            out = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(qtype))
    except (NotImplementedError, ValueError, KeyError) as exc:
        ggml = ggml_reference(qtype, raw)
        if ggml is None:
            raise ValueError(
                f"gguf-py cannot decode ggml type {qtype} ({exc}) and llama-cpp-python is not "
                'installed: pip install -e ".[bench]" for ggml\'s to_float'
            ) from exc
        return ggml
    return np.asarray(out, np.float32).reshape(raw.shape[0], -1)


def ggml_reference(qtype: int, raw: np.ndarray) -> np.ndarray | None:
    """ggml's ``to_float`` of the rows, None where llama-cpp-python is absent or ggml has no
    ``to_float`` for the type (F32)."""

    try:
        return _ggml_lib.dequantize_rows(raw, qtype, _row_weights(qtype))
    except (SettingError, ValueError):
        return None


def _check(qtype: int, got, want, inputs) -> tuple[float, str | None]:
    err = max_rel_err(got, want)
    if err > 0:
        return err, f"max rel err {err:.2e} vs gguf-py's decoder (must be bit-identical)"
    ggml = ggml_reference(qtype, inputs[0])
    if ggml is not None:
        ggml_err = max_rel_err(got, ggml)
        if ggml_err > GGML_RTOL:
            return ggml_err, f"max rel err {ggml_err:.2e} vs ggml's to_float"
    return err, None


def decoder_cases() -> list[KernelCase]:
    """A case for every type with an in-graph decoder."""

    return [
        KernelCase(
            f"ggml_decode.{type_name(qtype)}",
            partial(_decode, qtype),
            partial(_inputs, qtype),
            partial(gguf_reference, qtype),
            check=partial(_check, qtype),
            device_rtol=0.0,
        )
        for qtype in sorted(ggml_decode.IN_GRAPH_TYPES)  # read when asked: a type added counts
    ]


__all__ = ["decoder_cases", "ggml_reference", "gguf_reference", "type_name"]
