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

import os
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cache as once
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from healsweep.cache import StageCache, content_key
from healsweep.gguf_io import HEAD, block_prefix, split_block
from healsweep.heal import (
    expert_alpha,
    quantize,
    ridge,
    stages,
    student_trace,
    tensor_importance,
    tensor_types,
)
from healsweep.heal._runner import StageRunner
from healsweep.heal.knobs import (
    AlphaGranularity,
    AlphaMode,
    CalibrationConfig,
    Knobs,
    LayerTypes,
    require_ggml,
)
from healsweep.heal.quantize import fold_alpha, layer_experts
from healsweep.heal.ridge import HealedShexp, HeldoutFolds, RidgeBasis, RidgeFit, RidgeRhs
from healsweep.heal.stages import ExpertStacks, LayerAlpha, Residuals, RoutedOutput
from healsweep.heal.streamed import LayerMap, field_of
from healsweep.heal.tensor_types import InputMoments, RequantTensor
from healsweep.heal.trace import Trace, calibration_trace, report_lines
from healsweep.kernels import alpha as alpha_kernels
from healsweep.model import LayerReplacement
from healsweep.profile import PhaseProfile, phase
from healsweep.quant.registry import QuantizedGroup
from healsweep.quant.values import GROUPS, Group
from healsweep.runtime import current
from healsweep.stage_names import Stage

if TYPE_CHECKING:
    from healsweep.data.corpus import Corpus
    from healsweep.gguf_io import GGUFModel
    from healsweep.model import LayerReplacement

STUDENT_VERSION = 1
# Two threads for the held-out diagnostic of Part B: nothing a trial builds reads it, so its host
# solves run while the next layers heal; build_student waits for them before it returns. (One
# thread fell behind: on the 4-layer real-size slice a rho-only trial then waited 1.1 s for it
# after the last layer; with two, 0.55-0.6 s, and the trial took 2.5-2.6 s instead of 2.8 s, H200.)
HELDOUT_THREADS = 2
BASIS_AHEAD_ENV = "HEALSWEEP_BASIS_AHEAD"  # auto (on an accelerator), on, off: _basis_ahead
Progress = Callable[[str, str], None]


@dataclass
class Student:
    """A healed student: the base model plus per-layer replacements, and what built it.

    ``replacements`` and ``shexp_raw`` are :class:`~healsweep.heal.streamed.LayerMap` views:
    a layer's quantized experts and healed shared expert are read back from the stage cache
    when that layer is asked for, so a student of any depth holds one or two layers' arrays
    (a forward reads them layer by layer), never every layer's."""

    base: GGUFModel  # the teacher
    replacements: Mapping[int, LayerReplacement]  # quantized experts, healed shexp
    report: dict[str, Any]
    key: str
    knobs: Knobs
    alphas: list[float] = field(default_factory=list)
    shexp_raw: Mapping[int, np.ndarray] = field(default_factory=dict)  # requantized bytes/values
    shexp_types: dict[int, int] = field(default_factory=dict)  # where not the teacher's: ggml id


class Notice(NamedTuple):
    """A line for the user about a part of the method this model cannot take, and the stage
    (or ``layers``) it concerns."""

    stage: str
    text: str


def skip_notices(knobs: Knobs, model: GGUFModel) -> list[Notice]:
    """One notice per part of the method this model cannot take (a user reads them, the trial
    goes on): Part B on a model without a shared expert, and leading dense layers."""
    hp = model.hparams
    notices = []
    if knobs.ridge and hp.n_ff_shexp == 0:
        notices.append(
            Notice(
                "part_b",
                f"Part B skipped: {hp.arch} has no shared expert, so the ridge does not apply "
                "(ridge/rho/eta are ignored; quantization and Part A run as asked)",
            )
        )
    if hp.n_leading_dense:
        notices.append(
            Notice(
                "layers",
                f"layers 0..{hp.n_leading_dense - 1} skipped: dense FFN, no routed experts to "
                "quantize or heal (they stay as in the teacher)",
            )
        )
    return notices


