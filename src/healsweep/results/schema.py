"""The Parquet schemas of a sweep's results, readable without healsweep.

``RESULTS/<sweep>/windows/*.parquet`` holds one row per (config, window): who scored it (trial,
its ``role`` and ``label``, every knob), what was scored (window id, global index, stratum, ...), the window's metrics, the
trial's running pooled figures at that point, whether the trial was later pruned, and where and
when it was scored. ``RESULTS/<sweep>/trials.parquet`` holds one row per trial.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from healsweep.heal.knobs import Knobs

KNOB_PREFIX = "knob_"

# What a config is to the sweep: a tuned `trial`, the `baseline` (itself a trial), a fixed
# `reference` (unhealed, plain) or an `external` GGUF; references and externals are scored on
# the same windows, never pruned, and kept out of the Optuna study.
ROLES = ("trial", "baseline", "reference", "external")
REFERENCES = ("unhealed", "plain")  # the reference rows, in the order they run and are listed
# Bits per weight of the routed experts of every healsweep student: Q2_0's 18 bytes per 64
# weights (kernels.q2_0.BYTES_PER_BLOCK; not imported: reading results needs no jax).
Q2_0_BPW = 8 * 18 / 64

_KNOB_TYPES = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}


def knob_fields() -> list[pa.Field]:
    """One column per knob, ``knob_<name>``, typed from the knob's default."""
    defaults = Knobs().model_dump()
    return [pa.field(KNOB_PREFIX + name, _KNOB_TYPES[type(v)]) for name, v in defaults.items()]


METRIC_FIELDS = [
    pa.field("kld_sum", pa.float64()),
    pa.field("kld_count", pa.int64()),
    pa.field("kld_mean", pa.float64()),
    pa.field("top1", pa.float64()),
    pa.field("top1_count", pa.int64()),
    pa.field("delta_p_mean", pa.float64()),
    pa.field("teacher_nll_sum", pa.float64()),
    pa.field("student_nll_sum", pa.float64()),
    pa.field("teacher_ppl", pa.float64()),
    pa.field("student_ppl", pa.float64()),
    pa.field("router_jaccard", pa.float64()),
    pa.field("router_jaccard_layers", pa.list_(pa.float32())),
    pa.field("kld_p50", pa.float64()),
    pa.field("kld_p90", pa.float64()),
    pa.field("kld_p99", pa.float64()),
    pa.field("kld_p999", pa.float64()),
    pa.field("kld_max", pa.float64()),
    # expert-cache simulation (null without one): counts at the scored positions, all layers
    pa.field("cache_tokens", pa.int64()),
    pa.field("cache_lookups", pa.int64()),
    pa.field("cache_misses", pa.int64()),
    pa.field("cache_mib", pa.float64()),
    pa.field("hit_rate", pa.float64()),
    pa.field("misses_per_token", pa.float64()),
    pa.field("mib_per_token", pa.float64()),
]

_TS = pa.timestamp("us", tz="UTC")


def window_schema() -> pa.Schema:
    """Schema of a row of the windows dataset."""
    return pa.schema(
        [
            pa.field("sweep", pa.string()),
            pa.field("trial_id", pa.string()),
            pa.field("config_hash", pa.string()),
            pa.field("is_baseline", pa.bool_()),
            pa.field("role", pa.string()),
            pa.field("label", pa.string()),
            *knob_fields(),
            pa.field("window_id", pa.string()),
            pa.field("window_index", pa.int32()),
            pa.field("position", pa.int32()),
            pa.field("windows_total", pa.int32()),
            pa.field("stratum", pa.string()),
            pa.field("source", pa.string()),
            pa.field("doc_id", pa.string()),
            pa.field("kind", pa.string()),
            *METRIC_FIELDS,
            pa.field("windows_done", pa.int32()),
            pa.field("running_kld_mean", pa.float64()),
            pa.field("running_top1", pa.float64()),
            pa.field("pruned", pa.bool_()),
            pa.field("scored_node_ip", pa.string()),
            pa.field("scored_node_id", pa.string()),
            pa.field("scored_hostname", pa.string()),
            pa.field("scored_at", _TS),
            pa.field("written_at", _TS),
        ]
    )


def trial_schema() -> pa.Schema:
    """Schema of a row of ``trials.parquet``."""
    return pa.schema(
        [
            pa.field("sweep", pa.string()),
            pa.field("trial_id", pa.string()),
            pa.field("config_hash", pa.string()),
            pa.field("is_baseline", pa.bool_()),
            pa.field("role", pa.string()),
            pa.field("label", pa.string()),
            pa.field("routed_bpw", pa.float64()),
            pa.field("external_path", pa.string()),
            *knob_fields(),
            pa.field("status", pa.string()),
            pa.field("pruned", pa.bool_()),
            pa.field("windows_scored", pa.int32()),
            pa.field("windows_total", pa.int32()),
            pa.field("kld_mean", pa.float64()),
            pa.field("top1", pa.float64()),
            pa.field("kld_sum", pa.float64()),
            pa.field("kld_count", pa.int64()),
            pa.field("top1_count", pa.int64()),
            pa.field("n_failures", pa.int32()),
            pa.field("nodes", pa.string()),
            pa.field("started_at", _TS),
            pa.field("ended_at", _TS),
        ]
    )


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _seconds_to_ts(value: Any) -> Any:
    import datetime as dt

    if value is None or isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromtimestamp(float(value), tz=dt.UTC)


def to_table(rows: Iterable[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """A table of ``rows`` in ``schema``: missing columns are null, extra keys are dropped,
    NaN becomes null, float seconds become timestamps."""
    rows = list(rows)
    columns = {}
    for f in schema:
        values = [row.get(f.name) for row in rows]
        if pa.types.is_timestamp(f.type):
            values = [_seconds_to_ts(v) for v in values]
        elif pa.types.is_floating(f.type):
            values = [None if v is None else _clean(float(v)) for v in values]
        columns[f.name] = pa.array(values, type=f.type)
    return pa.table(columns, schema=schema)


def row_role(row: Mapping[str, Any]) -> str:
    """The row's role; rows written before roles existed are ``baseline`` or ``trial``."""
    return row.get("role") or ("baseline" if row.get("is_baseline") else "trial")


def knob_columns(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """``{knob_<name>: value}`` for a knob dict."""
    return {KNOB_PREFIX + name: value for name, value in knobs.items()}


__all__ = [
    "KNOB_PREFIX",
    "METRIC_FIELDS",
    "Q2_0_BPW",
    "REFERENCES",
    "ROLES",
    "knob_columns",
    "knob_fields",
    "row_role",
    "to_table",
    "trial_schema",
    "window_schema",
]
