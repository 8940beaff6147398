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
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from healsweep.cache import StageCache
from healsweep.errors import SettingError, TokenizerError
from healsweep.model import forward, forward_batches
from healsweep.model.expert_cache import CacheState, ExpertCacheInput, empty_state
from healsweep.model.forward import PAD_MULTIPLE
from healsweep.profile import phase
from healsweep.runtime import current
from healsweep.score.compact import COMPACT, TeacherCacheFormat, cache_format
from healsweep.score.expert_cache import MIB, ExpertCacheConfig, expert_bytes, layer_capacities
from healsweep.score.metrics import (
    WindowMetrics,
    bucket_rows,
    compact_window_metrics,
    window_metrics,
)
from healsweep.score.record import CacheWindowStats
from healsweep.score.student import StudentModel, student_model
from healsweep.score.teacher_cache import TeacherOutput, scored_positions, teacher_outputs

if TYPE_CHECKING:
    from healsweep.data.windows import Window
    from healsweep.gguf_io import GGUFModel


# Hidden states a group of windows carries between layers by default: 64 windows of 1,024
# tokens at D = 2,048 (Qwen1.5-MoE: 64 dev windows of up to 512 tokens fit in one group).
GROUP_BYTES = 512 << 20
TEACHER_AHEAD_ENV = "HEALSWEEP_TEACHER_AHEAD"  # on | off | auto (accelerators: on)

log = logging.getLogger(__name__)


def teacher_ahead_on() -> bool:
    """Whether :func:`teacher_ahead` runs: on a CUDA or ROCm GPU, unless
    :data:`TEACHER_AHEAD_ENV` says ``off``; elsewhere only where it says ``on`` (on the CPU
    backend the teacher's forward and the student's build would share the same cores, and on
    Metal the same memory, the host's)."""
    chosen = os.environ.get(TEACHER_AHEAD_ENV, "auto").strip().lower() or "auto"
    if chosen not in ("on", "off", "auto"):
        raise SettingError(
            f"{TEACHER_AHEAD_ENV}={os.environ[TEACHER_AHEAD_ENV]!r} is not on, off or auto; set "
            "it to on (the teacher's records made on a thread while the student is built), off, "
            "or unset it (auto: on CUDA and ROCm GPUs)"
        )
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    return chosen == "on" or (chosen == "auto" and gpu)


@contextmanager
def teacher_ahead(
    teacher: GGUFModel,
    windows: Sequence[Window],
    cache: StageCache,
    batch: int = 8,
    teacher_cache: str | TeacherCacheFormat = COMPACT,
) -> Iterator[None]:
    """While the block runs (a trial building its student: the calibration trace, the
    healing), the teacher's records of ``windows`` are computed on a thread of the runtime's
    (``teacher-ahead``), batch by batch in scoring order (:func:`teacher_outputs`), and stored,
    where :func:`score_windows` finds them. A record is a function of its window alone, so it
    is the same bytes whichever thread makes it; scoring that reaches a batch the thread is
    computing waits on its entries' locks, and one the thread has not reached it computes
    itself. The teacher's forward (on a cold trial of a real-size model, its XLA compiles
    above all) thus overlaps the host-bound stages before scoring. Entries are held by the
    cache's :meth:`~healsweep.cache.StageCache.holding` block around it. At the block's end
    the thread stops after its batch in flight; a failure there is logged and leaves the rest
    to scoring. A no-op unless :func:`teacher_ahead_on`; charged to phase ``teacher_ahead``.
    """
    if not teacher_ahead_on() or not windows:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        with phase("teacher_ahead"):
            for windows_of_batch in _batches(windows, batch):
                if stop.is_set():
                    return
                teacher_outputs(teacher, windows_of_batch, cache, teacher_cache)

    done = current().executor("teacher-ahead", 1).submit(run)
    try:
        yield
    finally:
        stop.set()
        failed = done.exception()  # waits for the batch in flight
        if failed is not None:
            log.warning("the teacher's records ahead of scoring stopped (%s: %s); scoring "
                        "computes the rest", type(failed).__name__, failed)  # fmt: skip


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
    return _per_window(result, positions, stats)


def student_batches(
    student: StudentModel, batches: Sequence[Sequence[Window]], cached: CachedStudent | None = None
) -> Iterator[list[tuple[np.ndarray, np.ndarray, Any]]]:
    """:func:`run_student` of each of ``batches``, in order, layer-major
    (:func:`~healsweep.model.forward.forward_batches`): the student's layers are read once for
    all of them, the results are the same bit for bit; the logits stay on the device (jax
    arrays, zero rows appended up to the metrics' row bucket: the same values reach their
    kernels). Through ``cached`` the batches run one
    after the other (its cache states pass from batch to batch)."""
    if cached is not None:
        for windows in batches:
            yield run_student(student, windows, cached)
        return
    model, replacements = student_model(student)
    positions = [[scored_positions(w) for w in windows] for windows in batches]
    tokens = [[w.tokens for w in windows] for windows in batches]
    results = forward_batches(model, tokens, replacements=replacements, logits_for=positions,
                              pad_rows=bucket_rows)  # fmt: skip
    for result, wanted in zip(results, positions, strict=True):
        yield _per_window(result, wanted, [None] * len(wanted))


