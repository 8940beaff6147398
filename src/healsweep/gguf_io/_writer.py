"""Write a GGUF model with the gguf-py writer: metadata, tokenizer and tensors.

Tensors are converted (``gguf.quants.quantize``) and spooled in order, so ``tensors`` may be
a lazy mapping that builds each array on access: writing a model larger than memory then needs
a few tensors' worth of RAM (one per host thread that draws and encodes ahead), not the model's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
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
from healsweep.threads import host_threads


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
    names = list(tensors)

    def chosen_type(name: str, ndim: int) -> Any:
        qtype = (types or {}).get(name)  # F32 is 0: test against None, not falsy
        return default_type(ndim) if qtype is None else qtype

    def encoded(tensor_name: str) -> tuple[np.ndarray, Any]:
        values = np.asarray(tensors[tensor_name], dtype=np.float32)
        qtype = chosen_type(tensor_name, values.ndim)
        return encode_tensor(tensor_name, values, qtype), qtype

    with atomic_path(path) as tmp:
        # The tensor infos come first in a GGUF; with every tensor's shape known up front
        # (arrays, or a lazy mapping's shape_of) they are written before the data, and each
        # tensor's bytes go straight to their place in the file: no spooled copy of the data.
        shapes = _shapes(tensors, names)
        writer = GGUFWriter(tmp, arch, use_temp_file=shapes is None)
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
            if shapes is not None:
                for tensor_name, shape in zip(names, shapes, strict=True):
                    qtype = chosen_type(tensor_name, len(shape))
                    stored, dtype, nbytes = _stored_layout(tensor_name, shape, qtype)
                    writer.add_tensor_info(tensor_name, stored, dtype, nbytes, raw_dtype=qtype)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
            # Tensors are drawn and encoded ahead on the host's threads (numpy's bulk work runs
            # outside the GIL) and written in order, at most one per thread in memory.
            for tensor_name, (data, qtype) in _in_order(encoded, names, host_threads()):
                if shapes is not None:
                    writer.write_tensor_data(data)
                else:
                    writer.add_tensor(tensor_name, data, raw_dtype=qtype)
                del data
            if shapes is None:
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
        finally:
            writer.close()
    return path


def _shapes(tensors: Mapping[str, Any], names: list[str]) -> list[tuple[int, ...]] | None:
    """Every tensor's shape without building a lazy one (its ``shape_of``, or an array's own
    shape); None where a lazy mapping cannot tell."""
    shape_of = getattr(tensors, "shape_of", None)
    if shape_of is not None:
        return [tuple(shape_of(name)) for name in names]
    if isinstance(tensors, dict) and all(hasattr(tensors[n], "shape") for n in names):
        return [tuple(tensors[n].shape) for n in names]
    return None


def _stored_layout(name: str, shape: tuple[int, ...], qtype: Any) -> tuple[tuple, np.dtype, int]:
    """``(shape, dtype, bytes)`` of a tensor of ``shape`` once encoded as ``qtype``, from the
    encoding of one row (what :func:`encode_tensor` gives, without the tensor)."""
    row = encode_tensor(name, np.zeros((1, shape[-1]), np.float32), qtype)
    stored = (*shape[:-1], row.shape[-1])
    return stored, row.dtype, int(np.prod(stored, dtype=np.int64)) * row.dtype.itemsize


def _in_order(
    fn: Callable[[str], Any], names: list[str], threads: int
) -> Iterator[tuple[str, Any]]:
    """``(name, fn(name))`` in the order of ``names``, computed up to ``threads`` ahead."""
    if threads <= 1:
        yield from ((name, fn(name)) for name in names)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="gguf-encode") as pool:
        pending: deque[tuple[str, Future]] = deque()
        for name in names:
            pending.append((name, pool.submit(fn, name)))
            if len(pending) >= threads:
                first, future = pending.popleft()
                yield first, future.result()
        while pending:
            first, future = pending.popleft()
            yield first, future.result()
