"""Storing an updated float32 tensor back in a GGUF storage type (Part B's shared-expert down).

F32 and F16 are stored as they are; IQ4_NL goes through healsweep's own codec (gguf-py cannot
quantize it); the types gguf-py can quantize (Q8_0, Q4_0, Q5_0, BF16, ...) go through
``gguf.quants``. Each call returns the stored bytes/values exactly as a GGUF writer takes them
and the float32 values a reader will dequantize them to, so the student runs on what is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from healsweep.errors import GGUFFormatError


def requantize(name: str, values: np.ndarray, ggml_type: Any) -> tuple[np.ndarray, np.ndarray]:
    """(raw for the writer, dequantized float32) of ``values`` [rows, cols] in ``ggml_type``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    values = np.ascontiguousarray(values, dtype=np.float32)
    if ggml_type == GGMLQuantizationType.F32:
        return values, values
    if ggml_type == GGMLQuantizationType.F16:
        raw = values.astype(np.float16)
        return raw, raw.astype(np.float32)
    block, _ = GGML_QUANT_SIZES[ggml_type]
    if values.shape[-1] % block:
        raise GGUFFormatError(
            f"cannot requantize {name} {values.shape} to {ggml_type.name}: rows of "
            f"{values.shape[-1]} are not a multiple of its block size {block}"
        )
    if ggml_type == GGMLQuantizationType.IQ4_NL:
        return _iq4_nl(values)
    try:
        raw = quantize(values, ggml_type)
    except NotImplementedError:
        raise GGUFFormatError(
            f"cannot requantize {name} to {ggml_type.name}: neither healsweep nor gguf-py "
            "quantizes that type; store the shared experts as F16, Q8_0 or IQ4_NL, or run "
            "with `ridge: false`"
        ) from None
    return raw, np.asarray(dequantize(raw, ggml_type), np.float32).reshape(values.shape)


def _iq4_nl(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from healsweep.kernels import iq4_nl

    rows, cols = values.shape
    blocks = values.reshape(-1, 32)
    d, idx = iq4_nl.quantize(blocks)
    raw = np.asarray(iq4_nl.pack(d, idx), np.uint8).reshape(rows, cols // 32 * 18)
    dense = np.asarray(iq4_nl.dequantize(d, idx), np.float32).reshape(rows, cols)
    return raw, dense
