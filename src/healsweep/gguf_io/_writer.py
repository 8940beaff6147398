"""Write a GGUF model with the gguf-py writer: metadata, tokenizer and tensors.

Tensors are converted (``gguf.quants.quantize``) and spooled one at a time, so ``tensors`` may be
a lazy mapping that builds each array on access: writing a model larger than memory then needs
one tensor's worth of RAM, not the model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, Keys
from gguf.quants import quantize

from healsweep._atomic import atomic_path
from healsweep.errors import GGUFFormatError
from healsweep.gguf_io._ggml_types import QUANT_SIZES, TensorType
from healsweep.gguf_io._kquant import KQUANT_TYPES, quantize_kquant
from healsweep.gguf_io._tokenizer import TokenizerMetadata


def default_type(array_ndim: int):
    """F32 for vectors (norms, biases, gates), F16 for matrices and expert stacks."""

    return GGMLQuantizationType.F32 if array_ndim <= 1 else GGMLQuantizationType.F16


def encode_tensor(name: str, values: np.ndarray, qtype) -> np.ndarray:
    """``values`` (float32) in the storage format ``qtype``: float arrays or packed bytes."""

    block, _ = QUANT_SIZES[TensorType(int(qtype))]
    if values.shape[-1] % block:
        raise GGUFFormatError(
            f"cannot store {name} {tuple(values.shape)} as {qtype.name}: rows of "
            f"{values.shape[-1]} values are not a multiple of its block size {block}; "
            "choose another type for this tensor"
        )
    if int(qtype) in KQUANT_TYPES:  # gguf-py cannot write these: our round-to-nearest
        return quantize_kquant(values, int(qtype))
    try:
        return quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)
    except NotImplementedError as exc:
        raise GGUFFormatError(
            f"gguf-py cannot quantize to {qtype.name} (tensor {name}); choose another type"
        ) from exc


def _add_value(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        writer.add_uint32(key, int(value)) if value >= 0 else writer.add_int32(key, int(value))
    elif isinstance(value, (float, np.floating)):
        writer.add_float32(key, float(value))
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"metadata {key}: cannot store a {type(value).__name__}")


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    types: Mapping[str, Any] | None = None,
    tokenizer_metadata: TokenizerMetadata | None = None,
    *,
    name: str = "healsweep",
    extra_metadata: Mapping[str, Any] | None = None,
    drop_keys: tuple[str, ...] = (),
) -> Path:
    """Write a GGUF: ``metadata`` (the ``{arch}.*`` hparams), tokenizer metadata and the tensors,
    in mapping order (``healsweep.model.write_model`` builds the metadata from hparams).

    ``types[name]`` chooses a ``GGMLQuantizationType`` per tensor (F32, F16, Q8_0, Q4_0, ... as
    ``gguf.quants.quantize`` supports); the default is F32 for 1-D and F16 for the rest.
    ``arch`` is written as ``general.architecture``; ``drop_keys`` leaves metadata keys out (to
    make deliberately incomplete files). The file is written to a temp name and renamed.
    """

    path = Path(path)
    with atomic_path(path) as tmp:
        writer = GGUFWriter(tmp, arch, use_temp_file=True)
        try:
            writer.add_string(Keys.General.NAME, name)
            for key, value in metadata.items():
                if key not in drop_keys:
                    _add_value(writer, key, value)
            if tokenizer_metadata is not None:
                for key, value in tokenizer_metadata.to_gguf_fields().items():
                    _add_value(writer, key, value)
            for key, value in (extra_metadata or {}).items():
                _add_value(writer, key, value)
            for tensor_name in tensors:
                values = np.asarray(tensors[tensor_name], dtype=np.float32)
                qtype = (types or {}).get(tensor_name)  # F32 is 0: test against None, not falsy
                qtype = default_type(values.ndim) if qtype is None else qtype
                encoded = encode_tensor(tensor_name, values, qtype)
                raw_dtype = qtype if encoded.dtype == np.uint8 else None
                if qtype == GGMLQuantizationType.BF16:
                    raw_dtype = qtype
                writer.add_tensor(tensor_name, encoded, raw_dtype=raw_dtype)
                del values, encoded
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return path
