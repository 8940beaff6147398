"""``healsweep bench trial``: what one heal trial costs on a model, stage by stage.

Four or five trials run in one process against one stage cache, each after the one before: a
cold trial (empty cache: teacher trace, quantization, Part A, the ridge factorization and fit),
then trials that change only quantization knobs (``gain_gu``), only ``rho``, only ``eta``, and
(where ggml's quantizer is installed and a bigger type fits the model's rows) only ``type_d`` —
the kinds of step a sweep takes. Each reports its wall time, the time of every stage it ran, which
stages were computed rather than read from the cache, its own peak RSS (the high-water mark
is reset before each trial where Linux allows it) and its peak owned memory (``RssAnon``,
sampled: what the process holds, not the file pages it reads through a map).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from healsweep._rss import OwnedPeak, peak_rss_bytes, reset_peak_rss
from healsweep.cache import StageCache
from healsweep.errors import SettingError
from healsweep.gguf_io._ggml_lib import libggml
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.kernels.ggml_types import step_up
from healsweep.profile import phase_totals, profiling
from healsweep.threads import host_threads

if TYPE_CHECKING:
    from healsweep.data.corpus import Corpus
    from healsweep.gguf_io import GGUFModel


def trial_variants(base: Knobs, model: GGUFModel | None = None) -> list[tuple[str, Knobs]]:
    """``(label, knobs)``: the cold trial, then one change of each kind a sweep makes; with
    ``model``, last a change of ``type_d`` alone (to the next type up the ladder whose blocks
    fill the model's down rows), when ggml's quantizer is there to make it."""
    nudge = 0.1 if base.gain_gu <= 1.9 else -0.1
    eta = base.eta * 2 if base.eta * 2 <= 2.0 else base.eta / 2
    eta_only = base.replace(gain_gu=round(base.gain_gu + nudge, 6), rho=base.rho * 2, eta=eta)
    variants = [
        ("cold", base),
        ("quant-knobs only (gain_gu)", base.replace(gain_gu=round(base.gain_gu + nudge, 6))),
        ("rho only", base.replace(gain_gu=round(base.gain_gu + nudge, 6), rho=base.rho * 2)),
        ("eta only", eta_only),
    ]
    found, _ = (None, "") if model is None else type_step(base.type_d, model.hparams.n_ff_exp)
    if found is not None:
        variants.append((f"type_d only ({base.type_d} -> {found})", eta_only.replace(type_d=found)))
    return variants


def type_step(type_d: str, width: int) -> tuple[str | None, str]:
    """``(type, "")``: the next type above ``type_d`` whose blocks fill rows of ``width`` weights
    (:func:`~healsweep.kernels.ggml_types.step_up`), or ``(None, why)`` where the type-only
    trial cannot run: ggml's quantizer is not installed, or no bigger type fits the rows."""

    try:
        libggml()
    except SettingError:
        return None, (
            'no type-only trial: ggml\'s quantizer is not installed (pip install -e ".[ggml]")'
        )
    found = step_up(type_d, width)
    if found == type_d:
        return None, f"no type-only trial: no type above {type_d} fills rows of {width} weights"
    return found, ""


def bench_trials(
    model: GGUFModel,
    corpus: Corpus,
    cache: StageCache,
    calibration: CalibrationConfig,
    base: Knobs | None = None,
    count: int | None = None,
) -> list[dict[str, Any]]:
    """One row per variant of :func:`trial_variants` (the first ``count`` of them): seconds,
    stage timings, the phase profile, recomputed stages and peak RSS (MiB; ``None`` where the
    mark cannot be reset)."""

    rows = []
    for label, knobs in trial_variants(base or Knobs(), model)[:count]:
        resettable = reset_peak_rss()
        start = time.perf_counter()
        with profiling() as profile, OwnedPeak() as owned:
            student = build_student(model, knobs, calibration, cache, corpus=corpus)
        rows.append(
            {
                "trial": label,
                "seconds": time.perf_counter() - start,
                "layers": len(student.report["layers"]),
                "timings_s": dict(student.report["timings_s"]),
                "executed": dict(sorted(student.report["executed"].items())),
                "peak_rss_mib": peak_rss_bytes() / 2**20 if resettable else None,
                "peak_owned_mib": None if owned.peak is None else owned.peak / 2**20,
                "threads": host_threads(),
                "phases": phase_totals(profile.rows()),
                "phase_rows": profile.rows(),
            }
        )
    return rows


def format_trials(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`bench_trials` as text: a table of trials (wall time, per healed
    layer, peak RSS), then each trial's stages and what it computed."""
    width = max(len("trial"), *(len(row["trial"]) for row in rows))
    lines = [f"{'trial':<{width}}  {'seconds':>9}  {'per layer':>9}  {'peak RSS':>9}  peak owned"]
    for row in rows:
        rss = "-" if row["peak_rss_mib"] is None else f"{row['peak_rss_mib']:.0f} MiB"
        owned = row.get("peak_owned_mib")
        owned = "-" if owned is None else f"{owned:.0f} MiB"
        per_layer = row["seconds"] / max(row["layers"], 1)
        lines.append(f"{row['trial']:<{width}}  {row['seconds']:9.2f}  {per_layer:9.2f}  "
                     f"{rss:>9}  {owned}")  # fmt: skip
    for row in rows:
        computed = ", ".join(f"{k} x{v}" for k, v in row["executed"].items()) or "nothing"
        lines.append(f"{row['trial']} ({row['threads']} host threads), computed: {computed}")
        lines.append(phase_table(row["phases"]))
    return "\n".join(lines)


def phase_table(phases: Mapping[str, Mapping[str, Any]]) -> str:
    """Per phase (:func:`~healsweep.profile.phase_totals`): wall, CPU and device-busy seconds,
    CPU over wall (the cores a host phase kept busy), the wall seconds JAX spent compiling and
    stage-cache MiB written, as Markdown."""
    lines = ["| phase | layers | wall s | CPU s | CPU/wall | device s | compile s | cache MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, p in phases.items():
        ratio = p["cpu_s"] / p["wall_s"] if p["wall_s"] > 0.005 else None
        device = "-" if p["device_s"] is None else f"{p['device_s']:.2f}"
        lines.append(
            f"| {name} | {p['layers'] or '-'} | {p['wall_s']:.2f} | {p['cpu_s']:.2f} "
            f"| {'-' if ratio is None else f'{ratio:.2f}'} | {device} "
            f"| {p.get('compile_s') or 0.0:.2f} | {p['cache_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)
