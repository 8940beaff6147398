"""``sweep status``: what a sweep folder says about its progress, read without Ray."""

from __future__ import annotations

import fcntl
from collections import Counter
from pathlib import Path
from typing import Any

from healsweep.results.schema import row_role
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
    """Counts of trials by status, windows recorded, and the :class:`Progress` of the trials
    (best completed config, baseline); reference and external rows are listed apart
    (``fixed``: label -> role, status, pooled KLD)."""
    sweep_dir = Path(sweep_dir)
    manifest = read_manifest(sweep_dir)
    rows = read_trials(sweep_dir).to_pylist()
    fixed = {
        t["label"]: {"role": row_role(t), "status": t["status"], "kld_mean": t["kld_mean"]}
        for t in rows
        if not row_role(t).tuned
    }
    return {
        "sweep": manifest.get("sweep", sweep_dir.name),
        "folder": str(sweep_dir),
        "planned_trials": manifest.get("planned_trials"),
        "runs": len(manifest.get("runs", [])),
        "driver": driver_running(sweep_dir),
        "trials": dict(Counter(t["status"] for t in rows if row_role(t).tuned)),
        "fixed": fixed,
        "windows_recorded": read_windows(sweep_dir).num_rows,
        "progress": Progress.of(rows, manifest.get("planned_trials") or 0, 0, 0.0),
    }
