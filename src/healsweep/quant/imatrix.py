"""ggml's own quantizer on routed expert stacks, with one importance row per expert (an imatrix).

What ``llama-quantize --imatrix`` does for a MoE file, from healsweep's calibration trace: for
gate/up each expert's E[x²] over the tokens routed to it, for down E[h²] of the teacher expert's
hidden activation (an expert with fewer than ``min_tokens_per_expert`` tokens takes the
layer-wide statistic). :class:`healsweep.quant.ggml.GGMLImatrix` quantizes a ggml type with these
two functions, and so does the llama.cpp baseline (:mod:`healsweep.heal.llama_baseline`), so a
student's unhealed experts of a uniform type are that baseline's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from healsweep.gguf_io._ggml_lib import quantize_rows

EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def pooled_means(sums: np.ndarray, counts: np.ndarray, min_tokens: int) -> np.ndarray:
    """[E, C] per-expert means, the layer-wide mean for experts under ``min_tokens`` tokens."""
    sums = np.asarray(sums, np.float64)
    counts = np.asarray(counts, np.float64)
    layer = sums.sum(axis=0) / max(counts.sum(), 1.0)  # [C]
    enough = counts >= min_tokens
    per_expert = sums / np.maximum(counts, 1.0)[:, None]
    return np.where(enough[:, None], per_expert, layer[None, :]).astype(np.float32)


def expert_importance(trace_layer: Mapping[str, np.ndarray], min_tokens: int) -> dict[str, Any]:
    """Per-expert importance rows of one layer by tensor: gate/up ``[E, n_embd]`` (E[x²]), down
    ``[E, n_ff_exp]`` (E[h²]); an expert under ``min_tokens`` routed tokens takes the layer's."""
    counts = trace_layer["counts"]
    x_sq = pooled_means(trace_layer["x_sq_sums"], counts, min_tokens)
    h_sq = pooled_means(trace_layer["h_sq_sums"], counts, min_tokens)
    return {EXPERT_TENSORS[0]: x_sq, EXPERT_TENSORS[1]: x_sq, EXPERT_TENSORS[2]: h_sq}


def quantize_expert_stack(
    weights: np.ndarray, qtype: int, importance: np.ndarray | None
) -> np.ndarray:
    """``weights`` float32 ``[E, out, in]`` (numpy or a device array) by ggml, expert by expert:
    uint8 ``[E, out, row]``. Each expert's rows are quantized on the process's host threads
    (:func:`~healsweep.gguf_io._ggml_lib.quantize_rows`); one expert is on the host at a time."""

    return np.stack([
        quantize_rows(np.asarray(weights[e], np.float32), qtype,
                      None if importance is None else importance[e])
        for e in range(weights.shape[0])
    ])  # fmt: skip
