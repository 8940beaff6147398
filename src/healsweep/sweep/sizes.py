"""The size of a config's file on a sweep's model, from the model's shapes (read once per process
and file version) and the config's types: what a sweep's budget and its results columns need."""

from __future__ import annotations

import functools

from healsweep.bundled import resolve_model
from healsweep.errors import KnobError
from healsweep.heal.knobs import Knobs
from healsweep.heal.size import ConfigSize, ModelShapes


@functools.lru_cache(maxsize=8)
def _shapes(path: str, size: int, mtime_ns: int) -> ModelShapes:
    from healsweep.model import open_model  # lazy: the model package brings jax

    return ModelShapes.of(open_model(path))


def model_shapes(model: str) -> ModelShapes:
    """The shapes of ``model`` (a GGUF path or a packaged model's name)."""
    path = resolve_model(model)
    stat = path.stat()
    return _shapes(str(path), stat.st_size, stat.st_mtime_ns)


def config_size(model: str, knobs: Knobs) -> ConfigSize | None:
    """The size of ``knobs``' file on ``model``; None when the knobs cannot be stored on it (a
    type whose blocks do not divide its rows: the trial itself says so)."""
    try:
        return model_shapes(model).size(knobs)
    except KnobError:
        return None