def needs_trace(knobs: Knobs, model: GGUFModel) -> bool:
    """Whether any stage of this trial reads the calibration trace."""
    ridge = knobs.ridge and model.hparams.n_ff_shexp > 0
    reads = any(
        quantize.reads_trace(knobs, group, types.of(group))
        for types in quantize.expert_types(model, knobs).values()
        for group in GROUPS
    )
    return knobs.alpha == AlphaMode.MSE or ridge or reads


@dataclass(frozen=True)
class LayerInputs:
    """What the stages of one MoE layer read. The teacher's experts and the layer's trace are
    loaders, called only when a stage computes: a trial whose stages are all cached reads
    neither (hundreds of MB a layer at real size)."""

    model: GGUFModel
    index: int
    knobs: Knobs
    calibration: CalibrationConfig
    types: LayerTypes  # the storage types of its gate/up and down experts
    trace: Trace | None
    weights: Callable[[], dict[str, Any]]  # the teacher's routed experts and ffn_norm
    trace_layer: Callable[[], dict[str, np.ndarray]]  # only when trace is not None
    diagnostics: bool = True  # Part B's held-out diagnostic beside the fit (build_student)
    shexp_target: Any = None  # (GGMLType, importance row) Part B stores down_shexp in, if not
    # the teacher's type (knob type_shexp)
    student: Trace | None = None  # the student's trace Part A and B fit on, where retyped
    student_layer: Callable[[], dict[str, np.ndarray]] | None = None  # its layer's arrays

    @property
    def fit_trace(self) -> Trace | None:
        """The trace routed_q, Part A and Part B read: the student's where the config retypes
        a group upstream of the MoE layers (:mod:`healsweep.heal.student_trace`), else the
        teacher's (the quantizers always read the teacher's)."""
        return self.student if self.student is not None else self.trace

    def fit_layer(self) -> dict[str, np.ndarray]:
        """This layer's arrays of :attr:`fit_trace`."""
        return (self.student_layer or self.trace_layer)()


class HealedLayer(NamedTuple):
    """One layer's result: the student's experts (expert alphas folded), the layer alpha (not
    yet folded into ``down``), the healed shared expert, the report, the stage keys that name
    it, and the held-out fold sums of Part B still being computed."""

    experts: ExpertStacks
    alpha: float
    shexp: HealedShexp | None
    report: dict[str, Any]
    keys: dict[str, str | None]
    folds: Future | None


@dataclass(frozen=True)
class TrialPlan:
    """What every layer of one trial's student is built from, and read back from: the inputs
    and the keys, never a layer's arrays (those are stage-cache entries, read per layer)."""

    model: GGUFModel
    knobs: Knobs
    calibration: CalibrationConfig
    cache: StageCache
    trace: Trace | None
    types: dict[int, LayerTypes]  # per MoE layer, its experts' storage types
    retype: dict[str, Any]  # tensor name -> the type its group's knob asks for
    retyped_keys: dict[str, str]  # requant_tensor key of each of those Part B does not store
    moments: InputMoments | None  # the importance the requantized tensors read
    shexp_targets: dict[int, tuple[Any, np.ndarray]]  # see _shexp_targets
    diagnostics: bool
    student: Trace | None  # the student's trace, where the knobs retype upstream groups

    @property
    def part_b(self) -> bool:
        """Whether Part B stores each MoE layer's down_shexp."""
        return self.knobs.ridge and self.model.hparams.n_ff_shexp > 0


class StudentLayer(NamedTuple):
    """One layer of a built student, as the forward and an export read it."""

    replacement: LayerReplacement
    shexp_raw: np.ndarray | None  # Part B's down_shexp as stored (None without Part B)


