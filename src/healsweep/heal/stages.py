"""The per-layer stages after the calibration trace: quantize, routed_q, part_a (Part B: ridge).

Each stage is a function of explicit inputs whose cache key is built from exactly those inputs
(DESIGN.md): the model fingerprint, the keys of the upstream entries it reads and the knobs of
``Knobs.for_stage``. Entries are per layer, so a stage loads and stores one layer at a time.

* ``quantize``: Q2_0 of the layer's routed gate/up/down experts (importance, gains; ``quantizer:
  plain`` is round-to-nearest with ``d = amax/2`` and reads no knob; ``quantizer:
  gptq`` adds error feedback over each expert's input second moment, :mod:`healsweep.heal.gptq`).
  Keyed by the trace only when an importance is ``act`` or the quantizer is ``gptq`` — a gain
  sweep of ``search`` never re-runs the teacher.
* ``routed_q``: the quantized experts' routed output on the trace's inputs and routing.
* ``part_a``: the layer's alpha (``none`` | ``gaussian`` | ``mse``) and the in-sample residuals.
* ``ridge_basis`` / ``ridge_fit`` / ``part_b``: the ridge on ``ffn_down_shexp`` and its
  requantization to the tensor's own type, in :mod:`healsweep.heal.ridge`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np

from healsweep._code import code_digest
from healsweep.cache import content_key
from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import block_prefix
from healsweep.heal import importance as imp
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.kernels import alpha as alpha_kernels

# Entry format numbers. A key's code digest already changes with any edit to the code the stage
# can run, so a code change needs no bump here; bump one to drop a stage's entries for a reason
# outside healsweep's source (say, a dependency release that changes its numerics).
VERSIONS = {
    "quantize": 1,
    "quantize_gptq": 2,
    "quantize_plain": 1,
    "routed_q": 1,
    "part_a": 1,
    "residuals": 1,
    "ridge_basis": 1,
    "ridge_rhs": 1,
    "ridge_fit": 4,
    "ridge_heldout": 1,
    "part_b": 3,
}
EXPERT_TENSORS = ("gate", "up", "down")
ROUTED_CHUNK = 2048  # tokens per routed-output call (padded), bounds memory and recompiles


# The code a stage runs is one of its inputs: a fix in the codec or the forward must not be
# served stale results from the cache. Every stage here is computed by functions and closures of
# heal.pipeline, and heal.evaluate computes quantize and routed_q entries with its own; their
# import closure (healsweep._code, read from the source) holds every module these stages run.
CODE_ROOTS = ("healsweep.heal.pipeline", "healsweep.heal.evaluate")


def stage_key(stage: str, inputs: dict[str, Any]) -> str:
    """Content key of ``stage`` over ``inputs`` plus its version and its code digest."""
    return content_key(stage, VERSIONS[stage], {**inputs, "code": code_digest(CODE_ROOTS)})


# --- quantize ----------------------------------------------------------------------------------


def quantize_key(model: Any, knobs: Knobs, trace_key: str | None, layer: int) -> str:
    """Key of the quantized experts of ``layer``: the trace enters only for ``act`` importance
    or ``gptq``. ``gptq`` and ``plain`` entries are keyed under their own names and code
    (``quantize_gptq``, ``quantize_plain``), so adding them left the keys of ``search`` entries
    as they were."""
    uses_trace = knobs.uses_activation_statistics()
    named = {"gptq": "quantize_gptq", "plain": "quantize_plain"}
    return stage_key(
        named.get(knobs.quantizer, "quantize"),
        {
            "model": model.fingerprint,
            "knobs": knobs.for_stage("quantize"),
            "trace": trace_key if uses_trace else None,
            "layer": layer,
        },
    )


def check_quantizable(model: Any) -> None:
    """Raise :class:`GGUFFormatError` unless every routed expert's rows split into Q2_0 blocks
    of 64: gate/up rows hold ``n_embd`` values, down rows ``n_ff_exp``. Called before any
    teacher pass, so that such a model fails in seconds, naming its file."""
    hp = model.hparams
    widths = (("ffn_gate_exps/ffn_up_exps", hp.n_embd), ("ffn_down_exps", hp.n_ff_exp))
    for tensors, width in widths:
        if width % 64:
            raise GGUFFormatError(
                f"{model.path}: the rows of {tensors} hold {width} values, not a multiple of the "
                "Q2_0 block of 64; this model's routed experts cannot be quantized to Q2_0"
            )


def expert_weights(
    model: Any, layer: int, tensors: tuple[str, ...] = EXPERT_TENSORS
) -> dict[str, Any]:
    """What quantize and Part A read of a layer: its routed expert stacks as float32 device
    arrays, decoded in the graph from their stored bytes (several times gguf-py's numpy speed;
    on an accelerator they never cross to the host), and ffn_norm."""
    from healsweep.model import architecture
    from healsweep.model.forward import dense_on_device

    out = {}
    for suffix in (f"ffn_{n}_exps.weight" for n in tensors):
        out[suffix] = dense_on_device(model, block_prefix(layer) + suffix)
    # the FFN's input norm, whatever the architecture calls it (glm4moe: post_attention_norm)
    out["ffn_norm.weight"] = model.tensor(block_prefix(layer) + architecture(model.arch).ffn_norm)
    return out


def quantize_layer(
    weights: dict[str, Any],
    knobs: Knobs,
    trace_layer: dict[str, np.ndarray] | None,
    calibration: CalibrationConfig,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Q2_0 codes and scales of the layer's routed experts, as cache arrays, and the stage's
    report (``gptq``: how many experts fell back to ``search``, per tensor)."""
    if knobs.quantizer == "plain":
        return plain_layer(weights), {}
    min_tokens = calibration.min_tokens_per_expert
    get = (lambda k: trace_layer[k]) if trace_layer is not None else (lambda k: None)
    gate_up_imp = imp.gate_up_importance(
        knobs, weights["ffn_norm.weight"], get("x_sq_sums"), get("counts"), min_tokens
    )
    down_imp = imp.down_importance(knobs, get("h_sq_sums"), get("counts"), min_tokens)
    arrays: dict[str, np.ndarray] = {}
    report: dict[str, Any] = {}
    left: dict[str, np.ndarray] = {}  # per tensor, the experts gptq leaves to the search
    if knobs.quantizer == "gptq":  # first, so that the search runs only where it is needed
        for names in (("gate", "up"), ("down",)):  # gate and up read one input: one H_e
            found = _gptq_experts(names, weights, knobs, trace_layer, min_tokens)
            for name, (d, codes, rest, fallback) in found.items():
                arrays[f"{name}.d"], arrays[f"{name}.codes"], left[name] = d, codes, rest
                report[name] = fallback
    for name, importance, gain in (
        ("gate", gate_up_imp, knobs.gain_gu),
        ("up", gate_up_imp, knobs.gain_gu),
        ("down", down_imp, knobs.gain_d),
    ):
        w = weights[f"ffn_{name}_exps.weight"]  # [E, out, in]; in checked by check_quantizable
        _search_experts(name, arrays, left.get(name), w, importance, gain)
    return arrays, ({"gptq_fallback": report} if knobs.quantizer == "gptq" else {})


