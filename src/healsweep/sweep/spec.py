"""The sweep spec: one YAML file that says what a sweep runs, validated once at the edge.

Every problem raises :class:`~healsweep.errors.SpecError` with one line that names the field (and
its YAML line when the spec came from a file), the bad value and what is allowed. ``baseline``
and ``fixed`` are :class:`~healsweep.heal.knobs.Knobs`, ``calibration`` a
:class:`~healsweep.heal.knobs.CalibrationConfig` and each ``search_space`` dimension holds values
of its knob's own type, so pydantic checks every knob value against the knob's own field once,
here. What a field accepts, in words, is its docstring (error messages quote it).

The stored form of a spec (``spec.json``, and its hash in the manifest) keeps ``baseline``,
``fixed``, ``search_space`` and ``calibration`` as they were written: a spec hashes as it did
before these fields were typed, so earlier sweeps still resume.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.size import Budget
from healsweep.kernels.ggml_types import ROUTED_TYPES, ggml_type
from healsweep.results.schema import REFERENCES
from healsweep.sweep.dimensions import SearchSpace

if TYPE_CHECKING:
    pass

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
EXTERNAL_DIR = "external"  # SWEEP/external/NAME.gguf: the files of the spec's llama recipes


class _Strict(BaseModel):
    # A field's docstring says what it accepts, in words: error messages quote it.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SamplerSpec(_Strict):
    """How configs are chosen: the full grid in order, Optuna TPE, Optuna random, or the grid
    plus the allocations the allocator proposes from a sensitivity pass (``allocator``)."""

    type: Literal["grid", "tpe", "random", "allocator"] = "grid"
    """grid, tpe, random or allocator"""
    seed: int = 0
    """an integer"""


class FutilitySpec(_Strict):
    """Stop a trial that can no longer beat the best one by what the decision rule needs
    (:func:`healsweep.sweep.pruning.futile`)."""

    confidence: float = Field(default=0.9, ge=0.5, lt=1.0)
    """a float in [0.5, 1)"""
    min_windows: int = Field(default=12, ge=2)
    """an integer >= 2"""


class PrunerSpec(_Strict):
    """How losing trials are cut: paired Wilcoxon vs the best trial (with the futility rule
    unless ``futility: false``), median rule, or never."""

    type: Literal["wilcoxon", "median", "none"] = "none"
    """wilcoxon, median or none"""
    p_threshold: float = Field(default=0.1, gt=0.0, lt=1.0)
    """a float in (0, 1)"""
    n_startup_steps: int = Field(default=4, ge=0)
    """an integer >= 0"""
    futility: FutilitySpec | None = Field(default="auto", validate_default=True)
    """{confidence, min_windows} or false (off); with type wilcoxon only"""

    @field_validator("futility", mode="before")
    @classmethod
    def _futility_for_wilcoxon(cls, value: Any, info: ValidationInfo) -> Any:
        wilcoxon = info.data.get("type") == "wilcoxon"
        if value is None or value is False or (value == "auto" and not wilcoxon):
            return None
        if not wilcoxon:
            raise ValueError("futility needs type wilcoxon")
        return {} if value is True or value == "auto" else value


class ScoringSpec(_Strict):
    """Which dev windows every trial scores, in batches of how many, and the teacher cache's
    format (``compact``: unbiased KLD from a small record; ``exact``: full log-softmax)."""

    max_scored: int = Field(default=128, ge=1, le=4096)
    """an integer in [1, 4096]"""
    max_context: int | None = Field(default=None, ge=1)
    """an integer >= 1, or null for no cap"""
    max_windows: int | None = Field(default=None, ge=1)
    """an integer >= 1, or null for every dev window"""
    checkpoint_every: int = 8
    """ignored: trials keep no checkpoint since the Parquet rows are the one record of what is
    finished; kept so that specs and sweep folders written before still load (and hash) as they
    did"""
    batch: int = Field(default=4, ge=1, le=256)
    """an integer in [1, 256] (windows per student forward)"""
    teacher_cache: Literal["compact", "exact"] = "compact"
    """compact (default) or exact"""
    group: int | None = Field(default=None, ge=1)
    """an integer >= 1 (windows whose batches advance through the student's layers together,
    each layer read once per group), or null: with a pruner 4 batches, so that a trial still
    reports often; without, every window that fits the hidden-state budget"""

    @model_serializer(mode="wrap")
    def _dump_group(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # left out when not given, so a spec from before is stored (and hashed) as it was
        dumped = handler(self)
        if dumped.get("group") is None:
            dumped.pop("group", None)
        return dumped

    def group_for(self, pruned: bool) -> int | None:
        """The windows advanced together (None: as many as the hidden-state budget carries):
        the spec's ``group``, else 4 batches where a pruner judges the trial after each
        window."""
        if self.group is not None:
            return self.group
        return 4 * self.batch if pruned else None


class LlamaRecipe(_Strict):
    """An external file the sweep makes itself: the teacher with its routed experts quantized by
    llama.cpp's quantizer (``healsweep baseline llama``), into ``SWEEP/external/NAME.gguf``."""

    type: Literal[tuple(t.name for t in ROUTED_TYPES)]  # type: ignore[valid-type]
    """a routed-expert type of llama.cpp's quantizer (iq2_xxs, iq2_xs, q2_k, ...)"""
    imatrix: bool = True
    """true (default: importance rows from the sweep's calibration) or false"""
    tensors: Literal["routed", "all"] | None = None
    """routed (default: the routed experts alone) or all (every matrix in the type, as
    llama-quantize with one type for every tensor; router and vectors as the teacher stores them)"""

    @model_serializer(mode="wrap")
    def _dump_tensors(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # left out when not given, so a recipe from before is stored (and hashed) as it was
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def all_tensors(self) -> bool:
        """Whether every matrix goes to the type (``tensors: all``)."""
        return self.tensors == "all"


class ExternalSpec(_Strict):
    """A fixed GGUF student scored like a trial: a file made beforehand (``path``, e.g. by
    ``healsweep baseline llama``) or one the sweep makes before scoring (``llama``)."""

    name: str = Field(pattern=NAME_PATTERN)
    """1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"""
    path: str | None = None
    """a GGUF file path (relative to the spec's folder)"""
    llama: LlamaRecipe | None = None
    """{type, imatrix}: llama.cpp's quantizer on the sweep's model, built into the sweep folder"""

    @model_validator(mode="after")
    def _one_source(self) -> ExternalSpec:
        if (self.path is None) == (self.llama is None):
            raise ValueError("an external entry has either a path or a llama recipe, not both")
        return self

    @model_serializer(mode="wrap")
    def _dump_source(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # the unused one is left out, so a path entry is stored (and hashed) as before recipes
        return {k: v for k, v in handler(self).items() if v is not None or k == "name"}

    def built_path(self, sweep_dir: str | Path) -> Path:
        """Where a recipe's file is built: ``SWEEP/external/NAME.gguf``."""
        return Path(sweep_dir) / EXTERNAL_DIR / f"{self.name}.gguf"

    def file(self, sweep_dir: str | Path) -> str:
        """The GGUF this entry scores (its path, or the file its recipe builds)."""
        return self.path if self.path is not None else str(self.built_path(sweep_dir))


class BudgetSpec(_Strict):
    """A size budget: configs larger than it are never scored. One measure, a number or a list
    of them (tiers: a config is admitted under the largest; the report ranks each tier)."""

    routed_bpw: list[Annotated[float, Field(gt=0.0, le=32.0)]] | None = None
    """stored bits per weight of the routed experts (a number or list in (0, 32])"""
    file_bytes: list[Annotated[int, Field(gt=0)]] | None = None
    """bytes of the model file (an integer or list of integers > 0)"""
    file_mib: list[Annotated[float, Field(gt=0.0)]] | None = None
    """MiB (2^20 bytes) of the model file (a number or list > 0)"""
    file_gib: list[Annotated[float, Field(gt=0.0)]] | None = None
    """GiB (2^30 bytes) of the model file (a number or list > 0)"""

    @field_validator("routed_bpw", "file_bytes", "file_mib", "file_gib", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, int | float) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_measure(self) -> BudgetSpec:
        measures = (self.routed_bpw, self.file_bytes, self.file_mib, self.file_gib)
        given = [v for v in measures if v is not None]
        if len(given) != 1 or not given[0]:
            raise ValueError("a budget names one of routed_bpw, file_bytes, file_mib, file_gib")
        if len(set(given[0])) != len(given[0]):
            raise ValueError(f"it lists a limit twice: {given[0]!r}")
        return self

    def budget(self) -> Budget:
        """The budget as :class:`healsweep.heal.size.Budget` (limits ascending, MiB as bytes)."""
        found = Budget.from_mapping(self.model_dump())
        assert found is not None  # one measure is given (checked above)
        return found


_TYPE_NAMES = tuple(t.name for t in ROUTED_TYPES)


class AllocatorSpec(_Strict):
    """The allocator sampler (:mod:`healsweep.sweep.allocator`): a sensitivity pass around the
    baseline with the ``fixed`` knobs (:mod:`healsweep.sweep.sensitivity`), then, per budget
    limit, the allocations of least predicted KLD, scored as trials beside the grid's."""

    ladder: list[Literal[_TYPE_NAMES]] | None = None  # type: ignore[valid-type]
    """a list of routed-expert types (the steps a tensor group may take), or null for all"""
    proposals: int = Field(default=3, ge=1, le=100)
    """an integer in [1, 100] (allocations proposed per budget limit)"""
    windows: int | None = Field(default=None, ge=1)
    """an integer >= 1 (the sensitivity pass's dev windows, the sweep's first N), or null"""

    @field_validator("ladder")
    @classmethod
    def _ordered_ladder(cls, ladder: list[str] | None) -> list[str] | None:
        """The ladder in order of bits per weight; a type twice, or two of one size, refused."""
        if ladder is None:
            return None
        if len(set(ladder)) != len(ladder):
            raise ValueError(f"it lists a type twice: {ladder!r}")
        bits = {name: ggml_type(name).bits_per_weight for name in ladder}
        ordered = sorted(ladder, key=bits.__getitem__)
        for lower, upper in zip(ordered, ordered[1:], strict=False):
            if bits[lower] == bits[upper]:
                raise ValueError(
                    f"{lower} and {upper} have the same bits per weight ({bits[lower]:g}): a "
                    "step between them changes no size; keep one"
                )
        return ordered


# what a trial asks of a resource: Ray takes a negative, NaN or infinite amount and fails late
ResourceAmount = Annotated[float, Field(ge=0, allow_inf_nan=False)]
# the spec's (and Tune's) resource names -> Ray's (ray.nodes(), ray.cluster_resources())
RAY_RESOURCE_NAMES = {"cpu": "CPU", "gpu": "GPU"}


class SweepSpec(_Strict):
    """A validated sweep spec (see ``sweeps/*.yaml`` for examples)."""

    name: str = Field(pattern=NAME_PATTERN)
    """1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"""
    model: str = "demo"
    """a GGUF file path, or a packaged model: 'demo', 'demo-medium-cpu'"""
    corpus: str = "demo"
    """a corpus JSONL path or 'demo'"""
    split: str = "auto"
    """a split YAML path or 'auto' (the parity split of the corpus)"""
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    """a mapping of calibration settings (corpus, max_tokens, chunk_length, ...)"""
    baseline: Knobs = Field(default_factory=Knobs)
    """a mapping of knob: value"""
    fixed: Knobs = Field(default_factory=Knobs)
    """a mapping of knob: value (only the knobs it names are fixed: ``fixed.model_fields_set``)"""
    search_space: SearchSpace = Field(default_factory=SearchSpace)
    """a mapping of knob: [grid values] | {choices: [...]} | {low, high, log, step}"""
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    """grid, tpe, random or allocator, or {type: grid|tpe|random|allocator, seed: int}"""
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    """wilcoxon, median or none, or {type: ..., p_threshold, n_startup_steps, futility}"""
    num_samples: int | None = Field(default=None, ge=1)
    """an integer >= 1 (tpe/random), or omitted for grid"""
    resources: dict[str, ResourceAmount] = Field(default_factory=dict)
    """a mapping of resource: a finite amount >= 0, e.g. {gpu: 1}, {metal: 1} or {cpu: 4}; without cpu,
    a trial takes its node's share of the cores (cores ÷ the trials that run there at once)"""
    max_concurrent: int = Field(default=2, ge=1)
    """an integer >= 1"""
    max_failures: int = Field(default=2, ge=0)
    """an integer >= 0"""
    results: str = "results"
    """a directory path (the results root)"""
    scoring: ScoringSpec = Field(default_factory=ScoringSpec)
    """a mapping of max_scored, max_context, max_windows, batch, teacher_cache"""
    seed: int = 0
    """an integer (seeds each trial's window order)"""
    references: bool | list[Literal["unhealed", "plain"]] = True
    """true (default: unhealed and plain), false, or a list of unhealed, plain"""
    external: list[ExternalSpec] = Field(default_factory=list)
    """a list of {name, path} or {name, llama: {type, imatrix}} (GGUFs scored beside trials)"""
    budget: BudgetSpec | None = None
    """{routed_bpw: X | [X, ...]}, {file_bytes: N | [...]}, {file_mib: M | [...]} or
    {file_gib: G | [...]} (the file measures count the whole file)"""
    allocator: AllocatorSpec | None = None
    """{ladder, proposals, windows} (with sampler allocator)"""
    placement: Literal["cache", "ray"] = "cache"
    """cache (default: a trial runs on the node that holds its quantized experts, by Ray's soft
    node affinity) or ray (wherever Ray's default scheduling puts it)"""
    cache_root: str | None = None
    """a stage-cache folder every worker mounts at this same path (shared storage: each entry
    is then computed once for the whole pool), or null for each worker's own ($HEALSWEEP_CACHE)"""
    cache_max_gb: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """GiB >= 0, each worker's stage-cache size limit, or null ($HEALSWEEP_CACHE_MAX_GB or none)"""
    # where the sweep's confirms record their openings: the project's specs name the tracked
    # ledger/ledger.jsonl (docs/reliability.md)
    ledger: str | None = None
    """a ledger file path for its confirms, or null for RESULTS/ledger.jsonl"""

    # Fields added after sweeps were recorded, with the value that means "as before": at it they
    # are left out of the stored form, so every earlier spec keeps its hash (as Knobs.ADDED_LATER).
    added_later: ClassVar[dict[str, Any]] = {
        "budget": None,
        "placement": "cache",
        "cache_root": None,
        "cache_max_gb": None,
        "resources": {},
        "ledger": None,
        "allocator": None,
    }
    _given: dict[str, Any] = PrivateAttr(default_factory=dict)
    _cpu_share: float | None = PrivateAttr(default=None)  # the node share, once Ray is up

    def allocator_settings(self) -> AllocatorSpec:
        """The allocator's settings (its defaults where the spec has no ``allocator``)."""
        return self.allocator or AllocatorSpec()

    @field_validator("sampler", "pruner", mode="before")
    @classmethod
    def _type_shorthand(cls, value: Any) -> Any:  # `sampler: tpe` is `sampler: {type: tpe}`
        return {"type": value} if isinstance(value, str) else value

    @model_validator(mode="wrap")
    @classmethod
    def _keep_as_given(cls, data: Any, handler: ModelWrapValidatorHandler[SweepSpec]) -> Any:
        """Validate; remember the typed sections as written (their stored form), and let the
        calibration corpus default to the sweep's corpus."""
        if not isinstance(data, Mapping):
            return handler(data)
        given = {name: _plain(data[name]) for name in _AS_GIVEN if name in data}
        calibration = data.get("calibration", {})
        if isinstance(calibration, Mapping) and "corpus" not in calibration:
            corpus = data.get("corpus", "demo")
            data = {**data, "calibration": {"corpus": corpus, **calibration}}
        spec = handler(data)
        spec._given = given
        return spec

    @model_serializer(mode="wrap")
    def _dump_as_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = handler(self)
        for name in _AS_GIVEN:
            if name in dumped:
                dumped[name] = copy.deepcopy(self._given.get(name, {}))
        for name, unchanged in self.added_later.items():
            if name in dumped and getattr(self, name) == unchanged:
                del dumped[name]
        return dumped

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """Unpickle. A spec pickled before its sections were typed (the results recorder held
        in a running sweep's ``tuner.pkl``) is validated again from what it holds: its
        sections become typed and its stored form, so its hash, stays what it was."""
        fields = state.get("__dict__", {})
        if isinstance(fields.get("baseline"), Mapping):
            state = type(self).model_validate(fields).__getstate__()
        super().__setstate__(state)

    def trial_resources(self) -> dict[str, float]:
        """Per-trial resources (also of a fixed row's task): the spec's, with ``cpu`` its own
        or, where it names none, the node share :meth:`with_cpu_share` set (one CPU before)."""
        return {"cpu": self._cpu_share or 1.0, **self.resources}

    def cpu_given(self) -> bool:
        """Whether the spec names the CPUs of a trial (else it takes its node's share)."""
        return "cpu" in self.resources

    def with_cpu_share(self, cpus: float) -> SweepSpec:
        """A copy whose trials take ``cpus`` CPUs where the spec names none (its stored form,
        so its hash, unchanged)."""
        copied = self.model_copy()
        copied._given = self._given
        copied._cpu_share = None if self.cpu_given() else float(cpus)
        return copied

    def reference_names(self) -> tuple[str, ...]:
        """The reference rows this sweep scores (``unhealed``, ``plain``, both or none)."""
        chosen = REFERENCES if self.references is True else self.references or ()
        return tuple(r for r in REFERENCES if r in chosen)


# Typed sections whose stored form is what the spec said (see the module docstring).
_AS_GIVEN = ("calibration", "baseline", "fixed", "search_space")


def _plain(value: Any) -> Any:
    """A section's value as written (a model passed in code: the fields it was given)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    return copy.deepcopy(value)
