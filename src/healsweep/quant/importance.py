"""Per-input-channel importance weights for the Q2_0 search (knobs ``importance``, ``importance_down``).

* ``none``: every channel weighs the same (the quantizer gets no importance).
* ``norm_proxy`` (gate/up only): the audit's shipped proxy, the mean square of the layer's FFN-norm
  gains per input channel. The shipped healer averaged ``w²`` over the 4 hyper-connection norms
  of its architecture; qwen2moe/qwen3moe have a single ``ffn_norm``, so the proxy is ``w_d²``
  (the variance an RMS-normalised input would have if every pre-norm channel had unit scale).
* ``act``: measured statistics from the calibration trace. Gate/up: ``E[x²]`` per input channel
  over the tokens routed to each expert; down: ``E[h²]`` with ``h = silu(x·Wg)*(x·Wu)`` of the
  teacher expert over its routed tokens. An expert that received fewer than
  ``min_tokens_per_expert`` tokens uses the layer-wide statistic instead (pooled over all
  (token, expert) pairs), so a starved expert is not quantized with noise for weights.

The moment kernels return sums and counts, not means, so chunks of a trace can be added up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels._precision import healing_jit
from healsweep.quant.imatrix import pooled_means
from healsweep.quant.values import Importance, ImportanceDown

ROW_CHUNK = 256  # routed-token rows per call, zero-padded, so every call has one shape
_FLOOR = 1e-6  # importance floor relative to the channel maximum: the Q2_0 search needs a > 0


def norm_proxy(ffn_norm_weight: np.ndarray) -> np.ndarray:
    """[D] float32: the mean square of the FFN-norm gains per channel (one norm: ``w²``)."""
    w = np.asarray(ffn_norm_weight, np.float32)
    return np.square(w).reshape(-1, w.shape[-1]).mean(axis=0)


@healing_jit
def expert_input_moments(x: jax.Array, topk_ids: jax.Array, n_expert_grid: jax.Array):
    """(sum of x² [E, D], token counts [E]) over each expert's routed tokens.

    ``x`` [T, D], ``topk_ids`` [T, k]; ``n_expert_grid`` is ``jnp.arange(E)`` (a traced array so
    that E need not be a static argument).
    """
    routed = jnp.any(topk_ids[:, :, None] == n_expert_grid[None, None, :], axis=1)  # [T, E]
    routed = routed.astype(jnp.float32)
    sums = jnp.einsum("te,td->ed", routed, jnp.square(x.astype(jnp.float32)))  # [E, D]
    return sums, jnp.sum(routed, axis=0)


@healing_jit
def _hidden_square_sum(x_rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, e) -> jax.Array:
    """sum over rows of h² [F] of expert ``e`` of the stacks; zero padding rows give
    h = silu(0)*0 = 0 and add nothing."""
    h = jax.nn.silu(x_rows @ w_gate[e].T) * (x_rows @ w_up[e].T)  # [P, F]
    return jnp.sum(jnp.square(h), axis=0)


def expert_hidden_moments(
    x: np.ndarray, topk_ids: np.ndarray, gate_exps, up_exps
) -> tuple[np.ndarray, np.ndarray]:
    """(sum of h² [E, F], token counts [E]) of each teacher expert over its routed tokens.

    ``x`` [T, D], ``topk_ids`` [T, k], ``gate_exps``/``up_exps`` [E, F, D] (numpy or device
    arrays; device stacks stay where they are, only the routed rows of x travel).
    """
    n_expert, n_ff, _ = gate_exps.shape
    sums = np.zeros((n_expert, n_ff), np.float32)
    counts = np.zeros(n_expert, np.float32)
    for e in range(n_expert):
        rows = np.nonzero(np.any(topk_ids == e, axis=1))[0]
        counts[e] = len(rows)
        for a in range(0, len(rows), ROW_CHUNK):  # one shape for every call: one compile
            x_rows = np.zeros((ROW_CHUNK, x.shape[1]), np.float32)
            part = rows[a : a + ROW_CHUNK]
            x_rows[: len(part)] = x[part]
            sums[e] += np.asarray(_hidden_square_sum(x_rows, gate_exps, up_exps, np.int32(e)))
    return sums, counts


def _floored(importance: np.ndarray) -> np.ndarray:
    importance = np.asarray(importance, np.float32)
    top = importance.max(axis=-1, keepdims=True)
    floor = np.where(top > 0, top * _FLOOR, 1.0).astype(np.float32)
    return np.maximum(importance, floor)


def gate_up_importance(
    kind: Importance | str,
    ffn_norm_weight: np.ndarray,
    x_sq_sums: np.ndarray | None,
    counts: np.ndarray | None,
    min_tokens: int,
) -> np.ndarray | None:
    """Importance of the gate/up input channels under knob ``importance`` = ``kind``: None,
    [D] (norm proxy) or [E, D] (act)."""
    if kind == Importance.NONE:
        return None
    if kind == Importance.NORM_PROXY:
        return _floored(norm_proxy(ffn_norm_weight))
    if x_sq_sums is None or counts is None:
        raise ValueError("gate_up_importance: `act` needs the trace's E[x²] sums and counts")
    return _floored(pooled_means(x_sq_sums, counts, min_tokens))


def down_importance(
    kind: ImportanceDown | str, h_sq_sums: np.ndarray | None, counts: np.ndarray | None, min_tokens: int
) -> np.ndarray | None:
    """Importance of the down-projection input channels under knob ``importance_down`` =
    ``kind``: None or [E, F] (act)."""
    if kind == ImportanceDown.NONE:
        return None
    if h_sq_sums is None or counts is None:
        raise ValueError("down_importance: `act` needs the trace's E[h²] sums and counts")
    return _floored(pooled_means(h_sq_sums, counts, min_tokens))


def gaussian_probe_scale(ffn_norm_weight: np.ndarray) -> np.ndarray:
    """[D] the shipped Part A probe scale s = sqrt(norm proxy), so that E[x_d²] = proxy_d."""
    return np.sqrt(norm_proxy(ffn_norm_weight)).astype(np.float32)
