"""The Parquet schemas of a sweep's results, readable without healsweep.

``RESULTS/<sweep>/windows/*.parquet`` holds one row per (config, window): who scored it (trial,
its ``role`` and ``label``, every knob), the window's record
(:class:`~healsweep.score.record.WindowRecord`), the trial's running pooled figures at that point
and whether the trial was later pruned. ``RESULTS/<sweep>/trials.parquet`` holds one row per trial.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

import pyarrow as pa

from healsweep.cache import canonical_json
from healsweep.heal.knobs import Knobs
from healsweep.heal.reads import student_key
from healsweep.score.record import WindowRecord

KNOB_PREFIX = "knob_"


class Role(StrEnum):
    """What a row's config is to the sweep (its ``role`` column): a tuned ``trial``, the
    ``baseline`` (itself a trial), a fixed ``reference`` (unhealed, plain) or an ``external``
    GGUF; references and externals are scored on the same windows, never pruned, and kept out
    of the Optuna study."""

    TRIAL = "trial"
    BASELINE = "baseline"
    REFERENCE = "reference"
    EXTERNAL = "external"

    @property
    def tuned(self) -> bool:
        """A trial of the Tune experiment (the baseline is one); not a fixed row."""
        return self in (Role.TRIAL, Role.BASELINE)


class TrialStatus(StrEnum):
    """Where a row's config stands (the ``status`` column of ``trials.parquet``)."""

    PENDING = "pending"
    RUNNING = "running"
    RETRYING = "retrying"
    COMPLETED = "completed"
    PRUNED = "pruned"
    ERROR = "error"

    @property
    def unfinished(self) -> bool:
        """Not ended yet: a resume carries it on."""
        return self in (TrialStatus.PENDING, TrialStatus.RUNNING, TrialStatus.RETRYING)


REFERENCES = ("unhealed", "plain")  # the reference rows, in the order they run and are listed

_KNOB_TYPES = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
_TS = pa.timestamp("us", tz="UTC")


def _knob_type(value: Any) -> pa.DataType:
    """The Arrow type of a knob's column, from its default (a StrEnum knob is a string)."""
    return next(arrow for kind, arrow in _KNOB_TYPES.items() if isinstance(value, kind))


def _config_fields(*extra: pa.Field) -> list[pa.Field]:
    """Who scored a row: the trial, its config and role (``extra`` after them), every knob
    (``knob_<name>``, typed from the knob's default)."""
    text = pa.string()
    knobs = Knobs().model_dump()
    return [
        *(pa.field(name, text) for name in ("sweep", "trial_id", "config_hash")),
        pa.field("is_baseline", pa.bool_()),
        pa.field("role", text),
        pa.field("label", text),
        *extra,
        *(pa.field(KNOB_PREFIX + name, _knob_type(v)) for name, v in knobs.items()),
    ]


def window_schema() -> pa.Schema:
    """Schema of a row of the windows dataset (see the module docstring)."""
    return pa.schema(
        [
            *_config_fields(),
            *WindowRecord.arrow_fields(),
            pa.field("windows_done", pa.int32()),
            pa.field("running_kld_mean", pa.float64()),
            pa.field("running_top1", pa.float64()),
            pa.field("pruned", pa.bool_()),
            pa.field("written_at", _TS),
        ]
    )


def trial_schema() -> pa.Schema:
    """Schema of a row of ``trials.parquet``."""
    return pa.schema(
        [
            *_config_fields(
                pa.field("routed_bpw", pa.float64()),
                pa.field("external_path", pa.string()),
                pa.field("file_bytes", pa.int64()),
            ),
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
            *placement_fields(),
        ]
    )


def placement_fields() -> list[pa.Field]:
    """Where a row's work ran and what its stage caches did (its last attempt; null in rows
    written before placement was recorded): ``placement`` (``cache`` | ``ray``), the node
    (``placed_node``), the nodes that held its quantization when it was placed (``holders``,
    comma-separated; empty for a trial with none, i.e. not a follow-up) and whether it ran on one
    (``on_holder``), its ``quantization`` (``sweep.holders.quantization_of``), the GPUs it saw
    (``gpus``: ``CUDA_VISIBLE_DEVICES``), stage-cache entries served, computed and served after
    waiting for another process (``cache_hits``, ``cache_computed``, ``cache_waited``; per stage in
    ``cache_detail``, JSON), the work's wall and CPU seconds and its process's peak RSS, the host
    threads it ran with (``threads``: BLAS, XLA's CPU client, ggml's quantizer) and where its
    time went (``phase_profile``: JSON rows of :meth:`healsweep.profile.PhaseProfile.rows`)."""
    text, count, seconds = pa.string(), pa.int64(), pa.float64()
    return [
        *(pa.field(name, text) for name in ("placement", "placed_node", "holders")),
        pa.field("on_holder", pa.bool_()),
        *(pa.field(name, text) for name in ("quantization", "gpus")),
        *(pa.field(name, count) for name in ("cache_hits", "cache_computed", "cache_waited")),
        pa.field("cache_detail", text),
        *(pa.field(name, seconds) for name in ("work_s", "work_cpu_s", "peak_rss_mb")),
        pa.field("threads", count),
        pa.field("phase_profile", text),
    ]


