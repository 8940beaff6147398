"""Scoring: per-window metrics of a student against its teacher, pooling and comparison.

``score_windows`` (runner) yields ``(window, WindowMetrics)``; ``pooled``, ``paired_compare`` and
``decision`` (stats) turn many windows into figures, confidence intervals and a verdict. The teacher
is cached per window as a compact record by default (``compact``, see docs/teacher-cache.md) or
as its full log-softmax (``exact``).

The names below are imported on first use, so that ``healsweep.score.record`` (the window record,
which reading results needs) can be imported without jax.
"""

from importlib import import_module
from typing import Any

_MODULE_OF = {
    "CompactTeacher": "compact",
    "TeacherCacheFormat": "compact",
    "cache_format": "compact",
    "WindowMetrics": "record",
    "WindowRecord": "record",
    "compact_window_metrics": "metrics",
    "router_agreement": "metrics",
    "window_metrics": "metrics",
    "check_same_vocab": "runner",
    "score_windows": "runner",
    "student_model": "student",
    "Comparison": "stats",
    "DecisionRule": "stats",
    "StratumChange": "stats",
    "Verdict": "stats",
    "decision": "stats",
    "paired_compare": "stats",
    "pooled": "stats",
    "TeacherOutput": "teacher_cache",
    "teacher_key": "teacher_cache",
    "teacher_outputs": "teacher_cache",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'healsweep.score' has no attribute {name!r}")
    return getattr(import_module(f"healsweep.score.{_MODULE_OF[name]}"), name)


__all__ = sorted(_MODULE_OF)