def build_student(
    model: GGUFModel,
    knobs: Knobs,
    calibration: CalibrationConfig,
    cache: StageCache,
    *,
    corpus: Corpus | None = None,
    progress: Progress | None = None,
    diagnostics: bool = True,
) -> Student:
    """Quantize and heal every layer of ``model`` under ``knobs``; stages come from ``cache``.

    Layer-major: each layer's stages run, are stored, and are let go before the next layer's
    teacher weights are read; the student returned holds the stage keys and reads a layer's
    replacement back from ``cache`` when it is asked for (:class:`Student`).

    ``corpus`` overrides loading ``calibration.corpus`` (tests and benchmarks pass one they
    built); ``progress(stage, message)`` is called as stages finish (the CLI prints it).
    ``diagnostics=False`` leaves out Part B's held-out diagnostic (``ridge_heldout``), which
    nothing the student is made of reads: a sweep scores its own held-out windows instead, and
    the diagnostic's host solves grow with the calibration tokens (29.9 of a rho-only trial's
    35.5 s on an H100 at 94k tokens, 4 layers, docs/sizing.md).
    """
    quantize.check_quantizable(model, knobs)
    require_ggml(knobs.model_dump())
    say = progress or (lambda stage, message: None)
    run = StageRunner(cache)
    computed_before = dict(cache.computed)
    # Entries are written on the cache's writer thread while the next stages run; all are
    # on disk when the block ends. Every entry the trial reads or writes is held (no eviction
    # of a bounded cache deletes it) until its student is built.
    with cache.holding(), cache.writing_behind():
        plan, notices = _plan(run, model, knobs, calibration, corpus, say, diagnostics)
        healed = _heal_layers(run, plan, say)
        run.timed("cache_write", cache.flush)  # what is still being written: not overlapped
    trace = plan.trace
    report = {
        "knobs": knobs.model_dump(),
        "calibration": trace.report if trace else None,
        "trace_key": trace.key if trace else None,
        **({"student_trace_key": plan.student.key} if plan.student else {}),
        "layers": healed.reports,
        "notices": [notice.text for notice in notices],
        "tensor_types": dict(Counter(chosen.name for chosen in plan.retype.values())),
        "timings_s": {k: round(v, 4) for k, v in run.seconds.items()},
        "executed": {
            k: v - computed_before.get(k, 0)
            for k, v in cache.computed.items()
            if v != computed_before.get(k, 0)
        },
    }
    found = {"layers": healed.keys}
    if plan.retype:  # keys from before the group type knobs stay as they were
        found["tensors"] = dict(sorted(plan.retyped_keys.items()))
    key = content_key("student", STUDENT_VERSION, found)
    return _streamed_student(plan, report, key, healed.alphas, healed.shexp_types)


def _plan(
    run: StageRunner,
    model: GGUFModel,
    knobs: Knobs,
    calibration: CalibrationConfig,
    corpus: Corpus | None,
    say: Progress,
    diagnostics: bool,
) -> tuple[TrialPlan, list[Notice]]:
    """The whole-model stages (the calibration trace, the input moments, the other groups'
    requantized tensors), the notices, and the plan the layers are built from."""
    cache = run.cache
    trace: Trace | None = None
    if needs_trace(knobs, model):
        trace = run.timed(
            "calib_trace", lambda: calibration_trace(model, calibration, cache, corpus)
        )
        for line in report_lines(trace.report):
            say("calib_trace", line)
    else:
        say("calib_trace", "not needed by these knobs (no teacher pass)")
    notices = skip_notices(knobs, model)
    for notice in notices:
        say(notice.stage, notice.text)
    retype = tensor_types.planned_types(tensor_types.group_tensors(model), knobs)
    moments, mkey = None, None
    if retype:
        mkey, moments = run.timed(
            Stage.TENSOR_IMPORTANCE,
            lambda: tensor_importance.input_importance(model, calibration, cache, corpus),
        )
    keys = _retyped_keys(run, model, knobs, retype, moments, mkey)
    targets = _shexp_targets(model, knobs, retype, moments)
    student = None
    if trace is not None and student_trace.upstream(model, retype):
        student = run.timed(Stage.STUDENT_TRACE, partial(_student_trace, run, model, calibration,
                            corpus, trace, retype, moments, keys, mkey))  # fmt: skip
        retyped = len(student.report["retyped"])
        say(Stage.STUDENT_TRACE, f"Part A and B fit the student's own trace ({retyped} retyped "
            "tensors upstream of the MoE layers)")  # fmt: skip
    plan = TrialPlan(model, knobs, calibration, cache, trace, quantize.expert_types(model, knobs),
                     retype, keys, moments, targets, diagnostics, student)  # fmt: skip
    if retype:
        say("requant_tensor", _retyped_line(knobs, retype))
    return plan, notices