PLACEMENT_COLUMNS = tuple(field.name for field in placement_fields())


def _cell(value: Any, kind: pa.DataType) -> Any:
    if value is None or isinstance(value, dt.datetime):
        return value
    if pa.types.is_timestamp(kind):  # float seconds, as time.time() gives them
        return dt.datetime.fromtimestamp(float(value), tz=dt.UTC)
    if pa.types.is_floating(kind):
        return None if math.isnan(float(value)) else float(value)
    return value


def to_table(rows: Iterable[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """A table of ``rows`` in ``schema``: missing columns are null, extra keys are dropped,
    NaN becomes null, float seconds become timestamps."""
    rows = list(rows)
    columns = {
        f.name: pa.array([_cell(r.get(f.name), f.type) for r in rows], f.type) for f in schema
    }
    return pa.table(columns, schema=schema)


def row_role(row: Mapping[str, Any]) -> Role:
    """The row's role; rows written before roles existed are ``baseline`` or ``trial``."""
    return Role(row.get("role") or (Role.BASELINE if row.get("is_baseline") else Role.TRIAL))


def scored_all(windows_done: int, windows_total: int | None) -> bool:
    """Whether a config has scored every window of the sweep: the one rule of *pruned*, a
    trial that stopped without an error before it had (:func:`end_status`)."""
    return bool(windows_total) and windows_done >= int(windows_total or 0)


def end_status(windows_done: int, windows_total: int | None) -> TrialStatus:
    """How a trial that stopped without an error ended: completed, or pruned."""
    return TrialStatus.COMPLETED if scored_all(windows_done, windows_total) else TrialStatus.PRUNED


def short_hash(value: Any) -> str:
    """16 hex digits of sha256 over the canonical JSON of ``value``: how a config is named."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:16]


def config_hash(knobs: Knobs) -> str:
    """A short content hash of a full knob set (the identity of a config across trials and runs:
    :meth:`Knobs.identity`, so a knob added later at its old default leaves it as it was)."""
    return short_hash(knobs.identity())


def fixed_config_hash(role: Role, label: str, knobs: Knobs | None, fingerprint: str | None) -> str:
    """The config hash of a reference or external row: over its role, label and what it scores
    (knobs, or the file's fingerprint), so never equal to a trial's, even with a trial's knobs."""
    identity = {
        "role": role,
        "label": label,
        "knobs": knobs.identity() if knobs is not None else None,
        "fingerprint": fingerprint,
    }
    return short_hash(identity)


def is_candidate(role: Role, status: str, kld_mean: float | None) -> bool:
    """Whether a config may be a sweep's best: a completed trial (the baseline included) with a
    pooled KLD; reference and external rows are not trials."""
    return role.tuned and status == TrialStatus.COMPLETED and kld_mean is not None


def best_trial(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The sweep's best config so far: the completed trial with the lowest dev pooled KLD, the
    baseline included (a sweep whose baseline beats every tuned config has found nothing
    better; a worse trial is not its answer); reference and external rows are not trials.
    None before a trial has completed."""
    done = [row for row in rows if is_candidate(row_role(row), row["status"], row["kld_mean"])]
    return min(done, key=lambda row: row["kld_mean"], default=None)


def student_of(row: Mapping[str, Any]) -> str:
    """The student a row scored: its knobs' student key
    (:meth:`~healsweep.heal.knobs.Knobs.student_key`), or for an external GGUF its config hash
    (which covers the file's fingerprint). Rows of one student have the same windows."""
    knobs = knobs_of(row)
    return row["config_hash"] if knobs is None else student_key(knobs)


def knob_columns(knobs: Knobs | None) -> dict[str, Any]:
    """``{knob_<name>: value}`` of a config's knobs (none for an external GGUF)."""
    values = {} if knobs is None else knobs.model_dump()
    return {KNOB_PREFIX + name: value for name, value in values.items()}


def knobs_of(row: Mapping[str, Any]) -> Knobs | None:
    """The knobs in a row's ``knob_<name>`` columns (inverse of :func:`knob_columns`; None for
    an external GGUF, which has none).

    A null knob is one the row's sweep predates: its default applies (what that trial ran
    with, since a new knob's default keeps the old behaviour).
    """
    if row_role(row) == Role.EXTERNAL:
        return None
    return Knobs(
        **{
            k[len(KNOB_PREFIX) :]: v
            for k, v in row.items()
            if k.startswith(KNOB_PREFIX) and v is not None
        }
    )
