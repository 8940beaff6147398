"""Writing a healed student: a GGUF that llama.cpp runs, and the packed Q2_0 sidecar.

The GGUF keeps every metadata field of the teacher with its exact value type, and every tensor
in file order. The routed experts of healed layers are written as healed by default
(``experts="healed"``): each tensor in the type the student holds it in, its blocks byte for
byte (Q2_0 as ggml type 42: fp16 ``d`` with alpha already folded in, then the 16 code bytes;
a ggml type as its rows, alpha folded into their fp16 block scales), so nothing is
re-quantized and llama.cpp runs exactly the weights healsweep scored; a file may mix types
(knobs ``type_gu``, ``type_d``, ``up_first``/``up_last``, ``layer_types``). ``experts="q2_0"``
asks for the same, and refuses a student with experts in another type; ``experts="f16"`` writes
them dequantized to F16, for tools that do not know a type. A ridge-healed ``ffn_down_shexp``
holds its requantized bytes in the teacher's storage type; every other tensor is the teacher's
bytes, copied unchanged. Tensors are streamed one at a time, so writing needs about one expert
stack of memory. The knobs, the student's cache key, the alphas, the teacher's fingerprint, the
expert format, the allocation (``expert_types``, in the ``layer_types`` knob's syntax) and the
routed experts' stored bits per weight go into ``healsweep.*`` metadata.

The sidecar (``.npz``) holds the same type-42 blocks ``[..., out, in/64, 18]`` of every healed
Q2_0 expert tensor, plus the alphas and knobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from healsweep._atomic import atomic_file, atomic_path
from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import (
    HEAD,
    TensorType,
    add_tensor_info,
    block_prefix,
    element_shape,
    split_block,
)
from healsweep.heal.knobs import LayerTypes
from healsweep.kernels.ggml_types import ggml_type, stored_type
from healsweep.quant.formats import Q2_0, stack_format, stack_type_name

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel
    from healsweep.heal.pipeline import Student

_EXPERT_FIELDS = {
    "ffn_gate_exps.weight": "gate_exps",
    "ffn_up_exps.weight": "up_exps",
    "ffn_down_exps.weight": "down_exps",
}
HEAL_KEY_PREFIX = "healsweep."
EXPERT_FORMATS = ("healed", "q2_0", "f16")
TensorPlan = tuple[Any, tuple[int, ...], Any]  # (ggml type, stored array shape, numpy dtype)


def expert_type(weight: Any) -> str:
    """The routed-expert type name of a student's expert stack (``q2_0``, a ggml type's name);
    :class:`GGUFFormatError` for a dense one."""
    return stack_type_name(weight)


def _expert_plan(student: Student, name: str, experts: str) -> TensorPlan:
    """(ggml type, stored array shape, dtype) of one healed expert stack in the chosen format."""
    if experts == "f16":
        shape = tuple(student.base.tensor_shape(name))
        return GGMLQuantizationType.F16, shape, np.dtype(np.float16)
    _, weight = _replacement(student, name)
    stored = expert_type(weight)
    if experts not in ("healed", stored):  # a named type: every expert stack must be in it
        raise GGUFFormatError(
            f"{name} of this student is stored as {stored}, not {experts}; write the experts "
            "as healed (experts='healed', each in its own type) or as f16"
        )
    found = stack_format(weight)
    return found.gguf_type(weight), found.gguf_shape(weight), np.dtype(np.uint8)


def _expert_data(weight: Any, experts: str) -> np.ndarray:
    """One healed expert stack in the chosen format (its stored rows, or float16)."""
    if experts == "f16":
        dense = weight if isinstance(weight, np.ndarray) else np.asarray(weight.dequantize())
        return np.asarray(dense, np.float32).astype(np.float16)
    return stack_format(weight).gguf_rows(weight)


def allocation(student: Student) -> dict[int, LayerTypes]:
    """The types of the student's routed experts, per healed layer (gate/up, down)."""
    found = {}
    for layer in sorted(student.replacements):  # one layer read at a time
        r = student.replacements[layer]
        if r.gate_exps is not None and r.down_exps is not None:
            found[layer] = LayerTypes(expert_type(r.gate_exps), expert_type(r.down_exps))
    return found


