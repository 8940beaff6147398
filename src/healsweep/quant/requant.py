"""Storing an updated float32 tensor back in a GGUF storage type (Part B's shared-expert down).

F32 and F16 are stored as they are; IQ4_NL goes through healsweep's own codec (gguf-py cannot
quantize it); the types gguf-py can quantize (Q8_0, Q4_0, Q5_0, BF16, ...) go through
``gguf.quants``; :func:`requantize_ggml` stores in any ggml type by ggml's quantizer with an
importance row (knob ``type_shexp``). Each call returns the stored bytes/values exactly as a
GGUF writer takes them and the float32 values a reader will dequantize them to, so the student runs on what is written;
:func:`dequantized` gives those values again from the stored bytes alone (Part B's cache entry
keeps only the bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from healsweep.errors import GGUFFormatError


def requantize(name: str, values: np.ndarray, ggml_type: Any) -> tuple[np.ndarray, np.ndarray]:
    """(raw for the writer, dequantized float32) of ``values`` [rows, cols] in ``ggml_type``."""
    # lazy: heavy (gguf)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    values = np.ascontiguousarray(values, dtype=np.float32)
    if ggml_type == GGMLQuantizationType.F32:
        return values, values
    if ggml_type == GGMLQuantizationType.F16:
        raw = values.astype(np.float16)
        return raw, dequantized(raw, ggml_type, values.shape)
    block, _ = GGML_QUANT_SIZES[ggml_type]
    if values.shape[-1] % block:
        raise GGUFFormatError(
            f"cannot requantize {name} {values.shape} to {ggml_type.name}: rows of "
            f"{values.shape[-1]} are not a multiple of its block size {block}"
        )
    if ggml_type == GGMLQuantizationType.IQ4_NL:
        raw = _iq4_nl(values)
    else:
        try:
            raw = quantize(values, ggml_type)
        except NotImplementedError:
            raise GGUFFormatError(
                f"cannot requantize {name} to {ggml_type.name}: neither healsweep nor gguf-py "
                "quantizes that type; store the shared experts as F16, Q8_0 or IQ4_NL, or run "
                "with `ridge: false`"
            ) from None
    return raw, dequantized(raw, ggml_type, values.shape)


def requantize_ggml(
    values: np.ndarray, ggml_type: Any, importance: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes, dequantized float32) of ``values`` [rows, cols] in ``ggml_type`` by ggml's
    quantizer with the importance row ``importance`` [cols] (or none): how a group type knob
    (``type_shexp``) stores Part B's healed shared-expert down."""
    # lazy: optional (llama-cpp-python, an optional extra)
    from healsweep.gguf_io._ggml_lib import quantize_rows

    values = np.ascontiguousarray(values, dtype=np.float32)
    raw = quantize_rows(values, int(ggml_type), importance)
    return raw, dequantized(raw, ggml_type, values.shape)


def dequantized(raw: np.ndarray, ggml_type: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values [rows, cols] of ``raw`` as :func:`requantize` returned it in
    ``ggml_type``: bit for bit the values it returned beside it (it computes them here)."""
    # lazy: heavy (gguf)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if ggml_type == GGMLQuantizationType.F32:
        return np.asarray(raw, np.float32).reshape(shape)
    if ggml_type == GGMLQuantizationType.F16:
        return np.asarray(raw, np.float16).astype(np.float32).reshape(shape)
    if int(ggml_type) == 42:  # Q2_0: gguf-py does not name it; healsweep's decoder does
        from healsweep.kernels.ggml_decode import decode_rows  # lazy: heavy (jax)

        rows = np.asarray(raw, np.uint8).reshape(shape[0], -1)
        return np.asarray(decode_rows(rows, 42, shape[-1]), np.float32).reshape(shape)
    if ggml_type == GGMLQuantizationType.IQ4_NL:
        # lazy: heavy (jax)
        from healsweep.kernels import iq4_nl

        d, idx = iq4_nl.unpack(np.asarray(raw, np.uint8).reshape(-1, 18))
        return np.asarray(iq4_nl.dequantize(d, idx), np.float32).reshape(shape)
    return np.asarray(dequantize(raw, ggml_type), np.float32).reshape(shape)


def _iq4_nl(values: np.ndarray) -> np.ndarray:
    # lazy: heavy (jax)
    from healsweep.kernels import iq4_nl

    rows, cols = values.shape
    d, idx = iq4_nl.quantize(values.reshape(-1, 32))
    return np.asarray(iq4_nl.pack(d, idx), np.uint8).reshape(rows, cols // 32 * 18)
