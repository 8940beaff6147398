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

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from healsweep.bundled import is_bundled
from healsweep.errors import KnobError, SpecError
from healsweep.heal.knobs import CalibrationConfig, Knobs, problem
from healsweep.heal.size import Budget
from healsweep.kernels.ggml_types import ROUTED_TYPES
from healsweep.results.schema import REFERENCES, Role
from healsweep.sweep.dimensions import SHAPES, Choices, Range, SearchSpace

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
EXTERNAL_DIR = "external"  # SWEEP/external/NAME.gguf: the files of the spec's llama recipes


class _Strict(BaseModel):
    # A field's docstring says what it accepts, in words: error messages quote it.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SamplerSpec(_Strict):
    """How configs are chosen: the full grid in order, Optuna TPE, or Optuna random."""

    type: Literal["grid", "tpe", "random"] = "grid"
    """grid, tpe or random"""
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


class LlamaRecipe(_Strict):
    """An external file the sweep makes itself: the teacher with its routed experts quantized by
    llama.cpp's quantizer (``healsweep baseline llama``), into ``SWEEP/external/NAME.gguf``."""

    type: Literal[tuple(t.name for t in ROUTED_TYPES)]  # type: ignore[valid-type]
    """a routed-expert type of llama.cpp's quantizer (iq2_xxs, iq2_xs, q2_k, ...)"""
    imatrix: bool = True
    """true (default: importance rows from the sweep's calibration) or false"""


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

    @field_validator("routed_bpw", "file_bytes", "file_mib", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, int | float) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_measure(self) -> BudgetSpec:
        given = [v for v in (self.routed_bpw, self.file_bytes, self.file_mib) if v is not None]
        if len(given) != 1 or not given[0]:
            raise ValueError("a budget names one of routed_bpw, file_bytes, file_mib")
        if len(set(given[0])) != len(given[0]):
            raise ValueError(f"it lists a limit twice: {given[0]!r}")
        return self

    def budget(self) -> Budget:
        """The budget as :class:`healsweep.heal.size.Budget` (limits ascending, MiB as bytes)."""
        found = Budget.from_mapping(self.model_dump())
        assert found is not None  # one measure is given (checked above)
        return found


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
    """grid, tpe or random, or {type: grid|tpe|random, seed: int}"""
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    """wilcoxon, median or none, or {type: ..., p_threshold, n_startup_steps, futility}"""
    num_samples: int | None = Field(default=None, ge=1)
    """an integer >= 1 (tpe/random), or omitted for grid"""
    resources: dict[str, float] = Field(default_factory=lambda: {"cpu": 1.0})
    """a mapping of resource: amount >= 0, e.g. {cpu: 1} or {metal: 1}"""
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
    """{routed_bpw: X | [X, ...]}, {file_bytes: N | [...]} or {file_mib: M | [...]}"""
    placement: Literal["cache", "ray"] = "cache"
    """cache (default: a trial runs on the node that holds its quantized experts, by Ray's soft
    node affinity) or ray (wherever Ray's default scheduling puts it)"""
    cache_root: str | None = None
    """a stage-cache folder every worker mounts at this same path (shared storage: each entry
    is then computed once for the whole pool), or null for each worker's own ($HEALSWEEP_CACHE)"""
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
        "ledger": None,
    }
    _given: dict[str, Any] = PrivateAttr(default_factory=dict)

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
        """Per-trial resources (also of a fixed row's task): one CPU unless the spec says
        otherwise."""
        return {"cpu": 1.0, **self.resources}

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


