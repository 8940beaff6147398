"""The search space of a sweep: checking it, expanding the grid, and turning a trial's config
into validated knobs.

Every trial's knobs are ``baseline ∪ fixed ∪ sampled point``. The baseline runs first and is
itself a trial. For ``grid`` the trial configs are expanded here, in a fixed order (baseline
first, then the grid in ``itertools.product`` order of the spec's keys, a point dropped when an
earlier config would build and score the same student: the same knobs read by every stage and
at scoring, e.g. ``gptq_damp`` crossed with ``quantizer: search``) and handed to Tune as one
``grid_search`` over full knob dicts, so the trial list is explicit, ordered and free of
repeats. For ``tpe``/``random`` the searched knobs become Optuna distributions and the baseline
is enqueued as the first point; a sampled point equal to the baseline's searched values is the
baseline."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from typing import Any

from healsweep.cache import canonical_json
from healsweep.errors import KnobError, SpecError
from healsweep.heal.knobs import SCORE_KNOBS, STAGES, Knobs, require_ggml
from healsweep.sweep.spec import SweepSpec, field_name, locate

KNOB_NAMES: tuple[str, ...] = tuple(Knobs.model_fields)
_DEFAULTS = Knobs().model_dump()


def config_hash(knobs: Knobs | Mapping[str, Any]) -> str:
    """A short content hash of a full knob set (the identity of a config across trials/runs)."""
    values = (knobs if isinstance(knobs, Knobs) else Knobs(**knobs)).identity()
    return hashlib.sha256(canonical_json(values).encode()).hexdigest()[:16]


def check_space(
    spec: SweepSpec, *, where: str = "sweep spec", lines: Mapping | None = None
) -> None:
    """Check baseline, fixed knobs, search space and sample count; raise ``SpecError``."""
    lines = lines or {}
    baseline = _knobs(spec.baseline, ("baseline",), where, lines)
    for values in (spec.baseline, spec.fixed, spec.search_space):  # ggml types need ggml
        require_ggml(values)
    fixed = _knobs(spec.fixed, ("fixed",), where, lines).model_dump()
    for knob in spec.search_space:
        at = locate(where, lines, ("search_space", knob))
        if knob not in KNOB_NAMES:
            raise SpecError(
                f"{at}: field 'search_space.{knob}': unknown knob; knobs are {', '.join(KNOB_NAMES)}"
            )
        if knob in spec.fixed:
            raise SpecError(
                f"{at}: knob '{knob}' is both fixed and searched; remove it from one of them"
            )
        _check_dimension(spec, knob, where, lines)
    kind = spec.sampler.type
    if kind == "grid":
        n = len(grid_configs(spec))
        if spec.num_samples is not None and spec.num_samples != n:
            raise SpecError(
                f"{locate(where, lines, ('num_samples',))}: field 'num_samples' = "
                f"{spec.num_samples} is not allowed; the grid has {n} configs (baseline included): "
                "omit num_samples or set it to that"
            )
        return
    if not spec.search_space:
        raise SpecError(
            f"{locate(where, lines, ('search_space',))}: field 'search_space' is empty; sampler "
            f"{kind} needs at least one searched knob"
        )
    if spec.num_samples is None:
        raise SpecError(
            f"{where}: field 'num_samples' is missing; sampler {kind} needs an integer >= 1"
        )
    for knob, value in baseline.model_dump().items():
        dim = spec.search_space.get(knob, {})
        if "choices" in dim:
            inside = value in [_value(knob, c) for c in dim["choices"]]
        else:
            inside = not dim or _value(knob, dim["low"]) <= value <= _value(knob, dim["high"])
        if not inside:
            raise SpecError(
                f"{locate(where, lines, ('search_space', knob))}: the baseline's {knob} = "
                f"{value!r} lies outside search_space.{knob}; the baseline runs through the "
                "sampler, so widen the dimension or change the baseline"
            )
        if not dim and knob in spec.fixed and fixed[knob] != value:
            raise SpecError(
                f"{locate(where, lines, ('fixed', knob))}: field 'fixed.{knob}' = "
                f"{spec.fixed[knob]!r} differs from the baseline's {value!r}; with sampler {kind} "
                "the baseline shares every knob outside the search space: drop it from fixed, "
                "set the baseline to it, or search it"
            )


def _knobs(values: Mapping[str, Any], path: tuple, where: str, lines: Mapping) -> Knobs:
    """``Knobs(**values)``, or a ``SpecError`` naming ``path`` (at the bad knob's line if known)."""
    try:
        return Knobs(**dict(values))
    except KnobError as exc:
        bad = next((k for k in values if f"'{k}'" in str(exc)), None)
        at = locate(where, lines, (*path, bad) if bad else path)
        raise SpecError(f"{at}: field '{field_name(path)}': {exc}") from None


def _value(knob: str, value: Any) -> Any:
    """``value`` as the knob holds it (``KnobError`` when it is not allowed)."""
    return Knobs(**{knob: value}).model_dump()[knob]


def _check_value(knob: str, value: Any, path: tuple, where: str, lines: Mapping) -> Any:
    return _knobs({knob: value}, path, where, lines).model_dump()[knob]


def _check_dimension(spec: SweepSpec, knob: str, where: str, lines: Mapping) -> None:
    raw, path, sampler = spec.search_space[knob], ("search_space", knob), spec.sampler.type
    at = locate(where, lines, path)

    def bad(why: str) -> SpecError:
        return SpecError(f"{at}: field 'search_space.{knob}' = {raw!r} is not allowed; {why}")

    if sampler == "grid":
        if not isinstance(raw, list) or not raw:
            raise bad("with sampler grid a dimension is a non-empty list of values")
        values = raw
    elif not isinstance(raw, Mapping):
        raise bad(f"with sampler {sampler} a dimension is {{low, high, log}} or {{choices: [...]}}")
    elif "choices" in raw:
        if set(raw) != {"choices"} or not isinstance(raw["choices"], list) or not raw["choices"]:
            raise bad("expected {choices: [v1, v2, ...]} with a non-empty list and no other keys")
        values, path = raw["choices"], (*path, "choices")
    else:  # a range
        if not set(raw) <= {"low", "high", "log"} or not {"low", "high"} <= set(raw):
            raise bad("a range is {low: number, high: number, log: true|false}")
        if not isinstance(_DEFAULTS[knob], float):
            raise bad(f"a range needs a float knob; {knob} is discrete, use {{choices: [...]}}")
        low, high = (_check_value(knob, raw[k], (*path, k), where, lines) for k in ("low", "high"))
        log = raw.get("log", False)
        for failed, why in (
            (not isinstance(log, bool), f"log = {log!r}; expected true or false"),
            (not low < high, f"low {low} must be below high {high}"),
            (log is True and low <= 0, f"a log range needs low > 0, got {low}"),
        ):
            if failed:
                raise SpecError(f"{at}: field 'search_space.{knob}': {why}")
        return
    values = [_check_value(knob, v, (*path, i), where, lines) for i, v in enumerate(values)]
    if len(set(map(repr, values))) != len(values):
        raise SpecError(f"{at}: field 'search_space.{knob}' lists a value twice: {values!r}")


def baseline_knobs(spec: SweepSpec) -> Knobs:
    """The baseline's full knob set."""
    return Knobs(**spec.baseline)


def _with_point(spec: SweepSpec, point: Mapping[str, Any]) -> Knobs:
    """The baseline's knobs, then the fixed ones, then ``point``'s."""
    fixed = Knobs(**spec.fixed).model_dump(include=set(spec.fixed))
    return Knobs(**{**baseline_knobs(spec).model_dump(), **fixed, **point})


def grid_configs(spec: SweepSpec) -> list[dict[str, Any]]:
    """Full knob dicts of a grid sweep: the baseline first, then the grid without points that
    repeat an earlier config's student (:func:`_effect`)."""
    baseline = baseline_knobs(spec)
    configs, seen = [baseline.model_dump()], {_effect(baseline)}
    names = list(spec.search_space)
    for point in itertools.product(*(spec.search_space[k] for k in names)):
        knobs = _with_point(spec, dict(zip(names, point, strict=True)))
        if _effect(knobs) not in seen:
            seen.add(_effect(knobs))
            configs.append(knobs.model_dump())
    return configs


def _effect(knobs: Knobs) -> str:
    """What a config changes: the knobs each heal stage reads and the score-time knobs."""
    read = {stage: knobs.for_stage(stage) for stage in STAGES}
    read.update({k: getattr(knobs, k) for k in SCORE_KNOBS})
    return canonical_json(read)


def optuna_space(spec: SweepSpec) -> dict[str, Any]:
    """Optuna distributions of the searched knobs (tpe/random)."""
    import optuna

    space: dict[str, Any] = {}
    for knob, dim in spec.search_space.items():  # checked by check_space
        if "choices" in dim:
            choices = [_value(knob, c) for c in dim["choices"]]
            space[knob] = optuna.distributions.CategoricalDistribution(choices)
        else:
            low, high = (float(_value(knob, dim[k])) for k in ("low", "high"))
            space[knob] = optuna.distributions.FloatDistribution(
                low, high, log=dim.get("log", False)
            )
    return space


def baseline_point(spec: SweepSpec) -> dict[str, Any]:
    """The baseline's values of the searched knobs (the first point a tpe/random sweep runs)."""
    base = baseline_knobs(spec).model_dump()
    return {knob: base[knob] for knob in spec.search_space}


def resolve_knobs(spec: SweepSpec, config: Mapping[str, Any]) -> Knobs:
    """The full knobs of a trial from its Tune config (``{"knobs": {...}}`` or a sampled point)."""
    if "knobs" in config:
        return Knobs(**config["knobs"])
    return _with_point(spec, {k: v for k, v in config.items() if k in KNOB_NAMES})


def planned_trials(spec: SweepSpec) -> int:
    """How many trials the sweep runs (grid size, or num_samples)."""
    return len(grid_configs(spec)) if spec.sampler.type == "grid" else int(spec.num_samples or 0)
