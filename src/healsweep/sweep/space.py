"""The search space of a sweep: checking it against the sampler, expanding the grid, and who a
trial is.

Every trial's knobs are the baseline, then the knobs ``fixed`` names, then the sampled point. The
baseline runs first and is itself a trial. For ``grid`` the trial configs are expanded here, in a
fixed order (baseline first, then the grid in ``itertools.product`` order of the spec's keys, a
point dropped when an earlier config builds and scores the same student:
:func:`~healsweep.heal.reads.student_key`, e.g. ``gptq_damp`` crossed with ``quantizer:
search``) and handed to Tune as one ``grid_search`` over full knob sets, so the trial list is
explicit, ordered and free of repeats. For ``tpe``/``random`` the searched knobs become Optuna
distributions and the baseline is enqueued as the first point; a sampled point equal to the
baseline's searched values is the baseline. Each dimension's values were checked against their
knob by the spec's pydantic model; what is checked here is how the parts fit together.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from healsweep.errors import HealsweepError, SpecError
from healsweep.heal.knobs import EXPERT_TYPES, Knobs, require_ggml
from healsweep.heal.reads import student_key
from healsweep.heal.size import ConfigSize
from healsweep.results.schema import Role, config_hash, knob_columns
from healsweep.settings_errors import locate
from healsweep.sweep.dimensions import Choices, Range
from healsweep.sweep.sizes import config_size
from healsweep.sweep.spec import SweepSpec

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

KNOB_NAMES: tuple[str, ...] = tuple(Knobs.model_fields)
GRIDDED = ("grid", "allocator")  # samplers whose dimensions are lists of grid values
_SHAPE = {
    "grid": "a non-empty list of values",
    "sampled": "{low, high, log, step} or {choices: [...]}",
}


def check_space(
    spec: SweepSpec, *, where: str = "sweep spec", lines: Mapping | None = None
) -> None:
    """Check that the search space fits the sampler, the fixed knobs and the baseline, and the
    sample count; raise ``SpecError``."""
    lines = lines or {}
    kind, dimensions = spec.sampler.type, spec.search_space.dimensions()
    written = spec.model_dump()["search_space"]
    fixed = spec.fixed.model_dump(exclude_unset=True)
    for values in (spec.baseline.model_dump(), fixed, written):  # ggml types need ggml
        require_ggml(values)
    for knob, dim in dimensions.items():
        at = locate(where, lines, ("search_space", knob))
        if knob in spec.fixed.model_fields_set:
            raise SpecError(
                f"{at}: knob '{knob}' is both fixed and searched; remove it from one of them"
            )
        if (kind in GRIDDED) != isinstance(dim, list):
            shape = _SHAPE["grid" if kind in GRIDDED else "sampled"]
            raise SpecError(
                f"{at}: field 'search_space.{knob}' = {written[knob]!r} is not allowed; with "
                f"sampler {kind} a dimension is {shape}"
            )
    if spec.allocator is not None and kind != "allocator":
        raise SpecError(
            f"{locate(where, lines, ('allocator',))}: field 'allocator' needs sampler allocator "
            f"(the sampler is {kind}); remove it or set sampler: allocator"
        )
    if kind == "allocator":
        _check_allocator(spec, where, lines)
        return
    if kind == "grid":
        n = len(grid_configs(spec))
        if spec.num_samples is not None and spec.num_samples != n:
            raise SpecError(
                f"{locate(where, lines, ('num_samples',))}: field 'num_samples' = "
                f"{spec.num_samples} is not allowed; the grid has {n} configs (baseline included): "
                "omit num_samples or set it to that"
            )
        return
    if not dimensions:
        raise SpecError(
            f"{locate(where, lines, ('search_space',))}: field 'search_space' is empty; sampler "
            f"{kind} needs at least one searched knob"
        )
    if spec.num_samples is None:
        raise SpecError(
            f"{where}: field 'num_samples' is missing; sampler {kind} needs an integer >= 1"
        )
    _check_baseline_inside(spec, where, lines)


def _check_allocator(spec: SweepSpec, where: str, lines: Mapping) -> None:
    """The allocator runs the grid and its proposals (no sample count), and moves the base
    config's types along its ladder: each type the base may store a group in is on it."""
    if spec.budget is None:
        raise SpecError(
            f"{locate(where, lines, ('sampler',))}: sampler allocator chooses types under a "
            "size budget: add a budget ({routed_bpw: X}, or a file size)"
        )
    if spec.num_samples is not None:
        raise SpecError(
            f"{locate(where, lines, ('num_samples',))}: field 'num_samples' = "
            f"{spec.num_samples} is not allowed; sampler allocator runs the grid and its "
            "proposals (allocator.proposals per budget limit): omit num_samples"
        )
    ladder = spec.allocator_settings().ladder
    require_ggml({"type_gu": ladder or EXPERT_TYPES})  # its moves reach ggml types
    if ladder is None:
        return
    base = with_point(spec, {})
    for group, experts in (("gu", "gate and up"), ("d", "down")):
        off = sorted(base.possible_types(group) - set(ladder))
        if off:
            raise SpecError(
                f"{locate(where, lines, ('allocator', 'ladder'))}: field 'allocator.ladder' = "
                f"{ladder!r} lacks {', '.join(off)}, a type the base config (the baseline "
                f"with the fixed knobs) stores its {experts} experts in; add it to the ladder"
            )