def _student_trace(run: StageRunner, model: GGUFModel, calibration: CalibrationConfig,
                   corpus: Corpus | None, trace: Trace, retype: dict[str, Any],
                   moments: InputMoments | None, keys: dict[str, str],
                   importance_key: str | None) -> Trace:  # fmt: skip
    """The student's trace over the upstream retyped tensors, each as the student stores it
    before healing (Part B's ``ffn_down_shexp`` too: its requantized teacher weight)."""
    found = {
        name: keys.get(name) or tensor_types.requant_key(model, name, chosen, importance_key)
        for name, chosen in student_trace.upstream(model, retype).items()
    }
    weight = partial(_retyped_weight, run, model, retype, moments, found)
    return student_trace.student_trace(model, calibration, run.cache, trace, found, weight, corpus)


def _retyped_weight(run: StageRunner, model: GGUFModel, retype: dict[str, Any],
                    moments: InputMoments | None, keys: dict[str, str], name: str) -> Any:  # fmt: skip
    return _requantized(run, model, retype, moments, name, keys[name])


class _Healed(NamedTuple):
    """What :func:`_heal_layers` keeps of the layers: small figures and keys, no arrays."""

    alphas: list[float]
    reports: list[dict[str, Any]]
    keys: list[dict[str, str | None]]
    shexp_types: dict[int, int]


def _heal_layers(run: StageRunner, plan: TrialPlan, say: Progress) -> _Healed:
    """Heal the MoE layers in order, each layer's arrays let go before the next one's teacher
    weights are read; Part B's held-out diagnostics are collected at the end. At most
    :func:`_heldout_backlog` of them are pending while the next layers heal, so their inputs
    (the layer's basis, B and fit) never pile up."""
    hp = plan.model.hparams
    healed = _Healed([], [], [], {})
    heldout: list[tuple[dict[str, Any], Future]] = []  # (layer report, its fold sums)
    ahead = _basis_ahead(run, plan.model, plan.knobs, plan.student or plan.trace)
    backlog = _heldout_backlog()
    for n, i in enumerate(hp.moe_layers):
        run.layer = i
        if n + 1 < len(hp.moe_layers):
            ahead(hp.moe_layers[n + 1])
        layer = _heal_layer(run, _layer_inputs(run, plan, i, plan.diagnostics))
        if layer.folds is not None:
            heldout.append((layer.report, layer.folds))
            _wait_heldout(run, heldout[: len(heldout) - backlog], plan.knobs)
        if layer.shexp is not None and i in plan.shexp_targets:
            healed.shexp_types[i] = plan.shexp_targets[i][0].ggml_id
        healed.alphas.append(layer.alpha)
        healed.reports.append(layer.report)
        healed.keys.append(layer.keys)
        say(f"layer {i + 1}/{hp.n_layer}", _layer_line(layer.report))
        del layer  # this layer's experts and shared expert: in the cache, not in memory
    run.layer = None
    _wait_heldout(run, heldout, plan.knobs)
    if heldout:
        say(
            "ridge_heldout",
            "held-out change per layer: "
            + ", ".join(f"{100 * r['ridge']['heldout_change']:+.2f}%" for r, _ in heldout),
        )
    return healed


def _heldout_backlog() -> int:
    """Held-out diagnostics left running beside the next layers: :data:`HELDOUT_THREADS` on an
    accelerator, where their host solves overlap the device's work; none on the CPU backend,
    where they would share the next layer's cores and hold a second layer's basis, B, fit and
    solver buffers at that layer's peak (the 2-layer A2.7B slice's second layer peaked 630 MiB
    above its first with the first layer's diagnostic running beside it, issue 46)."""
    return 0 if jax.default_backend() == "cpu" else HELDOUT_THREADS


def _wait_heldout(run: StageRunner, pending: list[tuple[dict[str, Any], Future]],
                  knobs: Knobs) -> None:  # fmt: skip
    """Wait for the held-out fold sums of ``pending`` layers (in order) and add their figures
    to the layer reports; a layer done already is not waited for twice."""
    for layer_report, folds in pending:
        if "heldout_change" in layer_report["ridge"]:
            continue
        found = run.timed(Stage.RIDGE_HELDOUT, folds.result, layer_report["layer"])
        layer_report["ridge"].update(ridge.heldout_figures(found, knobs.eta))


