"""Stage ``quantize``: one layer's routed experts of one tensor group, in one storage type.

A layer's routed experts come in two tensor groups, each with its own storage type (knobs
``type_gu``, ``type_d``, ``up_first``/``up_last``, ``layer_types``; :meth:`Knobs.expert_types`):
``gu`` (gate and up, which read the same input, so one importance row and one GPTQ ``H_e``
serve both) and ``d`` (down). Each (layer, group, type) is its own cache entry, so a trial that
changes one group's type, or only a knob that one group reads (``gain_d``), re-quantizes that
group alone.

* ``q2_0``: healsweep's own quantizers (knob ``quantizer``): ``search`` (the codec's
  importance-weighted signed-scale search with a norm-inflation gain), ``gptq`` (error feedback
  over each expert's input second moment, :mod:`healsweep.heal.gptq`) or ``plain``
  (round-to-nearest, ``d = amax/2``, no knob). Keyed by the trace only when the group's
  importance is ``act`` or the quantizer is ``gptq``. Stored as :class:`Q2Packed`.
* every other type: ggml's own quantizer (:func:`healsweep.heal.llama_baseline.
  quantize_expert_stack`) with one importance row per expert from the calibration trace (E[x²]
  of its routed tokens for gate/up, E[h²] of its hidden activation for down), exactly as
  ``healsweep baseline llama --imatrix-from-calibration`` does; no knob is read. Stored as the
  type's rows, :class:`GGMLWeight` (decoded in the graph). ``quantizer: gptq`` (with
  ``gptq_damp``) adds error feedback over each expert's ``H_e`` on the types whose grid allows
  it: Q2_K/Q3_K re-choose ggml's codes on its grid (:mod:`healsweep.heal.kgrid`); IQ2_XXS/IQ2_XS
  are quantized by :func:`healsweep.heal.ggml_gptq.quantize_experts_ef` (``method="column"``:
  ggml picks each 256-chunk's scales for the error-updated weights, then each 8-weight group
  is chosen on that grid under the chunk's conditional metric, its error fed forward). Experts
  with too few routed tokens, or whose ``H_e`` does not factor, keep plain ggml.

Part A's alpha reaches any type through its fp16 block scales (:func:`scaled`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from healsweep.cache import StageCache
from healsweep.errors import CacheError, GGUFFormatError
from healsweep.heal import importance as imp
from healsweep.heal.knobs import GROUPS, IQ2_GRID_TYPES, Q2_0, CalibrationConfig, Knobs, LayerTypes
from healsweep.heal.stages import Arrays, ExpertStacks, stage_key
from healsweep.kernels.ggml_types import ggml_type

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel

GROUP_TENSORS = {"gu": ("gate", "up"), "d": ("down",)}
_Q2_STAGES = {"search": "quantize", "gptq": "quantize_gptq", "plain": "quantize_plain"}


class QuantizedGroup(NamedTuple):
    """``quantize``: the stacks ``[E, out, in]`` of one tensor group (gate and up, or down) in
    ``type_name``, and the stage's report (``gptq``: experts that fell back to ``search``)."""

    stacks: tuple[Any, ...]  # Q2Packed (q2_0) or GGMLWeight (a ggml type), one per tensor
    type_name: str
    report: dict[str, Any]

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        arrays: Arrays = {}
        for n, stack in enumerate(self.stacks):
            if self.type_name == Q2_0:
                arrays[f"{n}.d"] = np.asarray(stack.d, np.float16)
                arrays[f"{n}.codes"] = np.asarray(stack.codes, np.uint8)
            else:
                arrays[f"{n}.raw"] = np.asarray(stack.raw, np.uint8)
        meta = {"type": self.type_name, "tensors": len(self.stacks), "report": self.report}
        if self.type_name != Q2_0:
            meta["n_in"] = self.stacks[0].n_in
        return arrays, meta

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> QuantizedGroup:
        """Q2_0 as packed ``Q2Packed`` pytrees (unpacking 3 x 173M codes per layer on the host
        cost a warm trial seconds a layer), any other type as its stored rows."""
        from healsweep.kernels.ggml_decode import GGMLWeight
        from healsweep.kernels.q2_0 import Q2Packed

        name, count = meta["type"], meta["tensors"]
        if name == Q2_0:
            stacks = tuple(Q2Packed(arrays[f"{n}.d"], arrays[f"{n}.codes"]) for n in range(count))
        else:
            qtype = ggml_type(name).ggml_id
            stacks = tuple(
                GGMLWeight(arrays[f"{n}.raw"], qtype, meta["n_in"]) for n in range(count)
            )
        return cls(stacks, name, meta["report"])


