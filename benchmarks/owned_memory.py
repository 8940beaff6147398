"""Peak owned (anonymous) memory of a command's process tree, sampled from /proc (Linux).

    python benchmarks/owned_memory.py [--every 0.1] [--timeline OUT] -- COMMAND ...

Runs COMMAND and, every ``--every`` seconds, sums ``RssAnon`` (memory the processes own: heap,
arrays, XLA's buffers) and ``VmRSS`` (that plus the file pages they touch through a map: the
GGUF, the stage cache's entries) over the command's process and all its descendants. Prints the
peaks when it exits, and with ``--timeline`` writes ``seconds owned_MiB rss_MiB`` once a second.
The acceptance figure of issue 46 (a trial's owned memory is flat in the model's depth) is
``peak owned`` of

    python benchmarks/owned_memory.py -- healsweep bench trial SLICE --calib-tokens 1024 \\
        --tokens '' --cold-only

on 2- and 8-layer slices (docs/sizing.md, "What one layer costs"). A sample misses a peak that
lasts less than the interval; the figures are lower bounds within that.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def _status_kib(pid: int) -> tuple[int, int]:
    """``(RssAnon, VmRSS)`` of one process, KiB (0, 0 once it is gone)."""
    found = {"RssAnon": 0, "VmRSS": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in found:
                found[key] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    return found["RssAnon"], found["VmRSS"]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant (through each thread's children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def tree_kib(pid: int) -> tuple[int, int]:
    """``(RssAnon, VmRSS)`` summed over the process tree of ``pid``, KiB."""
    owned = rss = 0
    for member in process_tree(pid):
        anon, total = _status_kib(member)
        owned, rss = owned + anon, rss + total
    return owned, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.1, help="seconds between samples")
    parser.add_argument("--timeline", type=Path, help="write seconds, owned and RSS MiB each second")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    start = time.monotonic()
    child = subprocess.Popen(command)
    peak_owned = peak_rss = 0
    last_line = -1.0
    timeline = args.timeline.open("w") if args.timeline else None
    while child.poll() is None:
        owned, rss = tree_kib(child.pid)
        peak_owned, peak_rss = max(peak_owned, owned), max(peak_rss, rss)
        now = time.monotonic() - start
        if timeline is not None and now - last_line >= 1.0:
            timeline.write(f"{now:.1f} {owned // 1024} {rss // 1024}\n")
            timeline.flush()
            last_line = now
        time.sleep(args.every)
    if timeline is not None:
        timeline.close()
    print(f"exit {child.returncode}, {time.monotonic() - start:.1f} s: peak owned (RssAnon, "
          f"process tree) {peak_owned / 1024:.0f} MiB, peak RSS {peak_rss / 1024:.0f} MiB")  # fmt: skip
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
