"""Stage ``student_trace``: the calibration trace as the student's own retyped layers see it.

A config that stores attention, the shared expert, the leading dense layers or the token
embeddings in another type (knobs ``type_attn``, ``type_shexp``, ``type_dense``, ``type_embd``:
:mod:`healsweep.heal.tensor_types`) changes what reaches every MoE layer after them. The
teacher's trace (:mod:`healsweep.heal.trace`) records the MoE inputs the teacher's own layers
produce; this stage records them as the student produces them, so that Part A and Part B fit the
experts on the inputs they will see. ``type_output`` alone changes nothing upstream of a MoE
layer and keeps the teacher's trace (as does a config that retypes nothing: its keys and results
are the teacher trace's, as before this stage).

The traced model is the teacher with the retyped tensors as the student stores them (the
``requant_tensor`` entries, Part B's ``ffn_down_shexp`` before its healing included) and the
teacher's routed experts: the routed experts' quantization is what each layer heals, and a trace
through quantized experts would depend on every routed knob (one trace per trial, not one per
retyping). Per MoE layer it keeps what the teacher's trace keeps, over the same calibration
chunks in the same order (:func:`healsweep.heal.trace.run_trace`, layer-major, one layer's
captures held at a time), and:

* ``x``, ``ids``, ``weights``, ``gate``: the student's FFN input, its routing and its shared
  expert's gate at that input;
* ``y_ref``: the teacher's routed experts on that input with that routing. Part A's mse alpha
  then minimises ``|y_ref - alpha·y_q|²`` over the student's inputs (y_q: the quantized experts
  on the same inputs and routing), i.e. the quantization error of the routed experts where they
  run, and Part B fits ``dY = y_ref - alpha·y_q`` (plus ``shexp_gap``) on the student's Z'. The
  target is the teacher's MoE at the student's input, not at the teacher's: the difference
  between the two is the upstream layers' error, which neither a scale on the experts nor the
  shared expert's down projection sees the cause of, and a fit against it shrinks alpha by the
  correlation that error removes;
* ``shexp_gap`` (only where the shared expert's gate or up is retyped): ``gate·(z_T − z_S)·Wᵀ``
  [T, D], z the SwiGLU hidden state of the teacher's and of the student's gate/up at ``x``, W the
  teacher's down. Part B's design Z' is then the student's (its gate/up as stored, handed with
  each layer as ``shexp_weights``), and its target gains this term: the healed down W + dW
  minimises ``|y_ref + gate·z_T·Wᵀ − alpha·y_q − gate·z_S·(W + dW)ᵀ|²``, the teacher's routed and
  shared output at the student's input against the student's.

The key: the teacher trace's key (model, calibration, documents), the ``requant_tensor`` key of
every retyped tensor upstream of a MoE layer (its type and importance), and this module's code.
Configs that retype alike share it, whatever their routed knobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from gguf import MODEL_TENSOR

from healsweep._code import code_digest
from healsweep.cache import StageCache, content_key
from healsweep.data.chat_template import model_chat_format
from healsweep.data.corpus import load_corpus
from healsweep.gguf_io import HEAD, split_block, tensor_name
from healsweep.heal import ridge, tensor_types
from healsweep.heal.knobs import CalibrationConfig
from healsweep.heal.streamed import LayerMap
from healsweep.heal.trace import (
    Trace,
    budgeted,
    calibration_documents,
    layer_key,
    make_chunks,
    run_trace,
)
from healsweep.heal.trace import _report as trace_report
from healsweep.kernels._precision import healing_jit, matmul
from healsweep.model import LayerReplacement
from healsweep.model.forward import dense_on_device
from healsweep.stage_names import VERSIONS, Stage

if TYPE_CHECKING:
    from healsweep.data.corpus import Corpus
    from healsweep.gguf_io import GGUFModel

STAGE = Stage.STUDENT_TRACE
LAYER_STAGE = Stage.STUDENT_TRACE_LAYER
VERSION = VERSIONS[STAGE]
CODE_ROOTS = ("healsweep.heal.student_trace",)
UPSTREAM = frozenset({"attn", "shexp", "dense", "embd"})  # groups that reach a MoE layer's input
_SHEXP_IN = (MODEL_TENSOR.FFN_GATE_SHEXP, MODEL_TENSOR.FFN_UP_SHEXP)
Weight = Callable[[str], Any]  # a retyped tensor's name -> its weight as the forward takes it


def upstream(model: GGUFModel, retype: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of ``retype`` (name → type) upstream of some MoE layer's input."""
    n_dense = model.hparams.n_leading_dense
    return {
        name: chosen
        for name, chosen in retype.items()
        if tensor_types.tensor_group(name, len(model.tensor_shape(name)), n_dense) in UPSTREAM
    }