def layer_experts(gate_up: QuantizedGroup, down: QuantizedGroup) -> ExpertStacks:
    """A layer's three routed stacks from its two groups."""
    return ExpertStacks(*gate_up.stacks, *down.stacks)


def layer_keys(model: GGUFModel, knobs: Knobs, trace_key: str | None, layer: int) -> dict[str, str]:
    """``{group: quantize key}`` of ``layer`` under ``knobs`` (the layer's two entries)."""
    types = expert_types(model, knobs)[layer]
    keys: dict[str, str] = {}
    for g in GROUPS:  # gate/up first: a down quantized from the student's h names its key
        keys[g] = quantize_key(model, knobs, trace_key, layer, g, types.of(g), keys.get("gu"))
    return keys


def cached_experts(cache: StageCache, keys: dict[str, str]) -> ExpertStacks:
    """A layer's routed stacks from its quantize entries ``keys`` (:func:`layer_keys`);
    :class:`~healsweep.errors.CacheError` when one is not in ``cache``."""
    found = {}
    for group, key in keys.items():
        entry = cache.get("quantize", key)
        if entry is None:
            raise CacheError(f"quantize entry {key[:16]} ({group}) is not in {cache.root}")
        found[group] = QuantizedGroup.from_entry(*entry)
    return layer_experts(found["gu"], found["d"])


def reads_trace(knobs: Knobs, group: str, stored_as: str) -> bool:
    """Whether quantizing ``group`` as ``stored_as`` reads the calibration trace: a ggml type
    always (its importance rows), ``q2_0`` for ``act`` importance or ``gptq``."""
    return stored_as != Q2_0 or knobs.uses_activation_statistics(group)


def quantize_key(
    model: GGUFModel,
    knobs: Knobs,
    trace_key: str | None,
    layer: int,
    group: str,
    stored_as: str,
    gate_up_key: str | None = None,
) -> str:
    """Key of ``group`` of ``layer`` stored as ``stored_as``: the model, the knobs that group
    reads in that type (``Knobs.for_stage``), and the trace where it reads one; for a down
    quantized from the quantized gate and up (:func:`reads_gate_up`), their key
    ``gate_up_key`` too. Each quantizer's entries have their own stage name and code
    (``quantize``, ``quantize_gptq``, ``quantize_plain``, ``quantize_ggml``)."""
    stage = _Q2_STAGES[knobs.quantizer] if stored_as == Q2_0 else "quantize_ggml"
    parts = {
        "model": model.fingerprint,
        "knobs": knobs.for_stage("quantize", group=group, stored_as=stored_as),
        "trace": trace_key if reads_trace(knobs, group, stored_as) else None,
        "layer": layer,
        "group": group,
    }
    if reads_gate_up(knobs, group, stored_as):
        parts["gate_up"] = gate_up_key
    return stage_key(stage, parts)


def reads_gate_up(knobs: Knobs, group: str, stored_as: str) -> bool:
    """Whether ``group`` stored as ``stored_as`` is quantized from the layer's quantized gate
    and up (``down_input: student``), so their quantization comes first and is in its key."""
    return knobs.for_stage("quantize", group=group, stored_as=stored_as).get("down_input") == (
        "student"
    )


def expert_types(model: GGUFModel, knobs: Knobs) -> dict[int, LayerTypes]:
    """The storage types of each MoE layer's two tensor groups under ``knobs``."""
    return knobs.expert_types(model.hparams.moe_layers, model.hparams.n_layer)


