"""Teacher outputs per window, computed once and served from the stage cache afterwards.

Two entry formats live side by side in stage ``teacher_logits`` (their keys differ):

- ``exact``: for the ``n`` positions that predict a window's scored tokens (``scored_from - 1
  ... scored_from + n - 2``), the teacher's float32 log-softmax ``[n, V]`` (exact to float32,
  never a 16-bit clamp; an entry is bounded by ``max_scored x V``) and its router top-k expert
  ids ``[n, L, k]``. Its key is the model file's fingerprint, the window's token ids and its
  scored range, and the digest of the code that computes it (the forward, the kernels, this
  module: :data:`CODE_ROOTS`' import closure).
- ``compact`` (the default): a fixed-size record per position, see
  :mod:`healsweep.score.compact`; the key adds the record format, (K, S), the tail sampler and
  the window id that seeds the draws.

Misses are computed with one forward per call (see :func:`teacher_outputs`), in which every
window is computed as if it were alone (:func:`healsweep.model.forward_each`): a record is a
function of its window, never of the batch it was computed in or of what else is in the cache,
so a corrupt entry rebuilt later, in any batch, equals the original bit for bit.
``StageCache.computed["teacher_logits"]`` counts the windows whose teacher output was computed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from healsweep._code import code_digest
from healsweep.cache import StageCache, content_key, recompute_seconds
from healsweep.kernels.kld import log_softmax
from healsweep.model import forward_each
from healsweep.score.compact import (
    COMPACT,
    CompactTeacher,
    TeacherCacheFormat,
    cache_format,
    compact_record,
    router_dtype,
)
from healsweep.score.metrics import _bucket
from healsweep.stage_names import Stage

if TYPE_CHECKING:
    from healsweep.data.windows import Window
    from healsweep.gguf_io import GGUFModel

STAGE = Stage.TEACHER_LOGITS
VERSION = 1  # exact entries' format (code changes are in the key's code digest)
COMPACT_VERSION = 2  # 2: top-K and the tail draws on the device (float32 two-level inverse CDF)
# Teacher outputs are computed by functions of this module, from the window's fields alone (no
# method of the window's class runs): the closure of its imports (the forward, the kernels, the
# compact record) is the code a key covers.
CODE_ROOTS = ("healsweep.score.teacher_cache",)


class TeacherOutput(NamedTuple):
    """The teacher's view of one window's scored positions."""

    # [n, V] float32 log-softmax; run_teacher's is a device array, kept there, of
    # _bucket(n) rows, the rows past n zero (as the scorer pads them)
    logprobs: Any
    topk_ids: np.ndarray  # [n, L, k] int32


Teacher = TeacherOutput | CompactTeacher


def scored_positions(window: Window) -> np.ndarray:
    """Positions whose logits predict the scored tokens: ``scored_from - 1 + arange(n)``."""
    return np.arange(window.n_scored, dtype=np.int64) + (window.scored_from - 1)


def teacher_key(model: GGUFModel, window: Window, fmt: str | TeacherCacheFormat = COMPACT) -> str:
    """Cache key of a window's teacher output in ``fmt``."""
    fmt = cache_format(fmt)
    tokens = np.ascontiguousarray(window.tokens, dtype="<i4").tobytes()
    inputs = {
        "model": model.fingerprint,
        "tokens_sha256": hashlib.sha256(tokens).hexdigest(),
        "n_tokens": int(len(window.tokens)),
        "scored_from": int(window.scored_from),
        "n_scored": int(window.n_scored),
        "code": code_digest(CODE_ROOTS),
    }
    if fmt.kind == "exact":
        return content_key(STAGE, VERSION, inputs)
    inputs.update(fmt.key_inputs(), window_id=window.window_id)
    return content_key(STAGE, COMPACT_VERSION, inputs)


def run_teacher(model: GGUFModel, windows: Sequence[Window]) -> list[TeacherOutput]:
    """The teacher's outputs over ``windows`` (no cache), each window's a function of that
    window alone (:func:`~healsweep.model.forward_each`)."""
    positions = [scored_positions(w) for w in windows]
    # The logits stay on the device, each window's rows padded as the scorer pads them (zero
    # rows up to its bucket): one compiled log-softmax per bucket, where a shape per row count
    # kept ~20 executables per distinct count in memory (issue 47), and no [n, V] crosses to
    # the host and back (issue 46: the H100 night's cold trial spent 99 s there). The
    # log-probs stay on the device, where the compact record is made.
    result = forward_each(model, [w.tokens for w in windows], logits_for=positions,
                          pad_rows=_bucket)  # fmt: skip
    outputs = []
    for logits, router, pos in zip(result.logits, result.router, positions, strict=True):
        logprobs = _log_softmax()(logits, len(pos))  # [_bucket(n), V]
        outputs.append(TeacherOutput(logprobs, np.asarray(router[pos], dtype=np.int32)))
    return outputs