def student_trace_key(teacher_key: str, tensors: Mapping[str, str]) -> str:
    """Key of the student's trace: the teacher trace's key, each upstream retyped tensor's
    ``requant_tensor`` key (``tensors``: name → key) and this stage's code."""
    inputs = {"teacher": teacher_key, "tensors": dict(sorted(tensors.items()))}
    return content_key(STAGE, VERSION, {**inputs, "code": code_digest(CODE_ROOTS)})


def student_layers(tensors: Mapping[str, str], weight: Weight) -> Mapping[int, LayerReplacement]:
    """The forward's replacements of the retyped tensors, each layer's read when asked for (at
    :data:`~healsweep.gguf_io.HEAD`: the token embeddings)."""
    by_layer: dict[int, list[str]] = {}
    for name in tensors:
        index, _ = split_block(name)
        by_layer.setdefault(HEAD if index is None else index, []).append(name)

    def load(i: int) -> LayerReplacement:
        named = {(n if i == HEAD else split_block(n)[1]): weight(n) for n in by_layer[i]}
        return LayerReplacement(tensors=named)

    return LayerMap(by_layer, load)


@jax.jit
def _dense(weight: Any) -> jax.Array:
    return weight.dequantize()


def student_shexp(
    model: GGUFModel, tensors: Mapping[str, str], weight: Weight, layer: int
) -> tuple[jax.Array, jax.Array] | None:
    """Layer ``layer``'s shared-expert gate and up [Fs, D] as the student stores them (float32
    device arrays), None where neither is retyped."""
    names = [tensor_name(kind, layer) for kind in _SHEXP_IN]
    if not any(name in tensors for name in names):
        return None
    return tuple(
        _dense(weight(name)) if name in tensors else dense_on_device(model, name) for name in names
    )


@healing_jit
def _gap_rows(z_teacher, z_student, down):
    return matmul(z_teacher - z_student, down.T)  # [n, D]


def shexp_gap(
    model: GGUFModel, layer: int, arrays: Mapping[str, np.ndarray], student: tuple[Any, Any]
) -> np.ndarray:
    """``gate·(z_T − z_S)·Wᵀ`` [T, D] float32 over the layer's traced tokens, computed as Part
    B computes Z' (from the stored x, :data:`healsweep.heal.ridge.CHUNK` tokens at a time)."""
    x, gate = arrays["x"], arrays["gate"]
    teacher = ridge.shexp_weights(model, layer)
    down = dense_on_device(model, tensor_name(MODEL_TENSOR.FFN_DOWN_SHEXP, layer))  # [D, Fs]
    out = np.empty((x.shape[0], down.shape[0]), np.float32)
    for a in range(0, x.shape[0], ridge.CHUNK):
        b = min(a + ridge.CHUNK, x.shape[0])
        z_t = ridge.gated_design(x, gate, teacher, a, b)
        z_s = ridge.gated_design(x, gate, student, a, b)
        out[a:b] = np.asarray(_gap_rows(z_t, z_s, down))
    return out


def student_trace(
    model: GGUFModel,
    calibration: CalibrationConfig,
    cache: StageCache,
    teacher: Trace,
    tensors: Mapping[str, str],
    weight: Weight,
    corpus: Corpus | None = None,
) -> Trace:
    """The cached trace of the student whose upstream retyped tensors are ``tensors`` (name →
    ``requant_tensor`` key; ``weight(name)`` the tensor as the forward takes it), over the
    calibration chunks of ``teacher``; computed once per key, layer-major like the teacher's."""
    calibration = budgeted(model, calibration)
    key = student_trace_key(teacher.key, tensors)
    for i in model.hparams.moe_layers:  # read later, one by one: held from now
        cache.hold(LAYER_STAGE, layer_key(key, i))
    shexp = partial(student_shexp, model, tensors, weight)

    def compute() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        start = time.perf_counter()
        pool = corpus if corpus is not None else load_corpus(calibration.corpus)
        docs = calibration_documents(pool, calibration)
        chunks, info = make_chunks(docs, model.tokenizer(), calibration, model_chat_format(model))

        def store(i: int, arrays: dict[str, np.ndarray]) -> None:
            student = shexp(i)
            if student is not None:
                arrays["shexp_gap"] = shexp_gap(model, i, arrays, student)
            seconds = time.perf_counter() - start
            cache.put(LAYER_STAGE, layer_key(key, i), arrays, seconds=seconds)

        counts = run_trace(model, chunks, store, replacements=student_layers(tensors, weight))
        report = trace_report(chunks, info, counts, calibration)
        report["retyped"] = sorted(tensors)
        return {"tokens_per_expert": counts}, report

    def recompute() -> None:
        arrays, meta = compute()
        cache.put(STAGE, key, arrays, meta)
        cache.computed[STAGE] += 1

    arrays, meta = cache.get_or_compute(STAGE, key, compute)
    return Trace(key, meta, arrays["tokens_per_expert"], cache, recompute, LAYER_STAGE, shexp)
