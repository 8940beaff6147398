"""A sweep's results: the Parquet schema and files, aggregation, the report and its plots.

``RESULTS/<sweep>/windows/`` (one row per config and window) and ``trials.parquet`` are plain
Parquet, readable with pyarrow, pandas or DuckDB without healsweep.
"""

from healsweep.results.store import read_manifest, read_trials, read_windows

__all__ = ["read_manifest", "read_trials", "read_windows"]
