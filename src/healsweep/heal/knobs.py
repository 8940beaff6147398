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
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from healsweep.cache import canonical_json
from healsweep.errors import KnobError, SettingError
from healsweep.kernels.ggml_types import ROUTED_TYPES, step_up


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
# The routed experts' storage types: q2_0 through healsweep's own quantizers (knob `quantizer`),
# every other through ggml's quantizer with the calibration importance; ordered by bits per weight.
EXPERT_TYPES: tuple[str, ...] = tuple(t.name for t in ROUTED_TYPES)
Q2_0 = "q2_0"
GROUPS = ("gu", "d")  # the routed tensor groups a type is chosen for: gate and up, down
# ggml types whose grid `quantizer: gptq` refines with error feedback: Q2_K/Q3_K (heal.kgrid),
# IQ2_XXS/IQ2_XS (heal.ggml_gptq, column-wise on ggml's 8-weight grid rows)
GPTQ_GRID_TYPES = ("q2_k", "q3_k", "iq2_xxs", "iq2_xs")
IQ2_GRID_TYPES = ("iq2_xxs", "iq2_xs")
_TYPE_LIST = ", ".join(EXPERT_TYPES)
_TYPE_KNOBS = ("type_gu", "type_d", "up_first", "up_last", "layer_types")


def _float(default: float, lo: float, hi: float, *, lo_open: bool = False) -> Any:
    # strict: a YAML slip such as `gain_gu: true` is refused, not read as 1.0 (ints still pass)
    bounds = {"gt": lo} if lo_open else {"ge": lo}
    return Field(default=default, le=hi, allow_inf_nan=False, strict=True, **bounds)


# Knobs added after sweeps and confirmations were recorded, with the default that reproduces the
# behaviour from before them: at that value they are not part of a config's identity.
ADDED_LATER: dict[str, Any] = {
    "gptq_refine": 0,
    "type_gu": Q2_0,
    "type_d": Q2_0,
    "up_first": 0,
    "up_last": 0,
    "layer_types": "",
    "down_input": "teacher",
}


class LayerTypes(NamedTuple):
    """The storage types of one layer's routed experts: gate and up, and down."""

    gu: str
    d: str

    def of(self, group: str) -> str:
        """The type of tensor group ``group`` (``gu`` or ``d``)."""
        return self.gu if group == "gu" else self.d


