"""Q2_0 (ggml type 42) through healsweep's own quantizers: ``search``, ``gptq``, ``plain``.

Stored as packed ``Q2Packed`` stacks (fp16 ``d`` ``[E, out, in/64]``, four 2-bit codes a byte
``[E, out, in/4]``, ggml's order), decoded in the graph; Part A's alpha multiplies ``d`` (rounded
to fp16 from float32, as it always has been).

* :class:`Q2Search`: the codec's importance-weighted signed-scale search with a norm-inflation
  gain (:func:`healsweep.kernels.q2_0.quantize_matrix`); reads ``importance`` and ``gain_gu``
  (gate/up) or ``importance_down`` and ``gain_d`` (down), and the trace only for ``act``.
* :class:`Q2Gptq`: error feedback over each expert's input second moment
  (:mod:`healsweep.quant.gptq`), the search for experts with too few routed tokens or an ``H``
  that does not factor; reads the search's knobs and ``gptq_damp``, ``gptq_refine``.
* :class:`Q2Plain`: round-to-nearest, ``d = amax/2`` (:mod:`healsweep.kernels.q2_0_plain`);
  reads no knob but its own name and no trace (the ``plain`` reference row).

Their keys do not name the type: Q2_0's keys predate the type knobs, and each quantizer has its
own key stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from healsweep import kernels  # a lazy face: jax is imported where a kernel runs
from healsweep.quant import importance as imp
from healsweep.quant._base import Arrays, GroupInputs, GroupQuantizer
from healsweep.quant.values import Q2_0, Group, Importance, ImportanceDown, Quantizer

# Per group: the knob of its importance and of its gain.
_IMPORTANCE = {Group.GU: "importance", Group.D: "importance_down"}
_GAIN = {Group.GU: "gain_gu", Group.D: "gain_d"}
_ACT = {Group.GU: Importance.ACT, Group.D: ImportanceDown.ACT}


class Q2Stored(GroupQuantizer):
    """The Q2_0 storage of a group: packed ``Q2Packed`` stacks."""

    @classmethod
    def to_arrays(cls, stacks: tuple[Any, ...]) -> tuple[Arrays, dict[str, Any]]:
        arrays: Arrays = {}
        for n, stack in enumerate(stacks):
            arrays[f"{n}.d"] = np.asarray(stack.d, np.float16)
            arrays[f"{n}.codes"] = np.asarray(stack.codes, np.uint8)
        return arrays, {}

    @classmethod
    def from_arrays(cls, arrays: Arrays, meta: Mapping[str, Any], count: int) -> tuple[Any, ...]:
        """Packed ``Q2Packed`` pytrees: unpacking 3 x 173M codes per layer on the host cost a
        warm trial seconds a layer."""
        return tuple(
            kernels.q2_0.Q2Packed(arrays[f"{n}.d"], arrays[f"{n}.codes"]) for n in range(count)
        )


class Q2Search(Q2Stored, types=(Q2_0,), quantizer=Quantizer.SEARCH):
    """The codec's importance-weighted signed-scale search (the knob default)."""

    key_stage: ClassVar[str] = "quantize"
    knobs: ClassVar[Mapping[Group, tuple[str, ...]]] = {
        Group.GU: ("importance", "gain_gu"),
        Group.D: ("importance_down", "gain_d"),
    }

    @classmethod
    def reads_trace(cls, read: Mapping[str, Any], group: Group) -> bool:
        return read.get(_IMPORTANCE[group]) == _ACT[group]

    @classmethod
    def quantize(cls, inputs: GroupInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
        importance = _importance(inputs)
        gain = inputs.read[_GAIN[inputs.group]]
        return tuple(_search_experts(w, importance, gain) for w in inputs.stacks()), {}


class Q2Gptq(Q2Stored, types=(Q2_0,), quantizer=Quantizer.GPTQ):
    """GPTQ over each expert's ``H_e``; the search for the experts it leaves."""

    key_stage: ClassVar[str] = "quantize_gptq"
    knobs: ClassVar[Mapping[Group, tuple[str, ...]]] = {
        group: (*Q2Search.knobs[group], "quantizer", "gptq_damp", "gptq_refine") for group in Group
    }
    inert: ClassVar[Mapping[str, Any]] = {"gptq_refine": 0}  # keys of plain gptq as before it

    @classmethod
    def quantize(cls, inputs: GroupInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
        importance = _importance(inputs)  # for the experts that fall back to the search
        gain = inputs.read[_GAIN[inputs.group]]
        found = _gptq_experts(inputs, gain)  # first: the search runs only where it is needed
        stacks = tuple(
            _search_experts(w, importance, gain, d, codes, rest)
            for w, (d, codes, rest, _) in zip(inputs.stacks(), found, strict=True)
        )
        fallback = {
            name: counts for name, (*_, counts) in zip(inputs.group.tensors, found, strict=True)
        }
        return stacks, {"gptq_fallback": fallback}


class Q2Plain(Q2Stored, types=(Q2_0,), quantizer=Quantizer.PLAIN):
    """Round-to-nearest under ``d = amax/2``: ordinary Q2_0, the ``plain`` reference row."""

    key_stage: ClassVar[str] = "quantize_plain"
    knobs: ClassVar[Mapping[Group, tuple[str, ...]]] = {group: ("quantizer",) for group in Group}

    @classmethod
    def reads_trace(cls, read: Mapping[str, Any], group: Group) -> bool:
        return False

    @classmethod
    def quantize(cls, inputs: GroupInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
        q2_0 = kernels.q2_0
        stacks = []
        for w in inputs.stacks():  # [E, out, in]
            d, q = kernels.q2_0_plain.quantize(w)
            stacks.append(q2_0.Q2Packed(np.asarray(d, np.float16), np.asarray(q2_0.pack_codes(q))))
        return tuple(stacks), {}


def _importance(inputs: GroupInputs) -> np.ndarray | None:
    """The search's importance of the group's input channels (its knob, the trace for ``act``)."""
    kind = inputs.read[_IMPORTANCE[inputs.group]]
    if inputs.group is Group.GU:
        return imp.gate_up_importance(
            kind,
            inputs.weights["ffn_norm.weight"],
            inputs.trace("x_sq_sums"),
            inputs.trace("counts"),
            inputs.min_tokens,
        )
    return imp.down_importance(
        kind, inputs.trace("h_sq_sums"), inputs.trace("counts"), inputs.min_tokens
    )


def _search_experts(w, importance, gain, d=None, codes=None, rest=None) -> Any:
    """The codec's search (:func:`q2_0.quantize_matrix`) of ``w`` [E, out, in] as a
    ``Q2Packed``: of every expert, or with ``rest`` (expert indices) of those only, the others
    taken from ``d``, ``codes`` (GPTQ's)."""
    q2_0 = kernels.q2_0
    if rest is None:
        q2 = q2_0.quantize_matrix(w, importance, gain, packed=True)
        return q2_0.Q2Packed(np.asarray(q2.d, np.float16), np.asarray(q2.codes))
    if len(rest):
        per_expert = importance is not None and np.ndim(importance) == 2
        q2 = q2_0.quantize_matrix(
            w[rest], importance[rest] if per_expert else importance, gain, packed=True
        )
        d[rest] = np.asarray(q2.d, np.float16)
        codes[rest] = np.asarray(q2.codes)
    return q2_0.Q2Packed(d, codes)


def _gptq_experts(inputs: GroupInputs, gain: float) -> list[tuple[Any, ...]]:
    """GPTQ of the group's stacks (all reading one input) for every expert with enough routed
    tokens. Returns per stack ``(d, codes, rest, fallback)``: the packed arrays with the GPTQ
    experts filled, the indices of the experts left to the search (too few tokens, or an ``H``
    that did not factor), and the fallback counts."""
    from healsweep.quant import gptq  # lazy: jax is heavy (knobs read this module)

    weights, read = inputs.weights, inputs.read
    counts = np.asarray(inputs.trace("counts"))
    enough = np.nonzero(counts >= inputs.min_tokens)[0]
    down = inputs.group is Group.D  # its input h comes from the teacher's gate and up
    gate_up = (weights["ffn_gate_exps.weight"], weights["ffn_up_exps.weight"]) if down else None
    stacks = inputs.stacks()
    found, ok = gptq.quantize_experts(
        stacks,
        inputs.trace("x"),
        inputs.trace("ids"),
        enough,
        gain,
        read["gptq_damp"],
        gate_up,
        read.get("gptq_refine", Q2Gptq.inert["gptq_refine"]),
    )
    done = enough[ok]
    fallback = {"few_tokens": int(len(counts) - len(enough)), "not_factored": int((~ok).sum())}
    out = []
    for w, (d_g, q_g) in zip(stacks, found, strict=True):
        n_expert, n_out, n_in = w.shape
        d = np.zeros((n_expert, n_out, n_in // 64), np.float16)
        codes = np.zeros((n_expert, n_out, n_in // 4), np.uint8)
        d[done] = d_g[ok]
        codes[done] = np.asarray(kernels.q2_0.pack_codes(q_g[ok]))
        out.append((d, codes, np.setdiff1d(np.arange(n_expert), done), dict(fallback)))
    return out
