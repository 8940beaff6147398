"""Routed-residual figures of Part A and Part B, in-sample and on a held-out calibration slice.

The audit's §1.2 table: per layer, the relative routed residual ``|y_ref - alpha*y_q|² / |y_ref|²``
for alpha = 1, the shipped Gaussian alpha and the MSE alpha fitted on the calibration trace, and
with the shipped ridge on top, each on the calibration tokens (in-sample) and on calibration
documents held out of the fit. With the ridge, the residual counts the shared expert's change:
``|y_ref - alpha*y_q - gate * z·ΔWᵀ|² / |y_ref|²`` with ΔW the stored (requantized) update.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from healsweep.cache import StageCache
from healsweep.heal import quantize, ridge, stages
from healsweep.heal._runner import StageRunner
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import Student, build_student
from healsweep.heal.stages import RoutedOutput
from healsweep.heal.trace import calibration_documents, calibration_trace
from healsweep.stage_names import Stage

if TYPE_CHECKING:
    from healsweep.data.corpus import Corpus
    from healsweep.gguf_io import GGUFModel

VARIANTS = ("alpha_1", "gaussian", "mse", "gaussian_ridge", "mse_ridge")


def heldout_split(
    corpus: Corpus, calibration: CalibrationConfig, every: int = 4
) -> tuple[CalibrationConfig, CalibrationConfig]:
    """(fit, held-out) configs: every ``every``-th calibration document of each stratum is held out."""
    docs = calibration_documents(corpus, calibration)
    position: dict[str, int] = {}
    held = []
    for doc in docs:
        n = position.get(doc.stratum, 0)
        position[doc.stratum] = n + 1
        if n % every == every - 1:
            held.append(doc.doc_id)
    kept = [d.doc_id for d in docs if d.doc_id not in set(held)]
    excluded = tuple(calibration.exclude_doc_ids)
    fit = calibration.model_copy(update={"exclude_doc_ids": excluded + tuple(held)})
    heldout = calibration.model_copy(update={"exclude_doc_ids": excluded + tuple(kept)})
    return fit, heldout


def _energies(
    y_ref: np.ndarray, y_q: np.ndarray, alpha: float, shared_change: np.ndarray | None = None
) -> tuple[float, float]:
    """(|y_ref - alpha*y_q - shared_change|², |y_ref|²) in float64 on host."""
    residual = y_ref.astype(np.float64) - alpha * y_q.astype(np.float64)
    if shared_change is not None:
        residual -= shared_change
    return float(np.sum(residual**2)), float(np.sum(y_ref.astype(np.float64) ** 2))


def _shared_change(student: Student, layer: int, trace_layer: dict[str, np.ndarray]):
    new = student.replacements[layer].down_shexp
    if new is None:
        return None
    return ridge.shared_change(student.base, layer, trace_layer, new)  # [T, D]


def residual_table(
    model: GGUFModel,
    corpus: Corpus,
    cache: StageCache,
    calibration: CalibrationConfig,
    base: Knobs | None = None,
    every: int = 4,
) -> dict[str, Any]:
    """Per-layer and pooled residuals of every variant, in-sample and held-out, plus timings."""
    base = base or Knobs()
    fit_cfg, held_cfg = heldout_split(corpus, calibration, every)
    shipped, cold = _timed_student(model, base.replace(alpha="gaussian"), fit_cfg, cache, corpus)
    trials = {
        name: _timed_student(model, base.replace(alpha="gaussian", **changed), fit_cfg, cache,
                             corpus)[1]
        for name, changed in _timed_changes(base)
    }  # fmt: skip
    mse = build_student(model, base.replace(alpha="mse", gamma=0.0), fit_cfg, cache, corpus=corpus)
    traces = {
        "cal": calibration_trace(model, fit_cfg, cache, corpus),
        "heldout": calibration_trace(model, held_cfg, cache, corpus),
    }
    totals: dict[str, list[float]] = {}
    run = StageRunner(cache)
    rows = [
        _layer_row(model, run, base, traces, (shipped, mse), (position, layer), totals)
        for position, layer in enumerate(model.hparams.moe_layers)
    ]
    return {
        "rows": rows,
        "pooled": {k: res / ref if ref > 0 else 0.0 for k, (res, ref) in totals.items()},
        "tokens": {split: trace.report["tokens_used"] for split, trace in traces.items()},
        "calibration_report": traces["cal"].report,
        "ridge_warnings": sorted(
            {(r.get("ridge") or {}).get("warning") or "" for r in shipped.report["layers"]} - {""}
        ),
        "trial_cold": cold,
        **{f"trial_{name}": trial for name, trial in trials.items()},
    }


def _timed_changes(base: Knobs) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The warm trials timed after the cold one: each changes one stage's knob."""
    return (
        ("eta_only", {"eta": base.eta * 2}),
        ("rho_only", {"rho": base.rho * 2}),
        ("quant_only", {"gain_d": 0.5 if base.gain_d != 0.5 else 0.25}),
    )


