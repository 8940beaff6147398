"""Scoring: per-window metrics of a student against its teacher, pooling and comparison.

``score_windows`` (runner) yields ``(window, WindowMetrics)``; ``pooled``, ``paired_compare`` and
``decision`` (stats) turn many windows into figures, confidence intervals and a verdict. The teacher
is cached per window as a compact record by default (``compact``, see docs/teacher-cache.md) or
as its full log-softmax (``exact``).
"""

from healsweep.score.compact import CompactTeacher, TeacherCacheFormat, cache_format
from healsweep.score.metrics import (
    WindowMetrics,
    compact_window_metrics,
    router_agreement,
    window_metrics,
)
from healsweep.score.runner import check_same_vocab, score_windows, student_model
from healsweep.score.stats import (
    Comparison,
    DecisionRule,
    StratumChange,
    Verdict,
    decision,
    paired_compare,
    pooled,
)
from healsweep.score.teacher_cache import TeacherOutput, teacher_key, teacher_outputs

__all__ = [
    "CompactTeacher",
    "Comparison",
    "DecisionRule",
    "StratumChange",
    "TeacherCacheFormat",
    "TeacherOutput",
    "Verdict",
    "WindowMetrics",
    "cache_format",
    "check_same_vocab",
    "compact_window_metrics",
    "decision",
    "paired_compare",
    "pooled",
    "router_agreement",
    "score_windows",
    "student_model",
    "teacher_key",
    "teacher_outputs",
    "window_metrics",
]
