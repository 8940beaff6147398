"""The per-layer stages after the calibration trace: quantize, routed_q, part_a (Part B: ridge).

Each stage is a function of explicit inputs whose cache key is built from exactly those inputs
(DESIGN.md): the model fingerprint, the keys of the upstream entries it reads and the knobs it
reads (:func:`healsweep.heal.reads.stage_reads`). Entries are per layer, so a stage loads and
stores one layer at a time. Stage names and entry versions: :mod:`healsweep.stage_names`.

* ``quantize``: one layer's routed gate and up, or down, experts in the type chosen for them,
  by the class the registry gives (:mod:`healsweep.heal.quantize`, :mod:`healsweep.quant`).
* ``routed_q``: the quantized experts' routed output on the trace's inputs and routing.
* ``part_a``: the layer's alpha (``none`` | ``gaussian`` | ``mse``) and the in-sample residuals.
* ``ridge_basis`` / ``ridge_fit`` / ``part_b``: the ridge on ``ffn_down_shexp`` and its
  requantization to the tensor's own type, in :mod:`healsweep.heal.ridge`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from healsweep.gguf_io import block_prefix
from healsweep.heal._runner import CODE_ROOTS as CODE_ROOTS  # the stages' code roots
from healsweep.heal._runner import join_entry, split_entry, stage_key
from healsweep.heal.knobs import Knobs
from healsweep.kernels import alpha as alpha_kernels
from healsweep.model import architecture
from healsweep.model.forward import dense_on_device
from healsweep.model.layers import expert_tile_rows, routed_experts
from healsweep.quant import importance as imp
from healsweep.stage_names import Stage

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel

EXPERT_TENSORS = ("gate", "up", "down")
ROUTED_CHUNK = 2048  # tokens per routed-output call (padded), bounds memory and recompiles
Arrays = dict[str, np.ndarray]


# --- quantize ----------------------------------------------------------------------------------


def expert_weights(
    model: GGUFModel, layer: int, tensors: tuple[str, ...] = EXPERT_TENSORS
) -> dict[str, Any]:
    """What quantize and Part A read of a layer: its routed expert stacks as float32 device
    arrays, decoded in the graph from their stored bytes (several times gguf-py's numpy speed;
    on an accelerator they never cross to the host), and ffn_norm."""

    out = {}
    for suffix in (f"ffn_{n}_exps.weight" for n in tensors):
        out[suffix] = dense_on_device(model, block_prefix(layer) + suffix)
    # the FFN's input norm, whatever the architecture calls it (glm4moe: post_attention_norm)
    out["ffn_norm.weight"] = model.tensor(block_prefix(layer) + architecture(model.arch).ffn_norm)
    return out


class ExpertStacks(NamedTuple):
    """A layer's routed expert stacks ``[E, out, in]``, each a quantized pytree (``Q2Packed``) or
    a dense array: what the forward's ``LayerReplacement`` and the routed output take."""

    gate: Any
    up: Any
    down: Any


# --- routed_q ----------------------------------------------------------------------------------


class RoutedOutput(NamedTuple):
    """``routed_q``: the quantized experts' routed output on the trace's inputs and routing."""

    y_q: np.ndarray  # [T, D] float32

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        return split_entry(self, ("y_q",))

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> RoutedOutput:
        return join_entry(cls, arrays, meta)


def routed_q_key(quantize: Any, trace_key: str, layer: int) -> str:
    """Key of the quantized experts' routed output on the trace of ``layer``; ``quantize`` names
    the experts (the keys of the layer's quantize entries, and of any alphas folded in)."""
    return stage_key("routed_q", {"quantize": quantize, "trace": trace_key, "layer": layer})


ROUTED_IN_FLIGHT = 3  # chunks dispatched ahead of the one being copied back


@partial(jax.jit, static_argnums=(4, 5))
def _routed(x, ids, weights, experts, n_expert: int, tile: int):
    gate, up, down = experts
    x = x.astype(jax.numpy.float32)  # the trace keeps f16: half the bytes cross to the device
    return routed_experts(x, ids, weights, gate, up, down, n_expert, tile)


def _padded(rows: np.ndarray, size: int) -> np.ndarray:
    """``rows`` with zero rows appended up to ``size`` (a copy only for the last, short chunk)."""
    pad = size - rows.shape[0]
    return rows if pad == 0 else np.pad(rows, ((0, pad), (0, 0)))