def _healed_shexp(model: GGUFModel, knobs: Knobs) -> dict[int, str]:
    """Per MoE layer whose down_shexp Part B stores, that tensor's name."""
    hp = model.hparams
    part_b = knobs.ridge and hp.n_ff_shexp > 0
    return {i: block_prefix(i) + "ffn_down_shexp.weight" for i in hp.moe_layers if part_b}


def _shexp_targets(
    model: GGUFModel, knobs: Knobs, retype: dict[str, Any], moments: InputMoments | None
) -> dict[int, tuple[Any, np.ndarray]]:
    """Per MoE layer whose down_shexp Part B stores in another type than the teacher's (knob
    ``type_shexp``): ``(type, importance row)``."""
    n_ff = model.hparams.n_ff_shexp
    return {
        i: (retype[name], moments.row(name, n_ff, retype[name].requires_imatrix))
        for i, name in _healed_shexp(model, knobs).items()
        if name in retype
    }


def _layer_inputs(run: StageRunner, plan: TrialPlan, i: int, diagnostics: bool) -> LayerInputs:
    """What layer i's stages read, as loaders (the teacher's experts, the trace's layer)."""
    trace, student = plan.trace, plan.student
    return LayerInputs(
        plan.model,
        i,
        plan.knobs,
        plan.calibration,
        plan.types[i],
        trace,
        once(partial(stages.expert_weights, plan.model, i)),
        once(partial(run.timed, "calib_trace", partial(trace.layer, i), i)) if trace else _no_trace,
        diagnostics,
        plan.shexp_targets.get(i),
        student,
        once(partial(run.timed, Stage.STUDENT_TRACE, partial(student.layer, i), i))
        if student
        else None,
    )


def _streamed_student(plan: TrialPlan, report: dict[str, Any], key: str, alphas: list[float],
                      shexp_types: dict[int, int]) -> Student:  # fmt: skip
    """The student of ``plan``: its layers read back from the stage cache when asked for."""
    hp = plan.model.hparams
    outside = {split_block(name)[0] for name in plan.retyped_keys}  # None: outside the layers
    extra = [HEAD] if None in outside else []
    extra += [i for i in range(hp.n_leading_dense) if i in outside]
    layers = LayerMap([*hp.moe_layers, *extra], partial(_student_layer, plan))
    replacements = LayerMap(layers, partial(field_of, layers, "replacement"))
    shexp = LayerMap(hp.moe_layers if plan.part_b else (), partial(field_of, layers, "shexp_raw"))
    return Student(plan.model, replacements, report, key, plan.knobs, alphas, shexp, shexp_types)


def _student_layer(plan: TrialPlan, i: int) -> StudentLayer:
    """Layer i of the student, from its stage entries (each recomputed, as the build computed
    it, if it has been evicted since); the read is charged to phase ``student_layer``."""
    run = StageRunner(plan.cache, PhaseProfile())  # its stages' seconds are the phase's below
    run.layer = i
    with phase("student_layer", i):
        tensors = _retyped_weights(run, plan, None if i == HEAD else i) or None
        if i not in plan.model.hparams.moe_layers:
            return StudentLayer(LayerReplacement(tensors=tensors), None)
        healed = _heal_layer(run, _layer_inputs(run, plan, i, diagnostics=False))
        down = fold_alpha(plan.knobs, plan.types[i].d, healed.experts.down, healed.alpha)
        shexp = healed.shexp
        replacement = LayerReplacement(
            gate_exps=healed.experts.gate,
            up_exps=healed.experts.up,
            down_exps=down,
            down_shexp=None if shexp is None else shexp.dense,
            tensors=tensors,
        )
        return StudentLayer(replacement, None if shexp is None else shexp.raw)