@cache
def _log_softmax() -> Any:
    """``(logits [R, V], n) -> [R, V]``: :func:`~healsweep.kernels.kld.log_softmax` of every
    row, rows ``n`` and later zeroed (padding, as :func:`~healsweep.score.metrics._pad_rows`
    pads a record's rows); jitted once, ``n`` traced, so a shape per bucket of rows."""

    def padded_log_softmax(logits: Any, n: Any) -> Any:
        real = jnp.arange(logits.shape[0])[:, None] < n  # [R, 1]
        return jnp.where(real, log_softmax(logits), 0.0)

    return jax.jit(padded_log_softmax)


def _entry(
    model: GGUFModel, window: Window, out: TeacherOutput, fmt: TeacherCacheFormat
) -> dict[str, np.ndarray]:
    """The arrays stored for one window in ``fmt``."""
    if fmt.kind == "exact":  # the real rows only (run_teacher's are padded)
        logprobs = np.asarray(out.logprobs, np.float32)[: window.n_scored]
        return {"logprobs": logprobs, "topk_ids": out.topk_ids}
    # the scored tokens from the fields the key holds (not Window.scored_tokens: its module is
    # no part of this stage's code digest)
    scored = window.tokens[window.scored_from : window.scored_from + window.n_scored]
    record = compact_record(out.logprobs, scored, out.topk_ids, window.window_id, fmt)
    arrays = record._asdict()
    arrays["topk_ids"] = record.topk_ids.astype(router_dtype(model.hparams.n_expert))
    return arrays


def _output(arrays: dict[str, np.ndarray], fmt: TeacherCacheFormat) -> Teacher:
    if fmt.kind == "exact":
        return TeacherOutput(arrays["logprobs"], arrays["topk_ids"])
    fields = {name: arrays[name] for name in CompactTeacher._fields}
    fields["topk_ids"] = fields["topk_ids"].astype(np.int32)
    return CompactTeacher(**fields)


def teacher_outputs(
    model: GGUFModel,
    windows: Sequence[Window],
    cache: StageCache,
    fmt: str | TeacherCacheFormat = COMPACT,
) -> list[Teacher]:
    """Teacher outputs of ``windows`` in ``fmt`` (``exact``, ``compact``, ``compact:K:S``).

    The windows without an entry on disk are computed together in one forward the first time
    one of them is needed (an entry found corrupt on reading, alone). Each window's output is a
    function of that window only (:func:`run_teacher`), so which neighbours were computed with
    it, which another process (a concurrent trial) stored first, or whether the entry is a
    rebuild of a corrupt one, changes no bit of it.
    """
    fmt = cache_format(fmt)
    keys = [teacher_key(model, w, fmt) for w in windows]
    missing = [i for i, key in enumerate(keys) if not cache.path(STAGE, key).is_file()]
    computed: dict[int, tuple[TeacherOutput, float]] = {}  # with its share of the forward's s

    def compute(i: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if i not in computed:
            todo = [j for j in missing if j not in computed] if i in missing else [i]
            start = time.perf_counter()
            outs = run_teacher(model, [windows[j] for j in todo])
            share = (time.perf_counter() - start) / len(todo)
            for j, out in zip(todo, outs, strict=True):
                computed[j] = (out, share)
        out, share = computed.pop(i)
        recompute_seconds(share)  # one forward made them all: each entry is worth its share
        meta = {"window_id": windows[i].window_id, "model": model.fingerprint, "format": fmt.label}
        return _entry(model, windows[i], out, fmt), meta

    outputs = []
    for i, key in enumerate(keys):
        arrays, _ = cache.get_or_compute(STAGE, key, lambda i=i: compute(i))
        outputs.append(_output(arrays, fmt))
    return outputs


__all__ = [
    "CODE_ROOTS",
    "COMPACT_VERSION",
    "STAGE",
    "VERSION",
    "Teacher",
    "TeacherOutput",
    "run_teacher",
    "scored_positions",
    "teacher_key",
    "teacher_outputs",
]
