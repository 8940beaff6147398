"""The knobs of one healing trial and the calibration settings, validated once at the edge.

``Knobs`` is the contract table of ``docs/contracts.md``: defaults reproduce the audit's shipped
healer, every value is range-checked, and an unknown knob or an out-of-range value raises
:class:`~healsweep.errors.KnobError` naming the knob, the value and what is allowed.
``Knobs.for_stage`` returns exactly the knobs a stage reads, so a stage's cache key changes only
when something that stage depends on changes. Calibration settings are not knobs (a sweep does not
tune them); they live in :class:`CalibrationConfig` and key the calibration-trace stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from healsweep.errors import KnobError

# Knobs that change how a student is scored, not how it is healed: no stage reads them.
SCORE_KNOBS = ("moce_bonus", "cache_experts")
STAGES = ("calib_trace", "quantize", "routed_q", "part_a", "ridge_basis", "ridge_fit", "part_b")

# What each knob accepts, in words, for error messages (mirrors the Field constraints below).
ALLOWED = {
    "importance": "one of none, norm_proxy, act",
    "importance_down": "one of none, act",
    "quantizer": "one of search, gptq, plain",
    "gptq_damp": "a float in (0, 1]",
    "gptq_refine": "an integer in [0, 20] (rounds; acts only with quantizer gptq)",
    "gain_gu": "a float in [0, 2]",
    "gain_d": "a float in [0, 2]",
    "alpha": "one of none, gaussian, mse",
    "gamma": "a float in [0, 1]",
    "alpha_granularity": "one of layer, expert",
    "ridge": "true or false",
    "rho": "a float in (0, 1000]",
    "eta": "a float in [0, 2]",
    "moce_bonus": "a float in [0, 1] (acts only with cache_experts > 0)",
    "cache_experts": "an integer >= 0 (0: no expert-cache simulation)",
}

_CALIBRATION_ALLOWED = {
    "corpus": "a corpus path or 'demo'",
    "max_tokens": "a positive integer, or null for all calibration tokens",
    "chunk_length": "an integer in [16, 65536]",
    "min_tokens_per_expert": "an integer >= 1",
    "exclude_doc_ids": "a list of document ids",
}


def _float(default: float, lo: float, hi: float, *, lo_open: bool = False) -> Any:
    bounds = {"gt": lo} if lo_open else {"ge": lo}
    return Field(default=default, le=hi, allow_inf_nan=False, **bounds)


# Knobs added after sweeps and confirmations were recorded, with the default that reproduces the
# behaviour from before them: at that value they are not part of a config's identity.
ADDED_LATER: dict[str, Any] = {"gptq_refine": 0}


class Knobs(BaseModel):
    """The knobs of one trial (frozen; ``Knobs(**values)`` validates and raises ``KnobError``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    importance: Literal["none", "norm_proxy", "act"] = "norm_proxy"
    importance_down: Literal["none", "act"] = "none"
    quantizer: Literal["search", "gptq", "plain"] = "search"
    gptq_damp: float = _float(0.01, 0.0, 1.0, lo_open=True)
    # Rounds of code descent + closed-form scale refit after GPTQ (heal/gptq.refine); 0: none.
    gptq_refine: int = Field(default=0, ge=0, le=20, strict=True)
    gain_gu: float = _float(0.3, 0.0, 2.0)
    gain_d: float = _float(0.3, 0.0, 2.0)
    alpha: Literal["none", "gaussian", "mse"] = "gaussian"
    gamma: float = _float(0.75, 0.0, 1.0)
    alpha_granularity: Literal["layer", "expert"] = "layer"
    ridge: bool = Field(default=True, strict=True)
    rho: float = _float(6.0, 0.0, 1000.0, lo_open=True)
    eta: float = _float(0.15, 0.0, 2.0)
    # Score-time knobs (docs/expert-cache.md): the student routes through a simulated LRU cache
    # of `cache_experts` routed experts per layer, resident ones favoured by `moce_bonus`. No
    # heal stage reads them, so they never change a stage's cache key. (A bonus without a cache
    # is refused when the trial scores, not here: a spec checks each searched value alone.)
    moce_bonus: float = _float(0.0, 0.0, 1.0)
    cache_experts: int = Field(default=0, ge=0)

    def __init__(self, **values: Any) -> None:
        _reject_bools_as_numbers(values)
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _knob_error(exc, values, ALLOWED, "knob") from None

    def for_stage(self, stage: str) -> dict[str, Any]:
        """Exactly the knobs ``stage`` reads (its cache-key contribution); {} for knob-free stages.

        Knobs that cannot change a stage's output under the current setting are left out (gamma
        when alpha is none (alpha_granularity too), rho/eta when the ridge is off, gptq_damp
        under the ``search`` quantizer; importance and gains under ``plain``, which reads none),
        so equal outputs share one cache entry.
        """
        if stage not in STAGES:
            raise KnobError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        if stage == "quantize":
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
        if stage == "part_a":
            if self.alpha == "none":
                return {"alpha": "none"}
            read = {"alpha": self.alpha, "gamma": self.gamma}
            if self.alpha_granularity == "expert":  # `layer` adds nothing: keys from before
                read["alpha_granularity"] = "expert"
            return read
        if stage == "ridge_fit":
            return {"rho": self.rho} if self.ridge else {}
        if stage == "part_b":
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


class CalibrationConfig(BaseModel):
    """Which calibration tokens the teacher trace uses and how ``act`` statistics are pooled.

    ``max_tokens=None`` uses every token of the calibration pool; otherwise documents are taken in
    corpus order until the budget is reached (the last one cut to fit, and the trace report says
    so). ``chunk_length`` is the forward's sequence length: longer documents are split into
    consecutive chunks, all of them traced. An expert with fewer than ``min_tokens_per_expert``
    routed tokens uses the layer-wide statistic for ``act`` importance, and ``search`` instead of
    ``gptq``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    corpus: str = "demo"
    max_tokens: int | None = Field(default=None, ge=1)
    chunk_length: int = Field(default=512, ge=16, le=65536)
    min_tokens_per_expert: int = Field(default=16, ge=1)
    exclude_doc_ids: tuple[str, ...] = ()

    def __init__(self, **values: Any) -> None:
        _reject_bools_as_numbers(values)
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _knob_error(exc, values, _CALIBRATION_ALLOWED, "calibration setting") from None

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


def _reject_bools_as_numbers(values: Mapping[str, Any]) -> None:
    # pydantic would read `gain_gu: true` as 1.0; a YAML slip like that must not pass silently.
    for name, value in values.items():
        if isinstance(value, bool) and name not in ("ridge",):
            allowed = ALLOWED.get(name) or _CALIBRATION_ALLOWED.get(name, "see the knob table")
            raise KnobError(f"knob {name!r} = {value!r} is not allowed: expected {allowed}")


def _knob_error(
    exc: ValidationError, values: Mapping[str, Any], allowed: Mapping[str, str], what: str
) -> KnobError:
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else "?"
    if first["type"] == "extra_forbidden":
        return KnobError(f"unknown {what} {name!r}; known: {', '.join(allowed)}")
    value = values.get(name, first.get("input"))
    return KnobError(
        f"{what} {name!r} = {value!r} is not allowed: expected {allowed.get(name, first['msg'])}"
    )
