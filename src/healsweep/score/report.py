"""A whole scoring run as one JSON-ready record, and its summary table.

The record's ``windows`` hold, per window, everything needed to recompute it independently:
``tokens`` (all ids, context included), ``scored_from`` and ``n_scored`` (the scored tokens are
``tokens[scored_from : scored_from + n_scored]``, each predicted from the logits at the position
before it) next to the window's metrics. ``pooled`` holds the token-pooled figures, per stratum
too (see :func:`healsweep.score.stats.pooled`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gguf import Keys

from healsweep.cache import StageCache
from healsweep.errors import TokenizerError
from healsweep.score.expert_cache import layer_capacities, pooled_cache
from healsweep.score.runner import score_windows
from healsweep.score.stats import pooled
from healsweep.score.student import student_model

if TYPE_CHECKING:
    from healsweep.data.windows import Window
    from healsweep.gguf_io import GGUFModel
    from healsweep.score.compact import TeacherCacheFormat
    from healsweep.score.expert_cache import ExpertCacheConfig
    from healsweep.score.student import StudentModel

TOKENS_KEY = Keys.Tokenizer.LIST


def check_same_tokenizer(teacher: GGUFModel, student: StudentModel) -> int:
    """The shared vocabulary size; :class:`TokenizerError` naming the first differing token."""
    model, _ = student_model(student)
    ref, got = teacher.metadata(TOKENS_KEY), model.metadata(TOKENS_KEY)
    if ref is None or got is None:
        which = teacher.path if ref is None else model.path
        raise TokenizerError(
            f"{which} has no {TOKENS_KEY} metadata, so the tokenizers cannot be compared; "
            "score GGUFs that carry their tokenizer"
        )
    if list(ref) == list(got):
        return len(ref)
    if len(ref) != len(got):
        detail = f"{len(ref)} vs {len(got)} tokens"
    else:
        i = next(i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b)
        detail = f"token {i} is {ref[i]!r} in the reference but {got[i]!r} in the model"
    raise TokenizerError(
        f"the tokenizers of {teacher.path} and {model.path} differ ({detail}); KL needs the same "
        "token list: score two exports of the same base model"
    )


def score_report(
    teacher: GGUFModel,
    student: StudentModel,
    windows: Sequence[Window],
    cache: StageCache,
    *,
    batch: int = 8,
    progress: Callable[[int, int, float], None] | None = None,
    teacher_cache: str | TeacherCacheFormat = "compact",
    expert_cache: ExpertCacheConfig | None = None,
) -> dict[str, Any]:
    """Score ``windows`` and return ``{pooled, windows, n_windows, seconds, windows_per_s}``
    (and ``expert_cache``: its config, capacities and pooled figures, when one is simulated).

    ``progress(done, total, elapsed_s)`` is called after every window; ``teacher_cache`` and
    ``expert_cache`` are passed to :func:`~healsweep.score.runner.score_windows`.
    """
    started = time.perf_counter()
    records, metrics = [], []
    for done, (window, m) in enumerate(
        score_windows(teacher, student, windows, cache, batch=batch, teacher_cache=teacher_cache,
                      expert_cache=expert_cache),  # fmt: skip
        start=1,
    ):
        metrics.append(m)
        records.append({**window.to_record(), **m.to_dict()})
        if progress is not None:
            progress(done, len(windows), time.perf_counter() - started)
    seconds = time.perf_counter() - started
    report = {
        "n_windows": len(records),
        "seconds": seconds,
        "windows_per_s": len(records) / seconds if seconds > 0 else math.inf,
        "pooled": pooled(metrics, [w.stratum for w in windows]),
        "windows": records,
    }
    if expert_cache is not None:

        report["expert_cache"] = {
            **expert_cache.model_dump(),
            "capacity": layer_capacities(expert_cache, student),
            "pooled": pooled_cache(records),
        }
    return report


def _row(name: str, p: dict[str, Any]) -> str:
    return (
        f"{name:<14} {p['n_windows']:>7d} {p['n_tokens']:>7d} {p['kld_mean']:>10.5f} "
        f"{100 * p['top1']:>7.2f} {p['delta_p_mean']:>+9.5f} {p['teacher_ppl']:>9.2f} "
        f"{p['student_ppl']:>9.2f} {p['router_jaccard']:>8.4f}"
    )


def format_summary(report: dict[str, Any]) -> str:
    """A plain-text table: one row per stratum, then the pooled row and the macro means."""
    header = (
        f"{'stratum':<14} {'windows':>7} {'tokens':>7} {'KLD mean':>10} {'top-1 %':>7} "
        f"{'delta p':>9} {'ppl ref':>9} {'ppl model':>9} {'router J':>8}"
    )
    pool = report["pooled"]
    lines = [header, "-" * len(header)]
    lines += [_row(name, p) for name, p in pool.get("per_stratum", {}).items()]
    lines.append("-" * len(header))
    lines.append(_row("pooled", pool))
    if "kld_macro" in pool:
        lines.append(
            f"macro over strata: KLD {pool['kld_macro']:.5f}, top-1 {100 * pool['top1_macro']:.2f}%"
        )
    if report.get("expert_cache"):
        ec = report["expert_cache"]
        cp, low, high = ec["pooled"], min(ec["capacity"]), max(ec["capacity"])
        size = f"{low}" if low == high else f"{low}-{high}"
        lines.append(
            f"expert cache (bonus {ec['bonus']:g}, {size} experts per layer, "
            f"{'warm' if ec['warm'] else 'cold'}): hit rate "
            f"{100 * cp['hit_rate']:.2f}%, {cp['misses_per_token']:.3f} misses/token, "
            f"{cp['mib_per_token']:.4f} MiB/token"
        )
    lines.append(
        f"{report['n_windows']} windows in {report['seconds']:.1f} s "
        f"({report['windows_per_s']:.2f} windows/s)"
    )
    return "\n".join(lines)


__all__ = ["check_same_tokenizer", "format_summary", "score_report"]
