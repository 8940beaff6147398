"""Writing a healed student: a GGUF any GGUF tool can load, and the packed Q2_0 sidecar.

The GGUF keeps every metadata field of the teacher with its exact value type, and every tensor
in file order: the routed experts of healed layers hold the healed weights dequantized to F16
(alpha folded into the down projections), a ridge-healed ``ffn_down_shexp`` holds its
requantized bytes in the teacher's storage type, and every other tensor is the teacher's bytes,
copied unchanged. Tensors are streamed one at a time, so writing needs about one expert stack
of memory. The sidecar (``.npz``) holds the packed Q2_0 blocks (the ggml byte layout: fp16 d,
then 16 bytes of 2-bit codes) of every healed expert tensor, alpha already folded into the down
scales, plus the alphas themselves.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from healsweep.errors import GGUFFormatError

_EXPERT_FIELDS = {
    "ffn_gate_exps.weight": "gate_exps",
    "ffn_up_exps.weight": "up_exps",
    "ffn_down_exps.weight": "down_exps",
}
HEAL_KEY_PREFIX = "healsweep."


def _replaced_tensor(student: Any, name: str) -> tuple[np.ndarray, Any] | None:
    """(data, ggml type) of a tensor the student replaces, or None to copy the teacher's."""
    from gguf import GGMLQuantizationType

    if not name.startswith("blk."):
        return None
    _, layer, suffix = name.split(".", 2)
    replacement = student.replacements.get(int(layer))
    if replacement is None:
        return None
    if suffix in _EXPERT_FIELDS:
        weight = getattr(replacement, _EXPERT_FIELDS[suffix])
        if weight is None:
            return None
        dense = weight if isinstance(weight, np.ndarray) else np.asarray(weight.dequantize())
        return np.asarray(dense, np.float32).astype(np.float16), GGMLQuantizationType.F16
    if suffix == "ffn_down_shexp.weight" and int(layer) in student.shexp_raw:
        return student.shexp_raw[int(layer)], student.base.tensor_type(name)
    return None


def write_healed_gguf(student: Any, out: str | Path) -> Path:
    """Write ``student`` as a GGUF at ``out`` (atomically: temp file, then rename)."""
    import gguf

    out = Path(out)
    reader = gguf.GGUFReader(student.base.path)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
        writer.add_string(HEAL_KEY_PREFIX + "knobs", json.dumps(student.knobs.model_dump()))
        writer.add_string(HEAL_KEY_PREFIX + "student_key", student.key)
        writer.add_array(HEAL_KEY_PREFIX + "alphas", [float(a) for a in student.alphas])
        planned = []
        for tensor in reader.tensors:
            replaced = _replaced_tensor(student, tensor.name)
            data, qtype = replaced if replaced is not None else (tensor.data, tensor.tensor_type)
            _check_shape(student, tensor, data, qtype)
            writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, qtype)
            planned.append(tensor.name if replaced is not None else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor, replaced_name in zip(reader.tensors, planned, strict=True):
            if replaced_name is None:
                writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
            else:  # recomputed here so only one replaced tensor is in memory at a time
                writer.write_tensor_data(_replaced_tensor(student, replaced_name)[0])
    finally:
        writer.close()
    tmp.replace(out)
    return out


def _check_shape(student: Any, tensor: Any, data: np.ndarray, qtype: Any) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_from_byte_shape

    shape = tuple(data.shape)
    if data.dtype == np.uint8 and qtype not in (GGMLQuantizationType.I8,):
        shape = tuple(quant_shape_from_byte_shape(shape, qtype))
    want = student.base.tensor_shape(tensor.name)
    if shape != tuple(want):
        raise GGUFFormatError(
            f"healed tensor {tensor.name} has shape {shape}, the teacher's is {tuple(want)}"
        )


def write_q2_sidecar(student: Any, out: str | Path) -> Path:
    """Save packed Q2_0 blocks (uint8 [..., in/64, 18]) of every healed expert tensor + alphas."""
    from healsweep.kernels import q2_0

    out = Path(out)
    arrays: dict[str, np.ndarray] = {"alphas": np.asarray(student.alphas, np.float32)}
    for layer, replacement in sorted(student.replacements.items()):
        for suffix, field in _EXPERT_FIELDS.items():
            weight = getattr(replacement, field)
            if weight is None or isinstance(weight, np.ndarray):
                continue
            d = np.asarray(weight.d)  # [..., out, in/64]
            q = np.asarray(weight.q)  # [..., out, in]
            packed = np.asarray(q2_0.pack(d.reshape(-1), q.reshape(-1, 64)))  # [N, 18]
            arrays[f"blk.{layer}.{suffix}"] = packed.reshape(*d.shape, 18)
    arrays["knobs_json"] = np.frombuffer(json.dumps(student.knobs.model_dump()).encode(), np.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
