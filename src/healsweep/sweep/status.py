"""``sweep status``: what a sweep folder says about its progress, read without Ray."""

from __future__ import annotations

import fcntl
from collections import Counter
from pathlib import Path
from typing import Any

from healsweep.results.aggregate import window_counts
from healsweep.results.placement import pool_summary
from healsweep.results.schema import KNOB_PREFIX, row_role
from healsweep.results.store import LOCK_FILE, read_manifest, read_trials, read_windows
from healsweep.sweep.progress import Progress


def driver_running(sweep_dir: Path) -> str | None:
    """``"pid N"`` of the driver holding the sweep's lock, or ``None`` when none does.

    The driver holds the lock exclusively; the probe asks for it shared, so that two processes
    probing at once (two `confirm`s, a `status` beside a `confirm`) do not see each other as a
    driver."""
    path = sweep_dir / LOCK_FILE
    if not path.exists():
        return None
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            return handle.read().strip() or "another process"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def sweep_status(sweep_dir: str | Path) -> dict[str, Any]:
    """Counts of trials by status, windows scored (``windows``:
    :func:`~healsweep.results.aggregate.window_counts`, the count progress and the report show),
    and the :class:`Progress` of the trials
    (best completed config, baseline); reference and external rows are listed apart
    (``fixed``: label -> role, status, pooled KLD); ``pool``: where the work ran and the
    stage-cache hit rate (:func:`~healsweep.results.placement.pool_summary`, None before any
    row recorded it)."""
    sweep_dir = Path(sweep_dir)
    manifest = read_manifest(sweep_dir)
    rows = read_trials(sweep_dir).to_pylist()
    fixed = {
        t["label"]: {"role": str(row_role(t)), "trial_id": t["trial_id"], "status": t["status"],
                     "kld_mean": t["kld_mean"]}
        for t in rows
        if not row_role(t).tuned
    }  # fmt: skip
    windows = read_windows(sweep_dir)
    knobs = [name for name in windows.column_names if name.startswith(KNOB_PREFIX)]
    counted = windows.select(["config_hash", "window_id", "role", "is_baseline", *knobs])
    return {
        "sweep": manifest.get("sweep", sweep_dir.name),
        "folder": str(sweep_dir),
        "planned_trials": manifest.get("planned_trials"),
        "runs": len(manifest.get("runs", [])),
        "driver": driver_running(sweep_dir),
        "trials": dict(Counter(t["status"] for t in rows if row_role(t).tuned)),
        "fixed": fixed,
        "windows": (counts := window_counts(counted.to_pylist())),
        "progress": Progress.of(rows, manifest.get("planned_trials") or 0, counts["scored"], 0.0),
        "pool": pool_summary(rows),
    }