def _basis_ahead(
    run: StageRunner, model: GGUFModel, knobs: Knobs, trace: Trace | None
) -> Callable[[int], None]:
    """On an accelerator, ``ahead(i)`` starts layer i's ridge basis on a host thread, so its
    eigendecomposition (on CUDA the device's float64 eigh, elsewhere the host's LAPACK:
    :func:`healsweep.heal.ridge.basis_on`) runs while the device quantizes and heals the layer
    before it;
    Part B then finds the entry written (or waits on its lock for the rest). A no-op on the CPU
    backend, where both would share the same cores, and where the trial needs no basis.
    ``HEALSWEEP_BASIS_AHEAD`` = ``on`` | ``off`` overrides the backend's choice (the result is
    the same either way: the entry is the same computation, only its thread differs)."""

    if trace is None or not knobs.ridge or model.hparams.n_ff_shexp == 0:
        return lambda i: None
    chosen = os.environ.get(BASIS_AHEAD_ENV, "auto")
    if chosen == "off" or (chosen != "on" and jax.default_backend() == "cpu"):
        return lambda i: None
    pool = current().executor("ridge-basis", 1)

    def build(i: int) -> None:
        key = ridge.basis_key(model, trace.key, i)
        if run.meta(Stage.RIDGE_BASIS, key) is not None:
            return
        with phase("ridge_basis_ahead", i):
            run.stored(
                Stage.RIDGE_BASIS, key, RidgeBasis,
                lambda: ridge.compute_basis(model, i, trace.layer(i)),
            )  # fmt: skip

    return lambda i: pool.submit(build, i) and None


def _no_trace() -> dict[str, np.ndarray]:
    raise RuntimeError("a stage read the calibration trace of a trial that has none")


def _heal_layer(run: StageRunner, layer: LayerInputs) -> HealedLayer:
    """One layer: quantize (per tensor group) → routed_q → part_a (→ expert alphas folded) →
    residuals → part_b.

    Each stage is cached; routed_q and Part B's upstream stages are loaders, read only when a
    stage that needs them computes, so a trial that changes only ``eta`` reads the quantized
    experts, the basis and the fit, nothing else.
    """
    knobs, trace = layer.knobs, layer.fit_trace
    qkeys: dict[str, str] = {}
    groups: dict[str, QuantizedGroup] = {}
    for g in GROUPS:  # gate/up first: a down quantized from the student's h reads it
        qkeys[g] = _quantize_key(layer, g, qkeys.get(Group.GU))
        compute = partial(_quantize, layer, g, groups.get(Group.GU))
        groups[g] = run.value(Stage.QUANTIZE, qkeys[g], QuantizedGroup, compute)
    quantized = layer_experts(groups[Group.GU], groups[Group.D])
    rkey, y_q = None, None
    if trace is not None:
        rkey = stages.routed_q_key(qkeys, trace.key, layer.index)
        y_q = _routed_q(run, layer, rkey, quantized)
    akey = stages.part_a_key(
        knobs, layer.model, qkeys, rkey if knobs.alpha == AlphaMode.MSE else None, layer.index
    )
    alpha = run.value(Stage.PART_A, akey, LayerAlpha, partial(_part_a, layer, quantized, y_q))
    report: dict[str, Any] = {"layer": layer.index, "alpha": alpha.alpha}
    report["types"] = layer.types._asdict()
    fallback = {k: v for g in GROUPS for k, v in groups[g].report.get("gptq_fallback", {}).items()}
    if fallback:
        report["quantize"] = {"gptq_fallback": fallback}
    experts, y_healed = quantized, y_q
    if alpha.expert_alpha is not None:
        # Folded into each expert's down scales now; what Part B and the residuals see is the
        # routed output of those scaled experts (alpha 1), computed once and cached.
        report["expert_alphas"] = [float(a) for a in alpha.expert_alpha]
        down = fold_alpha(knobs, layer.types.d, quantized.down, alpha.expert_alpha)
        experts = quantized._replace(down=down)
        if y_q is not None:
            skey = stages.routed_q_key({**qkeys, "part_a": akey}, trace.key, layer.index)
            y_healed = _routed_q(run, layer, skey, experts)
    if y_healed is not None:
        residuals = run.value(
            "residuals",
            stages.residuals_key(rkey, akey),
            Residuals,
            partial(_residuals, layer, y_healed, y_q, alpha.alpha),
        )
        report.update(residuals._asdict())
    shexp, bkey, folds = None, None, None
    if knobs.ridge and layer.model.hparams.n_ff_shexp > 0:
        shexp, bkey, folds = _part_b(run, layer, y_healed, alpha.alpha, akey, rkey)
        stats = dict(shexp.stats)
        stats["residual_after_ridge"] = report["residual"] * (
            1 + stats["realized_in_sample_change"]
        )
        report["ridge"] = stats
    keys = {
        "quantize_gu": qkeys[Group.GU], "quantize_d": qkeys[Group.D], "part_a": akey, "part_b": bkey,
    }  # fmt: skip
    return HealedLayer(experts, alpha.alpha, shexp, report, keys, folds)