def _per_window(
    result: Any, positions: list[np.ndarray], stats: Sequence[Any]
) -> list[tuple[np.ndarray, np.ndarray, Any]]:
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
    group: int | None = None,
) -> Iterator[tuple[Window, WindowMetrics]]:
    """Yield ``(window, WindowMetrics)`` for each window, in order.

    Teacher outputs come from ``cache`` (computed and stored on a miss) in the format
    ``teacher_cache`` names: ``compact`` (default; KLD estimated without bias, everything else
    exact) or ``exact`` (the full log-softmax). The student runs in batches of ``batch``
    windows, layer-major over groups of ``group`` windows (whole batches, rounded up; None: as
    many as carry at most :data:`GROUP_BYTES` of hidden states): every batch of a group
    advances through layer l before layer l + 1 is read, so a streamed student's layers are
    read once per group, then each batch's logits and metrics are made and its windows
    yielded. A window's metrics do not depend on ``group``
    (each batch runs the same shapes as alone); a smaller group yields its first window sooner
    (a pruner's reports) and carries fewer hidden states (``[batch, T, D]`` float32 a batch).
    Router agreement compares top-k expert sets at the positions that predict the scored
    tokens.

    ``expert_cache`` (an :class:`~healsweep.score.expert_cache.ExpertCacheConfig`) runs the
    student's routing through a simulated expert cache with the MoCE bonus and adds the
    window's cache figures (``WindowMetrics.expert_cache``); the teacher is never biased.
    """
    if batch < 1:
        raise ValueError(f"score_windows: batch must be >= 1, got {batch}")
    if group is not None and group < 1:
        raise ValueError(f"score_windows: group must be >= 1 or None, got {group}")
    fmt = cache_format(teacher_cache)
    check_same_vocab(teacher, student)
    cached = None
    if expert_cache is not None:
        cached = CachedStudent(student, expert_cache)
    with cache.holding():  # the teacher records read or written: held until scoring ends
        n_embd = teacher.hparams.n_embd
        for batches in _groups(_batches(windows, batch), group, n_embd):
            yield from _scored(teacher, student, batches, cache, fmt, cached)


def _carried_bytes(windows: Sequence[Window], n_embd: int) -> int:
    """A batch's hidden states between layers: ``[B, T, D]`` float32, T padded as the forward
    pads it."""
    longest = max(len(w.tokens) for w in windows)
    return len(windows) * -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE * n_embd * 4


def _groups(
    batches: Iterable[list[Window]], group: int | None, n_embd: int
) -> Iterator[list[list[Window]]]:
    """Batches gathered into groups that advance through the layers together: whole batches
    up to ``group`` windows (at least one batch), or with ``group`` None as many as carry at
    most :data:`GROUP_BYTES` of hidden states."""
    found: list[list[Window]] = []
    size = carried = 0
    for windows in batches:
        more = _carried_bytes(windows, n_embd)
        full = size >= group if group is not None else carried + more > GROUP_BYTES
        if found and full:
            yield found
            found, size, carried = [], 0, 0
        found.append(windows)
        size += len(windows)
        carried += more
    if found:
        yield found


def _scored(
    teacher: GGUFModel,
    student: StudentModel,
    batches: Sequence[Sequence[Window]],
    cache: StageCache,
    fmt: TeacherCacheFormat,
    cached: CachedStudent | None,
) -> Iterator[tuple[Window, WindowMetrics]]:
    """One group of windows: the student's layers once for all its batches, then batch by
    batch the teacher's records, the student's logits and the metrics (one batch's logits and
    teacher records exist at a time)."""
    studied = student_batches(student, batches, cached)
    for windows_of_batch in batches:
        with phase("teacher_record"):
            taught = teacher_outputs(teacher, windows_of_batch, cache, fmt)
        with phase("scoring"):
            scored = [
                (window, _metrics(window, t_out, *student_out))
                for window, t_out, student_out in zip(
                    windows_of_batch, taught, next(studied), strict=True
                )
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


__all__ = [
    "CachedStudent",
    "check_same_vocab",
    "run_student",
    "score_windows",
    "student_batches",
    "teacher_ahead",
]
