"""One call for a cached, timed stage value: :class:`StageRunner`.

A stage's output is a NamedTuple that converts itself to and from a cache entry (``to_entry()
-> (arrays, meta)``, ``from_entry(arrays, meta)``); the entry format on disk is the cache's
(arrays + a JSON record), the pipeline only ever sees the NamedTuple. :meth:`StageRunner.value`
serves it from the cache or computes it, and charges the wall time to the stage;
:meth:`StageRunner.lazy` does the same on first use only, so a trial whose stages are all
cached never runs (nor reads the inputs of) an upstream stage it does not need.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, NamedTuple, Protocol, Self, TypeVar

import numpy as np

from healsweep.cache import StageCache


class Entry(Protocol):
    """A stage output that the stage cache can store."""

    def to_entry(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]: ...

    @classmethod
    def from_entry(cls, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Self: ...


T = TypeVar("T", bound=Entry)
V = TypeVar("V")


class StageRunner:
    """The cache and the clock of one trial.

    ``seconds[stage]``: wall seconds per stage, summed over layers (cache hits included: that
    is what a trial pays). Stages run inside one another (a stage reads its upstream values
    only when it computes), so each is charged its own time, without the stages nested in it.
    """

    def __init__(self, cache: StageCache) -> None:
        self.cache = cache
        self.seconds: dict[str, float] = {}
        self._nested: list[float] = []  # per open stage: seconds of the stages run inside it

    def timed(self, stage: str, fn: Callable[[], V]) -> V:
        """``fn()``, its wall time charged to ``stage``."""
        start = time.perf_counter()
        self._nested.append(0.0)
        try:
            return fn()
        finally:
            elapsed = time.perf_counter() - start
            inner = self._nested.pop()
            self.seconds[stage] = self.seconds.get(stage, 0.0) + elapsed - inner
            if self._nested:
                self._nested[-1] += elapsed

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