def routed_bits_per_weight(student: Student) -> float:
    """Stored bits per weight of the student's routed experts over the whole model (a routed
    tensor the student leaves alone counts as the teacher stores it)."""
    bits, weights = 0.0, 0
    for name in student.base.tensor_names:
        if not name.endswith(tuple(_EXPERT_FIELDS)):
            continue
        n = int(np.prod(student.base.tensor_shape(name), dtype=np.int64))
        found = _replacement(student, name)
        if found is None:
            bits += 8.0 * student.base.tensor_nbytes(name)
        else:
            bits += n * ggml_type(expert_type(found[1])).bits_per_weight
        weights += n
    return bits / max(weights, 1)


def _replacement(student: Student, name: str) -> tuple[str, Any] | None:
    """``("experts", weight)``, ``("shexp", raw)`` or ``("tensor", GGMLWeight)`` (a tensor of
    another group in the type of its knob) for a tensor the student replaces."""

    layer, suffix = split_block(name)
    replacement = student.replacements.get(HEAD if layer is None else layer)
    if replacement is None:
        return None
    if layer is not None and suffix in _EXPERT_FIELDS:
        weight = getattr(replacement, _EXPERT_FIELDS[suffix])
        return None if weight is None else ("experts", weight)
    if suffix == "ffn_down_shexp.weight" and layer in student.shexp_raw:
        return "shexp", student.shexp_raw[layer]
    retyped = (replacement.tensors or {}).get(suffix)
    return None if retyped is None else ("tensor", retyped)


def heal_metadata(student: Student, experts: str) -> dict[str, Any]:
    """The ``healsweep.*`` fields every healed GGUF carries (str, float list): ``experts`` is
    ``f16``, or the one type of every healed expert tensor, or ``mixed``."""
    types = allocation(student)
    named = {name for layer in types.values() for name in layer}
    stored = "f16" if experts == "f16" else (named.pop() if len(named) == 1 else "mixed")
    groups = student.knobs.file_types()
    found = {
        "knobs": json.dumps(student.knobs.model_dump(), sort_keys=True),
        "student_key": student.key,
        "alphas": [float(a) for a in student.alphas],
        "teacher_fingerprint": student.base.fingerprint,
        "experts": stored,
        "expert_types": ",".join(f"{i}:{t.gu}/{t.d}" for i, t in types.items()),
        "routed_bpw": 16.0 if experts == "f16" else routed_bits_per_weight(student),
    }
    if groups:  # the other tensor groups' types, where the knobs set any
        found["tensor_types"] = ",".join(f"{g}:{t}" for g, t in groups.items())
    return found


