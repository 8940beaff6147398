"""ggml tensor types: gguf-py's, plus those it does not name yet (Q2_0, type 42, in gguf-py 0.19).

:class:`TensorType` is an ``IntEnum`` with every member of gguf-py's ``GGMLQuantizationType`` (same
names, same values, so the two compare and hash alike and gguf-py's functions accept either) and
the local types; :data:`QUANT_SIZES` is gguf-py's ``GGML_QUANT_SIZES`` plus the local block
geometries. gguf-py's own enum and table are never changed: healsweep reads and writes tensor
infos itself (``_header``, ``add_tensor_info``) where gguf-py would reject an unknown type id.
Once gguf-py names a local type, its own member and geometry are used and the local entry is
only checked against them.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from healsweep.kernels.ggml_types import ggml_type

_Q2_0 = ggml_type("q2_0")
GGML_Q2_0 = _Q2_0.ggml_id
# ggml types gguf-py may lack: name → (id, (weights per block, bytes per block))
_LOCAL_TYPES = {"Q2_0": (GGML_Q2_0, (_Q2_0.block_weights, _Q2_0.block_bytes))}

_GGUF_IDS = {int(member) for member in GGMLQuantizationType}
TensorType = IntEnum(
    "TensorType",
    {m.name: int(m) for m in GGMLQuantizationType}
    | {name: id_ for name, (id_, _) in _LOCAL_TYPES.items() if id_ not in _GGUF_IDS},
)
QUANT_SIZES: dict[TensorType, tuple[int, int]] = {
    TensorType(int(t)): (int(s[0]), int(s[1])) for t, s in GGML_QUANT_SIZES.items()
}
for _name, (_id, _sizes) in _LOCAL_TYPES.items():
    if QUANT_SIZES.setdefault(TensorType(_id), _sizes) != _sizes:
        raise RuntimeError(
            f"gguf-py gives ggml type {_id} ({TensorType(_id).name}) blocks of "
            f"{QUANT_SIZES[TensorType(_id)]}, healsweep's {_name} is {_sizes}; this gguf-py is "
            "incompatible"
        )


def q2_0_type() -> TensorType:
    """The member for ggml type 42 (Q2_0)."""
    return TensorType(GGML_Q2_0)


def gguf_py_names(qtype: int) -> bool:
    """Whether gguf-py itself knows ggml type ``qtype`` (its reader and writer accept it)."""
    return int(qtype) in _GGUF_IDS


def element_shape(byte_shape: tuple[int, ...], qtype: int) -> tuple[int, ...]:
    """The numpy shape in weights of a tensor stored as ``[..., row bytes]`` of type ``qtype``."""
    block, size = QUANT_SIZES[TensorType(int(qtype))]
    return (*byte_shape[:-1], byte_shape[-1] // size * block)


def add_tensor_info(
    writer, name: str, qtype: int, shape: tuple[int, ...], dtype: np.dtype, nbytes: int
) -> None:
    """``writer.add_tensor_info`` for a tensor stored as ``shape``/``dtype`` (bytes
    ``[..., row bytes]`` uint8 for block types), of any ggml type.

    gguf-py converts a uint8 byte shape to weights through its own table, which lacks the local
    types; for those the shape is converted here and handed over as the weights' shape, with the
    data's dtype given as whole blocks (``np.void`` of the block's bytes), which gguf-py writes
    as it is.
    """
    qtype = TensorType(int(qtype))
    if gguf_py_names(qtype) or np.dtype(dtype) != np.uint8:
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=qtype)
        return
    block_dtype = np.dtype((np.void, QUANT_SIZES[qtype][1]))
    writer.add_tensor_info(name, element_shape(shape, qtype), block_dtype, nbytes, qtype)