def spec_from_dict(
    raw: Any, *, where: str = "sweep spec", lines: Mapping | None = None
) -> SweepSpec:
    """Validate a parsed spec mapping; ``SpecError`` names the field, value and what is allowed."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where}: a sweep spec is a YAML mapping, got {type(raw).__name__}")
    lines = lines or {}
    try:
        spec = SweepSpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise _pydantic_error(exc, where, lines) from None
    if spec.split.strip().lower() == "test":
        raise SpecError(
            f"{locate(where, lines, ('split',))}: field 'split' = {spec.split!r}: a sweep tunes "
            "on dev windows only and never opens the test split; score test windows once per "
            "milestone with `healsweep confirm` (it records a ledger grant)"
        )
    from healsweep.sweep.space import check_space

    check_space(spec, where=where, lines=lines)
    _check_external_names(spec, where, lines)
    return spec


def _check_external_names(spec: SweepSpec, where: str, lines: Mapping) -> None:
    taken = {Role.BASELINE.value, *REFERENCES}
    for i, entry in enumerate(spec.external):
        if entry.name in taken:
            raise SpecError(
                f"{locate(where, lines, ('external', i, 'name'))}: field 'external[{i}].name' = "
                f"{entry.name!r} is taken (by the baseline, a reference or another external "
                "entry); give each external GGUF its own name"
            )
        taken.add(entry.name)


def load_spec(path: str | Path, *, check_paths: bool = True) -> SweepSpec:
    """Read a spec YAML; relative model/corpus/split paths are resolved against its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(
            f"cannot read sweep spec {path}: {exc.strerror or exc}; check the path"
        ) from None
    try:
        node = yaml.compose(text)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{path}{line}: YAML syntax error ({problem}); fix the spec") from None
    spec = spec_from_dict(raw, where=str(path), lines=_key_lines(node))
    spec = _resolve_paths(spec, path.parent)
    if check_paths:
        _check_paths(spec, str(path))
    return spec


_FILES = {"model": "demo", "corpus": "demo", "split": "auto"}  # field -> its value without a file


def _named(field: str, value: str) -> bool:
    """Whether a file field holds a name rather than a path (``demo``, ``auto``, a packaged
    model such as ``demo-medium-cpu``)."""
    return value == _FILES[field] or (field == "model" and is_bundled(value))


def _resolve_paths(spec: SweepSpec, folder: Path) -> SweepSpec:
    def resolved(value: str) -> str:
        return value if Path(value).is_absolute() else str((folder / value).resolve())

    changes: dict[str, Any] = {
        field: resolved(getattr(spec, field))
        for field in _FILES
        if not _named(field, getattr(spec, field))
    }
    corpus = spec.calibration.corpus
    if corpus != "demo":
        changes["calibration"] = spec.calibration.model_copy(update={"corpus": resolved(corpus)})
    changes["external"] = [
        e if e.path is None else e.model_copy(update={"path": resolved(e.path)})
        for e in spec.external
    ]
    if spec.cache_root is not None:
        changes["cache_root"] = resolved(spec.cache_root)
    if spec.ledger is not None:
        changes["ledger"] = resolved(spec.ledger)
    out = spec.model_copy(update=changes)
    given = spec._given.get("calibration")
    if isinstance(given, Mapping) and given.get("corpus", "demo") != "demo":  # stored resolved
        out._given = {**spec._given, "calibration": {**given, "corpus": resolved(given["corpus"])}}
    return out


def _check_paths(spec: SweepSpec, where: str) -> None:
    """Every path of the spec checked where it is loaded: each file exists and is of its kind
    (a corpus parses as one, a split config as one), the calibration corpus included, and the
    folders (results root, shared cache root) are folders where they exist; externals open and
    share the model's tokenizer, and a budget is checked against the model."""
    for field in _FILES:
        value = getattr(spec, field)
        if not _named(field, value) and not Path(value).is_file():
            allowed = SweepSpec.model_fields[field].description
            raise SpecError(
                f"{where}: field '{field}' = {value!r}: no such file; allowed: {allowed}"
            )
    _check_contents(spec, where)
    for field, value in (("results", spec.results), ("cache_root", spec.cache_root)):
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise SpecError(
                f"{where}: field '{field}' = {value!r} is a file, not a folder; "
                f"expected {SweepSpec.model_fields[field].description}"
            )
    if spec.ledger is not None and (Path(spec.ledger).is_dir()
                                    or not Path(spec.ledger).parent.is_dir()):  # fmt: skip
        raise SpecError(
            f"{where}: field 'ledger' = {spec.ledger!r} is a folder or lies in a missing one; "
            f"expected {SweepSpec.model_fields['ledger'].description}"
        )
    if spec.external:
        check_externals(spec, where)
    if spec.budget is not None:
        from healsweep.sweep.budget import check_budget

        check_budget(spec, where)


