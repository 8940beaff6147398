"""The record of one scored window: its metrics, its place in a sweep, and its flat row.

:class:`WindowMetrics` is what the scorer measures on a window (with :class:`CacheWindowStats`
when the student ran through a simulated expert cache); :class:`WindowRecord` adds where the
window stands and where and when it was scored. Each turns into a flat, JSON-ready row
(``to_dict``: what Tune results, trial checkpoints and Parquet rows hold), back again
(``from_dict``), and into its Arrow columns (``arrow_fields``, derived from the fields), so that
scoring, the sweep, ``confirm`` and the report share one definition: a new metric is a new field
here. No jax here: reading results must not need it.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

# Arrow type of a field: by its annotation, or the name in its metadata where they differ.
_ARROW = {"float": "float64", "int": "int64", "str": "string"}
_INT32 = {"arrow": "int32"}
PER_TOKEN = ("hit_rate", "misses_per_token", "mib_per_token")


def _arrow_fields(cls: type, prefix: str = "", skip: tuple[str, ...] = ()) -> list[Any]:
    # lazy: heavy (pyarrow)
    import pyarrow as pa

    special = {"float32 list": pa.list_(pa.float32()), "timestamp": pa.timestamp("us", tz="UTC")}
    out = []
    for f in fields(cls):
        if f.name not in skip:
            kind = f.metadata.get("arrow") or _ARROW[f.type]
            out.append(pa.field(prefix + f.name, special.get(kind) or pa.type_for_alias(kind)))
    return out


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


@dataclass(frozen=True)
class CacheWindowStats:
    """Expert-cache figures of one window's scored positions, summed over MoE layers."""

    tokens: int
    lookups: int  # tokens x layers x k
    misses: int
    mib: float  # MiB loaded on misses

    def to_dict(self) -> dict[str, Any]:
        """The window row's cache columns (counts and the per-token figures)."""
        counts = {f"cache_{f.name}": getattr(self, f.name) for f in fields(self)}
        return {**counts, **per_token(self.tokens, self.lookups, self.misses, self.mib)}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> CacheWindowStats | None:
        """Inverse of :meth:`to_dict`; None when the row has no cache figures."""
        if row.get("cache_tokens") is None:
            return None
        return cls(*(row[f"cache_{f.name}"] for f in fields(cls)))

    @classmethod
    def arrow_fields(cls) -> list[Any]:
        """The columns of :meth:`to_dict`."""
        # lazy: heavy (pyarrow)
        import pyarrow as pa

        return _arrow_fields(cls, "cache_") + [pa.field(n, pa.float64()) for n in PER_TOKEN]


def per_token(tokens: int, lookups: int, misses: int, mib: float) -> dict[str, float]:
    """``hit_rate``, ``misses_per_token`` and ``mib_per_token`` from summed counts."""
    nan = float("nan")
    rates = (
        1.0 - misses / lookups if lookups else nan,
        misses / tokens if tokens else nan,
        mib / tokens if tokens else nan,
    )
    return dict(zip(PER_TOKEN, rates, strict=True))