def check_quantizable(model: GGUFModel, knobs: Knobs | None = None) -> None:
    """Raise :class:`GGUFFormatError` unless every routed expert's rows fill whole blocks of the
    type chosen for them (without ``knobs``: Q2_0's blocks of 64): gate/up rows hold
    ``n_embd`` values, down rows ``n_ff_exp``; a ``layer_types`` entry that names no MoE layer
    raises :class:`~healsweep.errors.KnobError`. Called before any teacher pass, so that such a
    model fails in seconds, naming its file."""
    hp = model.hparams
    types = expert_types(model, knobs) if knobs is not None else {}
    widths = {"gu": hp.n_embd, "d": hp.n_ff_exp}
    for layer in hp.moe_layers:
        chosen = types.get(layer, LayerTypes(Q2_0, Q2_0))
        for group in GROUPS:
            found = ggml_type(chosen.of(group))
            if widths[group] % found.block_weights == 0:
                continue
            named = "/".join(f"ffn_{n}_exps" for n in GROUP_TENSORS[group])
            if found.name == Q2_0:
                raise GGUFFormatError(
                    f"{model.path}: the rows of {named} hold {widths[group]} values, not a "
                    "multiple of the Q2_0 block of 64; this model's routed experts cannot be "
                    "quantized to Q2_0"
                )
            raise GGUFFormatError(
                f"{model.path}: the rows of blk.{layer}.{named} hold {widths[group]} values, not "
                f"a multiple of the {found.name.upper()} block of {found.block_weights}; they "
                f"cannot be stored as {found.name} (choose a type whose block divides "
                f"{widths[group]}: q2_0 has blocks of 64, iq4_nl of 32)"
            )


def quantize_group(
    weights: dict[str, Any],
    knobs: Knobs,
    trace_layer: dict[str, np.ndarray] | None,
    calibration: CalibrationConfig,
    group: str,
    stored_as: str,
    gate_up: QuantizedGroup | None = None,
) -> QuantizedGroup:
    """``group``'s routed stacks of one layer in ``stored_as``; ``weights`` from
    :func:`healsweep.heal.stages.expert_weights`, ``trace_layer`` where :func:`reads_trace`,
    ``gate_up`` (the layer's quantized gate and up) where :func:`reads_gate_up`."""
    if reads_gate_up(knobs, group, stored_as) and gate_up is None:
        raise ValueError("down_input: student needs the layer's quantized gate and up")
    if stored_as != Q2_0:
        return _ggml_group(weights, knobs, trace_layer, calibration, group, stored_as, gate_up)
    if knobs.quantizer == "plain":
        return QuantizedGroup(_plain(weights, group), Q2_0, {})
    min_tokens = calibration.min_tokens_per_expert
    get = (lambda k: trace_layer[k]) if trace_layer is not None else (lambda k: None)
    if group == "gu":
        importance = imp.gate_up_importance(
            knobs, weights["ffn_norm.weight"], get("x_sq_sums"), get("counts"), min_tokens
        )
        gain = knobs.gain_gu
    else:
        importance = imp.down_importance(knobs, get("h_sq_sums"), get("counts"), min_tokens)
        gain = knobs.gain_d
    names = GROUP_TENSORS[group]
    found = {}  # per tensor, the GPTQ experts, and those gptq leaves to the search
    if knobs.quantizer == "gptq":  # first, so that the search runs only where it is needed
        found = _gptq_experts(names, weights, knobs, trace_layer, min_tokens)
    stacks = []
    for name in names:  # [E, out, in]; in checked by check_quantizable
        w = weights[f"ffn_{name}_exps.weight"]
        d, codes, rest, _ = found.get(name, (None, None, None, None))
        stacks.append(_search_experts(w, importance, gain, d, codes, rest))
    report = {name: fallback for name, (*_, fallback) in found.items()}
    return QuantizedGroup(tuple(stacks), Q2_0, {"gptq_fallback": report} if found else {})


