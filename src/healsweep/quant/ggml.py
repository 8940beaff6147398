"""The ggml types (every routed-expert type but Q2_0): ggml's own quantizer, and GPTQ on its grids.

Stored as the type's rows, ``GGMLWeight`` (uint8 ``[E, out, row_bytes]``, decoded in the graph);
Part A's alpha multiplies every block's fp16 scale(s) (:mod:`healsweep.quant.formats`).
Every class here reads the calibration trace (its importance rows) and names the type in its key.

* :class:`GGMLImatrix`: ``ggml_quantize_chunk`` with one importance row per expert (E[x²] of its
  routed tokens for gate/up, E[h²] of its hidden activation for down), exactly as ``healsweep
  baseline llama --imatrix-from-calibration`` and ``llama-quantize --imatrix`` make it; reads no
  knob, so it serves every ``quantizer`` value no other class claims for its type.
* :class:`KGridGptq` (``quantizer: gptq`` on Q2_K, Q3_K): ggml quantizes, then the codes are chosen
  again on the grid it stored with error feedback over each expert's ``H_e``
  (:mod:`healsweep.quant.kgrid`).
* :class:`IQ2GridGptq` (``quantizer: gptq`` on IQ2_XXS, IQ2_XS): column-wise error feedback
  (:mod:`healsweep.quant.ggml_gptq`, ``method="column"``): ggml picks each 256-chunk's scales for
  the error-updated weights, then each 8-weight group is chosen on that grid under the chunk's
  conditional metric; with ``down_input: student``, down on the quantized gate and up's output.
* :class:`IQ1GridGptq` (``quantizer: gptq`` on IQ1_S, IQ1_M): the same on ggml's IQ1 grids, each
  8-weight group's grid row (and on IQ1_M its ``δ`` sign) chosen on ggml's scales.
* :class:`IQ3GridGptq` (IQ3_XXS, IQ3_S) and :class:`IQ4GridGptq` (IQ4_XS): the same on ggml's
  IQ3 grids (grid rows of 4 with their signs) and on IQ4_XS's 16 values (each weight's code).
* :class:`KGridColumnGptq` (``quantizer: gptq`` on Q4_K, Q5_K): the same on ggml's Q4_K/Q5_K
  grids (:mod:`healsweep.quant.ggml_kgrid`), each weight's code chosen on the scale and min ggml
  picked for its 32 weights.

Experts with too few routed tokens, or whose ``H_e`` does not factor, keep plain ggml (counted in
the stage's report). The GPTQ classes read ``quantizer`` and ``gptq_damp`` (those on the IQ grids
also ``down_input``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from healsweep import kernels  # a lazy face: jax is imported where a kernel runs
from healsweep.kernels.ggml_types import ROUTED_TYPES, ggml_type
from healsweep.quant._base import Arrays, GroupInputs, GroupQuantizer
from healsweep.quant.imatrix import expert_importance, quantize_expert_stack
from healsweep.quant.values import Q2_0, DownInput, Group, Quantizer


class GGMLStored(GroupQuantizer):
    """The storage of a group in a ggml type: its rows, as ``GGMLWeight`` stacks."""

    key_stage: ClassVar[str] = "quantize_ggml"
    keys_type: ClassVar[bool] = True

    @classmethod
    def to_arrays(cls, stacks: tuple[Any, ...]) -> tuple[Arrays, dict[str, Any]]:
        arrays = {f"{n}.raw": np.asarray(stack.raw, np.uint8) for n, stack in enumerate(stacks)}
        return arrays, {"n_in": stacks[0].n_in}

    @classmethod
    def from_arrays(cls, arrays: Arrays, meta: Mapping[str, Any], count: int) -> tuple[Any, ...]:
        qtype = ggml_type(meta["type"]).ggml_id
        return tuple(
            kernels.ggml_decode.GGMLWeight(arrays[f"{n}.raw"], qtype, meta["n_in"])
            for n in range(count)
        )

    @classmethod
    def _stacks(cls, inputs: GroupInputs, raws: list[np.ndarray]) -> tuple[Any, ...]:
        qtype, n_in = ggml_type(inputs.stored_as).ggml_id, inputs.stacks()[0].shape[-1]
        return tuple(kernels.ggml_decode.GGMLWeight(raw, qtype, n_in) for raw in raws)


GGML_TYPES = tuple(t.name for t in ROUTED_TYPES if t.name != Q2_0)


class GGMLImatrix(GGMLStored, types=GGML_TYPES, quantizer=None):
    """ggml's quantizer with the calibration importance rows: the llama.cpp baseline's bytes."""

    @classmethod
    def quantize(cls, inputs: GroupInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
        qtype = ggml_type(inputs.stored_as).ggml_id
        rows = expert_importance(inputs.trace_layer, inputs.min_tokens)
        raws = [
            quantize_expert_stack(w, qtype, rows[f"ffn_{name}_exps.weight"])
            for name, w in zip(inputs.group.tensors, inputs.stacks(), strict=True)
        ]
        return cls._stacks(inputs, raws), {}


_GPTQ_KNOBS = ("quantizer", "gptq_damp")


def _teacher_gate_up(inputs: GroupInputs) -> tuple[Any, Any] | None:
    """Down's input ``h`` comes from the teacher's gate and up: those stacks, for down."""
    if inputs.group is not Group.D:
        return None
    return inputs.weights["ffn_gate_exps.weight"], inputs.weights["ffn_up_exps.weight"]


class KGridGptq(GGMLStored, types=("q2_k", "q3_k"), quantizer=Quantizer.GPTQ):
    """ggml's Q2_K / Q3_K bytes, their codes chosen again with error feedback on ggml's grid."""

    knobs: ClassVar[Mapping[Group, tuple[str, ...]]] = {group: _GPTQ_KNOBS for group in Group}

    @classmethod
    def quantize(cls, inputs: GroupInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
        from healsweep.quant import kgrid  # lazy: jax is heavy (knobs read this module)

        qtype = ggml_type(inputs.stored_as).ggml_id
        rows = expert_importance(inputs.trace_layer, inputs.min_tokens)
        stacks = inputs.stacks()
        raws = [
            quantize_expert_stack(w, qtype, rows[f"ffn_{name}_exps.weight"])
            for name, w in zip(inputs.group.tensors, stacks, strict=True)
        ]
        raws, fallback = kgrid.gptq_stacks(
            raws, stacks, qtype, inputs.trace_layer, inputs.read["gptq_damp"], inputs.min_tokens,
            _teacher_gate_up(inputs),
        )  # fmt: skip
        report = {"gptq_fallback": {name: dict(fallback) for name in inputs.group.tensors}}
        return cls._stacks(inputs, raws), report


class IQ2GridGptq(GGMLStored, types=("iq2_xxs", "iq2_xs"), quantizer=Quantizer.GPTQ):
    """Column-wise error feedback on ggml's IQ2 grids (8-weight grid rows with their signs)."""

    knobs: ClassVar[Mapping[Group, tuple[str, ...]]] = {
        Group.GU: _GPTQ_KNOBS,
        Group.D: (*_GPTQ_KNOBS, "down_input"),
    }
    inert: ClassVar[Mapping[str, Any]] = {"down_input": DownInput.TEACHER}

    @classmethod
    def reads_gate_up(cls, read: Mapping[str, Any], group: Group) -> bool:
        return read.get("down_input") == DownInput.STUDENT

    @classmethod
    def quantize(cls, inputs: GroupInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
        from healsweep.quant import ggml_gptq  # lazy: jax is heavy (knobs read this module)

        rows = expert_importance(inputs.trace_layer, inputs.min_tokens)
        importance = rows[f"ffn_{inputs.group.tensors[0]}_exps.weight"]  # gate's = up's
        student = None
        if cls.reads_gate_up(inputs.read, inputs.group):
            student = tuple(np.asarray(s.dequantize(), np.float32) for s in inputs.gate_up.stacks)
        counts = np.asarray(inputs.trace("counts"))
        enough = np.nonzero(counts >= inputs.min_tokens)[0]
        raws, fed = ggml_gptq.quantize_experts_ef(
            inputs.stacks(),
            inputs.stored_as,
            np.asarray(inputs.trace("x"), np.float32),
            np.asarray(inputs.trace("ids")),
            enough,
            inputs.read["gptq_damp"],
            importance,
            _teacher_gate_up(inputs),
            method="column",
            student_gate_up=student,
        )
        fallback = {
            "few_tokens": int(len(counts) - len(enough)),
            "not_factored": int(len(enough) - fed.sum()),
        }
        report = {"gptq_fallback": {name: dict(fallback) for name in inputs.group.tensors}}
        return cls._stacks(inputs, raws), report


class IQ1GridGptq(IQ2GridGptq, types=("iq1_s", "iq1_m"), quantizer=Quantizer.GPTQ):
    """Column-wise error feedback on ggml's IQ1 grids (8-weight grid rows and their ``δ``
    shift, :mod:`healsweep.quant.ggml_iq1grid`): the knobs, inputs and fallbacks of
    :class:`IQ2GridGptq`, whose ``quantize`` serves any grid of ``ggml_gptq.COLUMN_GRIDS``."""


class IQ3GridGptq(IQ2GridGptq, types=("iq3_xxs", "iq3_s"), quantizer=Quantizer.GPTQ):
    """Column-wise error feedback on ggml's IQ3 grids (4-weight grid rows with their signs,
    :mod:`healsweep.quant.ggml_iq3grid`): the knobs, inputs and fallbacks of :class:`IQ2GridGptq`."""


class IQ4GridGptq(IQ2GridGptq, types=("iq4_xs",), quantizer=Quantizer.GPTQ):
    """Column-wise error feedback on IQ4_XS's non-linear grid (each weight's code on ggml's
    6-bit scales, :mod:`healsweep.quant.ggml_iq4grid`): the knobs, inputs and fallbacks of
    :class:`IQ2GridGptq`."""
class KGridColumnGptq(IQ2GridGptq, types=("q4_k", "q5_k"), quantizer=Quantizer.GPTQ):
    """Column-wise error feedback on ggml's Q4_K / Q5_K grids (``d·sc·q − dmin·m``, one scale
    and min per 32 weights, :class:`healsweep.quant.ggml_kgrid.KGrid`): the knobs, inputs and
    fallbacks of :class:`IQ2GridGptq`. Per 256-column chunk ggml picks the scales for the
    error-updated weights and each column's codes are then chosen on them; on these types this
    beats keeping ggml's whole-row grid as :class:`KGridGptq` does (``docs/sizing.md``)."""
