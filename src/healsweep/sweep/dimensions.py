"""The dimensions of a sweep's ``search_space``: each knob's values checked against the knob.

A dimension is a list of values (sampler ``grid``), ``{choices: [...]}`` or, for a float knob,
``{low, high, log, step}`` (``tpe``, ``random``). :data:`SearchSpace` has one optional field per
knob, typed from the knob's own field (type and range), so pydantic checks every searched value
as ``Knobs`` would, and a knob added to ``Knobs`` can be searched with no change here.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Annotated, Any, Generic, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    Tag,
    create_model,
    model_validator,
)

from healsweep.heal.knobs import Knobs

T = TypeVar("T")


class _Strict(BaseModel):
    # What a field accepts, in words, is its description (error messages quote it). Not an
    # attribute docstring: pydantic reads those from the source of every generic parametrization.
    model_config = ConfigDict(extra="forbid", frozen=True)


def _distinct(values: list[Any]) -> list[Any]:
    if len(set(map(repr, values))) != len(values):
        raise ValueError(f"it lists a value twice: {values!r}")
    return values


class Choices(_Strict, Generic[T]):
    """``{choices: [v1, v2, ...]}``: a categorical dimension (sampler tpe or random)."""

    choices: Annotated[
        list[T],
        Field(min_length=1, description="a non-empty list of the knob's values"),
        AfterValidator(_distinct),
    ]


class Range(_Strict, Generic[T]):
    """``{low, high, log, step}``: a dimension of a float knob (sampler tpe or random)."""

    low: T = Field(description="the knob's lowest value")
    high: T = Field(description="the knob's highest value")
    log: bool = Field(default=False, description="true or false (sample on a log scale)")
    step: float | None = Field(
        default=None, gt=0.0, description="a float > 0 (sample low, low + step, ...), or null"
    )

    @model_validator(mode="after")
    def _ordered(self) -> Range[T]:
        for failed, why in (
            (not self.low < self.high, f"low {self.low} must be below high {self.high}"),
            (self.log and self.low <= 0, f"a log range needs low > 0, got {self.low}"),
            (self.log and self.step is not None, "a range has a log scale or a step, not both"),
        ):
            if failed:
                raise ValueError(why)
        return self


Dimension = list[Any] | Choices[Any] | Range[Any]
SHAPES = "a non-empty list of values (sampler grid), {choices: [...]} or {low, high, log, step}"


def _shape(value: Any) -> str:
    """Which member of a dimension's union ``value`` is (written, or validated)."""
    if isinstance(value, Choices) or (isinstance(value, Mapping) and "choices" in value):
        return "choices"
    return "range" if isinstance(value, Range | Mapping) else "grid"


def _no_range(knob: str, value: Any) -> Any:
    raise ValueError(f"a range needs a float knob; {knob} is discrete, use {{choices: [...]}}")


def _dimension(knob: str) -> Any:
    """The type of a dimension of ``knob``: its values have the knob's type and range."""
    field = Knobs.model_fields[knob]
    value = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
    grid = Annotated[list[value], Field(min_length=1), AfterValidator(_distinct)]
    if field.annotation is float:
        span: Any = Range[value]
    else:
        span = Annotated[Any, AfterValidator(partial(_no_range, knob))]
    return Annotated[
        Annotated[grid, Tag("grid")]
        | Annotated[Choices[value], Tag("choices")]
        | Annotated[span, Tag("range")],
        Discriminator(_shape),
    ]


class _SearchSpace(_Strict):
    """The searched knobs, each with its dimension (one optional field per knob)."""

    _order: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        space = handler(data)
        if isinstance(data, Mapping):  # the grid expands in the order the spec lists its knobs
            space._order = tuple(str(knob) for knob in data)
        return space

    def dimensions(self) -> dict[str, Dimension]:
        """``{knob: dimension}`` in the spec's order."""
        return {knob: getattr(self, knob) for knob in self._order}


SearchSpace = create_model(
    "SearchSpace",
    __base__=_SearchSpace,
    **{knob: (_dimension(knob) | None, None) for knob in Knobs.model_fields},
)
