"""One translator from a settings file's problems to one line each: YAML syntax, and pydantic.

Sweep specs (:mod:`healsweep.sweep.spec_files`) and knob files (:func:`healsweep.heal.knobs.
load_knobs`) are YAML read into pydantic models whose fields carry, as their docstring, what they
accept in words. A problem becomes one line: where (the file and, for a spec, the line of the key,
:func:`key_lines` / :func:`locate`), which field (:func:`field_name`), the value, and what is
allowed (the field's docstring). :func:`problem` is the line for one field of a settings model
(``Knobs``, ``CalibrationConfig``: their ``noun`` names the field); :func:`validation_message`
the line for a whole nested model, given where its sub-models sit (``models``) and, for a search
space of knob values, what its dimensions accept (:class:`SearchSpaceRules`).

Base layer: pydantic and yaml only; the caller wraps the line in its own error type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from healsweep._inputs import quoted
from healsweep.errors import KnobError


def problem(model: Any, error: Mapping[str, Any]) -> str:
    """One line for a validation ``error`` of a field of settings ``model`` (``Knobs``,
    ``CalibrationConfig``): ``unknown knob 'x'; known: ...`` or ``knob 'x' = value is not
    allowed: expected`` what its docstring says it accepts."""
    name = str(error["loc"][0]) if error["loc"] else "?"
    if error["type"] == "extra_forbidden":
        return f"unknown {model.noun} {name!r}; known: {', '.join(model.model_fields)}"
    field = model.model_fields.get(name)
    expected = _words(field.description) if field is not None and field.description else error["msg"]
    reason = (error.get("ctx") or {}).get("error") if error["type"] == "value_error" else None
    because = f" ({reason})" if reason else ""
    return (
        f"{model.noun} {name!r} = {quoted(error['input'])} is not allowed{because}: expected {expected}"
    )


def yaml_problem(exc: yaml.YAMLError, where: str, *, column: bool = False) -> tuple[str, str]:
    """``(where[:LINE[:COLUMN]], what the parser said)`` of a YAML syntax error."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        where += f":{mark.line + 1}" + (f":{mark.column + 1}" if column else "")
    return where, getattr(exc, "problem", None) or str(exc).splitlines()[0]


def key_lines(node: Any, prefix: tuple = ()) -> dict[tuple, int]:
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
        lines.update(key_lines(value, (*prefix, key)))
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
    for part in path:  # a key from the file is cut: the message never grows with the input
        name = str(part) if len(str(part)) <= 80 else f"{str(part)[:77]}..."
        out += f"[{part}]" if isinstance(part, int) else (f".{name}" if out else name)
    return out


@dataclass(frozen=True)
class SearchSpaceRules:
    """What the dimensions of a search space of knob values accept: the section's name, the
    knobs' model, each dimension shape's model by its union tag, and the shapes in words."""

    section: str
    knobs: Any  # the settings model of the knobs (its fields are the dimensions)
    shapes: Mapping[str, type[BaseModel]]  # union tag -> model ("grid", "choices", "range")
    words: str


def validation_message(
    exc: ValidationError,
    where: str,
    lines: Mapping,
    models: Mapping[str, type[BaseModel]],
    *,
    explained: tuple[str, ...] = (),
    unions: tuple[str, ...] = (),
    search: SearchSpaceRules | None = None,
) -> str:
    """One line for the first error of ``exc`` in a file read at ``where`` (``lines``:
    :func:`key_lines`). ``models`` maps each dotted field path that holds a model to it (``""``
    the top); a ``value_error`` in a section of ``explained`` says why in the validator's words;
    a field of ``unions`` is named without pydantic's union member; ``search`` describes the
    search-space section. A settings model's own error (a ``KnobError`` raised inside) keeps its
    message."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    if loc[:1] and loc[0] in unions:  # pydantic names the union's member (bool, list[...]) too
        loc = loc[:1]
    shape = None
    if search and loc[:1] == (search.section,) and len(loc) > 2 and loc[2] in search.shapes:
        shape, loc = loc[2], loc[:2] + loc[3:]  # the dimension's shape (a union tag)
    name = field_name(loc) or "(top level)"
    knob_error = err.get("ctx", {}).get("error")
    if isinstance(knob_error, KnobError):  # a settings model's own message
        at = locate(where, lines, (*loc, knob_error.name))
        return f"{at}: field '{name}': {knob_error}"
    at = locate(where, lines, loc)
    if search and loc[:1] == (search.section,) and len(loc) >= 2:
        return _dimension_message(err, loc, shape, at, search, models)
    names = [part for part in loc if isinstance(part, str)]  # list indices dropped
    if err["type"] == "extra_forbidden":
        known = ", ".join(models[".".join(names[:-1])].model_fields)
        return f"{at}: unknown field '{name}'; known fields: {known}"
    if err["type"] == "value_error" and names[:1] and names[0] in explained:
        why = str(err["ctx"]["error"])  # how the parts of the section fit together
        return f"{at}: field '{name}' = {quoted(err['input'])} is not allowed; {why}"
    allowed = _allowed(names, models) or err["msg"]
    if err["type"] == "missing":
        return f"{at}: field '{name}' is missing; expected {allowed}"
    return f"{at}: field '{name}' = {quoted(err['input'])} is not allowed; expected {allowed}"


def _dimension_message(
    err: Any,
    loc: tuple,
    shape: str | None,
    at: str,
    search: SearchSpaceRules,
    models: Mapping[str, type[BaseModel]],
) -> str:
    """A search-space error: an unknown knob, a value the knob refuses (a grid value, a choice,
    a range's low or high), or a dimension of the wrong shape."""
    knob, name = str(loc[1]), field_name(loc)
    shape_model = search.shapes.get(shape or "grid")
    if err["type"] == "extra_forbidden" and len(loc) == 2:
        known = ", ".join(search.knobs.model_fields)
        return f"{at}: field '{search.section}.{knob}': unknown knob; knobs are {known}"
    if err["type"] == "extra_forbidden":
        return f"{at}: unknown field '{name}'; known fields: {', '.join(shape_model.model_fields)}"
    if err["type"] == "value_error":
        why = str(err["ctx"]["error"])
        return f"{at}: field '{name}' = {quoted(err['input'])} is not allowed; {why}"
    names = [search.section, knob, *map(str, loc[2:])]
    if shape is not None:  # a field of the dimension's shape
        field = shape_model.model_fields.get(names[-1]) if len(names) > 2 else None
        expected = _words(field.description) if field is not None else None
    else:
        expected = _allowed(names, models)
    expected = expected or search.words
    if err["type"] == "missing":
        return f"{at}: field '{name}' is missing; expected {expected}"
    if isinstance(loc[-1], int) or loc[-1] in ("low", "high"):  # one of the knob's values
        return f"{at}: field '{name}': {problem(search.knobs, {**err, 'loc': (knob,)})}"
    return f"{at}: field '{name}' = {quoted(err['input'])} is not allowed; expected {expected}"


def _allowed(names: list[str], models: Mapping[str, type[BaseModel]]) -> str | None:
    """What the deepest described field of the path ``names`` accepts (its docstring)."""
    for cut in range(len(names), 0, -1):
        model = models.get(".".join(names[: cut - 1]))
        field = model.model_fields.get(names[cut - 1]) if model else None
        if field is not None and field.description:
            return _words(field.description)
    return None


def _words(description: str | None) -> str | None:
    """A field's docstring on one line (a message is one line)."""
    return " ".join(description.split()) if description else description