def _quantize_key(layer: LayerInputs, group: str, gate_up_key: str | None = None) -> str:
    trace_key = layer.trace.key if layer.trace else None
    return quantize.quantize_key(
        layer.model, layer.knobs, trace_key, layer.index, group, layer.types.of(group), gate_up_key
    )


def _quantize(layer: LayerInputs, group: str, gate_up: QuantizedGroup | None) -> QuantizedGroup:
    stored_as = layer.types.of(group)
    reads = quantize.reads_trace(layer.knobs, group, stored_as)
    return quantize.quantize_group(
        layer.weights(),
        layer.knobs,
        layer.trace_layer() if reads else None,
        layer.calibration,
        group,
        stored_as,
        gate_up,
    )


def _routed_q(
    run: StageRunner, layer: LayerInputs, key: str, experts: ExpertStacks
) -> Callable[[], np.ndarray]:
    """A loader of y_q [T, D], the routed output of ``experts`` on the layer's trace."""
    n_expert = layer.model.hparams.n_expert

    def compute() -> RoutedOutput:
        return RoutedOutput(stages.routed_output(experts, layer.fit_layer(), n_expert))

    load = run.lazy(Stage.ROUTED_Q, key, RoutedOutput, compute)
    return lambda: load().y_q


def _part_a(
    layer: LayerInputs, experts: ExpertStacks, y_q: Callable[[], np.ndarray] | None
) -> LayerAlpha:
    """The layer's alpha (``gaussian`` probe or ``mse`` on the trace), or one per expert."""
    knobs = layer.knobs
    per_expert = knobs.alpha_granularity == AlphaGranularity.EXPERT
    if knobs.alpha == AlphaMode.GAUSSIAN:
        if per_expert:
            found = expert_alpha.gaussian_alphas(layer.weights(), experts, knobs.gamma)
            return LayerAlpha(1.0, found)
        return LayerAlpha(stages.gaussian_alpha(layer.weights(), experts, knobs.gamma))
    if knobs.alpha == AlphaMode.MSE:
        y_ref = layer.fit_layer()["y_ref"]
        value = float(alpha_kernels.alpha_mse(y_ref, y_q(), knobs.gamma))
        if per_expert:  # starved experts keep the layer's alpha
            found = expert_alpha.mse_alphas(
                layer.weights(),
                experts,
                layer.fit_layer(),
                knobs.gamma,
                value,
                layer.calibration.min_tokens_per_expert,
            )
            return LayerAlpha(1.0, found)
        return LayerAlpha(value)
    return LayerAlpha(1.0)


def _residuals(
    layer: LayerInputs,
    y_healed: Callable[[], np.ndarray],
    y_raw: Callable[[], np.ndarray],
    alpha: float,
) -> Residuals:
    """The residuals of the healed experts at ``alpha``; at alpha 1 means before Part A, i.e.
    of the experts before any expert alpha was folded into them."""
    y_ref = layer.fit_layer()["y_ref"]
    found = stages.residual_report(y_ref, y_healed(), alpha)
    if y_raw is not y_healed:
        unscaled = stages.residual_report(y_ref, y_raw(), 1.0)
        found = found._replace(residual_alpha_1=unscaled.residual_alpha_1)
    return found