def _search_experts(w, importance, gain, d=None, codes=None, rest=None) -> Any:
    """The codec's search (:func:`q2_0.quantize_matrix`) of ``w`` [E, out, in] as a
    ``Q2Packed``: of every expert, or with ``rest`` (expert indices) of those only, the others
    taken from ``d``, ``codes`` (GPTQ's)."""
    from healsweep.kernels import q2_0
    from healsweep.kernels.q2_0 import Q2Packed

    if rest is None:
        q2 = q2_0.quantize_matrix(w, importance, gain, packed=True)
        return Q2Packed(np.asarray(q2.d, np.float16), np.asarray(q2.codes))
    if len(rest):
        per_expert = importance is not None and np.ndim(importance) == 2
        q2 = q2_0.quantize_matrix(
            w[rest], importance[rest] if per_expert else importance, gain, packed=True
        )
        d[rest] = np.asarray(q2.d, np.float16)
        codes[rest] = np.asarray(q2.codes)
    return Q2Packed(d, codes)


def _plain(weights: dict[str, Any], group: str) -> tuple[Any, ...]:
    """``quantizer: plain`` (round-to-nearest, ``d = amax/2``, :mod:`healsweep.kernels.q2_0_plain`)
    of the group's stacks: ordinary Q2_0."""
    from healsweep.kernels import q2_0_plain
    from healsweep.kernels.q2_0 import Q2Packed, pack_codes

    stacks = []
    for name in GROUP_TENSORS[group]:
        d, q = q2_0_plain.quantize(weights[f"ffn_{name}_exps.weight"])  # [E, out, in]
        stacks.append(Q2Packed(np.asarray(d, np.float16), np.asarray(pack_codes(q))))
    return tuple(stacks)