def parse_layer_types(text: str) -> list[tuple[int, LayerTypes]]:
    """``layer_types`` as ``[(layer index as written, LayerTypes)]``; raises ``ValueError``."""
    entries = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        layer, sep, types = entry.partition(":")
        names = [t.strip().lower() for t in types.split("/")]
        if not sep or len(names) not in (1, 2):
            raise ValueError(f"entry {entry!r} is not LAYER:GU/DOWN or LAYER:TYPE")
        try:
            index = int(layer.strip())
        except ValueError:
            raise ValueError(f"entry {entry!r}: {layer.strip()!r} is not a layer index") from None
        for name in names:
            if name not in EXPERT_TYPES:
                raise ValueError(f"entry {entry!r}: {name!r} is not a routed-expert type")
        entries.append((index, LayerTypes(names[0], names[-1])))
    indices = [index for index, _ in entries]
    if len(set(indices)) != len(indices):
        raise ValueError("a layer is listed twice")
    return entries


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
    # GPTQ of down on the IQ2 grids (docs/contracts.md, Knobs): `teacher` takes down's input h
    # from the teacher's gate and up; `student` from the layer's quantized gate and up, with
    # down's target corrected so that its output matches the teacher's (W·C·H_s⁻¹).
    down_input: Literal["teacher", "student"] = "teacher"
    """one of teacher, student (down's GPTQ input on the IQ2 grids)"""
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
    # The routed experts' storage types (docs/contracts.md, Knobs): gate/up and down, then the
    # first/last N MoE layers one step up the ladder (`kernels.ggml_types.step_up`), then the
    # explicit per-layer types of `layer_types`, which win over both.
    type_gu: Literal[EXPERT_TYPES] = Field(  # type: ignore[valid-type]
        default=Q2_0, description=f"one of {_TYPE_LIST} (the routed gate and up experts' type)"
    )
    type_d: Literal[EXPERT_TYPES] = Field(  # type: ignore[valid-type]
        default=Q2_0, description=f"one of {_TYPE_LIST} (the routed down experts' type)"
    )
    up_first: int = Field(default=0, ge=0, strict=True)
    """an integer >= 0 (the first N MoE layers one type step up)"""
    up_last: int = Field(default=0, ge=0, strict=True)
    """an integer >= 0 (the last N MoE layers one type step up)"""
    layer_types: str = Field(
        default="",
        strict=True,
        description="'' or comma-separated LAYER:GU/DOWN or LAYER:TYPE entries, e.g. "
        "'0:iq2_xs/iq3_xxs,-1:iq3_xxs' (LAYER a block index, negative from the last; types of "
        f"{_TYPE_LIST})",
    )

    @field_validator("layer_types")
    @classmethod
    def _canonical_layer_types(cls, text: str) -> str:
        """One spelling per allocation: ``LAYER:GU/DOWN`` entries, lower case, no spaces."""
        return ",".join(f"{i}:{t.gu}/{t.d}" for i, t in parse_layer_types(text))

    def for_stage(
        self, stage: Stage | str, *, group: str | None = None, stored_as: str | None = None
    ) -> dict[str, Any]:
        """Exactly the knobs ``stage`` reads (its cache-key contribution); {} for knob-free stages.

        Knobs that cannot change a stage's output under the current setting are left out (gamma
        when alpha is none (alpha_granularity too), rho/eta when the ridge is off, gptq_damp
        under the ``search`` quantizer; importance and gains under ``plain``, which reads none;
        every quantizer knob for a tensor group stored as a ggml type), so equal outputs share
        one cache entry.

        ``quantize`` is one stage per layer and tensor group: with ``group`` (``gu`` or ``d``)
        and the type that group of the layer is ``stored_as`` (:meth:`expert_types`), what that
        quantization reads: for ``q2_0`` the quantizer's knobs of that group, for a ggml type
        ``{"type": name}`` (ggml reads no knob; its importance comes from the trace; ``gptq``
        adds ``quantizer`` and ``gptq_damp`` on the grids of :data:`GPTQ_GRID_TYPES`). Without
        ``group``,
        what quantizing the whole model may read, for any model: the type knobs and the
        quantizer knobs of each group some layer may store as ``q2_0`` (or on a K grid).
        """
        if stage not in _STAGE_NAMES:
            raise KnobError(f"unknown stage {stage!r}; stages are {', '.join(Stage)}")
        if stage == Stage.QUANTIZE:
            if group is not None:
                if stored_as == Q2_0:
                    return self._q2_0_reads(group)
                read = {"type": stored_as, **self._grid_reads(stored_as)}
                if group == "d" and self._down_from_student(stored_as):
                    read["down_input"] = "student"
                return read
            read: dict[str, Any] = {}
            for group in GROUPS:
                possible = self._possible_types(group)
                if Q2_0 in possible:
                    read.update(self._q2_0_reads(group))
                for name in possible:
                    read.update(self._grid_reads(name))
                    if group == "d" and self._down_from_student(name):
                        read["down_input"] = "student"
            read.update(
                {k: getattr(self, k) for k in _TYPE_KNOBS if getattr(self, k) != ADDED_LATER[k]}
            )
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

    def uses_activation_statistics(self, group: str | None = None) -> bool:
        """True when the Q2_0 quantization of ``group`` (``gu``, ``d``; None: either) reads the
        calibration trace (``act`` importance, or the ``gptq`` quantizer, which needs each
        expert's routed inputs); never for ``plain``, which reads no importance. (A group stored
        as a ggml type always reads it: :meth:`expert_types`.)"""
        if self.quantizer == "plain":
            return False
        act = {"gu": self.importance == "act", "d": self.importance_down == "act"}
        return self.quantizer == "gptq" or (act[group] if group else any(act.values()))

    def expert_types(self, moe_layers: Sequence[int], n_layer: int) -> dict[int, LayerTypes]:
        """The storage types of each MoE layer's routed experts: ``type_gu``/``type_d``, the
        first ``up_first`` and last ``up_last`` MoE layers one step up the ladder (once, where
        they overlap), then ``layer_types`` (``LAYER`` a block index, negative counted from
        ``n_layer``). A ``layer_types`` entry that names no MoE layer, or names one twice,
        raises :class:`KnobError`."""
        moe = list(moe_layers)
        stepped = set(moe[: self.up_first]) | set(
            moe[len(moe) - self.up_last :] if self.up_last else ()
        )
        base = LayerTypes(self.type_gu, self.type_d)
        up = LayerTypes(step_up(self.type_gu), step_up(self.type_d))
        types = {i: up if i in stepped else base for i in moe}
        named: dict[int, int] = {}
        for index, chosen in parse_layer_types(self.layer_types):
            layer = index + n_layer if index < 0 else index
            if layer not in types:
                raise KnobError(
                    f"knob layer_types = {self.layer_types!r}: layer {index} is not a MoE layer "
                    f"of this model (its MoE layers are {moe[0]}..{moe[-1]}, of {n_layer})"
                )
            if layer in named:
                raise KnobError(
                    f"knob layer_types = {self.layer_types!r}: entries {named[layer]} and {index} "
                    f"both name layer {layer} of this model; keep one"
                )
            named[layer] = index
            types[layer] = chosen
        return types

    def _possible_types(self, group: str) -> set[str]:
        """The types some layer of some model may store ``group`` in under these knobs."""
        base = getattr(self, f"type_{group}")
        found = {base, step_up(base)} if self.up_first or self.up_last else {base}
        return found | {t.of(group) for _, t in parse_layer_types(self.layer_types)}

    def _grid_reads(self, stored_as: str) -> dict[str, Any]:
        """The knobs ggml's quantization in ``stored_as`` reads: none, but ``gptq`` (with its
        damping) refines the codes on the Q2_K, Q3_K, IQ2_XXS and IQ2_XS grids."""
        if self.quantizer == "gptq" and stored_as in GPTQ_GRID_TYPES:
            return {"quantizer": "gptq", "gptq_damp": self.gptq_damp}
        return {}

    def _down_from_student(self, stored_as: str) -> bool:
        """Whether down stored as ``stored_as`` is quantized from the quantized gate and up's
        ``h`` (``down_input: student``, which acts where GPTQ runs on an IQ2 grid)."""
        return (
            self.down_input == "student"
            and self.quantizer == "gptq"
            and stored_as in IQ2_GRID_TYPES
        )

    def _q2_0_reads(self, group: str) -> dict[str, Any]:
        """The knobs the Q2_0 quantization of tensor group ``group`` reads."""
        if self.quantizer == "plain":  # round-to-nearest, d = amax/2: reads no other knob
            return {"quantizer": "plain"}
        if group == "gu":
            read: dict[str, Any] = {"importance": self.importance, "gain_gu": self.gain_gu}
        else:
            read = {"importance_down": self.importance_down, "gain_d": self.gain_d}
        # `search` (the default) adds nothing, so its keys are those from before `gptq`.
        if self.quantizer == "gptq":
            read.update(quantizer="gptq", gptq_damp=self.gptq_damp)
            if self.gptq_refine:  # 0 adds nothing: keys of plain gptq as before
                read["gptq_refine"] = self.gptq_refine
        return read


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
        knobs = Knobs(**{str(k): v for k, v in values.items()})
    except KnobError as exc:
        raise KnobError(f"{path}: {exc}") from None
    try:
        require_ggml(knobs.model_dump())
    except SettingError as exc:
        raise SettingError(f"{path}: {exc}") from None
    return knobs


