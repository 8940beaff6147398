"""This process's peak resident set size, read where the OS keeps it (a trial reports it)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``; ``ru_maxrss`` where there is no /proc)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (Linux ``clear_refs``); False where that is unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
