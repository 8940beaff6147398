"""The knobs of one healing trial and the calibration settings, validated once at the edge.

``Knobs`` is the contract table of ``docs/contracts.md``: defaults reproduce the audit's shipped
healer, every value is range-checked, and an unknown knob or an out-of-range value raises
:class:`~healsweep.errors.KnobError` naming the knob, the value and what is allowed.
What each stage reads of them (its cache key) is :func:`healsweep.heal.reads.stage_reads`. The
module stays light (no quantizer, no jax): every stage digest and the sweep driver read it.
Calibration settings are not knobs (a sweep does not tune them); they live in
:class:`CalibrationConfig` and key the calibration-trace stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from healsweep._yaml_input import load_yaml
from healsweep.errors import KnobError, SettingError
from healsweep.kernels.ggml_types import ROUTED_TYPES, TENSOR_TYPES, ggml_type, step_up
from healsweep.quant.values import Q2_0, DownInput, Importance, ImportanceDown, Quantizer
from healsweep.settings_errors import problem, yaml_problem
from healsweep.stage_names import Stage


class AlphaMode(StrEnum):
    """Knob ``alpha``: Part A's per-layer output scale."""

    NONE = "none"
    GAUSSIAN = "gaussian"  # the shipped probe: fixed experts on Gaussian inputs
    MSE = "mse"  # fitted on the calibration trace's routed outputs


class AlphaGranularity(StrEnum):
    """Knob ``alpha_granularity``: one alpha per layer, or one per routed expert."""

    LAYER = "layer"
    EXPERT = "expert"