def routed_output(
    experts: ExpertStacks,
    trace_layer: dict[str, np.ndarray],
    n_expert: int,
    chunk_tokens: int = ROUTED_CHUNK,
) -> np.ndarray:
    """y_q [T, D]: routing-weighted sum of the given experts on the trace's inputs and routing.

    The experts go to the device once (not once per chunk); each chunk's inputs cross in the
    trace's own dtype and are widened there; chunks are dispatched :data:`ROUTED_IN_FLIGHT`
    ahead of the one copied back, so the device never waits on the host's slicing and copies.
    Only y_q comes back: it is the stage's entry, and Part A, the residuals and the ridge read it.
    ``chunk_tokens``: tokens per call (a multiple of 64).
    """

    x, ids, weights = trace_layer["x"], trace_layer["ids"], trace_layer["weights"]
    n_tokens = x.shape[0]
    chunk = min(chunk_tokens, -(-n_tokens // 64) * 64)
    tile = expert_tile_rows(chunk * ids.shape[1], n_expert)
    stacked = jax.device_put(tuple(experts))
    out = np.empty(x.shape, np.float32)
    pending: list[tuple[int, int, jax.Array]] = []
    for a in range(0, n_tokens, chunk):
        b = min(a + chunk, n_tokens)  # zero rows with zero routing weight add nothing
        parts = (_padded(np.asarray(m[a:b]), chunk) for m in (x, ids, weights))
        pending.append((a, b, _routed(*parts, stacked, n_expert, tile)))
        if len(pending) > ROUTED_IN_FLIGHT:
            done_a, done_b, y = pending.pop(0)
            out[done_a:done_b] = np.asarray(y)[: done_b - done_a]
    for done_a, done_b, y in pending:
        out[done_a:done_b] = np.asarray(y)[: done_b - done_a]
    return out


# --- part_a ------------------------------------------------------------------------------------


class LayerAlpha(NamedTuple):
    """``part_a``: the layer's alpha and, under ``alpha_granularity: expert``, one per expert
    (folded into each expert's down scales; the layer's is then 1)."""

    alpha: float
    expert_alpha: np.ndarray | None = None  # [E] float32

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        arrays = {"alpha": np.float32(self.alpha)}
        if self.expert_alpha is not None:
            arrays["expert_alpha"] = self.expert_alpha
        return arrays, {}

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> LayerAlpha:
        return cls(float(arrays["alpha"]), arrays.get("expert_alpha"))


def part_a_key(
    knobs: Knobs, model: GGUFModel, quantize: Any, routed_q: str | None, layer: int
) -> str:
    """Key of the layer's alpha: mse reads routed_q (and through it the trace)."""
    return stage_key(
        "part_a",
        {
            "knobs": knobs.for_stage(Stage.PART_A),
            "model": model.fingerprint,
            "quantize": quantize,
            "routed_q": routed_q,
            "layer": layer,
        },
    )


def gaussian_alpha(weights: dict[str, np.ndarray], experts: ExpertStacks, gamma: float) -> float:
    """The shipped Part A on the fixed probe experts with Gaussian inputs (legacy baseline)."""
    probe = np.asarray(
        list(alpha_kernels.gaussian_probe_experts(weights["ffn_gate_exps.weight"].shape[0]))
    )
    x = alpha_kernels.gaussian_probe_inputs(imp.gaussian_probe_scale(weights["ffn_norm.weight"]))
    dense = tuple(np.asarray(weights[f"ffn_{n}_exps.weight"][probe]) for n in EXPERT_TENSORS)
    quantized = tuple(
        np.asarray(jax.tree_util.tree_map(lambda leaf: leaf[probe], stack).dequantize())
        for stack in experts
    )
    return float(alpha_kernels.alpha_gaussian(x, dense, quantized, gamma))


def residuals_key(routed_q: str, part_a: str) -> str:
    """Key of the layer's residual report: y_ref and y_q (through routed_q) and alpha."""
    return stage_key("residuals", {"routed_q": routed_q, "part_a": part_a})


class Residuals(NamedTuple):
    """``residuals``: the layer's in-sample relative routed residual at alpha=1, at the chosen
    alpha, and the MSE-optimal alpha (no arrays)."""

    residual_alpha_1: float
    residual: float
    alpha_mse_optimal: float

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        return split_entry(self, ())

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> Residuals:
        return join_entry(cls, arrays, meta)


def residual_report(y_ref: np.ndarray, y_q: np.ndarray, alpha: float) -> Residuals:
    """In-sample relative routed residual at alpha=1, at the chosen alpha, and the MSE optimum."""
    return Residuals(
        float(alpha_kernels.residual_fraction(y_ref, y_q, 1.0)),
        float(alpha_kernels.residual_fraction(y_ref, y_q, alpha)),
        float(alpha_kernels.alpha_mse(y_ref, y_q, 0.0)),
    )
