"""Storing an updated float32 tensor back in a GGUF storage type (Part B's shared-expert down).

F32 and F16 are stored as they are; IQ4_NL goes through healsweep's own codec (gguf-py cannot
quantize it); the types gguf-py can quantize (Q8_0, Q4_0, Q5_0, BF16, ...) go through
``gguf.quants``. Each call returns the stored bytes/values exactly as a GGUF writer takes them
and the float32 values a reader will dequantize them to, so the student runs on what is written;
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
