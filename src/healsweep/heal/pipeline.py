"""``build_student``: one trial's healed student, composed from cached stages.

The stages run layer by layer (only one layer's teacher weights and trace in memory at a time):

    calib_trace ─► quantize ─► routed_q ─► part_a ─► ridge_rhs ─► ridge_fit ─► part_b
    (teacher)      (Q2_0)      (y_q on the   (alpha)   (B = Z'ᵀdY)  (dW at rho) (W + eta·dW,
        │                      same inputs)                           ▲        requantized)
        └──────────────────► ridge_basis (G = V Λ Vᵀ) ────────────────┘

Stages that a knob setting does not need are skipped: with ``alpha: none`` (or ``gaussian``),
``ridge: false`` and no ``act`` importance the teacher is never traced. Each stage is served from
the cache when its key (DESIGN.md) is present, so a sweep over ``eta`` re-uses the quantized
experts, their routed outputs and dW (only W + eta·dW is requantized), a sweep over ``rho``
re-uses the factored Gram and B (two matrix products per layer), and a sweep over ``gain_d`` re-uses the
teacher trace and the factored Gram.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache as cache_fn
from functools import partial
from typing import Any

import numpy as np

from healsweep.cache import StageCache, content_key
from healsweep.heal import expert_alpha, ridge, stages
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.trace import Trace, calibration_trace, report_lines
from healsweep.kernels import alpha as alpha_kernels

STUDENT_VERSION = 1
# Two threads for the held-out diagnostic of Part B: nothing a trial builds reads it, so its host
# solves run while the next layers heal; build_student waits for them before it returns. (One
# thread fell behind: on the 4-layer real-size slice a rho-only trial then waited 1.1 s for it
# after the last layer; with two, 0.55-0.6 s, and the trial took 2.5-2.6 s instead of 2.8 s, H200.)
_HELDOUT = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ridge-heldout")
Progress = Callable[[str, str], None]


@dataclass
class Student:
    """A healed student: the base model plus per-layer replacements, and what built it."""

    base: Any  # the teacher's GGUFModel
    replacements: dict[int, Any]  # layer → LayerReplacement (Q2Weight experts, healed shexp)
    report: dict[str, Any]
    key: str
    knobs: Knobs
    alphas: list[float] = field(default_factory=list)
    shexp_raw: dict[int, np.ndarray] = field(default_factory=dict)  # requantized bytes/values


def skip_notices(knobs: Knobs, model: Any) -> list[str]:
    """One line per part of the method this model cannot take (a user reads them, the trial
    goes on): Part B on a model without a shared expert, and leading dense layers."""
    hp = model.hparams
    lines = []
    if knobs.ridge and hp.n_ff_shexp == 0:
        lines.append(
            f"Part B skipped: {hp.arch} has no shared expert, so the ridge does not apply "
            "(ridge/rho/eta are ignored; quantization and Part A run as asked)"
        )
    if hp.n_leading_dense:
        lines.append(
            f"layers 0..{hp.n_leading_dense - 1} skipped: dense FFN, no routed experts to "
            "quantize or heal (they stay as in the teacher)"
        )
    return lines


def needs_trace(knobs: Knobs, model: Any) -> bool:
    """Whether any stage of this trial reads the calibration trace."""
    ridge = knobs.ridge and model.hparams.n_ff_shexp > 0
    return knobs.alpha == "mse" or ridge or knobs.uses_activation_statistics()


def scaled_down(down: Any, alpha: float) -> Any:
    """The down experts with every scale d multiplied by alpha (stored back as fp16)."""
    if alpha == 1.0:
        return down
    from healsweep.kernels.q2_0 import Q2Weight

    if hasattr(down, "scale_d"):
        return down.scale_d(alpha)
    d = (np.asarray(down.d, np.float32) * np.float32(alpha)).astype(np.float16)
    return Q2Weight(d=d, q=down.q)


class _Timer:
    """Wall seconds per stage, summed over layers (cache hits included: that is what a trial
    pays). Stages run inside one another (a stage reads its upstream entries only when it
    computes), so each is charged its own time, without the stages nested in it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._nested: list[float] = []  # per open stage: seconds of the stages run inside it

    def run(self, stage: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        self._nested.append(0.0)
        try:
            return fn()
        finally:
            elapsed = time.perf_counter() - start
            inner = self._nested.pop()
            self.seconds[stage] = self.seconds.get(stage, 0.0) + elapsed - inner
            if self._nested:
                self._nested[-1] += elapsed


def build_student(
    model: Any,
    knobs: Knobs,
    calibration: CalibrationConfig,
    cache: StageCache,
    *,
    corpus: Any | None = None,
    progress: Progress | None = None,
) -> Student:
    """Quantize and heal every layer of ``model`` under ``knobs``; stages come from ``cache``.

    ``corpus`` overrides loading ``calibration.corpus`` (tests and benchmarks pass one they
    built); ``progress(stage, message)`` is called as stages finish (the CLI prints it).
    """
    from healsweep.model import LayerReplacement

    stages.check_quantizable(model)
    say = progress or (lambda stage, message: None)
    hp = model.hparams
    timer = _Timer()
    computed_before = dict(cache.computed)
    # Entries are written on the cache's writer thread while the next stages run; all are
    # on disk when the block ends.
    with cache.writing_behind():
        trace: Trace | None = None
        if needs_trace(knobs, model):
            trace = timer.run(
                "calib_trace", lambda: calibration_trace(model, calibration, cache, corpus)
            )
            for line in report_lines(trace.report):
                say("calib_trace", line)
        else:
            say("calib_trace", "not needed by these knobs (no teacher pass)")
        for line in skip_notices(knobs, model):
            say("part_b" if "shared expert" in line else "layers", line)
        replacements, alphas, shexp_raw, layer_reports, keys = {}, [], {}, [], []
        heldout: list[tuple[dict[str, Any], Future]] = []  # (layer report, its fold sums)
        for i in hp.moe_layers:
            # Read only if a stage computes: a trial whose stages are all cached reads neither
            # the teacher's experts nor the layer's trace (hundreds of MB a layer at real size).
            weights = cache_fn(partial(stages.expert_weights, model, i))
            trace_layer = (
                cache_fn(partial(timer.run, "calib_trace", partial(trace.layer, i)))
                if trace
                else None
            )
            built = _heal_layer(
                model, i, weights, trace, trace_layer, knobs, calibration, cache, timer
            )
            experts, alpha, shexp, report, layer_keys, folds = built
            if folds is not None:
                heldout.append((report, folds))
            replacements[i] = LayerReplacement(
                gate_exps=experts["gate"],
                up_exps=experts["up"],
                down_exps=scaled_down(experts["down"], alpha),
                down_shexp=None if shexp is None else shexp["dense"],
            )
            if shexp is not None:
                shexp_raw[i] = shexp["raw"]
            alphas.append(alpha)
            layer_reports.append(report)
            keys.append(layer_keys)
            say(f"layer {i + 1}/{hp.n_layer}", _layer_line(report))
        for layer_report, folds in heldout:
            found = timer.run("ridge_heldout", folds.result)
            layer_report["ridge"].update(ridge.heldout_figures(found, knobs.eta))
        if heldout:
            say(
                "ridge_heldout",
                "held-out change per layer: "
                + ", ".join(f"{100 * r['ridge']['heldout_change']:+.2f}%" for r, _ in heldout),
            )
        timer.run("cache_write", cache.flush)  # what is still being written: not overlapped
    report = {
        "knobs": knobs.model_dump(),
        "calibration": trace.report if trace else None,
        "trace_key": trace.key if trace else None,
        "layers": layer_reports,
        "notices": skip_notices(knobs, model),
        "timings_s": {k: round(v, 4) for k, v in timer.seconds.items()},
        "executed": {
            k: v - computed_before.get(k, 0)
            for k, v in cache.computed.items()
            if v != computed_before.get(k, 0)
        },
    }
    key = content_key("student", STUDENT_VERSION, {"layers": keys})
    return Student(model, replacements, report, key, knobs, alphas, shexp_raw)


def _heal_layer(model, i, weights, trace, trace_layer, knobs, calibration, cache, timer):
    """One layer through quantize → routed_q → part_a → part_b (each cached).

    ``weights`` and ``trace_layer`` are loaders (called only when a stage computes); the
    routed output y_q is read only when a stage that needs it computes, so a trial that
    changes only ``eta`` reads the quantized experts, the basis and the fit, nothing else.
    """
    act = knobs.uses_activation_statistics()
    qkey = stages.quantize_key(model, knobs, trace.key if trace else None, i)
    q_arrays, q_report = timer.run(
        "quantize",
        lambda: cache.get_or_compute(
            "quantize",
            qkey,
            lambda: stages.quantize_layer(
                weights(), knobs, trace_layer() if act else None, calibration
            ),
        ),
    )
    experts = stages.q2_weights(q_arrays)

    rkey, y_q = None, None
    if trace is not None:
        rkey = stages.routed_q_key(qkey, trace.key, i)
        y_q = cache_fn(
            lambda: timer.run(
                "routed_q",
                lambda: cache.get_or_compute(
                    "routed_q",
                    rkey,
                    lambda: (
                        {
                            "y_q": stages.routed_output(
                                experts, trace_layer(), model.hparams.n_expert
                            )
                        },
                        {},
                    ),
                ),
            )[0]["y_q"]
        )

    akey = stages.part_a_key(knobs, model, qkey, rkey if knobs.alpha == "mse" else None, i)

    per_expert = knobs.alpha != "none" and knobs.alpha_granularity == "expert"

    def compute_alpha():
        if knobs.alpha == "gaussian":
            if per_expert:
                alphas = expert_alpha.gaussian_alphas(weights(), experts, knobs.gamma)
                return {"alpha": np.float32(1.0), "expert_alpha": alphas}, {}
            value = stages.gaussian_alpha(weights(), experts, knobs.gamma)
        elif knobs.alpha == "mse":
            value = float(alpha_kernels.alpha_mse(trace_layer()["y_ref"], y_q(), knobs.gamma))
            if per_expert:  # starved experts keep the layer's alpha
                alphas = expert_alpha.mse_alphas(
                    weights(),
                    experts,
                    trace_layer(),
                    knobs.gamma,
                    value,
                    calibration.min_tokens_per_expert,
                )
                return {"alpha": np.float32(1.0), "expert_alpha": alphas}, {}
        else:
            value = 1.0
        return {"alpha": np.float32(value)}, {}

    a_arrays = timer.run("part_a", lambda: cache.get_or_compute("part_a", akey, compute_alpha))[0]
    alpha = float(a_arrays["alpha"])
    report: dict[str, Any] = {"layer": i, "alpha": alpha}
    if q_report:
        report["quantize"] = q_report
    y_q_raw, healed = y_q, experts
    if "expert_alpha" in a_arrays:
        # Folded into each expert's down scales now; what Part B and the residuals see is the
        # routed output of those scaled experts (alpha 1), computed once and cached.
        report["expert_alphas"] = [float(a) for a in a_arrays["expert_alpha"]]
        # A new name: the routed_q closure above must keep reading the unscaled experts.
        healed = {
            **experts,
            "down": experts["down"].scale_d(a_arrays["expert_alpha"][:, None, None]),
        }
        if y_q is not None:
            skey = stages.routed_q_key(f"{qkey}+{akey}", trace.key, i)
            y_q = cache_fn(
                lambda: timer.run(
                    "routed_q",
                    lambda: cache.get_or_compute(
                        "routed_q",
                        skey,
                        lambda: (
                            {
                                "y_q": stages.routed_output(
                                    healed, trace_layer(), model.hparams.n_expert
                                )
                            },
                            {},
                        ),
                    ),
                )[0]["y_q"]
            )
    if y_q is not None:

        def residuals():
            found = stages.residual_report(trace_layer()["y_ref"], y_q(), alpha)
            if y_q_raw is not y_q:  # at alpha 1 means: before Part A, i.e. the unscaled experts
                unscaled = stages.residual_report(trace_layer()["y_ref"], y_q_raw(), 1.0)
                found["residual_alpha_1"] = unscaled["residual_alpha_1"]
            return {}, found

        _, found = timer.run(
            "part_a",
            lambda: cache.get_or_compute("residuals", stages.residuals_key(rkey, akey), residuals),
        )
        report.update(found)

    shexp, bkey, folds = None, None, None
    if knobs.ridge and model.hparams.n_ff_shexp > 0:
        shexp, stats, bkey, folds = _part_b(
            model, i, trace, trace_layer, y_q, alpha, knobs, (akey, rkey), cache, timer
        )
        stats = dict(stats)
        stats["residual_after_ridge"] = report["residual"] * (
            1 + stats["realized_in_sample_change"]
        )
        report["ridge"] = stats
    keys = {"quantize": qkey, "part_a": akey, "part_b": bkey}
    return healed, alpha, shexp, report, keys, folds


def _part_b(model, i, trace, trace_layer, y_q, alpha, knobs, upstream, cache, timer):
    """ridge_basis (once per trace) → ridge_rhs (per target) → ridge_fit (per rho) → part_b
    (per eta), each cached and each read only when a stage after it computes."""
    akey, rkey = upstream
    nkey = ridge.basis_key(model, trace.key, i)
    basis = cache_fn(
        lambda: timer.run(
            "ridge_basis",
            lambda: cache.get_or_compute(
                "ridge_basis", nkey, lambda: ridge.compute_basis(model, i, trace_layer())
            ),
        )
    )
    hskey = ridge.rhs_key(nkey, akey, rkey, i)
    rhs = cache_fn(
        lambda: timer.run(
            "ridge_rhs",
            lambda: cache.get_or_compute(
                "ridge_rhs",
                hskey,
                lambda: ridge.compute_rhs(model, i, trace_layer(), y_q(), alpha, basis()[0]),
            ),
        )
    )
    fkey = ridge.fit_key(knobs, nkey, hskey, i)
    fit = cache_fn(
        lambda: timer.run(
            "ridge_fit",
            lambda: cache.get_or_compute(
                "ridge_fit", fkey, lambda: ridge.fit_from_rhs(*rhs(), *basis(), knobs.rho)
            ),
        )
    )
    bkey = ridge.part_b_key(knobs, model, fkey, i)
    shexp, stats = timer.run(
        "part_b",
        lambda: cache.get_or_compute(
            "part_b",
            bkey,
            lambda: ridge.ridge_layer(model, i, basis()[0], rhs()[0], *fit(), knobs.eta),
        ),
    )
    hkey = ridge.heldout_key(fkey)
    held = cache.meta("ridge_heldout", hkey)
    if held is not None:
        folds: Future = Future()
        folds.set_result(held["folds"])
    else:  # its inputs are read here, the host solves run beside the next layers
        args = (model, i, trace_layer(), y_q(), alpha, *basis(), rhs()[0], fit()[1])
        folds = _HELDOUT.submit(
            lambda: cache.get_or_compute(
                "ridge_heldout", hkey, lambda: ridge.compute_heldout(*args)
            )[1]["folds"]
        )
    return shexp, stats, bkey, folds


def _layer_line(report: dict[str, Any]) -> str:
    line = f"alpha {report['alpha']:.4f}"
    if "residual" in report:
        line += (
            f", routed residual {100 * report['residual_alpha_1']:.2f}% at alpha=1 → "
            f"{100 * report['residual']:.2f}%"
        )
    if "ridge" in report:
        ridge = report["ridge"]
        line += f", ridge rank {ridge['rank']} dof {ridge['dof']:.1f}"
    return line
