"""``healsweep bench trial``: what one heal trial costs on a model, stage by stage.

Four trials run in one process against one stage cache, each after the one before: a cold trial
(empty cache: teacher trace, quantization, Part A, the ridge factorization and fit), then trials
that change only quantization knobs (``gain_gu``), only ``rho``, and only ``eta`` — the three
kinds of step a sweep takes. Each reports its wall time, the time of every stage it ran, which
stages were computed rather than read from the cache, and its own peak RSS (the high-water mark
is reset before each trial where Linux allows it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from healsweep.cache import StageCache
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student

if TYPE_CHECKING:
    from healsweep.data.corpus import Corpus
    from healsweep.gguf_io import GGUFModel


def trial_variants(base: Knobs) -> list[tuple[str, Knobs]]:
    """``(label, knobs)``: the cold trial, then one change of each kind a sweep makes."""
    nudge = 0.1 if base.gain_gu <= 1.9 else -0.1
    eta = base.eta * 2 if base.eta * 2 <= 2.0 else base.eta / 2
    return [
        ("cold", base),
        ("quant-knobs only (gain_gu)", base.replace(gain_gu=round(base.gain_gu + nudge, 6))),
        ("rho only", base.replace(gain_gu=round(base.gain_gu + nudge, 6), rho=base.rho * 2)),
        ("eta only", base.replace(gain_gu=round(base.gain_gu + nudge, 6), rho=base.rho * 2,
                                  eta=eta)),
    ]


def bench_trials(
    model: GGUFModel, corpus: Corpus, cache: StageCache, calibration: CalibrationConfig,
    base: Knobs | None = None,
) -> list[dict[str, Any]]:
    """One row per variant of :func:`trial_variants`: seconds, stage timings, recomputed
    stages and peak RSS (MiB; ``None`` where the mark cannot be reset)."""
    from healsweep.model.bench import peak_rss_bytes, reset_peak_rss

    rows = []
    for label, knobs in trial_variants(base or Knobs()):
        resettable = reset_peak_rss()
        start = time.perf_counter()
        student = build_student(model, knobs, calibration, cache, corpus=corpus)
        rows.append({
            "trial": label,
            "seconds": time.perf_counter() - start,
            "timings_s": dict(student.report["timings_s"]),
            "executed": dict(sorted(student.report["executed"].items())),
            "peak_rss_mib": peak_rss_bytes() / 2**20 if resettable else None,
        })
    return rows


def format_trials(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`bench_trials` as text: one line per trial, its stages under it."""
    lines = []
    for row in rows:
        rss = "-" if row["peak_rss_mib"] is None else f"{row['peak_rss_mib']:.0f} MiB"
        lines.append(f"{row['trial']:<28} {row['seconds']:8.2f} s  peak RSS {rss}")
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in row["timings_s"].items())
        computed = ", ".join(f"{k} x{v}" for k, v in row["executed"].items()) or "nothing"
        lines.append(f"    stages: {stages}")
        lines.append(f"    computed: {computed}")
    return "\n".join(lines)