def _check_baseline_inside(spec: SweepSpec, where: str, lines: Mapping) -> None:
    """With tpe/random the baseline runs through the sampler: it must lie in every dimension,
    and share every knob outside the search space with the fixed ones."""
    dimensions, kind = spec.search_space.dimensions(), spec.sampler.type
    for knob, value in spec.baseline.model_dump().items():
        dim = dimensions.get(knob)
        if isinstance(dim, Choices | Range) and not _inside(value, dim):
            raise SpecError(
                f"{locate(where, lines, ('search_space', knob))}: the baseline's {knob} = "
                f"{value!r} lies outside search_space.{knob}; the baseline runs through the "
                "sampler, so widen the dimension or change the baseline"
            )
        fixed = getattr(spec.fixed, knob)
        if dim is None and knob in spec.fixed.model_fields_set and fixed != value:
            raise SpecError(
                f"{locate(where, lines, ('fixed', knob))}: field 'fixed.{knob}' = {fixed!r} "
                f"differs from the baseline's {value!r}; with sampler {kind} the baseline shares "
                "every knob outside the search space: drop it from fixed, set the baseline to it, "
                "or search it"
            )


def _inside(value: Any, dim: Choices | Range) -> bool:
    return value in dim.choices if isinstance(dim, Choices) else dim.low <= value <= dim.high


def with_point(spec: SweepSpec, point: Mapping[str, Any]) -> Knobs:
    """The baseline's knobs, then those ``fixed`` names, then ``point``'s."""
    return knobs_at(spec.baseline, spec.fixed, point)


def knobs_at(baseline: Knobs, fixed: Knobs, point: Mapping[str, Any]) -> Knobs:
    """``baseline``'s knobs, then those ``fixed`` names (its fields set), then ``point``'s."""
    return baseline.replace(**fixed.model_dump(exclude_unset=True), **point)


def grid_configs(spec: SweepSpec) -> list[Knobs]:
    """The knobs of a grid sweep's trials: the baseline first, then the grid without points
    that build and score a student an earlier config does (the same student key)."""
    configs, seen = [spec.baseline], {student_key(spec.baseline)}
    dimensions = spec.search_space.dimensions()
    for values in itertools.product(*dimensions.values()):
        knobs = with_point(spec, dict(zip(dimensions, values, strict=True)))
        if student_key(knobs) not in seen:
            seen.add(student_key(knobs))
            configs.append(knobs)
    return configs


def optuna_space(spec: SweepSpec) -> dict[str, BaseDistribution]:
    """Optuna distributions of the searched knobs (tpe/random)."""
    # lazy: heavy (optuna)
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    space: dict[str, BaseDistribution] = {}
    for knob, dim in spec.search_space.dimensions().items():  # shapes checked by check_space
        if isinstance(dim, Choices):
            space[knob] = CategoricalDistribution(dim.choices)
        else:
            space[knob] = FloatDistribution(dim.low, dim.high, log=dim.log, step=dim.step)
    return space


def varied_knobs(spec: SweepSpec) -> frozenset[str]:
    """The knobs whose value differs between two trials of the sweep: its search space's, and
    those ``fixed`` sets to another value than the baseline's (the baseline runs with its own)."""
    fixed = spec.fixed.model_dump(exclude_unset=True)
    moved = {knob for knob, value in fixed.items() if getattr(spec.baseline, knob) != value}
    return frozenset(spec.search_space.dimensions()) | moved


def baseline_point(spec: SweepSpec) -> dict[str, Any]:
    """The baseline's values of the searched knobs (the first point a tpe/random sweep runs)."""
    return {knob: getattr(spec.baseline, knob) for knob in spec.search_space.dimensions()}


@dataclass(frozen=True)
class TrialIdentity:
    """Who a Tune trial is, derived once from its Tune config by :func:`trial_identity`: its
    knobs, config hash, student key (rows with one student share their windows) and whether it
    is the baseline. The trial sends its hash and baseline flag with every result."""

    knobs: Knobs
    config_hash: str
    student: str
    is_baseline: bool
    size: ConfigSize | None = None  # its routed bpw and file bytes on the sweep's model

    @property
    def role(self) -> Role:
        """``baseline`` or ``trial``."""
        return Role.BASELINE if self.is_baseline else Role.TRIAL

    def columns(self) -> dict[str, Any]:
        """Its config columns in the results."""
        return {
            "config_hash": self.config_hash,
            "is_baseline": self.is_baseline,
            "role": self.role.value,
            "routed_bpw": None if self.size is None else self.size.routed_bpw,
            "file_bytes": None if self.size is None else self.size.file_bytes,
            **knob_columns(self.knobs),
        }


def trial_identity(
    config: Mapping[str, Any], baseline: Knobs, fixed: Knobs, model: str
) -> TrialIdentity:
    """The identity of the trial with Tune config ``config``: ``{"knobs": {...}}`` of a grid
    sweep, or the point an Optuna sampler chose (on ``baseline`` and ``fixed``, the spec's), its
    size on ``model`` (the spec's) when that file can be read here."""
    if "knobs" in config:
        knobs = Knobs(**config["knobs"])
    else:
        point = {k: v for k, v in config.items() if k in KNOB_NAMES}
        knobs = knobs_at(baseline, fixed, point)
    chash = config_hash(knobs)
    is_baseline = chash == config_hash(baseline)
    return TrialIdentity(knobs, chash, student_key(knobs), is_baseline, _size(model, knobs))


def _size(model: str, knobs: Knobs) -> ConfigSize | None:
    """The config's size for its results columns (None when the model cannot be read here)."""
    try:
        return config_size(model, knobs)
    except (OSError, HealsweepError):
        return None