def _timed_student(
    model: GGUFModel, knobs: Knobs, cfg: CalibrationConfig, cache: StageCache, corpus: Corpus
) -> tuple[Student, dict[str, Any]]:
    """The student of ``knobs`` and how long it took, per stage, with what it executed."""
    start = time.perf_counter()
    built = build_student(model, knobs, cfg, cache, corpus=corpus)
    timing = {
        "seconds": time.perf_counter() - start,
        "timings_s": built.report["timings_s"],
        "executed": built.report["executed"],
    }
    return built, timing


_RIDGE_FIGURES = ("rank", "dof", "in_sample_change", "heldout_change", "realized_in_sample_change")


def _layer_row(
    model: GGUFModel,
    run: StageRunner,
    base: Knobs,
    traces: dict[str, Any],
    students: tuple[Student, Student],
    where: tuple[int, int],
    totals: dict[str, list[float]],
) -> dict[str, Any]:
    """The row of MoE layer ``where = (position, layer)``: its alphas, each variant's residual
    per split (its energies added to ``totals``) and the shipped ridge's figures."""
    (shipped, mse), (position, layer) = students, where
    qkeys = quantize.layer_keys(model, base, traces["cal"].key, layer)
    experts = quantize.cached_experts(run.cache, qkeys)  # built by the students above
    row: dict[str, Any] = {
        "layer": layer,
        "alpha_gaussian": shipped.alphas[position],
        "alpha_mse": mse.alphas[position],
    }
    for split, trace in traces.items():
        arrays = trace.layer(layer)
        y_q = _routed_q(model, run, stages.routed_q_key(qkeys, trace.key, layer), experts, arrays)
        y_ref = arrays["y_ref"]
        if split == "heldout":
            row["alpha_oracle_heldout"] = float(
                np.sum(y_ref.astype(np.float64) * y_q) / np.sum(y_q.astype(np.float64) ** 2)
            )
        for name, (res, ref) in _variants(y_ref, y_q, students, where, arrays).items():
            row[f"{split}.{name}"] = res / ref if ref > 0 else 0.0
            acc = totals.setdefault(f"{split}.{name}", [0.0, 0.0])
            acc[0] += res
            acc[1] += ref
    ridge_report = shipped.report["layers"][position].get("ridge") or {}
    row.update({f"ridge.{k}": ridge_report.get(k) for k in _RIDGE_FIGURES})
    return row


def _routed_q(model: GGUFModel, run: StageRunner, key: str, experts: Any, arrays: Any) -> Any:
    """``y_q``: the quantized experts' routed output on a trace layer (the students cached it)."""

    def compute() -> RoutedOutput:
        return RoutedOutput(stages.routed_output(experts, arrays, model.hparams.n_expert))

    return run.value(Stage.ROUTED_Q, key, RoutedOutput, compute).y_q


def _variants(
    y_ref: np.ndarray,
    y_q: np.ndarray,
    students: tuple[Student, Student],
    where: tuple[int, int],
    arrays: dict[str, np.ndarray],
) -> dict[str, tuple[float, float]]:
    """(residual, reference) energies of each of :data:`VARIANTS` on one split of a layer."""
    (shipped, mse), (position, layer) = students, where
    a_ship, a_mse = shipped.alphas[position], mse.alphas[position]
    return {
        "alpha_1": _energies(y_ref, y_q, 1.0),
        "gaussian": _energies(y_ref, y_q, a_ship),
        "mse": _energies(y_ref, y_q, a_mse),
        "gaussian_ridge": _energies(y_ref, y_q, a_ship, _shared_change(shipped, layer, arrays)),
        "mse_ridge": _energies(y_ref, y_q, a_mse, _shared_change(mse, layer, arrays)),
    }