def write_healed_gguf(
    student: Student,
    out: str | Path,
    *,
    experts: str = "healed",
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``student`` as a GGUF at ``out`` (atomically: temp file, then rename).

    ``experts`` is ``"healed"`` (each expert tensor in the type the student holds it in, its
    blocks as they are), ``"q2_0"`` (the same, for a student whose experts are all Q2_0) or
    ``"f16"``; ``metadata`` adds ``healsweep.<key>`` string/number fields (e.g. the sweep and
    trial).
    """
    if experts not in EXPERT_FORMATS:
        raise ValueError(
            f"write_healed_gguf: experts must be one of {EXPERT_FORMATS}, got {experts!r}"
        )
    plan: dict[str, TensorPlan] = {}
    for name in student.base.tensor_names:
        found = _replacement(student, name)
        if found is None:
            continue
        if found[0] == "experts":
            plan[name] = _expert_plan(student, name, experts)
        elif found[0] == "tensor":
            raw = np.asarray(found[1].raw)
            plan[name] = (TensorType(found[1].qtype), raw.shape, raw.dtype)
        else:
            raw = np.asarray(found[1])
            layer = split_block(name)[0]
            qtype = student.shexp_types.get(layer)
            stored = student.base.tensor_type(name) if qtype is None else TensorType(qtype)
            plan[name] = (stored, raw.shape, raw.dtype)

    def produce(name: str) -> np.ndarray:
        kind, value = _replacement(student, name)
        if kind == "experts":
            return _expert_data(value, experts)
        return np.asarray(value.raw if kind == "tensor" else value)

    return write_replacing(
        student.base, out, plan, produce, {**heal_metadata(student, experts), **(metadata or {})}
    )


def write_replacing(
    base: GGUFModel,
    out: str | Path,
    plan: Mapping[str, TensorPlan],
    produce: Callable[[str], np.ndarray],
    metadata: Mapping[str, Any],
) -> Path:
    """Write a copy of GGUF model ``base`` at ``out`` whose tensors in ``plan`` are replaced.

    Every metadata field of ``base`` is kept with its value type, ``metadata`` is added under
    ``healsweep.``, tensors keep their file order. ``plan[name]`` declares a replacement's ggml
    type and stored array (bytes ``[..., row_bytes]`` uint8 for block types); ``produce(name)``
    builds it when the writer reaches it, so only one replaced tensor is in memory at a time.
    The file is written to a temp name and renamed.
    """

    out = Path(out)
    header = base.header
    arch = header.get(gguf.Keys.General.ARCHITECTURE)
    endianness = gguf.GGUFEndian.LITTLE if header.little_endian else gguf.GGUFEndian.BIG
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            for field in header.fields.values():
                if field.name == gguf.Keys.General.ARCHITECTURE:
                    continue
                writer.add_key_value(field.name, field.value, field.type, sub_type=field.item_type)
            for key, value in metadata.items():
                _add_field(writer, HEAL_KEY_PREFIX + key, value)
            for tensor in header.tensors:
                if tensor.name in plan:
                    qtype, shape, dtype = plan[tensor.name]
                    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                else:
                    dtype, shape = tensor.stored()
                    qtype, nbytes = tensor.type, tensor.n_bytes
                _check_shape(base, tensor.name, shape, np.dtype(dtype), qtype)
                add_tensor_info(writer, tensor.name, qtype, shape, np.dtype(dtype), nbytes)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for tensor in header.tensors:
                if tensor.name not in plan:
                    _, stored = base.raw_tensor(tensor.name)
                    writer.write_tensor_data(stored, tensor_endianess=endianness)
                    continue
                data = produce(tensor.name)
                _, shape, dtype = plan[tensor.name]
                if tuple(data.shape) != tuple(shape) or data.dtype != np.dtype(dtype):
                    raise ValueError(
                        f"write_replacing: {tensor.name} was planned as {np.dtype(dtype)} {shape}, "
                        f"produced as {data.dtype} {tuple(data.shape)}"
                    )
                writer.write_tensor_data(np.ascontiguousarray(data))
        finally:
            writer.close()
    return out


def _add_field(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float64(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"metadata {key}: cannot store a {type(value).__name__}")


def _check_shape(base: GGUFModel, name: str, shape: tuple, dtype: np.dtype, qtype: Any) -> None:
    shape = tuple(shape)
    if dtype == np.uint8:  # packed blocks (an 8-bit integer type's geometry is (1, 1))
        shape = element_shape(shape, qtype)
    want = tuple(base.tensor_shape(name))
    if shape != want:
        raise GGUFFormatError(f"replaced tensor {name} has shape {shape}, the model's is {want}")


def write_q2_sidecar(student: Student, out: str | Path) -> Path:
    """Save type-42 blocks (uint8 ``[..., out, in/64, 18]``) of every healed Q2_0 expert tensor
    (those in another type are not in it), the alphas and the knobs."""
    out = Path(out)
    arrays: dict[str, np.ndarray] = {"alphas": np.asarray(student.alphas, np.float32)}
    block_bytes = stored_type(Q2_0.ids[0]).block_bytes
    for layer in sorted(student.replacements):  # one layer read at a time
        replacement = student.replacements[layer]
        for suffix, field in _EXPERT_FIELDS.items():
            weight = getattr(replacement, field)
            if getattr(weight, "qtype", None) not in Q2_0.ids:
                continue
            rows = Q2_0.gguf_rows(weight)  # [..., out, nb * 18]
            arrays[block_prefix(layer) + suffix] = rows.reshape(*rows.shape[:-1], -1, block_bytes)
    arrays["knobs_json"] = np.frombuffer(json.dumps(student.knobs.model_dump()).encode(), np.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out, "wb") as fh:
        np.savez(fh, **arrays)
    return out
