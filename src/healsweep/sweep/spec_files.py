"""Reading a sweep spec file: YAML to a validated :class:`~healsweep.sweep.spec.SweepSpec`, with
every problem one line naming the field (and its YAML line), and every path it names checked.

:func:`load_spec` reads the file, :func:`spec_from_dict` validates a mapping (its pydantic errors
translated by :mod:`healsweep.settings_errors`, the one translator of specs and knob files), then
checks what the schema alone cannot: the search space against the sampler and the baseline
(:func:`healsweep.sweep.space.check_space`), the externals' names, and (:func:`check_paths`) that
each file exists and is of its kind, the externals open with the model's tokenizer and a budget
fits the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from healsweep._inputs import not_a_file, quoted
from healsweep._yaml_input import load_yaml
from healsweep.bundled import is_bundled
from healsweep.data.corpus import load_corpus
from healsweep.data.split import load_split
from healsweep.errors import HealsweepError, SpecError
from healsweep.gguf_io._ggml_lib import libggml
from healsweep.heal.knobs import Knobs
from healsweep.results.schema import REFERENCES, Role
from healsweep.settings_errors import (
    SearchSpaceRules,
    key_lines,
    locate,
    validation_message,
    yaml_problem,
)
from healsweep.sweep.budget import check_budget
from healsweep.sweep.dimensions import SHAPES, Choices, Range
from healsweep.sweep.space import check_space
from healsweep.sweep.spec import (
    AllocatorSpec,
    BudgetSpec,
    ExternalSpec,
    FutilitySpec,
    LlamaRecipe,
    PrunerSpec,
    SamplerSpec,
    ScoringSpec,
    SweepSpec,
)

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel

# The model of each field path that holds one (only these can have an unknown field).
_MODELS: dict[str, type[BaseModel]] = {
    "": SweepSpec, "sampler": SamplerSpec, "pruner": PrunerSpec, "pruner.futility": FutilitySpec,
    "scoring": ScoringSpec, "external": ExternalSpec, "external.llama": LlamaRecipe,
    "budget": BudgetSpec, "allocator": AllocatorSpec,
}  # fmt: skip
_SEARCH = SearchSpaceRules(
    "search_space", Knobs, {"grid": Choices, "choices": Choices, "range": Range}, SHAPES
)


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
        message = validation_message(
            exc, where, lines, _MODELS, explained=("budget", "external", "allocator"),
            unions=("references",), search=_SEARCH,
        )  # fmt: skip
        raise SpecError(message) from None
    if spec.split.strip().lower() == "test":
        raise SpecError(
            f"{locate(where, lines, ('split',))}: field 'split' = {spec.split!r}: a sweep tunes "
            "on dev windows only and never opens the test split; score test windows once per "
            "milestone with `healsweep confirm` (it records a ledger grant)"
        )
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
        raw, node = load_yaml(path, "sweep spec", error=SpecError)
    except OSError as exc:
        raise SpecError(
            f"cannot read sweep spec {path}: {exc.strerror or exc}; check the path"
        ) from None
    except yaml.YAMLError as exc:
        at, said = yaml_problem(exc, str(path))
        raise SpecError(f"{at}: YAML syntax error ({said}); fix the spec") from None
    spec = spec_from_dict(raw, where=str(path), lines=key_lines(node))
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
        if not _named(field, value) and (why := not_a_file(value)):
            allowed = SweepSpec.model_fields[field].description
            raise SpecError(f"{where}: field '{field}' = {quoted(value)}: {why}; allowed: {allowed}")
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
        check_budget(spec, where)


def _check_contents(spec: SweepSpec, where: str) -> None:
    """The corpora and the split config parse (a sweep whose calibration corpus was not a corpus
    loaded, then failed in every trial)."""

    checks = [("corpus", spec.corpus, load_corpus)]
    if spec.calibration.corpus != spec.corpus:
        checks.append(("calibration.corpus", spec.calibration.corpus, load_corpus))
    if spec.split != "auto":
        checks.append(("split", spec.split, load_split))
    for field, value, load in checks:
        if field == "calibration.corpus" and value != "demo" and (why := not_a_file(value)):
            raise SpecError(f"{where}: field 'calibration.corpus' = {quoted(value)}: {why}; "
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
    # lazy: heavy (gguf, jax): `sweep status` reads a spec without starting jax
    from healsweep.model import open_model
    from healsweep.score.report import check_same_tokenizer

    teacher = open_model(spec.model)
    for i, entry in enumerate(spec.external):
        at = f"{where}: field 'external[{i}]' ({entry.name})"
        if entry.llama is not None:
            _check_recipe(teacher, entry.llama, at)
            continue
        if why := not_a_file(entry.path):
            expected = ExternalSpec.model_fields["path"].description
            raise SpecError(f"{at}: {entry.path}: {why}; expected {expected}")
        try:
            check_same_tokenizer(teacher, open_model(entry.path))
        except HealsweepError as exc:
            raise SpecError(f"{at}: {exc}") from None


def _check_recipe(teacher: GGUFModel, recipe: LlamaRecipe, at: str) -> None:
    """A recipe's type fits the model's experts and ggml's quantizer is installed; else one
    ``SpecError`` line."""
    # lazy: heavy (gguf, jax): `sweep status` reads a spec without starting jax
    from healsweep.heal.llama_baseline import check_baseline

    try:
        libggml()
        check_baseline(teacher, recipe.type, recipe.imatrix)
    except HealsweepError as exc:
        raise SpecError(f"{at}: llama {recipe.type}: {exc}") from None
