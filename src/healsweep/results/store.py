"""Files of a sweep's results directory: atomic Parquet writes, the windows dataset, trials.

Layout of ``RESULTS/<sweep>/``:

- ``windows/part-<trial>-<seq>.parquet``: rows of a running trial, a small file per report, each
  written atomically, so a crash loses no finished window and readers never see half a file;
- ``windows/trial-<trial>.parquet``: a finished trial's rows consolidated into one file with the
  final ``pruned`` flag (its part files are removed after the rename);
- ``trials.parquet``: one row per trial; ``manifest.json`` and ``spec.json``: what ran;
- ``over_budget.json``: the configs a size budget kept from being scored (never a trial), by
  config hash: their knobs, routed bpw and file bytes.

A row is identified by ``(config_hash, window_id)``; readers drop repeats (a crash between a
consolidation's rename and the removal of its part files can leave one behind for a moment).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from healsweep._atomic import atomic_path, atomic_write_text
from healsweep._inputs import MIB, quoted, read_text
from healsweep.errors import ResultsError
from healsweep.results.schema import to_table, trial_schema, window_schema

WINDOWS_DIR = "windows"
TRIALS_FILE = "trials.parquet"
MANIFEST_FILE = "manifest.json"
SPEC_FILE = "spec.json"
OVER_BUDGET_FILE = "over_budget.json"
ALLOCATOR_FILE = "allocator.json"  # sampler allocator: its sensitivity table and proposals
RECORD_LIMIT = 64 * MIB  # a sweep folder's JSON records (manifest, spec, allocator)
LOCK_FILE = ".sweep.lock"  # held by the running driver; status probes it shared
_PART = re.compile(r"^part-(?P<trial>.+)-(?P<seq>\d{6})\.parquet$")


def atomic_write_table(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` atomically (:func:`healsweep._atomic.atomic_path`)."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_windows(
    rows: Iterable[Mapping[str, Any]], path: Path, schema: pa.Schema | None = None
) -> None:
    """Window rows (a record's columns with its config's) to one Parquet file, atomically, in
    ``schema`` (default: the windows schema; a column a row lacks is null)."""
    atomic_write_table(to_table(rows, schema or window_schema()), path)


def part_files(windows_dir: Path) -> dict[str, list[Path]]:
    """Part files per trial id, in sequence order."""
    parts: dict[str, list[Path]] = {}
    for path in sorted(windows_dir.glob("part-*.parquet")):
        match = _PART.match(path.name)
        if match:
            parts.setdefault(match["trial"], []).append(path)
    return parts


def trial_file(windows_dir: Path, trial_id: str) -> Path:
    """The consolidated file of a trial."""
    return windows_dir / f"trial-{trial_id}.parquet"


def next_seq(paths: list[Path]) -> int:
    """The next free part sequence number after ``paths``."""
    return 1 + max((int(_PART.match(p.name)["seq"]) for p in paths), default=-1)


def tidy_windows_dir(windows_dir: Path) -> None:
    """After a crash: remove temp files and part files already inside a consolidated file."""
    for tmp in windows_dir.glob(".tmp-*"):
        tmp.unlink(missing_ok=True)
    for trial_id, paths in part_files(windows_dir).items():
        consolidated = trial_file(windows_dir, trial_id)
        if not consolidated.exists():
            continue
        have = set(pq.read_table(consolidated, columns=["window_id"])["window_id"].to_pylist())
        for path in paths:
            ids = set(pq.read_table(path, columns=["window_id"])["window_id"].to_pylist())
            if ids <= have:
                path.unlink()


def consolidate_trial(windows_dir: Path, trial_id: str, pruned: bool) -> int:
    """Merge a trial's part files (and an earlier consolidated file) into one file with the
    final ``pruned`` flag; returns its row count."""
    paths = part_files(windows_dir).get(trial_id, [])
    target = trial_file(windows_dir, trial_id)
    sources = ([target] if target.exists() else []) + paths
    if not sources:
        return 0
    table = dedupe(pa.concat_tables([pq.read_table(p, schema=window_schema()) for p in sources]))
    flag = pa.array([pruned] * table.num_rows, type=pa.bool_())
    table = table.set_column(table.schema.get_field_index("pruned"), "pruned", flag)
    atomic_write_table(table, target)
    for path in paths:
        path.unlink(missing_ok=True)
    return table.num_rows


def dedupe(table: pa.Table) -> pa.Table:
    """Keep the first row of each ``(config_hash, window_id)``."""
    first: dict[tuple[str, str], int] = {}
    keys = zip(table["config_hash"].to_pylist(), table["window_id"].to_pylist(), strict=True)
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    keep = list(first.values())  # ascending: a dict keeps its keys in insertion order
    return table if len(keep) == table.num_rows else table.take(pa.array(keep, type=pa.int64()))


def read_windows(sweep_dir: str | Path) -> pa.Table:
    """All window rows of a sweep (repeats dropped), in the windows schema."""
    windows_dir = Path(sweep_dir) / WINDOWS_DIR
    if not windows_dir.is_dir():
        return window_schema().empty_table()
    dataset = ds.dataset(windows_dir, format="parquet", schema=window_schema())
    return dedupe(dataset.to_table())


def read_trials(sweep_dir: str | Path) -> pa.Table:
    """``trials.parquet`` of a sweep (empty when no trial has started)."""
    path = Path(sweep_dir) / TRIALS_FILE
    if not path.exists():
        return trial_schema().empty_table()
    # one open file: the driver replaces trials.parquet while a sweep runs, and a read by path
    # may take the footer from one version and the pages from the next
    with pa.OSFile(str(path)) as source:
        return pq.read_table(source, schema=trial_schema())


def read_manifest(sweep_dir: str | Path) -> dict[str, Any]:
    """The sweep's manifest; ``ResultsError`` when the folder is not a sweep's results."""
    path = Path(sweep_dir) / MANIFEST_FILE
    try:
        return json.loads(read_text(path, "sweep manifest", RECORD_LIMIT, error=ResultsError))
    except FileNotFoundError:
        raise ResultsError(
            f"{sweep_dir} holds no sweep results ({MANIFEST_FILE} missing); "
            "pass RESULTS/<sweep name> of a sweep started with `healsweep sweep run`"
        ) from None
    except (OSError, json.JSONDecodeError, RecursionError) as exc:
        raise ResultsError(
            f"{path} is unreadable ({quoted(str(exc))}); the results folder is damaged"
        ) from None


def record_over_budget(sweep_dir: str | Path, configs: Mapping[str, Mapping[str, Any]]) -> None:
    """Add ``{config_hash: {knobs, routed_bpw, file_bytes}}`` of configs the budget refused to
    ``over_budget.json`` (rewritten atomically; a config recorded before is kept once)."""

    known = read_over_budget(sweep_dir)
    merged = {**known, **{k: dict(v) for k, v in configs.items() if k not in known}}
    if len(merged) > len(known):
        text = json.dumps(merged, indent=1, sort_keys=True)
        atomic_write_text(Path(sweep_dir) / OVER_BUDGET_FILE, text + "\n")


def read_over_budget(sweep_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The configs over the sweep's budget, never scored (``{}`` without a budget)."""
    return _read_json(Path(sweep_dir) / OVER_BUDGET_FILE)


def write_allocator(sweep_dir: str | Path, record: Mapping[str, Any]) -> None:
    """Write ``allocator.json`` (the sensitivity table the allocator used and its proposals)."""
    text = json.dumps(record, indent=1, sort_keys=True)
    atomic_write_text(Path(sweep_dir) / ALLOCATOR_FILE, text + "\n")


def read_allocator(sweep_dir: str | Path) -> dict[str, Any]:
    """The allocator's record of the sweep (``{}`` for a sweep of another sampler)."""
    return _read_json(Path(sweep_dir) / ALLOCATOR_FILE)


def read_stored_spec(sweep_dir: str | Path) -> dict[str, Any]:
    """The sweep's stored spec as plain data (``{}`` when it has none)."""
    return _read_json(Path(sweep_dir) / SPEC_FILE)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(read_text(path, "sweep record", RECORD_LIMIT, error=ResultsError))
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError, RecursionError) as exc:
        raise ResultsError(
            f"{path} is unreadable ({quoted(str(exc))}); the results folder is damaged"
        ) from None