def _check_contents(spec: SweepSpec, where: str) -> None:
    """The corpora and the split config parse (a sweep whose calibration corpus was not a corpus
    loaded, then failed in every trial)."""
    from healsweep.data.corpus import load_corpus
    from healsweep.data.split import load_split
    from healsweep.errors import HealsweepError

    checks = [("corpus", spec.corpus, load_corpus)]
    if spec.calibration.corpus != spec.corpus:
        checks.append(("calibration.corpus", spec.calibration.corpus, load_corpus))
    if spec.split != "auto":
        checks.append(("split", spec.split, load_split))
    for field, value, load in checks:
        if field == "calibration.corpus" and value != "demo" and not Path(value).is_file():
            raise SpecError(f"{where}: field 'calibration.corpus' = {value!r}: no such file; "
                            "allowed: a corpus JSONL path or 'demo'")  # fmt: skip
        try:
            load(value)
        except HealsweepError as exc:
            raise SpecError(f"{where}: field '{field}' = {value!r}: {exc}") from None


def check_paths(spec: SweepSpec, where: str) -> None:
    """The load-time checks of :func:`load_spec` on a spec already loaded (a stored one, before a
    resume): SpecError naming the field for a path that is missing or not of its kind."""
    _check_paths(spec, where)


def check_externals(spec: SweepSpec, where: str = "sweep spec") -> None:
    """Each ``external`` GGUF opens, and has the token list of the sweep's model; else one
    ``SpecError`` line naming the entry (before anything is started)."""
    from healsweep.errors import HealsweepError
    from healsweep.model import open_model
    from healsweep.score.report import check_same_tokenizer

    teacher = open_model(spec.model)
    for i, entry in enumerate(spec.external):
        at = f"{where}: field 'external[{i}]' ({entry.name})"
        if entry.llama is not None:
            _check_recipe(teacher, entry.llama, at)
            continue
        if not Path(entry.path).is_file():
            expected = ExternalSpec.model_fields["path"].description
            raise SpecError(f"{at}: {entry.path}: no such file; expected {expected}")
        try:
            check_same_tokenizer(teacher, open_model(entry.path))
        except HealsweepError as exc:
            raise SpecError(f"{at}: {exc}") from None


def _check_recipe(teacher: GGUFModel, recipe: LlamaRecipe, at: str) -> None:
    """A recipe's type fits the model's experts and ggml's quantizer is installed; else one
    ``SpecError`` line."""
    from healsweep.errors import HealsweepError
    from healsweep.gguf_io._ggml_lib import libggml
    from healsweep.heal.llama_baseline import check_baseline

    try:
        libggml()
        check_baseline(teacher, recipe.type, recipe.imatrix)
    except HealsweepError as exc:
        raise SpecError(f"{at}: llama {recipe.type}: {exc}") from None


def _key_lines(node: Any, prefix: tuple = ()) -> dict[tuple, int]:
    """Map every key path of a composed YAML mapping to its 1-based line number."""
    if isinstance(node, yaml.MappingNode):
        items = [(key.value, key, value) for key, value in node.value]
    elif isinstance(node, yaml.SequenceNode):
        items = [(i, item, item) for i, item in enumerate(node.value)]
    else:
        items = []
    lines: dict[tuple, int] = {}
    for key, marked, value in items:  # a list item's line is its own
        lines[(*prefix, key)] = marked.start_mark.line + 1
        lines.update(_key_lines(value, (*prefix, key)))
    return lines


def locate(where: str, lines: Mapping, path: tuple) -> str:
    """``where:LINE`` for the deepest known prefix of ``path`` (``where`` alone if unknown)."""
    for cut in range(len(path), 0, -1):
        if path[:cut] in lines:
            return f"{where}:{lines[path[:cut]]}"
    return where


