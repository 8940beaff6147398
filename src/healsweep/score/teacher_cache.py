"""Teacher outputs per window, computed once and served from the stage cache afterwards.

An entry holds, for the ``n`` positions that predict a window's scored tokens (``scored_from - 1
... scored_from + n - 2``): the teacher's float32 log-softmax ``[n, V]`` (exact to float32, never
a 16-bit clamp; only scored positions, so an entry is bounded by ``max_scored x V``) and its
router top-k expert ids ``[n, L, k]``. The key is the model file's fingerprint, the window's
token ids and its scored range: nothing else can change the teacher's output.

Misses are computed with one batched forward per call (see :func:`teacher_outputs`);
``StageCache.computed["teacher_logits"]`` counts the windows whose teacher output was computed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from healsweep.cache import StageCache, content_key

STAGE = "teacher_logits"
VERSION = 1


class TeacherOutput(NamedTuple):
    """The teacher's view of one window's scored positions."""

    logprobs: np.ndarray  # [n, V] float32 log-softmax
    topk_ids: np.ndarray  # [n, L, k] int32


def scored_positions(window: Any) -> np.ndarray:
    """Positions whose logits predict the scored tokens: ``scored_from - 1 + arange(n)``."""
    return np.arange(window.n_scored, dtype=np.int64) + (window.scored_from - 1)


def teacher_key(model: Any, window: Any) -> str:
    """Cache key of a window's teacher output: model fingerprint + tokens + scored range."""
    tokens = np.ascontiguousarray(window.tokens, dtype="<i4").tobytes()
    return content_key(
        STAGE,
        VERSION,
        {
            "model": model.fingerprint,
            "tokens_sha256": hashlib.sha256(tokens).hexdigest(),
            "n_tokens": int(len(window.tokens)),
            "scored_from": int(window.scored_from),
            "n_scored": int(window.n_scored),
        },
    )


def run_teacher(model: Any, windows: Sequence[Any]) -> list[TeacherOutput]:
    """One batched teacher forward over ``windows`` (no cache)."""
    from healsweep.kernels.kld import log_softmax
    from healsweep.model import forward

    positions = [scored_positions(w) for w in windows]
    result = forward(model, [w.tokens for w in windows], logits_for=positions)
    outputs = []
    for logits, router, pos in zip(result.logits, result.router, positions, strict=True):
        logprobs = np.asarray(log_softmax(logits), dtype=np.float32)  # [n, V]
        outputs.append(TeacherOutput(logprobs, np.asarray(router[pos], dtype=np.int32)))
    return outputs


def teacher_outputs(model: Any, windows: Sequence[Any], cache: StageCache) -> list[TeacherOutput]:
    """Teacher outputs of ``windows``, from the cache where present.

    Windows without an entry on disk are computed together in one batched forward the first
    time one of them is needed; an entry found corrupt on reading is recomputed alone.
    """
    keys = [teacher_key(model, w) for w in windows]
    missing = [i for i, key in enumerate(keys) if not cache.path(STAGE, key).is_file()]
    computed: dict[int, TeacherOutput] = {}

    def compute(i: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if i not in computed:
            todo = [j for j in missing if j not in computed] if i in missing else [i]
            for j, out in zip(todo, run_teacher(model, [windows[j] for j in todo]), strict=True):
                computed[j] = out
        out = computed.pop(i)
        meta = {"window_id": windows[i].window_id, "model": model.fingerprint}
        return {"logprobs": out.logprobs, "topk_ids": out.topk_ids}, meta

    outputs = []
    for i, key in enumerate(keys):
        arrays, _ = cache.get_or_compute(STAGE, key, lambda i=i: compute(i))
        outputs.append(TeacherOutput(arrays["logprobs"], arrays["topk_ids"]))
    return outputs


__all__ = [
    "STAGE",
    "VERSION",
    "TeacherOutput",
    "run_teacher",
    "scored_positions",
    "teacher_key",
    "teacher_outputs",
]
