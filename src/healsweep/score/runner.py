"""Score a student against its teacher window by window.

:func:`score_windows` runs the forwards in batches (the teacher's only for windows missing from
the cache) and yields ``(window, WindowMetrics)`` one window at a time, in input order, so a
caller can report, checkpoint or prune after each.

A student is either a ``GGUFModel`` (any model file with the teacher's vocabulary) or a healed
student exposing ``base`` (the teacher's ``GGUFModel``) and ``replacements`` (per-layer
``LayerReplacement``), which runs as ``forward(base, ..., replacements=replacements)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np

from healsweep.cache import StageCache
from healsweep.errors import TokenizerError
from healsweep.model import forward
from healsweep.model.expert_cache import CacheState, ExpertCacheInput, empty_state
from healsweep.profile import phase
from healsweep.score.compact import COMPACT, TeacherCacheFormat, cache_format
from healsweep.score.expert_cache import MIB, ExpertCacheConfig, expert_bytes, layer_capacities
from healsweep.score.metrics import WindowMetrics, compact_window_metrics, window_metrics
from healsweep.score.record import CacheWindowStats
from healsweep.score.student import StudentModel, student_model
from healsweep.score.teacher_cache import TeacherOutput, scored_positions, teacher_outputs

if TYPE_CHECKING:
    from healsweep.data.windows import Window
    from healsweep.gguf_io import GGUFModel


def check_same_vocab(teacher: GGUFModel, student: StudentModel) -> None:
    """Raise :class:`TokenizerError` unless both models have the same vocabulary size."""
    model, _ = student_model(student)
    n_t, n_s = teacher.hparams.n_vocab, model.hparams.n_vocab
    if n_t != n_s:
        raise TokenizerError(
            f"teacher {teacher.path} has {n_t} tokens but student {model.path} has {n_s}; "
            "KL needs the same tokenizer: score models exported from the same base"
        )


class CachedStudent:
    """Runs a student's forwards through the expert cache and measures each window."""

    def __init__(self, student: StudentModel, config: ExpertCacheConfig) -> None:
        self.student = student
        self.config = config
        self.capacities = layer_capacities(config, student)
        self.mib_per_miss = np.asarray(expert_bytes(student), np.float64) / MIB  # [L]
        self._last: dict[str, list[Any]] = {}  # doc_id -> per-layer final state (warm)

    def run(self, windows: Sequence[Window], positions: Sequence[np.ndarray]) -> Any:
        """``(ForwardResult, [CacheWindowStats per window])`` of one batched forward."""
        model, replacements = student_model(self.student)
        hp = model.hparams
        init, continues = None, None
        if self.config.warm:
            continues = [b > 0 and w.doc_id == windows[b - 1].doc_id
                         for b, w in enumerate(windows)]  # fmt: skip
            init = []
            n_moe = len(hp.moe_layers)
            for layer in range(n_moe):
                cold = empty_state(hp.n_expert)
                starts = [self._last.get(w.doc_id, [cold] * n_moe)[layer] for w in windows]
                init.append(CacheState(np.stack([np.asarray(s.stamp) for s in starts]),
                                       np.stack([np.asarray(s.clock) for s in starts])))  # fmt: skip
        cache = ExpertCacheInput(self.config.bonus, self.capacities, init, continues)
        result = forward(model, [w.tokens for w in windows], replacements=replacements,
                         logits_for=positions, expert_cache=cache)  # fmt: skip
        if self.config.warm:
            for b, window in enumerate(windows):
                self._last[window.doc_id] = [CacheState(s.stamp[b], s.clock[b])
                                             for s in result.cache_states]  # fmt: skip
        stats = []
        for misses, pos in zip(result.cache_misses, positions, strict=True):
            scored = misses[pos].astype(np.int64)  # [n, L]
            stats.append(
                CacheWindowStats(
                    tokens=len(pos),
                    lookups=len(pos) * len(hp.moe_layers) * hp.n_expert_used,
                    misses=int(scored.sum()),
                    mib=float((scored.sum(axis=0) * self.mib_per_miss).sum()),
                )
            )
        return result, stats


