"""One call for a cached, timed stage value: :class:`StageRunner`; a heal stage's key:
:func:`stage_key`.

A stage's output is a NamedTuple that converts itself to and from a cache entry (``to_entry()
-> (arrays, meta)``, ``from_entry(arrays, meta)``); the entry format on disk is the cache's
(arrays + a JSON record), the pipeline only ever sees the NamedTuple. :meth:`StageRunner.value`
serves it from the cache or computes it, and charges the wall time to the stage;
:meth:`StageRunner.lazy` does the same on first use only, so a trial whose stages are all
cached never runs (nor reads the inputs of) an upstream stage it does not need.

The key sits here, jax-free, so a module that only names a stage's key (the requantized tensors'
planner, read when a sweep's sizes are) need not import the stages' jax.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, NamedTuple, Protocol, Self, TypeVar

import numpy as np

from healsweep._code import code_digest
from healsweep.cache import StageCache, content_key
from healsweep.profile import PhaseProfile, active
from healsweep.stage_names import VERSIONS, Stage

# The code a stage runs is one of its inputs: a fix in the codec or the forward must not be
# served stale results from the cache. Every heal stage is computed by functions and closures of
# heal.pipeline, and heal.evaluate computes quantize and routed_q entries with its own; their
# import closure (healsweep._code, read from the source) holds every module these stages run.
CODE_ROOTS = ("healsweep.heal.pipeline", "healsweep.heal.evaluate")


def stage_key(stage: Stage | str, inputs: dict[str, Any]) -> str:
    """Content key of ``stage`` over ``inputs`` plus its version and its code digest."""
    return content_key(stage, VERSIONS[stage], {**inputs, "code": code_digest(CODE_ROOTS)})


class Entry(Protocol):
    """A stage output that the stage cache can store."""

    def to_entry(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]: ...

    @classmethod
    def from_entry(cls, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Self: ...


T = TypeVar("T", bound=Entry)
V = TypeVar("V")


class StageRunner:
    """The cache and the clock of one trial.

    Each stage's time is charged to a :class:`~healsweep.profile.PhaseProfile` (the active one
    of the running work, else the runner's own), to the row of :attr:`layer`, the layer being
    healed (None for work of the whole model). Stages run inside one another (a stage reads its
    upstream values only when it computes), so each is charged its own time, without the
    stages nested in it. ``seconds[stage]``: wall seconds per stage this runner timed, summed
    over layers (cache hits included: that is what a trial pays).
    """

    def __init__(self, cache: StageCache, profile: PhaseProfile | None = None) -> None:
        self.cache = cache
        self.profile = profile or active() or PhaseProfile()
        self.layer: int | None = None
        self._stages: dict[str, None] = {}  # the stages timed here, in order

    @property
    def seconds(self) -> dict[str, float]:
        """Wall seconds per stage timed by this runner (see the class)."""
        spent = self.profile.seconds()
        return {stage: spent.get(stage, 0.0) for stage in self._stages}

    def timed(self, stage: str, fn: Callable[[], V], layer: int | None = None) -> V:
        """``fn()``, its wall time charged to ``stage`` (of ``layer``, default :attr:`layer`)."""
        self._stages.setdefault(stage)
        return self.profile.timed(stage, fn, self.layer if layer is None else layer)

    def value(self, stage: str, key: str, output: type[T], compute: Callable[[], T]) -> T:
        """The ``stage`` entry ``key`` as an ``output``: from the cache, or ``compute()``d and
        stored."""

        def entry() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
            return compute().to_entry()

        return self.timed(
            stage, lambda: output.from_entry(*self.cache.get_or_compute(stage, key, entry))
        )

    def lazy(
        self, stage: str, key: str, output: type[T], compute: Callable[[], T]
    ) -> Callable[[], T]:
        """:meth:`value` on the first call of the returned loader, remembered after it."""
        return cache(lambda: self.value(stage, key, output, compute))

    def stored(self, stage: str, key: str, output: type[T], compute: Callable[[], T]) -> T:
        """:meth:`value` without the clock, for work on another thread (a stage computed ahead
        or beside the layers; its wait is what the trial pays, timed where it waits)."""
        entry = self.cache.get_or_compute(stage, key, lambda: compute().to_entry())
        return output.from_entry(*entry)

    def meta(self, stage: str, key: str) -> dict[str, Any] | None:
        """The metadata of the ``stage`` entry ``key`` if it is cached (its arrays unread)."""
        return self.cache.meta(stage, key)


def split_entry(
    value: NamedTuple, arrays: tuple[str, ...], renamed: Mapping[str, str] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A NamedTuple stage output as a cache entry: the fields named in ``arrays`` as arrays,
    every other as a metadata key (``renamed`` maps a field to the key it is stored under)."""
    fields, renamed = value._asdict(), renamed or {}
    meta = {renamed.get(k, k): v for k, v in fields.items() if k not in arrays}
    return {k: fields[k] for k in arrays if fields[k] is not None}, meta


def join_entry(
    output: type[T],
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    renamed: Mapping[str, str] | None = None,
) -> T:
    """The inverse of :func:`split_entry`: each field from the arrays, else from the metadata,
    else its default."""
    renamed = renamed or {}
    values = {}
    for name in output._fields:
        key = renamed.get(name, name)
        if name in arrays:
            values[name] = arrays[name]
        elif key in meta:
            values[name] = meta[key]
    return output(**values)