def _search_experts(name, arrays, rest, w, importance, gain) -> None:
    """The codec's search (:func:`q2_0.quantize_matrix`) of ``w`` [E, out, in] into ``arrays``:
    of every expert, or with ``rest`` (expert indices) of those only, the others' entries of
    ``arrays`` already filled."""
    from healsweep.kernels import q2_0

    if rest is None:
        q2 = q2_0.quantize_matrix(w, importance, gain, packed=True)
        arrays[f"{name}.d"] = np.asarray(q2.d, np.float16)
        arrays[f"{name}.codes"] = np.asarray(q2.codes)
    elif len(rest):
        per_expert = importance is not None and np.ndim(importance) == 2
        q2 = q2_0.quantize_matrix(
            w[rest], importance[rest] if per_expert else importance, gain, packed=True
        )
        arrays[f"{name}.d"][rest] = np.asarray(q2.d, np.float16)
        arrays[f"{name}.codes"][rest] = np.asarray(q2.codes)


def plain_layer(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    """``quantizer: plain`` (round-to-nearest, ``d = amax/2``, :mod:`healsweep.kernels.q2_0_plain`)
    of the layer's routed experts, as the same cache arrays as ``search`` (ordinary Q2_0)."""
    from healsweep.kernels import q2_0_plain
    from healsweep.kernels.q2_0 import pack_codes

    arrays: dict[str, np.ndarray] = {}
    for name in EXPERT_TENSORS:
        d, q = q2_0_plain.quantize(weights[f"ffn_{name}_exps.weight"])  # [E, out, in]
        arrays[f"{name}.d"] = np.asarray(d, np.float16)
        arrays[f"{name}.codes"] = np.asarray(pack_codes(q))
    return arrays


def _gptq_experts(names, weights, knobs, trace_layer, min_tokens):
    """GPTQ of the tensors ``names`` (all reading one input) for every expert with enough
    routed tokens. Returns per tensor ``(d, codes, rest, fallback)``: the cache arrays with
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


def q2_weights(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """{gate, up, down}: packed ``Q2Packed`` pytrees of a ``quantize`` entry (decoded in the
    graph; unpacking 3 x 173M codes per layer on the host cost a warm trial seconds a layer)."""
    from healsweep.kernels.q2_0 import Q2Packed

    return {n: Q2Packed(d=arrays[f"{n}.d"], codes=arrays[f"{n}.codes"]) for n in EXPERT_TENSORS}


# --- routed_q ----------------------------------------------------------------------------------


def routed_q_key(quantize: str, trace_key: str, layer: int) -> str:
    """Key of the quantized experts' routed output on the trace of ``layer``."""
    return stage_key("routed_q", {"quantize": quantize, "trace": trace_key, "layer": layer})


@partial(jax.jit, static_argnums=(4, 5))
def _routed(x, ids, weights, experts, n_expert: int, tile: int):
    from healsweep.model.layers import routed_experts

    gate, up, down = experts
    return routed_experts(x, ids, weights, gate, up, down, n_expert, tile)


def routed_output(
    experts: dict[str, Any], trace_layer: dict[str, np.ndarray], n_expert: int
) -> np.ndarray:
    """y_q [T, D]: routing-weighted sum of the given experts on the trace's inputs and routing."""
    from healsweep.model.layers import expert_tile_rows

    x, ids, weights = trace_layer["x"], trace_layer["ids"], trace_layer["weights"]
    n_tokens = x.shape[0]
    chunk = min(ROUTED_CHUNK, -(-n_tokens // 64) * 64)
    tile = expert_tile_rows(chunk * ids.shape[1], n_expert)
    stacked = (experts["gate"], experts["up"], experts["down"])
    out = np.empty(x.shape, np.float32)
    for a in range(0, n_tokens, chunk):
        b = min(a + chunk, n_tokens)
        pad = chunk - (b - a)  # zero rows with zero routing weight add nothing
        xs = np.pad(np.asarray(x[a:b], np.float32), ((0, pad), (0, 0)))  # the trace keeps f16
        ids_s = np.pad(ids[a:b], ((0, pad), (0, 0)))
        ws = np.pad(weights[a:b], ((0, pad), (0, 0)))
        out[a:b] = np.asarray(_routed(xs, ids_s, ws, stacked, n_expert, tile))[: b - a]
    return out


# --- part_a ------------------------------------------------------------------------------------


def part_a_key(knobs: Knobs, model: Any, quantize: str, routed_q: str | None, layer: int) -> str:
    """Key of the layer's alpha: mse reads routed_q (and through it the trace)."""
    return stage_key(
        "part_a",
        {
            "knobs": knobs.for_stage("part_a"),
            "model": model.fingerprint,
            "quantize": quantize,
            "routed_q": routed_q,
            "layer": layer,
        },
    )


def gaussian_alpha(weights: dict[str, np.ndarray], experts: dict[str, Any], gamma: float) -> float:
    """The shipped Part A on the fixed probe experts with Gaussian inputs (legacy baseline)."""
    probe = np.asarray(
        list(alpha_kernels.gaussian_probe_experts(weights["ffn_gate_exps.weight"].shape[0]))
    )
    x = alpha_kernels.gaussian_probe_inputs(imp.gaussian_probe_scale(weights["ffn_norm.weight"]))
    dense = tuple(np.asarray(weights[f"ffn_{n}_exps.weight"][probe]) for n in EXPERT_TENSORS)
    quantized = tuple(
        np.asarray(jax.tree_util.tree_map(lambda leaf: leaf[probe], experts[n]).dequantize())
        for n in EXPERT_TENSORS
    )
    return float(alpha_kernels.alpha_gaussian(x, dense, quantized, gamma))


def residuals_key(routed_q: str, part_a: str) -> str:
    """Key of the layer's residual report: y_ref and y_q (through routed_q) and alpha."""
    return stage_key("residuals", {"routed_q": routed_q, "part_a": part_a})


def residual_report(y_ref: np.ndarray, y_q: np.ndarray, alpha: float) -> dict[str, float]:
    """In-sample relative routed residual at alpha=1, at the chosen alpha, and the MSE optimum."""
    return {
        "residual_alpha_1": float(alpha_kernels.residual_fraction(y_ref, y_q, 1.0)),
        "residual": float(alpha_kernels.residual_fraction(y_ref, y_q, alpha)),
        "alpha_mse_optimal": float(alpha_kernels.alpha_mse(y_ref, y_q, 0.0)),
    }
