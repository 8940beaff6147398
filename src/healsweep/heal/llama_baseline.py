"""The external baseline: the routed experts quantized by llama.cpp's own quantizer.

What a llama.cpp user has today: ``ggml_quantize_chunk`` (from the libggml-base that
llama-cpp-python bundles) on each routed expert's matrices, everything else of the teacher kept
byte for byte, so the file differs from the teacher exactly where a healed student does. Types:
every routed-expert type of :mod:`healsweep.kernels.ggml_types` (Q2_0, ggml type 42, the format
healsweep writes, the K- and IQ-types with blocks of 256, IQ4_NL with 32). With ``imatrix`` the quantizer gets, as llama-quantize passes it, one importance row per
expert: E[x²] over the tokens routed to that expert for gate/up and E[h²] of the teacher expert's
hidden activation for down, from healsweep's calibration trace (an expert with fewer than
``min_tokens_per_expert`` tokens takes the layer-wide statistic). IQ1_S, IQ2_XXS and IQ2_XS
cannot be made without one. With ``all_tensors`` every other matrix goes to the same type too
(attention, shared expert, embeddings, output, dense layers: the groups of
:mod:`healsweep.heal.tensor_types`, each with the importance row of its input from the same
calibration, a tensor whose rows the type's blocks do not fill in the smallest type of at least
its bits that does), as ``llama-quantize --pure`` would write it (the router and the vectors
kept as stored, as there); its default mix for a low-bit ftype raises the output, the embeddings and
``attn_v`` instead, which this does not copy. It quantizes with the two functions of :mod:`healsweep.quant.imatrix`
that the registry's :class:`~healsweep.quant.ggml.GGMLImatrix` quantizes a ggml type with (for
every type, Q2_0 included: llama.cpp's own Q2_0), so an unhealed student of a uniform ggml type is
this baseline, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from healsweep.cache import StageCache
from healsweep.errors import GGUFFormatError, SettingError
from healsweep.gguf_io import TensorType, _ggml_lib, block_prefix
from healsweep.gguf_io._ggml_lib import block_geometry, library_source
from healsweep.heal.export import write_replacing
from healsweep.heal.knobs import Knobs
from healsweep.heal.tensor_importance import input_importance
from healsweep.heal.tensor_types import group_tensors, planned_types, requantize_tensor
from healsweep.heal.trace import calibration_trace
from healsweep.kernels.ggml_types import ROUTED_TYPES
from healsweep.quant.imatrix import EXPERT_TENSORS, expert_importance, quantize_expert_stack

if TYPE_CHECKING:
    from healsweep.cache import StageCache
    from healsweep.gguf_io import GGUFModel
    from healsweep.heal.knobs import CalibrationConfig

LLAMA_TYPES = {t.name: t.ggml_id for t in ROUTED_TYPES}
Progress = Callable[[str, str], None]


def check_baseline(model: GGUFModel, type_name: str, imatrix: bool) -> int:
    """The ggml type id of ``type_name``; raises one line when the rows of the routed experts do
    not fill its blocks or when it needs an importance matrix that was not asked for."""

    if type_name not in LLAMA_TYPES:
        raise SettingError(
            f"unknown baseline type {type_name!r}; choose one of {', '.join(LLAMA_TYPES)}"
        )
    qtype = LLAMA_TYPES[type_name]
    block, _ = _ggml_lib.block_geometry(qtype)
    hp = model.hparams
    for tensors, width in (
        ("ffn_gate_exps/ffn_up_exps", hp.n_embd),
        ("ffn_down_exps", hp.n_ff_exp),
    ):
        if width % block:
            raise GGUFFormatError(
                f"{model.path}: the rows of {tensors} hold {width} values, not a multiple of the "
                f"{type_name.upper()} block of {block}; llama.cpp cannot store this model's "
                "routed experts in that type (q2_0 has blocks of 64)"
            )
    if _ggml_lib.requires_imatrix(qtype) and not imatrix:
        raise SettingError(
            f"{type_name} cannot be made without an importance matrix; pass "
            "--imatrix-from-calibration"
        )
    return qtype


def bits_per_weight(qtype: int) -> float:
    """Stored bits per weight of ggml type ``qtype``."""

    block, size = _ggml_lib.block_geometry(qtype)
    return 8.0 * size / block


def write_llama_baseline(
    model: GGUFModel,
    type_name: str,
    out: str | Path,
    *,
    calibration: CalibrationConfig | None = None,
    cache: StageCache | None = None,
    progress: Progress | None = None,
    all_tensors: bool = False,
) -> Path:
    """Write ``model`` with its routed experts quantized by ggml to ``type_name``.

    ``calibration`` (a ``CalibrationConfig``) asks for the importance matrix from the
    calibration trace (``cache``: the stage cache that holds it); None quantizes without one.
    ``all_tensors``: every other matrix in ``type_name`` too (the module docstring).
    """
    say = progress or (lambda stage, message: None)
    qtype = check_baseline(model, type_name, calibration is not None)
    ggml_type = TensorType(qtype)
    trace = None
    if calibration is not None:

        trace = calibration_trace(model, calibration, cache or StageCache())
        tokens = sum(trace.report.get("chunk_lengths", []))
        say("calib_trace", f"importance rows per expert from {tokens} calibration tokens")
    block, size = block_geometry(qtype)
    plan, others, moments = {}, {}, None
    if all_tensors:
        others, moments = _all_tensors(model, type_name, calibration, cache)
        for name, chosen in others.items():
            *lead, n_in = model.tensor_shape(name)
            shape = (*lead, chosen.row_bytes(n_in))
            plan[name] = (TensorType(chosen.ggml_id), shape, np.dtype(np.uint8))
        say("requant_tensor", f"{len(others)} other matrices to {type_name} (or the type "
                              "that fits their rows)")  # fmt: skip
    for i in model.hparams.moe_layers:
        for suffix in EXPERT_TENSORS:
            name = block_prefix(i) + suffix
            *lead, n_in = model.tensor_shape(name)
            plan[name] = (ggml_type, (*lead, n_in // block * size), np.dtype(np.uint8))
    importance: dict[int, dict[str, Any]] = {}

    def produce(name: str) -> np.ndarray:
        if name in others:
            return requantize_tensor(model, name, others[name], moments).raw
        layer = int(name.split(".")[1])
        suffix = name.split(".", 2)[2]
        imp = None
        if trace is not None:
            if layer not in importance:
                importance.clear()  # one layer's rows at a time
                importance[layer] = expert_importance(
                    trace.layer(layer), calibration.min_tokens_per_expert
                )
            imp = importance[layer][suffix]
        data = quantize_expert_stack(model.tensor(name), qtype, imp)
        if suffix == EXPERT_TENSORS[-1]:
            say(f"layer {layer + 1}/{model.hparams.n_layer}", f"experts quantized to {type_name}")
        return data

    library, source = library_source()
    llama_version = source  # HEALSWEEP_GGML_LIB or tools/build-ggml.sh: no package to name
    if source == "llama-cpp-python":
        try:
            llama_version = version("llama-cpp-python")
        except PackageNotFoundError:  # pragma: no cover - the library loaded, so it is installed
            llama_version = "unknown"
    metadata = {
        "baseline": "llama.cpp ggml_quantize_chunk, "
        + ("every matrix" if all_tensors else "routed experts only"),
        "baseline_type": type_name,
        "baseline_bits_per_weight": bits_per_weight(qtype),
        "imatrix": "calibration E[x2] / E[h2] per expert" if trace is not None else "none",
        "llama_cpp_python": llama_version,
        "ggml_library": library.name,
        "teacher_fingerprint": model.fingerprint,
        "experts": type_name,
    }
    return write_replacing(model, out, plan, produce, metadata)


def _all_tensors(
    model: GGUFModel,
    type_name: str,
    calibration: CalibrationConfig | None,
    cache: StageCache | None,
) -> tuple[dict[str, Any], Any]:
    """The other matrices of ``model`` in ``type_name`` (name → the type each gets) and their
    input moments from ``calibration`` (None without)."""
    uniform = Knobs(**dict.fromkeys(Knobs.FILE_TYPES, type_name))
    others = planned_types(group_tensors(model), uniform)
    moments = None
    if calibration is not None and others:
        moments = input_importance(model, calibration, cache or StageCache())[1]
    return others, moments