def require_ggml(values: Mapping[str, Any]) -> None:
    """Raise :class:`SettingError` (one line: which knob, what to install) when ``values`` may
    put a routed-expert tensor in a type other than ``q2_0`` and ggml's quantizer
    (llama-cpp-python, the ``[ggml]`` extra) is not installed. ``values`` maps knob names to a
    value, or to a list or ``{choices: [...]}`` of them (a sweep's search space); other knobs
    are ignored. A step up the ladder (``up_first``/``up_last`` > 0) always involves a ggml
    type (``q2_0`` steps to ``iq2_xs``; only ``iq2_xxs`` steps to ``q2_0``). Called where knobs
    enter: a knob file, a sweep spec, ``build_student``."""
    for knob in ("type_gu", "type_d", "layer_types", "up_first", "up_last"):
        for value in _leaves(values.get(knob)):
            if knob == "layer_types":
                ggml = any(name != Q2_0 for name in _layer_type_names(value))
            elif knob.startswith("up_"):
                ggml = isinstance(value, int) and value > 0
            else:
                ggml = value != Q2_0
            if not ggml:
                continue
            from healsweep.gguf_io._ggml_lib import libggml

            try:
                libggml()
            except SettingError as exc:
                raise SettingError(
                    f"knob {knob} = {value!r} needs ggml's quantizer: {exc}"
                ) from None
            return


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [] if value is None else [value]


def _layer_type_names(text: Any) -> list[str]:
    if not isinstance(text, str):
        return []
    try:
        return [name for _, types in parse_layer_types(text) for name in types]
    except ValueError:  # not a valid value: the knob's own check says so
        return []


def problem(model: type[_Settings], error: ErrorDetails) -> str:
    """One line for a validation ``error`` of a field of ``model`` (``Knobs``,
    ``CalibrationConfig``): ``unknown knob 'x'; known: ...`` or ``knob 'x' = value is not
    allowed: expected`` what its docstring says it accepts."""
    name = str(error["loc"][0]) if error["loc"] else "?"
    if error["type"] == "extra_forbidden":
        return f"unknown {model.noun} {name!r}; known: {', '.join(model.model_fields)}"
    field = model.model_fields.get(name)
    expected = field.description if field is not None and field.description else error["msg"]
    reason = (error.get("ctx") or {}).get("error") if error["type"] == "value_error" else None
    because = f" ({reason})" if reason else ""
    return (
        f"{model.noun} {name!r} = {error['input']!r} is not allowed{because}: expected {expected}"
    )
