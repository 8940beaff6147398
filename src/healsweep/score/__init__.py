"""Scoring: per-window metrics of a student against its teacher, pooling and comparison.

``score_windows`` (runner) yields ``(window, WindowMetrics)``; ``pooled``, ``paired_compare`` and
``decision`` (stats) turn many windows into figures, confidence intervals and a verdict.
"""

from healsweep.score.metrics import WindowMetrics, router_agreement, window_metrics
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
    "Comparison",
    "DecisionRule",
    "StratumChange",
    "TeacherOutput",
    "Verdict",
    "WindowMetrics",
    "check_same_vocab",
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
