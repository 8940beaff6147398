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

The statistics themselves are the trace's (:mod:`healsweep.quant.expert_moments`); this module
turns them into weights with numpy alone, so the quantizers that the knobs read import it at
their top without jax.
"""

from __future__ import annotations

import numpy as np

from healsweep.quant.imatrix import pooled_means
from healsweep.quant.values import Importance, ImportanceDown

_FLOOR = 1e-6  # importance floor relative to the channel maximum: the Q2_0 search needs a > 0


def norm_proxy(ffn_norm_weight: np.ndarray) -> np.ndarray:
    """[D] float32: the mean square of the FFN-norm gains per channel (one norm: ``w²``)."""
    w = np.asarray(ffn_norm_weight, np.float32)
    return np.square(w).reshape(-1, w.shape[-1]).mean(axis=0)


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
