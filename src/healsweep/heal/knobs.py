"""The knobs of one healing trial and the calibration settings, validated once at the edge.

``Knobs`` is the contract table of ``docs/contracts.md``: defaults reproduce the audit's shipped
healer, every value is range-checked, and an unknown knob or an out-of-range value raises
:class:`~healsweep.errors.KnobError` naming the knob, the value and what is allowed.
``Knobs.for_stage`` returns exactly the knobs a stage reads, so a stage's cache key changes only
when something that stage depends on changes. Calibration settings are not knobs (a sweep does not
tune them); they live in :class:`CalibrationConfig` and key the calibration-trace stage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from healsweep.cache import canonical_json
from healsweep.errors import KnobError


class Stage(StrEnum):
    """The stages of a trial's healing, in the order they run (their names key the caches and
    the per-stage timings)."""

    CALIB_TRACE = "calib_trace"
    QUANTIZE = "quantize"
    ROUTED_Q = "routed_q"
    PART_A = "part_a"
    RIDGE_BASIS = "ridge_basis"
    RIDGE_FIT = "ridge_fit"
    PART_B = "part_b"


_STAGE_NAMES = frozenset(Stage)
# Knobs that change how a student is scored, not how it is healed: no stage reads them.
SCORE_KNOBS = ("moce_bonus", "cache_experts")


def _float(default: float, lo: float, hi: float, *, lo_open: bool = False) -> Any:
    # strict: a YAML slip such as `gain_gu: true` is refused, not read as 1.0 (ints still pass)
    bounds = {"gt": lo} if lo_open else {"ge": lo}
    return Field(default=default, le=hi, allow_inf_nan=False, strict=True, **bounds)


# Knobs added after sweeps and confirmations were recorded, with the default that reproduces the
# behaviour from before them: at that value they are not part of a config's identity.
ADDED_LATER: dict[str, Any] = {"gptq_refine": 0}


class _Settings(BaseModel):
    # A field's docstring says what it accepts, in words: error messages quote it.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
    noun: ClassVar[str] = "setting"  # how an error message names one of the fields

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            error = exc.errors()[0]
            name = str(error["loc"][0]) if error["loc"] else None
            raise KnobError(problem(type(self), error), name) from None


class Knobs(_Settings):
    """The knobs of one trial (frozen; ``Knobs(**values)`` validates and raises ``KnobError``).

    A new knob is one field here: its type, default and range, and a docstring saying what it
    accepts (error messages quote it); the sweep spec, its search space, the Parquet columns and
    the config hashes follow from the fields. A knob that changes what a stage computes is also
    read in :meth:`for_stage`; one added after configs were recorded goes in ``ADDED_LATER``.
    """

    noun: ClassVar[str] = "knob"

    importance: Literal["none", "norm_proxy", "act"] = "norm_proxy"
    """one of none, norm_proxy, act"""
    importance_down: Literal["none", "act"] = "none"
    """one of none, act"""
    quantizer: Literal["search", "gptq", "plain"] = "search"
    """one of search, gptq, plain"""
    gptq_damp: float = _float(0.01, 0.0, 1.0, lo_open=True)
    """a float in (0, 1]"""
    gptq_refine: int = Field(default=0, ge=0, le=20, strict=True)
    """an integer in [0, 20] (rounds; acts only with quantizer gptq)"""
    # (rounds of code descent + closed-form scale refit after GPTQ, heal/gptq.refine; 0: none)
    gain_gu: float = _float(0.3, 0.0, 2.0)
    """a float in [0, 2]"""
    gain_d: float = _float(0.3, 0.0, 2.0)
    """a float in [0, 2]"""
    alpha: Literal["none", "gaussian", "mse"] = "gaussian"
    """one of none, gaussian, mse"""
    gamma: float = _float(0.75, 0.0, 1.0)
    """a float in [0, 1]"""
    alpha_granularity: Literal["layer", "expert"] = "layer"
    """one of layer, expert"""
    ridge: bool = Field(default=True, strict=True)
    """true or false"""
    rho: float = _float(6.0, 0.0, 1000.0, lo_open=True)
    """a float in (0, 1000]"""
    eta: float = _float(0.15, 0.0, 2.0)
    """a float in [0, 2]"""
    # Score-time knobs (docs/expert-cache.md): the student routes through a simulated LRU cache
    # of `cache_experts` routed experts per layer, resident ones favoured by `moce_bonus`. No
    # heal stage reads them, so they never change a stage's cache key. (A bonus without a cache
    # is refused when the trial scores, not here: a spec checks each searched value alone.)
    moce_bonus: float = _float(0.0, 0.0, 1.0)
    """a float in [0, 1] (acts only with cache_experts > 0)"""
    cache_experts: int = Field(default=0, ge=0, strict=True)
    """an integer >= 0 (0: no expert-cache simulation)"""

    def for_stage(self, stage: Stage | str) -> dict[str, Any]:
        """Exactly the knobs ``stage`` reads (its cache-key contribution); {} for knob-free stages.

        Knobs that cannot change a stage's output under the current setting are left out (gamma
        when alpha is none (alpha_granularity too), rho/eta when the ridge is off, gptq_damp
        under the ``search`` quantizer; importance and gains under ``plain``, which reads none),
        so equal outputs share one cache entry.
        """
        if stage not in _STAGE_NAMES:
            raise KnobError(f"unknown stage {stage!r}; stages are {', '.join(Stage)}")
        if stage == Stage.QUANTIZE:
            if self.quantizer == "plain":  # round-to-nearest, d = amax/2: reads no other knob
                return {"quantizer": "plain"}
            read = {
                "importance": self.importance,
                "importance_down": self.importance_down,
                "gain_gu": self.gain_gu,
                "gain_d": self.gain_d,
            }
            # `search` (the default) adds nothing, so its keys are those from before `gptq`.
            if self.quantizer == "gptq":
                read.update(quantizer="gptq", gptq_damp=self.gptq_damp)
                if self.gptq_refine:  # 0 adds nothing: keys of plain gptq as before
                    read["gptq_refine"] = self.gptq_refine
            return read
        if stage == Stage.PART_A:
            if self.alpha == "none":
                return {"alpha": "none"}
            read = {"alpha": self.alpha, "gamma": self.gamma}
            if self.alpha_granularity == "expert":  # `layer` adds nothing: keys from before
                read["alpha_granularity"] = "expert"
            return read
        if stage == Stage.RIDGE_FIT:
            return {"rho": self.rho} if self.ridge else {}
        if stage == Stage.PART_B:
            if not self.ridge:
                return {"ridge": False}
            return {"ridge": True, "eta": self.eta}
        return {}

    def identity(self) -> dict[str, Any]:
        """The knob values that name this config (config hashes, confirm's frozen hash): all of
        them, except a knob of :data:`ADDED_LATER` at its default, so adding a knob leaves every
        earlier config hash and confirmation as it was."""
        return {
            k: v
            for k, v in self.model_dump().items()
            if not (k in ADDED_LATER and v == ADDED_LATER[k])
        }

    def student_key(self) -> str:
        """A short hash of what builds and scores this config's student: the knobs each stage
        reads (:meth:`for_stage`) and the score-time knobs. Configs with one student key score
        the same on every window of a sweep (e.g. ``gamma`` is inert with ``alpha: none``), so
        a sweep scores that student once, whatever rows name it."""
        reads = {stage.value: self.for_stage(stage) for stage in Stage}
        reads.update({knob: getattr(self, knob) for knob in SCORE_KNOBS})
        return hashlib.sha256(canonical_json(reads).encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> Knobs:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        return Knobs(**{**self.model_dump(), **changes})

    def uses_activation_statistics(self) -> bool:
        """True when quantization reads the calibration trace (``act`` importance anywhere, or
        the ``gptq`` quantizer, which needs each expert's routed inputs); never for ``plain``,
        which reads no importance."""
        if self.quantizer == "plain":
            return False
        return self.importance == "act" or self.importance_down == "act" or self.quantizer == "gptq"


class CalibrationConfig(_Settings):
    """Which calibration tokens the teacher trace uses and how ``act`` statistics are pooled.

    ``max_tokens=None`` uses every token of the calibration pool; otherwise documents are taken in
    corpus order until the budget is reached (the last one cut to fit, and the trace report says
    so). ``chunk_length`` is the forward's sequence length: longer documents are split into
    consecutive chunks, all of them traced. An expert with fewer than ``min_tokens_per_expert``
    routed tokens uses the layer-wide statistic for ``act`` importance, and ``search`` instead of
    ``gptq``.
    """

    noun: ClassVar[str] = "calibration setting"

    corpus: str = "demo"
    """a corpus path or 'demo'"""
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    """a positive integer, or null for all calibration tokens"""
    chunk_length: int = Field(default=512, ge=16, le=65536, strict=True)
    """an integer in [16, 65536]"""
    min_tokens_per_expert: int = Field(default=16, ge=1, strict=True)
    """an integer >= 1"""
    exclude_doc_ids: tuple[str, ...] = ()
    """a list of document ids"""

    def key_inputs(self) -> dict[str, Any]:
        """The settings that change the trace (the corpus is keyed by content, not by path)."""
        return {
            "max_tokens": self.max_tokens,
            "chunk_length": self.chunk_length,
            "min_tokens_per_expert": self.min_tokens_per_expert,
            "exclude_doc_ids": sorted(self.exclude_doc_ids),
        }


def load_knobs(path: str | Path) -> Knobs:
    """Read a YAML mapping of knobs (missing knobs take their defaults); raise ``KnobError``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KnobError(f"cannot read knob file {path}: {exc.strerror or exc}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise KnobError(f"{where}: YAML syntax error ({problem}); fix the knob file") from None
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise KnobError(
            f"{path}: a knob file must be a mapping of knob: value, got {type(values).__name__}"
        )
    try:
        return Knobs(**{str(k): v for k, v in values.items()})
    except KnobError as exc:
        raise KnobError(f"{path}: {exc}") from None


def problem(model: type[_Settings], error: ErrorDetails) -> str:
    """One line for a validation ``error`` of a field of ``model`` (``Knobs``,
    ``CalibrationConfig``): ``unknown knob 'x'; known: ...`` or ``knob 'x' = value is not
    allowed: expected`` what its docstring says it accepts."""
    name = str(error["loc"][0]) if error["loc"] else "?"
    if error["type"] == "extra_forbidden":
        return f"unknown {model.noun} {name!r}; known: {', '.join(model.model_fields)}"
    field = model.model_fields.get(name)
    expected = field.description if field is not None and field.description else error["msg"]
    return f"{model.noun} {name!r} = {error['input']!r} is not allowed: expected {expected}"
