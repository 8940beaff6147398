"""The stages of a trial, by name: the one vocabulary of the stage cache, the timings and the keys.

:class:`Stage` lists every cached stage. :data:`VERSIONS` is the entry format number of each stage
whose key :func:`healsweep.heal.stages.stage_key` (or the trace) builds: a key's code digest
already changes with any edit to the code the stage can run, so a code change needs no bump; bump
one to drop a stage's entries for a reason outside healsweep's source (say, a dependency release
that changes its numerics). The teacher cache keeps the versions of its two formats itself
(:mod:`healsweep.score.teacher_cache`). Light on purpose: every stage digest imports it, and it
sits beside the cache, below the heal and score layers that both name stages.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """A cached stage, in the order a trial runs them."""

    CALIB_TRACE = "calib_trace"  # the teacher's pass over the calibration pool
    CALIB_TRACE_LAYER = "calib_trace_layer"  # one layer of it
    STUDENT_TRACE = "student_trace"  # the same pass with the retyped attention, shexp, ...
    STUDENT_TRACE_LAYER = "student_trace_layer"  # one layer of it
    QUANTIZE = "quantize"  # a group in its type; each entry's key names its class's key stage:
    QUANTIZE_GPTQ = "quantize_gptq"
    QUANTIZE_PLAIN = "quantize_plain"
    QUANTIZE_GGML = "quantize_ggml"
    ROUTED_Q = "routed_q"
    PART_A = "part_a"
    RESIDUALS = "residuals"
    RIDGE_BASIS = "ridge_basis"
    RIDGE_RHS = "ridge_rhs"
    RIDGE_FIT = "ridge_fit"
    RIDGE_HELDOUT = "ridge_heldout"
    PART_B = "part_b"
    TENSOR_IMPORTANCE = "tensor_importance"  # input E[x²] of every other matrix (imatrix)
    REQUANT_TENSOR = "requant_tensor"  # a tensor of another group in the type of its knob
    TEACHER_LOGITS = "teacher_logits"  # score: the teacher's record of a window


VERSIONS: dict[Stage, int] = {
    Stage.CALIB_TRACE: 3,
    Stage.CALIB_TRACE_LAYER: 3,
    Stage.STUDENT_TRACE: 1,
    Stage.STUDENT_TRACE_LAYER: 1,
    Stage.QUANTIZE: 2,  # 2: one entry per tensor group (gate+up, down) instead of per layer
    Stage.QUANTIZE_GPTQ: 3,
    Stage.QUANTIZE_PLAIN: 2,
    Stage.QUANTIZE_GGML: 1,
    Stage.ROUTED_Q: 1,
    Stage.PART_A: 1,
    Stage.RESIDUALS: 1,
    Stage.RIDGE_BASIS: 1,
    Stage.RIDGE_RHS: 1,
    Stage.RIDGE_FIT: 4,
    Stage.RIDGE_HELDOUT: 1,
    Stage.PART_B: 4,  # 4: the requantized bytes alone (the dense values are decoded when read)
    Stage.TENSOR_IMPORTANCE: 1,
    Stage.REQUANT_TENSOR: 1,
}
# The stages whose knob reads make up a student's key (heal.reads.student_key), as recorded in
# sweeps: the list is part of every student key, so it stays as it was.
STUDENT_STAGES = (
    Stage.CALIB_TRACE,
    Stage.QUANTIZE,
    Stage.ROUTED_Q,
    Stage.PART_A,
    Stage.RIDGE_BASIS,
    Stage.RIDGE_FIT,
    Stage.PART_B,
)