@dataclass(frozen=True)
class WindowMetrics:
    """Scores of one window (sums are over its ``kld_count`` scored tokens).

    ``delta_p_mean`` is the mean of ``p_student(next) - p_teacher(next)``: negative when the
    student is less sure of the token that actually came. ``router_jaccard`` is NaN when router
    captures were not available; ``router_jaccard_layers`` then is empty.
    """

    kld_sum: float
    kld_count: int
    kld_mean: float
    top1: float
    top1_count: int
    delta_p_mean: float
    teacher_nll_sum: float
    student_nll_sum: float
    router_jaccard: float
    kld_p50: float
    kld_p90: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    router_jaccard_layers: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=np.float32), metadata={"arrow": "float32 list"}
    )
    expert_cache: CacheWindowStats | None = None  # scored through a simulated expert cache

    @property
    def teacher_ppl(self) -> float:
        """Teacher perplexity over the scored tokens."""
        return math.exp(self.teacher_nll_sum / self.kld_count)

    @property
    def student_ppl(self) -> float:
        """Student perplexity over the scored tokens."""
        return math.exp(self.student_nll_sum / self.kld_count)

    def to_dict(self) -> dict[str, Any]:
        """The fields, both perplexities and the cache figures (with a cache) as flat columns."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "expert_cache"}
        row["router_jaccard_layers"] = [float(v) for v in self.router_jaccard_layers]
        row.update(teacher_ppl=self.teacher_ppl, student_ppl=self.student_ppl)
        return {**row, **(self.expert_cache.to_dict() if self.expert_cache else {})}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> WindowMetrics:
        """The metrics in a flat row (:meth:`to_dict`, a Parquet row, a Tune result). A figure a
        row lacks (one written before its column existed) is NaN; a missing ``top1_count`` is
        rebuilt from ``top1``."""
        count = int(row["kld_count"])
        top1_count = row.get("top1_count")
        if top1_count is None:
            top1_count = round(float(row["top1"]) * count)
        layers = row.get("router_jaccard_layers")
        return cls(
            **{f.name: _float(row.get(f.name)) for f in fields(cls) if f.type == "float"},
            kld_count=count,
            top1_count=int(top1_count),
            router_jaccard_layers=np.asarray([] if layers is None else layers, dtype=np.float32),
            expert_cache=CacheWindowStats.from_dict(row),
        )

    @classmethod
    def arrow_fields(cls) -> list[Any]:
        """The columns of :meth:`to_dict`."""
        # lazy: heavy (pyarrow)
        import pyarrow as pa

        ppl = [pa.field(n, pa.float64()) for n in ("teacher_ppl", "student_ppl")]
        return [*_arrow_fields(cls, skip=("expert_cache",)), *ppl, *CacheWindowStats.arrow_fields()]


@dataclass(frozen=True)
class WindowRecord:
    """One scored window: where it stands, its metrics, and where and when it was scored.

    ``window_index`` is the window's place in the fixed global order of its windows (ids
    sorted: the step the pruner pairs trials on), ``position`` its place in the order it was
    scored in. ``metrics`` may be given as a flat mapping (a test's work function), which is
    read with :meth:`WindowMetrics.from_dict`.
    """

    window_id: str
    window_index: int = field(metadata=_INT32)
    position: int = field(metadata=_INT32)
    windows_total: int = field(metadata=_INT32)
    stratum: str
    source: str
    doc_id: str
    kind: str
    metrics: WindowMetrics = field(repr=False)
    scored_node_ip: str = ""
    scored_node_id: str = ""
    scored_hostname: str = ""
    scored_at: float | None = field(default=None, metadata={"arrow": "timestamp"})  # seconds

    def __post_init__(self) -> None:
        if not isinstance(self.metrics, WindowMetrics):
            object.__setattr__(self, "metrics", WindowMetrics.from_dict(self.metrics))

    @classmethod
    def of(
        cls, window: Any, metrics: WindowMetrics, index: int, total: int, position: int
    ) -> WindowRecord:
        """The record of a :class:`~healsweep.data.windows.Window` scored with ``metrics``."""
        place = (window.stratum, window.source, window.doc_id, window.kind)
        return cls(window.window_id, index, position, total, *place, metrics)

    def to_dict(self) -> dict[str, Any]:
        """Every field as a flat column, the metrics' columns included."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "metrics"}
        return {**row, **self.metrics.to_dict()}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> WindowRecord:
        """The record in a flat row; other columns (a Parquet row's config, a Tune result's
        running figures) are ignored."""
        values = {f.name: row.get(f.name) for f in fields(cls) if f.name != "metrics"}
        if isinstance(values["scored_at"], dt.datetime):  # as pyarrow reads a timestamp
            values["scored_at"] = values["scored_at"].timestamp()
        return cls(**values, metrics=WindowMetrics.from_dict(row))

    @classmethod
    def arrow_fields(cls) -> list[Any]:
        """The columns of :meth:`to_dict`."""
        return [*_arrow_fields(cls, skip=("metrics",)), *WindowMetrics.arrow_fields()]


__all__ = ["PER_TOKEN", "CacheWindowStats", "WindowMetrics", "WindowRecord", "per_token"]
