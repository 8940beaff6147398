"""The window record: one definition of a window's fields, flat row and Parquet columns."""

from __future__ import annotations

import math

import numpy as np
import pytest

from healsweep.results.schema import to_table, window_schema
from healsweep.score.record import CacheWindowStats, WindowMetrics, WindowRecord


def _metrics(cache: bool) -> WindowMetrics:
    stats = CacheWindowStats(tokens=10, lookups=80, misses=20, mib=3.5) if cache else None
    return WindowMetrics(
        kld_sum=1.25, kld_count=10, kld_mean=0.125, top1=0.9, top1_count=9, delta_p_mean=-0.01,
        teacher_nll_sum=12.0, student_nll_sum=13.0, router_jaccard=0.75, kld_p50=0.1,
        kld_p90=0.2, kld_p99=0.3, kld_p999=0.31, kld_max=0.4,
        router_jaccard_layers=np.array([0.5, 1.0], dtype=np.float32), expert_cache=stats,
    )  # fmt: skip


def _record(cache: bool = True) -> WindowRecord:
    return WindowRecord("w1", 3, 0, 12, "ops", "src", "d1", "text", _metrics(cache),
                        "10.0.0.1", "node", "host", 1_700_000_000.5)  # fmt: skip


@pytest.mark.parametrize("cache", [True, False])
def test_every_row_key_has_one_column_and_the_row_reads_back(cache):
    record = _record(cache)
    row = record.to_dict()
    columns = [f.name for f in WindowRecord.arrow_fields()]
    assert len(columns) == len(set(columns))
    assert set(row) <= set(columns)  # the cache's columns are null without a cache
    assert set(columns) - set(row) == (set() if cache else {
        "cache_tokens", "cache_lookups", "cache_misses", "cache_mib", "hit_rate",
        "misses_per_token", "mib_per_token"})  # fmt: skip
    again = WindowRecord.from_dict(row)
    assert again.to_dict().keys() == row.keys()
    for key, value in again.to_dict().items():
        assert value == pytest.approx(row[key]), key


def test_a_parquet_row_reads_back_as_the_same_record():
    record = _record()
    table = to_table([{**record.to_dict(), "config_hash": "c", "trial_id": "t"}], window_schema())
    again = WindowRecord.from_dict(table.to_pylist()[0])
    assert again.scored_at == pytest.approx(record.scored_at)  # timestamp -> seconds
    assert again.metrics.expert_cache == record.metrics.expert_cache
    assert again.metrics.kld_sum == record.metrics.kld_sum
    assert np.array_equal(again.metrics.router_jaccard_layers, [0.5, 1.0])
    assert again.metrics.teacher_ppl == pytest.approx(math.exp(1.2))


def test_an_older_row_reads_with_nan_and_top1_count_from_top1():
    old = {"window_id": "w", "kld_sum": 2.0, "kld_count": 20, "top1": 0.85, "kld_mean": 0.1}
    metrics = WindowMetrics.from_dict(old)
    assert metrics.top1_count == 17
    assert math.isnan(metrics.delta_p_mean) and math.isnan(metrics.kld_p99)
    assert metrics.expert_cache is None and metrics.router_jaccard_layers.size == 0


def test_a_work_function_may_give_its_metrics_as_a_mapping():
    flat = {"kld_sum": 1.0, "kld_count": 4, "kld_mean": 0.25, "top1": 0.5, "top1_count": 2}
    record = WindowRecord("w", 0, 0, 1, "s", "src", "d", "text", flat)
    assert isinstance(record.metrics, WindowMetrics) and record.metrics.kld_sum == 1.0
