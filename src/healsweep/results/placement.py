"""What the pool did with a sweep's trials: where their work ran and what the stage caches
served (the placement columns of ``trials.parquet``, :func:`~healsweep.results.schema.placement_fields`).

``cache_hit_rate`` is the share of stage-cache lookups of the sweep's work served from the cache
(hits, including those served after waiting for another process, over hits plus computations);
``follow_up_on_holder`` is the share of follow-up rows (those whose quantization a node already
held when they were placed) that ran on such a node. Rows written before placement was recorded
carry none of it and are left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any


def pool_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The pool figures of trial rows (``trials.parquet`` as dicts), or None when no row
    records its placement: ``placed`` (rows), ``nodes`` ({node id: rows}), ``cache_hits``,
    ``cache_computed``, ``cache_waited``, ``cache_hit_rate`` (None without lookups),
    ``follow_ups``, ``follow_up_on_holder`` (None without follow-ups), ``gpus`` ({device: rows})."""
    placed = [row for row in rows if row.get("placed_node")]
    if not placed:
        return None
    hits = sum(row.get("cache_hits") or 0 for row in placed)
    computed = sum(row.get("cache_computed") or 0 for row in placed)
    follow_ups = [row for row in placed if row.get("holders")]
    on_holder = sum(bool(row.get("on_holder")) for row in follow_ups)
    return {
        "placed": len(placed),
        "nodes": dict(Counter(row["placed_node"] for row in placed)),
        "cache_hits": hits,
        "cache_computed": computed,
        "cache_waited": sum(row.get("cache_waited") or 0 for row in placed),
        "cache_hit_rate": hits / (hits + computed) if hits + computed else None,
        "follow_ups": len(follow_ups),
        "follow_up_on_holder": on_holder / len(follow_ups) if follow_ups else None,
        "gpus": dict(Counter(row["gpus"] for row in placed if row.get("gpus"))),
    }


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _follow_ups(pool: Mapping[str, Any]) -> str:
    """``3 of 4 follow-ups (75%) ran on the node holding their quantization``, or that there
    were none (every row quantized anew, or one node)."""
    n = pool["follow_ups"]
    if not n:
        return "no follow-ups (no row found its quantization already held by a node)"
    on = round(pool["follow_up_on_holder"] * n)
    return (
        f"{on} of {n} follow-ups ({_share(pool['follow_up_on_holder'])}) ran on the node "
        "holding their quantization"
    )


def pool_line(pool: Mapping[str, Any]) -> str:
    """One line of :func:`pool_summary` for ``sweep status`` and the report."""
    nodes = ", ".join(f"{node[:8]} {n}" for node, n in sorted(pool["nodes"].items()))
    line = (
        f"stage-cache hit rate {_share(pool['cache_hit_rate'])} ({pool['cache_hits']} hits, "
        f"{pool['cache_computed']} computed, {pool['cache_waited']} after waiting); "
        f"{_follow_ups(pool)}; {pool['placed']} rows placed on {len(pool['nodes'])} node(s) "
        f"({nodes})"
    )
    if pool["gpus"]:
        line += "; GPUs " + ", ".join(f"{gpu}: {n}" for gpu, n in sorted(pool["gpus"].items()))
    return line