def run_student(
    student: StudentModel, windows: Sequence[Window], cached: CachedStudent | None = None
) -> list[tuple[np.ndarray, np.ndarray, Any]]:
    """One batched student forward: per window ``(logits [n, V], topk_ids [n, L, k], cache
    stats)``; through ``cached`` (a :class:`CachedStudent`)
    when given, else the stats are None."""

    model, replacements = student_model(student)
    positions = [scored_positions(w) for w in windows]
    if cached is None:
        result = forward(
            model, [w.tokens for w in windows], replacements=replacements, logits_for=positions
        )
        stats = [None] * len(windows)
    else:
        result, stats = cached.run(windows, positions)
    return [
        (logits, np.asarray(router[pos], dtype=np.int32), stat)
        for logits, router, pos, stat in zip(
            result.logits, result.router, positions, stats, strict=True
        )
    ]


def _per_layer(topk_ids: np.ndarray) -> list[np.ndarray]:
    """``[n, L, k]`` → ``L x [n, k]``."""
    return [topk_ids[:, layer, :] for layer in range(topk_ids.shape[1])]


def _batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def score_windows(
    teacher: GGUFModel,
    student: StudentModel,
    windows: Iterable[Window],
    cache: StageCache,
    batch: int = 8,
    teacher_cache: str | TeacherCacheFormat = COMPACT,
    expert_cache: ExpertCacheConfig | None = None,
) -> Iterator[tuple[Window, WindowMetrics]]:
    """Yield ``(window, WindowMetrics)`` for each window, in order.

    Teacher outputs come from ``cache`` (computed and stored on a miss) in the format
    ``teacher_cache`` names: ``compact`` (default; KLD estimated without bias, everything else
    exact) or ``exact`` (the full log-softmax). The student runs in batches of ``batch``
    windows. Router agreement compares top-k expert sets at the positions that predict the
    scored tokens.

    ``expert_cache`` (an :class:`~healsweep.score.expert_cache.ExpertCacheConfig`) runs the
    student's routing through a simulated expert cache with the MoCE bonus and adds the
    window's cache figures (``WindowMetrics.expert_cache``); the teacher is never biased.
    """
    if batch < 1:
        raise ValueError(f"score_windows: batch must be >= 1, got {batch}")
    fmt = cache_format(teacher_cache)
    check_same_vocab(teacher, student)
    cached = None
    if expert_cache is not None:
        cached = CachedStudent(student, expert_cache)
    with cache.holding():  # the teacher records read or written: held until scoring ends
        yield from _scored(teacher, student, windows, cache, batch, fmt, cached)


def _scored(
    teacher: GGUFModel,
    student: StudentModel,
    windows: Iterable[Window],
    cache: StageCache,
    batch: int,
    fmt: TeacherCacheFormat,
    cached: CachedStudent | None,
) -> Iterator[tuple[Window, WindowMetrics]]:
    for group in _batches(windows, batch):
        with phase("teacher_record"):
            taught = teacher_outputs(teacher, group, cache, fmt)
        with phase("scoring"):
            studied = run_student(student, group, cached)
            scored = [
                (window, _metrics(window, t_out, *student_out))
                for window, t_out, student_out in zip(group, taught, studied, strict=True)
            ]
        yield from scored


def _metrics(window: Window, t_out: Any, s_logits: np.ndarray, s_topk: np.ndarray,
             stats: Any) -> WindowMetrics:  # fmt: skip
    """One window's metrics from the teacher's output and the student's."""
    routers = (_per_layer(t_out.topk_ids), _per_layer(s_topk))
    if isinstance(t_out, TeacherOutput):
        metrics = window_metrics(t_out.logprobs, s_logits, window.scored_tokens, *routers)
    else:
        metrics = compact_window_metrics(t_out, s_logits, window.scored_tokens, *routers)
    if stats is not None:
        metrics = dataclasses.replace(metrics, expert_cache=stats)
    return metrics


__all__ = ["CachedStudent", "check_same_vocab", "run_student", "score_windows"]