def _gptq_experts(names, weights, knobs, trace_layer, min_tokens):
    """GPTQ of the tensors ``names`` (all reading one input) for every expert with enough
    routed tokens. Returns per tensor ``(d, codes, rest, fallback)``: the packed arrays with
    the GPTQ experts filled, the indices of the experts left to the search (too few tokens, or
    an ``H`` that did not factor), and the fallback counts."""
    from healsweep.heal import gptq
    from healsweep.kernels.q2_0 import pack_codes

    counts = np.asarray(trace_layer["counts"])
    enough = np.nonzero(counts >= min_tokens)[0]
    down = names == ("down",)  # its input h comes from the teacher's gate and up
    gate_up = (weights["ffn_gate_exps.weight"], weights["ffn_up_exps.weight"]) if down else None
    gain = knobs.gain_d if down else knobs.gain_gu
    found, ok = gptq.quantize_experts(
        [weights[f"ffn_{name}_exps.weight"] for name in names],
        trace_layer["x"],
        trace_layer["ids"],
        enough,
        gain,
        knobs.gptq_damp,
        gate_up,
        knobs.gptq_refine,
    )
    done = enough[ok]
    fallback = {"few_tokens": int(len(counts) - len(enough)), "not_factored": int((~ok).sum())}
    out = {}
    for name, (d_g, q_g) in zip(names, found, strict=True):
        n_expert, n_out, n_in = weights[f"ffn_{name}_exps.weight"].shape
        d = np.zeros((n_expert, n_out, n_in // 64), np.float16)
        codes = np.zeros((n_expert, n_out, n_in // 4), np.uint8)
        d[done] = d_g[ok]
        codes[done] = np.asarray(pack_codes(q_g[ok]))
        out[name] = (d, codes, np.setdiff1d(np.arange(n_expert), done), dict(fallback))
    return out


def _ggml_group(
    weights: dict[str, Any],
    knobs: Knobs,
    trace_layer: dict[str, np.ndarray],
    calibration: CalibrationConfig,
    group: str,
    stored_as: str,
    quantized_gate_up: QuantizedGroup | None = None,
) -> QuantizedGroup:
    """ggml's quantization of the group's stacks to ``stored_as`` with one importance row per
    expert from the trace, as ``baseline llama --imatrix-from-calibration`` makes it; under
    ``quantizer: gptq`` the codes on a Q2_K / Q3_K grid are then chosen again with error
    feedback (:mod:`healsweep.heal.kgrid`), and IQ2_XXS / IQ2_XS are quantized with column-wise
    error feedback (:mod:`healsweep.heal.ggml_gptq`) instead."""
    from healsweep.heal.llama_baseline import expert_importance, quantize_expert_stack
    from healsweep.kernels.ggml_decode import GGMLWeight

    qtype = ggml_type(stored_as).ggml_id
    rows = expert_importance(trace_layer, calibration.min_tokens_per_expert)
    names = GROUP_TENSORS[group]
    stacks = [weights[f"ffn_{n}_exps.weight"] for n in names]  # [E, out, in] each
    report: dict[str, Any] = {}
    gptq = knobs.for_stage("quantize", group=group, stored_as=stored_as).get("quantizer") == "gptq"
    down = group == "d"  # its input h comes from the teacher's gate and up
    gate_up = (weights["ffn_gate_exps.weight"], weights["ffn_up_exps.weight"]) if down else None
    if gptq and stored_as in IQ2_GRID_TYPES:
        importance = rows[f"ffn_{names[0]}_exps.weight"]  # gate's and up's are one row
        student = None
        if reads_gate_up(knobs, group, stored_as):
            student = tuple(
                np.asarray(s.dequantize(), np.float32) for s in quantized_gate_up.stacks
            )
        raws, fallback = _iq2_feedback(
            stacks, stored_as, trace_layer, importance, knobs, calibration, gate_up, student
        )
        report["gptq_fallback"] = {name: dict(fallback) for name in names}
        n_in = stacks[0].shape[-1]
        return QuantizedGroup(tuple(GGMLWeight(r, qtype, n_in) for r in raws), stored_as, report)
    raws = [
        quantize_expert_stack(w, qtype, rows[f"ffn_{n}_exps.weight"])
        for n, w in zip(names, stacks, strict=True)
    ]
    if gptq:
        from healsweep.heal import kgrid

        raws, fallback = kgrid.gptq_stacks(
            raws, stacks, qtype, trace_layer, knobs.gptq_damp, calibration.min_tokens_per_expert,
            gate_up,
        )  # fmt: skip
        report["gptq_fallback"] = {name: dict(fallback) for name in names}
    n_in = stacks[0].shape[-1]
    return QuantizedGroup(tuple(GGMLWeight(r, qtype, n_in) for r in raws), stored_as, report)


def _iq2_feedback(
    stacks, stored_as, trace_layer, importance, knobs, calibration, gate_up, student=None
):
    """The stacks (one input: gate and up, or down) in IQ2_XXS / IQ2_XS with column-wise error
    feedback (:mod:`healsweep.heal.ggml_gptq`, damped by ``gptq_damp``) for the experts with
    ``min_tokens_per_expert`` routed tokens; returns their ggml rows and the fallback counts
    (plain ggml with ``importance`` [E, in] for the rest)."""
    from healsweep.heal import ggml_gptq

    counts = np.asarray(trace_layer["counts"])
    enough = np.nonzero(counts >= calibration.min_tokens_per_expert)[0]
    raws, fed = ggml_gptq.quantize_experts_ef(
        stacks,
        stored_as,
        np.asarray(trace_layer["x"], np.float32),
        np.asarray(trace_layer["ids"]),
        enough,
        knobs.gptq_damp,
        importance,
        gate_up,
        method="column",
        student_gate_up=student,
    )
    fallback = {
        "few_tokens": int(len(counts) - len(enough)),
        "not_factored": int(len(enough) - fed.sum()),
    }
    return raws, fallback


def scaled(stack: Any, factor: float | np.ndarray) -> Any:
    """``stack`` with its fp16 block (or super-block) scales multiplied by ``factor``, a scalar
    or one per expert ``[E]``: decodes to ``factor`` times what ``stack`` decodes to, up to the
    fp16 rounding of each scale. Q2_0 rounds ``d · factor`` from float32 (as it always has),
    the ggml types through :func:`healsweep.gguf_io.fold_scale`."""
    factor = np.asarray(factor, np.float32)
    if factor.ndim == 0 and factor == 1.0:
        return stack
    if hasattr(stack, "scale_d"):  # Q2Packed / Q2Weight: d [E, out, in/64]
        return stack.scale_d(factor if factor.ndim == 0 else factor[:, None, None])
    from healsweep.gguf_io import fold_scale
    from healsweep.kernels.ggml_decode import GGMLWeight

    return GGMLWeight(
        fold_scale(np.asarray(stack.raw), stack.qtype, factor), stack.qtype, stack.n_in
    )