# The routed experts' storage types: q2_0 through healsweep's own quantizers (knob `quantizer`),
# every other through ggml's quantizer with the calibration importance; ordered by bits per weight.
EXPERT_TYPES: tuple[str, ...] = tuple(t.name for t in ROUTED_TYPES)
_TYPE_LIST = ", ".join(EXPERT_TYPES)
# Every other tensor group's storage type (knobs type_attn, type_shexp, type_embd, type_output,
# type_dense): as the teacher stores it, or a type of kernels.ggml_types.TENSOR_TYPES.
TEACHER = "teacher"
GROUP_TYPES: tuple[str, ...] = (TEACHER, *(t.name for t in TENSOR_TYPES))
_GROUP_TYPE_LIST = ", ".join(GROUP_TYPES)


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
    "down_input": DownInput.TEACHER,
    "type_attn": TEACHER,
    "type_shexp": TEACHER,
    "type_embd": TEACHER,
    "type_output": TEACHER,
    "type_dense": TEACHER,
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
    read by that stage (:func:`healsweep.heal.reads.stage_reads`; a quantize knob: the knobs of
    its quantizer classes, :mod:`healsweep.quant`); one added after configs were recorded goes
    in ``ADDED_LATER``. A knob of fixed values is a StrEnum: its members are the strings.

    The groups of knobs are class constants: :attr:`HEALING` (Part A and B), :attr:`SCORING`
    (read when a student is scored, by no stage), :attr:`TYPES` (the storage types: the routed
    experts' and, :attr:`FILE_TYPES`, every other tensor group's; a config's size follows from
    them alone).
    """

    noun: ClassVar[str] = "knob"
    HEALING: ClassVar[tuple[str, ...]] = (
        "alpha", "gamma", "alpha_granularity", "ridge", "rho", "eta",
    )  # fmt: skip
    SCORING: ClassVar[tuple[str, ...]] = ("moce_bonus", "cache_experts")
    FILE_TYPES: ClassVar[tuple[str, ...]] = (
        "type_attn", "type_shexp", "type_embd", "type_output", "type_dense",
    )  # fmt: skip
    TYPES: ClassVar[tuple[str, ...]] = (
        "type_gu", "type_d", "up_first", "up_last", "layer_types", *FILE_TYPES,
    )  # fmt: skip
    UNHEALED: ClassVar[Mapping[str, Any]] = {"alpha": AlphaMode.NONE, "ridge": False}  # A, B off

    importance: Importance = Importance.NORM_PROXY
    """one of none, norm_proxy, act"""
    importance_down: ImportanceDown = ImportanceDown.NONE
    """one of none, act"""
    quantizer: Quantizer = Quantizer.SEARCH
    """one of search, gptq, plain"""
    gptq_damp: float = _float(0.01, 0.0, 1.0, lo_open=True)
    """a float in (0, 1]"""
    gptq_refine: int = Field(default=0, ge=0, le=20, strict=True)
    """an integer in [0, 20] (rounds; acts only with quantizer gptq)"""
    # (rounds of code descent + closed-form scale refit after GPTQ, quant/gptq.refine; 0: none)
    # GPTQ of down on the IQ1/IQ2 grids (docs/contracts.md, Knobs): `teacher` takes down's input h
    # from the teacher's gate and up; `student` from the layer's quantized gate and up, with
    # down's target corrected so that its output matches the teacher's (W·C·H_s⁻¹).
    down_input: DownInput = DownInput.TEACHER
    """one of teacher, student (down's GPTQ input on the IQ1 and IQ2 grids)"""
    gain_gu: float = _float(0.3, 0.0, 2.0)
    """a float in [0, 2]"""
    gain_d: float = _float(0.3, 0.0, 2.0)
    """a float in [0, 2]"""
    alpha: AlphaMode = AlphaMode.GAUSSIAN
    """one of none, gaussian, mse"""
    gamma: float = _float(0.75, 0.0, 1.0)
    """a float in [0, 1]"""
    alpha_granularity: AlphaGranularity = AlphaGranularity.LAYER
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
    # Every other tensor group's storage type (docs/contracts.md, Knobs; heal/tensor_types.py):
    # `teacher` keeps the group as the teacher stores it (the default: every config from before
    # these knobs); a type requantizes it with ggml's quantizer and the calibration importance
    # of its input. A tensor whose rows that type's blocks do not fill takes the smallest type
    # of at least its bits whose blocks do (kernels.ggml_types.fitting_type).
    type_attn: Literal[GROUP_TYPES] = Field(  # type: ignore[valid-type]
        default=TEACHER,
        description=f"one of {_GROUP_TYPE_LIST} (attention: q/k/v/o, or the MLA tensors)",
    )
    type_shexp: Literal[GROUP_TYPES] = Field(  # type: ignore[valid-type]
        default=TEACHER,
        description=f"one of {_GROUP_TYPE_LIST} (the shared expert's gate, up and down)",
    )
    type_embd: Literal[GROUP_TYPES] = Field(  # type: ignore[valid-type]
        default=TEACHER, description=f"one of {_GROUP_TYPE_LIST} (the token embeddings)"
    )
    type_output: Literal[GROUP_TYPES] = Field(  # type: ignore[valid-type]
        default=TEACHER, description=f"one of {_GROUP_TYPE_LIST} (the output projection)"
    )
    type_dense: Literal[GROUP_TYPES] = Field(  # type: ignore[valid-type]
        default=TEACHER,
        description=f"one of {_GROUP_TYPE_LIST} (the FFN of the leading dense layers)",
    )

    @field_validator("layer_types")
    @classmethod
    def _canonical_layer_types(cls, text: str) -> str:
        """One spelling per allocation: ``LAYER:GU/DOWN`` entries, lower case, no spaces."""
        return ",".join(f"{i}:{t.gu}/{t.d}" for i, t in parse_layer_types(text))

    def for_stage(self, stage: str) -> dict[str, Any]:
        """Exactly the knobs healing stage ``stage`` reads (its cache-key contribution): Part A's
        and Part B's (``part_a``, ``ridge_fit``, ``part_b``); {} for a stage that reads none.

        Knobs that cannot change a stage's output under the current setting are left out (gamma
        when alpha is none (alpha_granularity too), rho/eta when the ridge is off), so equal
        outputs share one cache entry. What ``quantize`` reads is its quantizer class's to say
        (:func:`healsweep.heal.reads.stage_reads`): asking here is a ``ValueError``.
        """
        if stage == Stage.QUANTIZE:
            raise ValueError("Knobs.for_stage: quantize's reads are its quantizer's: stage_reads")
        if stage not in set(Stage):
            raise KnobError(f"unknown stage {stage!r}; stages are {', '.join(Stage)}")
        if stage == Stage.PART_A:
            if self.alpha == AlphaMode.NONE:
                return {"alpha": AlphaMode.NONE}
            read = {"alpha": self.alpha, "gamma": self.gamma}
            if self.alpha_granularity == AlphaGranularity.EXPERT:  # `layer` adds nothing
                read["alpha_granularity"] = AlphaGranularity.EXPERT
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

    def replace(self, **changes: Any) -> Knobs:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        return Knobs(**{**self.model_dump(), **changes})

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

    def possible_types(self, group: str) -> set[str]:
        """The types some layer of some model may store ``group`` (``gu``, ``d``) in under these
        knobs."""
        base = getattr(self, f"type_{group}")
        found = {base, step_up(base)} if self.up_first or self.up_last else {base}
        return found | {t.of(group) for _, t in parse_layer_types(self.layer_types)}

    def file_types(self) -> dict[str, str]:
        """The tensor groups other than the routed experts whose type these knobs set (not
        ``teacher``): group (``attn``, ``shexp``, ``embd``, ``output``, ``dense``) → type."""
        found = {k.removeprefix("type_"): getattr(self, k) for k in self.FILE_TYPES}
        return {group: name for group, name in found.items() if name != TEACHER}

    def type_reads(self) -> dict[str, Any]:
        """The type knobs off their defaults: what the allocation adds to a whole-model read."""
        return {k: getattr(self, k) for k in self.TYPES if getattr(self, k) != ADDED_LATER[k]}


# The calibration budget of a night (issue 46): one MoE layer's trace entry within 4 GB / 24, so
# that a 24-layer trace stays within 4 GB of a night's stage cache. On the 24-layer A2.7B night
# every token of the pool (~94k) made a 22.6 GB trace, and the cache evicted what the next trial
# needed to keep it.
NIGHT = "night"
NIGHT_TRACE_LAYER_BYTES = 4 * 10**9 // 24
_ENTRY_HEADER_BYTES = 1 << 16  # an entry's header (checksums of its pieces) and padding, at most


def trace_token_bytes(n_embd: int, n_expert_used: int) -> int:
    """Bytes a token adds to one layer's trace entry (:mod:`healsweep.heal.trace`): its FFN
    input x (float16) and routed output y_ref (float32) [D], its routing ids (int32) and
    weights (float32) [k], and its shared-expert gate (float32)."""
    return 2 * n_embd + 4 * n_embd + 8 * n_expert_used + 4


def trace_layer_fixed_bytes(n_expert: int, n_embd: int, n_ff_exp: int) -> int:
    """Bytes of one layer's trace entry that do not grow with the tokens: the ``act`` sums
    E[x²] [E, D] and E[h²] [E, F] and the per-expert counts [E] (float32), and the header."""
    return 4 * n_expert * (n_embd + n_ff_exp + 1) + _ENTRY_HEADER_BYTES


def night_tokens(n_embd: int, n_expert_used: int, n_expert: int, n_ff_exp: int) -> int:
    """The calibration tokens of ``max_tokens: night`` for a model of this shape: as many as keep
    one layer's trace entry within :data:`NIGHT_TRACE_LAYER_BYTES` (13,451 for Qwen1.5-MoE-A2.7B's
    D 2048, top-4 of 60 experts of 1408; 13,366 for Qwen3-30B-A3B's top-8 of 128 of 768)."""
    room = NIGHT_TRACE_LAYER_BYTES - trace_layer_fixed_bytes(n_expert, n_embd, n_ff_exp)
    return max(1, room // trace_token_bytes(n_embd, n_expert_used))


class CalibrationConfig(_Settings):
    """Which calibration tokens the teacher trace uses and how ``act`` statistics are pooled.

    ``max_tokens`` is the budget: ``night`` (the default) as many tokens as keep each layer's
    trace within 4 GB / 24 (:func:`night_tokens`: 13,451 at Qwen1.5-MoE-A2.7B's shape, so a
    24-layer trace stays within 4 GB; a small model's whole pool, such as the demo models' 35k
    tokens), an integer that many, ``null`` every token of the pool. Under a budget smaller than
    the pool, documents (minus ``exclude_doc_ids``) are taken whole, one stratum after the other
    in turn, each stratum's in the pool's order, until it is reached, the last one cut to fit
    (:func:`healsweep.heal.trace.budget_takes`; the trace report says which was cut and how
    much): the same tokens every time, every stratum calibrated. ``chunk_length`` is the forward's
    sequence length: longer documents are split into consecutive chunks, all of them traced. An
    expert with fewer than ``min_tokens_per_expert`` routed tokens uses the layer-wide statistic
    for ``act`` importance, and ``search`` instead of ``gptq``.
    """

    noun: ClassVar[str] = "calibration setting"

    corpus: str = "demo"
    """a corpus path or 'demo'"""
    max_tokens: Annotated[int, Field(ge=1, strict=True)] | Literal["night"] | None = NIGHT
    """a positive integer, 'night' (a layer's trace within 4 GB / 24) or null for all tokens"""
    chunk_length: int = Field(default=512, ge=16, le=65536, strict=True)
    """an integer in [16, 65536]"""
    min_tokens_per_expert: int = Field(default=16, ge=1, strict=True)
    """an integer >= 1"""
    exclude_doc_ids: tuple[str, ...] = ()
    """a list of document ids"""

    def for_model(self, n_embd: int, n_expert_used: int, n_expert: int, n_ff_exp: int) -> Self:
        """These settings with ``max_tokens: night`` resolved to the tokens of a model of this
        shape (:func:`night_tokens`); an integer or null as it is."""
        if self.max_tokens != NIGHT:
            return self
        tokens = night_tokens(n_embd, n_expert_used, n_expert, n_ff_exp)
        return self.model_copy(update={"max_tokens": tokens})

    def key_inputs(self) -> dict[str, Any]:
        """The settings that change the trace (the corpus is keyed by content, not by path)."""
        return {
            "max_tokens": self.max_tokens,
            "chunk_length": self.chunk_length,
            "min_tokens_per_expert": self.min_tokens_per_expert,
            "exclude_doc_ids": sorted(self.exclude_doc_ids),
        }


def load_knobs(path: str | Path, *, need_ggml: bool = True) -> Knobs:
    """Read a YAML mapping of knobs (missing knobs take their defaults); raise ``KnobError``.
    With ``need_ggml`` (the default), a knob that needs ggml's quantizer where it cannot be
    found raises :class:`SettingError` (:func:`require_ggml_in`); a caller that first checks the
    knobs against a model passes False and calls that itself."""
    path = Path(path)
    try:
        values = load_yaml(path, "knob file", error=KnobError).value
    except OSError as exc:
        raise KnobError(f"cannot read knob file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        where, said = yaml_problem(exc, str(path), column=True)
        raise KnobError(f"{where}: YAML syntax error ({said}); fix the knob file") from None
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
    if need_ggml:
        require_ggml_in(knobs, str(path))
    return knobs


def require_ggml_in(knobs: Knobs, where: str) -> None:
    """:func:`require_ggml` of a knob file's ``knobs``, its message prefixed with ``where``."""
    try:
        require_ggml(knobs.model_dump())
    except SettingError as exc:
        raise SettingError(f"{where}: {exc}") from None


def _by_ggml(name: Any) -> bool:
    """Whether routed experts stored as ``name`` are quantized by ggml: every type but those
    healsweep's own quantizers serve (and any name that is no type, as it always was)."""
    try:
        return not ggml_type(str(name)).own_quantizer
    except KnobError:
        return True


def require_ggml(values: Mapping[str, Any]) -> None:
    """Raise :class:`SettingError` (one line: which knob, what to install) when ``values`` may
    put a routed-expert tensor in a type other than ``q2_0``, or another tensor group in any
    type (the ``type_attn`` ... ``type_dense`` knobs off ``teacher``), and ggml's quantizer
    (llama-cpp-python, the ``[ggml]`` extra) is not installed. ``values`` maps knob names to a
    value, or to a list or ``{choices: [...]}`` of them (a sweep's search space); other knobs
    are ignored. A step up the ladder (``up_first``/``up_last`` > 0) always involves a ggml
    type (``q2_0`` steps to ``iq2_xs``; only ``iq2_xxs`` steps to ``q2_0``). Called where knobs
    enter: a knob file, a sweep spec, ``build_student``."""
    for knob in ("type_gu", "type_d", "layer_types", "up_first", "up_last", *Knobs.FILE_TYPES):
        for value in _leaves(values.get(knob)):
            if knob == "layer_types":
                ggml = any(_by_ggml(name) for name in _layer_type_names(value))
            elif knob.startswith("up_"):
                ggml = isinstance(value, int) and value > 0
            elif knob in Knobs.FILE_TYPES:
                ggml = value != TEACHER
            else:
                ggml = _by_ggml(value)
            if not ggml:
                continue
            # lazy: heavy (gguf)
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