def _part_b(
    run: StageRunner,
    layer: LayerInputs,
    y_q: Callable[[], np.ndarray],
    alpha: float,
    akey: str,
    rkey: str,
) -> tuple[HealedShexp, str, Future | None]:
    """ridge_basis (once per trace) → ridge_rhs (per target) → ridge_fit (per rho) → part_b
    (per eta), each cached and each read only when a stage after it computes; the held-out
    diagnostic of the fit on a background thread (its fold sums are the returned future; None
    without ``layer.diagnostics``)."""
    model, i, knobs, trace_layer = layer.model, layer.index, layer.knobs, layer.fit_layer
    nkey = ridge.basis_key(model, layer.fit_trace.key, i)
    basis = run.lazy(
        Stage.RIDGE_BASIS, nkey, RidgeBasis, lambda: ridge.compute_basis(model, i, trace_layer())
    )
    hskey = ridge.rhs_key(nkey, akey, rkey, i)
    rhs = run.lazy(
        Stage.RIDGE_RHS,
        hskey,
        RidgeRhs,
        lambda: ridge.compute_rhs(model, i, trace_layer(), y_q(), alpha, basis()),
    )
    fkey = ridge.fit_key(knobs, nkey, hskey, i)
    fit = run.lazy(
        Stage.RIDGE_FIT, fkey, RidgeFit, lambda: ridge.fit_from_rhs(rhs(), basis(), knobs.rho)
    )
    storage = None if layer.shexp_target is None else layer.shexp_target[0].name
    bkey = ridge.part_b_key(knobs, model, fkey, i, storage)
    shexp = run.value(
        Stage.PART_B,
        bkey,
        HealedShexp,
        lambda: ridge.ridge_layer(model, i, basis(), rhs(), fit(), knobs.eta, layer.shexp_target),
    )
    if not layer.diagnostics:
        return shexp, bkey, None
    hkey = ridge.heldout_key(fkey)
    held = run.meta(Stage.RIDGE_HELDOUT, hkey)
    if held is not None:
        folds: Future = Future()
        folds.set_result(HeldoutFolds.from_entry({}, held).folds)
    else:  # its inputs are read here, the host solves run beside the next layers
        args = (model, i, trace_layer(), y_q(), alpha, basis(), rhs(), fit())

        def heldout() -> list[list[float]]:
            compute = partial(ridge.compute_heldout, *args)
            return run.stored(Stage.RIDGE_HELDOUT, hkey, HeldoutFolds, compute).folds

        folds = current().executor("ridge-heldout", HELDOUT_THREADS).submit(heldout)
    return shexp, bkey, folds


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


def _retyped_line(knobs: Knobs, retype: dict[str, Any]) -> str:
    groups = ", ".join(f"{group} {name}" for group, name in knobs.file_types().items())
    return f"{len(retype)} tensors of other groups requantized ({groups})"


def _retyped_keys(
    run: StageRunner,
    model: GGUFModel,
    knobs: Knobs,
    retype: dict[str, Any],
    moments: InputMoments | None,
    importance_key: str | None,
) -> dict[str, str]:
    """The ``requant_tensor`` key of each tensor of ``retype`` (name → type) but those Part B
    stores, each entry computed now where missing (and let go: a layer reads its own back)."""
    skip = set(_healed_shexp(model, knobs).values())
    keys = {}
    for name, chosen in retype.items():
        if name not in skip:
            keys[name] = tensor_types.requant_key(model, name, chosen, importance_key)
            _requantized(run, model, retype, moments, name, keys[name])
    return keys


def _requantized(run: StageRunner, model: GGUFModel, retype: dict[str, Any],
                 moments: InputMoments | None, name: str, key: str) -> Any:  # fmt: skip
    """Tensor ``name`` in its ``retype`` type, as the forward takes it (``requant_tensor``)."""
    compute = partial(tensor_types.requantize_tensor, model, name, retype[name], moments)
    return run.value(Stage.REQUANT_TENSOR, key, RequantTensor, compute).weight()


def _retyped_weights(run: StageRunner, plan: TrialPlan, layer: int | None) -> dict[str, Any]:
    """The requantized tensors of block ``layer`` by suffix, or (``layer`` None) those outside
    the layers by name."""
    found = {}
    for name, key in plan.retyped_keys.items():
        index, suffix = split_block(name)
        if index == layer:
            weight = _requantized(run, plan.model, plan.retype, plan.moments, name, key)
            found[suffix if layer is not None else name] = weight
    return found
