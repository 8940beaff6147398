"""Per trial of a device job: its wall, the GPU's busy share and the host's peak used memory over
the trial's own span (issue 46's acceptance: cold trial GPU busy >= 60%, host RSS <= 16 GB).

    python3 benchmarks/device/busy.py SAMPLES FOLDER

SAMPLES is what ``sample.sh`` wrote (epoch, GPU util %, GPU MiB, host used MiB, once a second);
FOLDER holds the job's ``trials.parquet`` files (their ``started_at``/``ended_at`` epochs). A trial
shorter than a few samples gets a coarse share: the sample count is printed beside it. Host used
memory is the machine's (``free``'s used: every process, page cache excluded), so it bounds the
trial's own RSS from above.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq


def samples(path: Path) -> list[tuple[float, float | None, float | None, float]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue
        number = [None if p == "-" else float(p) for p in parts]
        rows.append((number[0], number[1], number[2], number[3]))
    return rows


def epoch(value) -> float:
    """A row's ``started_at``/``ended_at``: epoch seconds, or a (naive UTC) timestamp."""
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    return float(value)


def table(sampled: list, folder: Path) -> list[str]:
    lines = ["| trial | wall s | GPU busy | GPU MiB peak | host used MiB peak | samples |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    spans = []
    for path in sorted(folder.rglob("trials.parquet")):
        for row in pq.read_table(path).to_pylist():
            if row.get("started_at") and row.get("ended_at"):
                spans.append(
                    (
                        epoch(row["started_at"]),
                        epoch(row["ended_at"]),
                        str(row.get("trial_id", "?")),
                    )
                )
    spans.sort()
    if sampled and spans:
        spans.append((min(s[0] for s in spans), max(s[1] for s in spans), "whole night"))
    for start, end, name in spans:
        inside = [s for s in sampled if start <= s[0] <= end]
        util = [s[1] for s in inside if s[1] is not None]
        gpu_mem = [s[2] for s in inside if s[2] is not None]
        busy = f"{sum(util) / len(util):.0f}%" if util else "-"
        peak_gpu = f"{max(gpu_mem):.0f}" if gpu_mem else "-"
        host = f"{max(s[3] for s in inside):.0f}" if inside else "-"
        lines.append(
            f"| {name} | {end - start:.1f} | {busy} | {peak_gpu} | {host} | {len(inside)} |"
        )
    whole = [s[3] for s in sampled]
    if whole:
        lines.append(f"\nhost used memory over the whole job: peak {max(whole):.0f} MiB")
    return lines


def main(argv: list[str]) -> int:
    path, folder = Path(argv[0]), Path(argv[1])
    if not path.is_file():
        print(f"busy: no samples at {path}")
        return 0
    print("\n".join(table(samples(path), folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
