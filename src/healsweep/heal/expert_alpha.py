"""``alpha_granularity: expert``: Part A's alpha fitted per routed expert, folded into its down ``d``.

The layer formula ``alpha = cos^(1-gamma)/ratio`` is applied to each expert's own share of the
routed output instead of the layer's sum:

* ``mse``: over the calibration tokens routed to expert ``e``, its contribution
  ``w_te · expert_e(x_t)`` of the teacher against that of the quantized expert (``w_te`` the
  routing weight), so ``gamma = 0`` is each expert's own least-squares scale. Experts with fewer
  than ``min_tokens_per_expert`` routed tokens take the layer's alpha (as ``act`` importance
  falls back to the layer-wide statistic).
* ``gaussian``: the shipped Gaussian probe tokens through expert ``e`` alone (dense against
  quantized), for every expert rather than the four probe experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.heal.stages import ExpertStacks
from healsweep.kernels import alpha as alpha_kernels
from healsweep.kernels._precision import healing_jit
from healsweep.quant import importance as imp

_MIN_ROWS = 256  # routed rows padded to a power of two of at least this: few compiles
_HIGHEST = jax.lax.Precision.HIGHEST


def _expert(experts: ExpertStacks, e: int) -> tuple:
    """(gate, up, down) of quantized expert ``e``, dequantized, each with a leading axis of 1."""
    return tuple(
        jax.tree_util.tree_map(lambda leaf: leaf[e : e + 1], stack).dequantize()
        for stack in experts
    )


def _dense(weights: dict, e: int) -> tuple:
    return tuple(weights[f"ffn_{n}_exps.weight"][e : e + 1] for n in ("gate", "up", "down"))


@healing_jit
def _contribution_stats(x_rows, route_w, dense, quantized) -> jax.Array:
    """[<r, q>, |r|², |q|²] of one expert's weighted contributions r (dense) and q (quantized)
    over the rows ``x_rows`` [P, D] (zero padding rows carry zero routing weight)."""
    r = alpha_kernels.expert_outputs(x_rows, *dense)[0] * route_w[:, None]  # [P, D]
    q = alpha_kernels.expert_outputs(x_rows, *quantized)[0] * route_w[:, None]
    return jnp.stack([jnp.sum(r * q), jnp.sum(r * r), jnp.sum(q * q)])


def mse_alphas(
    weights: dict,
    experts: ExpertStacks,
    trace_layer: dict,
    gamma: float,
    layer_alpha: float,
    min_tokens: int,
) -> np.ndarray:
    """[E] float32: each expert's alpha from its own routed contributions on the trace."""
    x, ids, route = trace_layer["x"], trace_layer["ids"], trace_layer["weights"]
    n_expert = weights["ffn_gate_exps.weight"].shape[0]
    alphas = np.full(n_expert, layer_alpha, np.float32)
    for e in range(n_expert):
        routed = ids == e  # [T, k]
        rows = np.nonzero(np.any(routed, axis=1))[0]
        if len(rows) < min_tokens:
            continue
        size = max(_MIN_ROWS, 1 << (len(rows) - 1).bit_length())
        x_rows = np.zeros((size, x.shape[1]), np.float32)
        x_rows[: len(rows)] = x[rows]
        route_w = np.zeros(size, np.float32)
        route_w[: len(rows)] = np.sum(np.where(routed[rows], route[rows], 0.0), axis=1)
        stats = _contribution_stats(x_rows, route_w, _dense(weights, e), _expert(experts, e))
        alphas[e] = float(alpha_kernels.alpha_from_stats(*stats, gamma))
    return alphas


def gaussian_alphas(weights: dict, experts: ExpertStacks, gamma: float) -> np.ndarray:
    """[E] float32: the shipped Gaussian-probe alpha of each expert alone."""
    x = alpha_kernels.gaussian_probe_inputs(imp.gaussian_probe_scale(weights["ffn_norm.weight"]))
    n_expert = weights["ffn_gate_exps.weight"].shape[0]
    return np.array(
        [
            float(alpha_kernels.alpha_gaussian(x, _dense(weights, e), _expert(experts, e), gamma))
            for e in range(n_expert)
        ],
        np.float32,
    )
