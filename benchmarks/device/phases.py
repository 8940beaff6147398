"""Print the phase table of every trial a device job's sweep recorded (the first thing to read
when a night is slow): per trial of each ``trials.parquet`` under the folders given, its phases
summed over layers (wall, CPU and device seconds, cache MiB), as ``bench trial`` prints them.

    python3 benchmarks/device/phases.py /tmp/hs/out/night [MORE ...]

Reads what the trials left even when the job stopped half-way (``bench night`` writes its own
tables only at the end). Not part of the runtime package: it only formats recorded rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from healsweep.bench.trial import phase_table
from healsweep.profile import phase_totals


def trial_tables(folder: Path) -> list[str]:
    """One titled phase table per trial with a phase profile, in each parquet file's order."""
    out = []
    for path in sorted(folder.rglob("trials.parquet")):
        rows = pq.read_table(path).to_pylist()
        for row in rows:
            if not row.get("phase_profile"):
                continue
            phases = phase_totals(json.loads(row["phase_profile"]))
            title = f"{path.parent.name}, trial {row.get('trial_id', '?')}"
            figures = [f"{row[name]:.1f} {unit}" for name, unit in
                       (("work_s", "s"), ("work_cpu_s", "CPU s"), ("peak_rss_mb", "MiB peak RSS"))
                       if isinstance(row.get(name), (int, float))]  # fmt: skip
            if row.get("cache_computed") is not None:
                figures.append(f"{row['cache_computed']} stage entries computed")
            title += f" ({', '.join(figures)})" if figures else ''
            out += [title + ":", phase_table(phases), ""]
    return out


def main(folders: list[str]) -> int:
    lines = [line for folder in folders for line in trial_tables(Path(folder))]
    print("\n".join(lines) if lines else f"phases: no trial with a phase profile under {folders}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
