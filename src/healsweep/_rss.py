"""This process's peak resident set size, read where the OS keeps it (a trial reports it), and
the peak of its owned (anonymous) memory, which no OS keeps: sampled on a thread."""

from __future__ import annotations

import resource
import sys
import threading
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


def owned_bytes() -> int | None:
    """This process's owned memory now: ``RssAnon`` (heap, arrays, XLA's buffers; not the file
    pages it reads through a map, such as a GGUF's or the stage cache's), None without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class OwnedPeak:
    """The peak of :func:`owned_bytes` while the block runs, sampled every ``every`` seconds
    on a thread (a peak shorter than that can be missed); ``peak`` is None without /proc."""

    def __init__(self, every: float = 0.05) -> None:
        self.every = every
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="owned-peak", daemon=True)

    def _sample(self) -> None:
        while True:
            now = owned_bytes()
            if now is None:
                return
            self.peak = max(self.peak or 0, now)
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> OwnedPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
