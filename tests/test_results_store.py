"""The Parquet results: schema, atomic writes, consolidation with the pruned flag, repeats
dropped, crash leftovers tidied, and the files readable by pyarrow/pandas without healsweep."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pyarrow.parquet as pq

from healsweep.heal.knobs import Knobs
from healsweep.results.schema import knob_columns, to_table, trial_schema, window_schema
from healsweep.results.store import (
    atomic_write_table,
    consolidate_trial,
    part_files,
    read_windows,
    tidy_windows_dir,
    trial_file,
)


def _row(trial: str, window: str, chash: str = "c1", kld: float = 0.1, n: int = 10) -> dict:
    return {
        "sweep": "s",
        "trial_id": trial,
        "config_hash": chash,
        "is_baseline": False,
        **knob_columns(Knobs()),
        "window_id": window,
        "window_index": int(window[1:]),
        "position": 0,
        "windows_total": 4,
        "stratum": "ops",
        "kld_sum": kld * n,
        "kld_count": n,
        "kld_mean": kld,
        "top1": 0.9,
        "router_jaccard": float("nan"),
        "router_jaccard_layers": [0.5, 0.75],
        "pruned": False,
        "scored_at": time.time(),
        "written_at": time.time(),
    }


def _write_parts(windows_dir, trial, windows, chash="c1"):
    windows_dir.mkdir(parents=True, exist_ok=True)
    for seq, window in enumerate(windows):
        path = windows_dir / f"part-{trial}-{seq:06d}.parquet"
        atomic_write_table(to_table([_row(trial, window, chash)], window_schema()), path)


def test_to_table_fills_missing_columns_and_turns_nan_into_null():
    table = to_table([_row("t1", "w0")], window_schema())
    assert table.schema == window_schema()
    row = table.to_pylist()[0]
    assert row["router_jaccard"] is None  # NaN -> null
    assert row["source"] is None  # not given -> null
    assert row["knob_gain_d"] == 0.3 and row["knob_ridge"] is True
    assert row["router_jaccard_layers"] == [0.5, 0.75]
    assert abs(row["scored_at"].timestamp() - time.time()) < 60


def test_consolidation_merges_parts_sets_pruned_and_removes_parts(tmp_path):
    windows_dir = tmp_path / "windows"
    _write_parts(windows_dir, "t1", ["w0", "w1", "w2"])
    _write_parts(windows_dir, "t2", ["w0"], chash="c2")
    assert consolidate_trial(windows_dir, "t1", pruned=True) == 3
    assert "t1" not in part_files(windows_dir) and "t2" in part_files(windows_dir)
    table = pq.read_table(trial_file(windows_dir, "t1"))
    assert table["pruned"].to_pylist() == [True, True, True]
    assert sorted(table["window_id"].to_pylist()) == ["w0", "w1", "w2"]
    # a trial resumed after consolidation: new parts merge into the same file, no repeats
    _write_parts(windows_dir, "t1", ["w2", "w3"])
    assert consolidate_trial(windows_dir, "t1", pruned=False) == 4
    assert read_windows(tmp_path).num_rows == 5


def test_reader_drops_repeats_and_tidy_removes_crash_leftovers(tmp_path):
    windows_dir = tmp_path / "windows"
    _write_parts(windows_dir, "t1", ["w0", "w1"])
    # simulate a crash after the consolidated file was renamed but before parts were removed
    table = to_table([_row("t1", "w0"), _row("t1", "w1")], window_schema())
    atomic_write_table(table, trial_file(windows_dir, "t1"))
    (windows_dir / ".tmp-half-written.parquet").write_bytes(b"PAR1 garbage")
    assert read_windows(tmp_path).num_rows == 2  # repeats dropped, dot-file ignored
    tidy_windows_dir(windows_dir)
    assert sorted(p.name for p in windows_dir.iterdir()) == ["trial-t1.parquet"]


def test_files_are_readable_without_healsweep(tmp_path):
    windows_dir = tmp_path / "windows"
    _write_parts(windows_dir, "t1", ["w0", "w1"])
    _write_parts(windows_dir, "t2", ["w0"], chash="c2")
    consolidate_trial(windows_dir, "t1", pruned=False)
    trials = to_table(
        [{"sweep": "s", "trial_id": "t1", "status": "completed", "kld_mean": 0.1}], trial_schema()
    )
    atomic_write_table(trials, tmp_path / "trials.parquet")
    script = f"""
import json, sys
import pyarrow.dataset as ds, pandas as pd
windows = ds.dataset({str(windows_dir)!r}, format="parquet").to_table().to_pandas()
trials = pd.read_parquet({str(tmp_path / "trials.parquet")!r})
assert not any(m.startswith("healsweep") for m in sys.modules), "healsweep was imported"
print(json.dumps({{"rows": len(windows), "kld": float(windows.kld_sum.sum()),
                  "status": trials.status.tolist(), "knob": windows.knob_alpha.iloc[0]}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["rows"] == 3 and got["status"] == ["completed"] and got["knob"] == "gaussian"
    assert math.isclose(got["kld"], 3 * 0.1 * 10)


def test_a_sweep_written_before_a_knob_existed_reads_back_with_its_default(tmp_path):
    """An older trials.parquet has no column for a newer knob: it reads back null, and
    ``knobs_of`` leaves it out so the knob's default (what the trial ran with) applies."""
    from healsweep.results.schema import knobs_of
    from healsweep.results.store import read_trials

    row = {
        "sweep": "s",
        "trial_id": "t1",
        "config_hash": "c1",
        "is_baseline": False,
        **knob_columns(Knobs(quantizer="gptq", gptq_damp=0.3)),
    }
    table = to_table([row], trial_schema()).drop_columns(["knob_gptq_refine"])
    pq.write_table(table, tmp_path / "trials.parquet")
    read = read_trials(tmp_path).to_pylist()[0]
    assert read["knob_gptq_refine"] is None
    knobs = knobs_of(read)
    assert knobs.gptq_refine == Knobs().gptq_refine == 0
    assert (knobs.quantizer, knobs.gptq_damp) == ("gptq", 0.3)