def field_name(path: tuple) -> str:
    """``search_space.gain_d[1]`` from ``("search_space", "gain_d", 1)``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _pydantic_error(exc: ValidationError, where: str, lines: Mapping) -> SpecError:
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    if loc[:1] == ("references",):  # pydantic names the union's member (bool, list[...]) too
        loc = loc[:1]
    shape = None
    if loc[:1] == ("search_space",) and len(loc) > 2 and loc[2] in ("grid", "choices", "range"):
        shape, loc = loc[2], loc[:2] + loc[3:]  # the dimension's shape (a union tag)
    name = field_name(loc) or "(top level)"
    knob_error = err.get("ctx", {}).get("error")
    if isinstance(knob_error, KnobError):  # baseline, fixed, calibration: Knobs' own message
        at = locate(where, lines, (*loc, knob_error.name))
        return SpecError(f"{at}: field '{name}': {knob_error}")
    at = locate(where, lines, loc)
    if loc[:1] == ("search_space",) and len(loc) >= 2:
        return _dimension_error(err, loc, shape, at)
    names = [part for part in loc if isinstance(part, str)]  # list indices dropped
    if err["type"] == "extra_forbidden":
        known = ", ".join(_MODELS[".".join(names[:-1])].model_fields)
        return SpecError(f"{at}: unknown field '{name}'; known fields: {known}")
    if err["type"] == "value_error" and names[:1] in (["budget"], ["external"]):
        why = str(err["ctx"]["error"])  # how the parts of the section fit together
        return SpecError(f"{at}: field '{name}' = {err['input']!r} is not allowed; {why}")
    allowed = _allowed(names) or err["msg"]
    if err["type"] == "missing":
        return SpecError(f"{at}: field '{name}' is missing; expected {allowed}")
    return SpecError(f"{at}: field '{name}' = {err['input']!r} is not allowed; expected {allowed}")


def _dimension_error(err: Any, loc: tuple, shape: str | None, at: str) -> SpecError:
    """A ``search_space`` error: an unknown knob, a value the knob refuses (a grid value, a
    choice, a range's low or high), or a dimension of the wrong shape."""
    knob, name = str(loc[1]), field_name(loc)
    if err["type"] == "extra_forbidden" and len(loc) == 2:
        known = ", ".join(Knobs.model_fields)
        return SpecError(f"{at}: field 'search_space.{knob}': unknown knob; knobs are {known}")
    if err["type"] == "extra_forbidden":
        known = ", ".join((Range if shape == "range" else Choices).model_fields)
        return SpecError(f"{at}: unknown field '{name}'; known fields: {known}")
    if err["type"] == "value_error":
        why = str(err["ctx"]["error"])
        return SpecError(f"{at}: field '{name}' = {err['input']!r} is not allowed; {why}")
    expected = _allowed(["search_space", knob, *map(str, loc[2:])], shape) or SHAPES
    if err["type"] == "missing":
        return SpecError(f"{at}: field '{name}' is missing; expected {expected}")
    if isinstance(loc[-1], int) or loc[-1] in ("low", "high"):  # one of the knob's values
        return SpecError(f"{at}: field '{name}': {problem(Knobs, {**err, 'loc': (knob,)})}")
    return SpecError(f"{at}: field '{name}' = {err['input']!r} is not allowed; expected {expected}")


# The model of each field path that holds one (only these can have an unknown field).
_MODELS: dict[str, type[BaseModel]] = {
    "": SweepSpec, "sampler": SamplerSpec, "pruner": PrunerSpec, "pruner.futility": FutilitySpec,
    "scoring": ScoringSpec, "external": ExternalSpec, "external.llama": LlamaRecipe,
    "budget": BudgetSpec,
}  # fmt: skip


def _allowed(names: list[str], shape: str | None = None) -> str | None:
    """What the deepest described field of the path ``names`` accepts (its docstring)."""
    if shape is not None:  # a field of a search_space dimension
        model = Range if shape == "range" else Choices
        field = model.model_fields.get(names[-1]) if len(names) > 2 else None
        return field.description if field is not None else None
    for cut in range(len(names), 0, -1):
        model = _MODELS.get(".".join(names[: cut - 1]))
        field = model.model_fields.get(names[cut - 1]) if model else None
        if field is not None and field.description:
            return field.description
    return None
