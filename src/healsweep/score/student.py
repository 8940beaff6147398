"""What can be scored against a teacher: a model file, or a healed student.

A healed student exposes ``base`` (the teacher's ``GGUFModel``) and ``replacements`` (per-layer
``LayerReplacement``) and runs as ``forward(base, ..., replacements=replacements)``. The
replacements are a mapping the forward reads layer by layer; a healed student's loads each layer
from the stage cache when read, so it is passed on as it is, never copied into a dict of every
layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel
    from healsweep.model.forward import LayerReplacement


class HealedModel(Protocol):
    """A healed student (``healsweep.heal.pipeline.Student``): the teacher's model and the
    layers that replace some of its weights."""

    @property
    def base(self) -> GGUFModel: ...

    @property
    def replacements(self) -> Mapping[int, LayerReplacement]: ...


# What can be scored against a teacher: a model file, or a healed student.
StudentModel: TypeAlias = "GGUFModel | HealedModel"


def student_model(
    student: StudentModel,
) -> tuple[GGUFModel, Mapping[int, LayerReplacement] | None]:
    """``(GGUFModel, replacements or None)`` that run the student's forward."""
    if hasattr(student, "replacements") and hasattr(student, "base"):
        return student.base, student.replacements
    return student, None
