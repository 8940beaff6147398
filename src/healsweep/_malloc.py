"""glibc's malloc arenas, capped for a command's process.

glibc gives each thread that meets contention an arena of its own (up to 8 per core), and
memory freed in one arena serves only that arena: a command whose threads (the cache's hashing
and writing threads, the teacher's tail-draw threads, XLA's) allocate and free in turn holds the
sum of every arena's high-water mark. Measured on the demo (issue 47): ``score_windows`` over
160 windows peaked at 1,043 MiB with the default arenas and at 629 MiB with two. So the command
line caps them at :data:`ARENAS` as it starts, unless ``MALLOC_ARENA_MAX`` says otherwise (glibc
reads that itself). Ray's worker processes do not start here and keep glibc's default.

Freed memory stays in the arenas, counted in the process's resident set, until glibc gives it
back; :func:`trim` asks it to, after a phase that freed much (``confirm`` after it drops the
compiled code of a student's build: about 1.4-3.6 MiB an executable, issue 47).
"""

from __future__ import annotations

import ctypes
import os
import sys

ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def cap_arenas(arenas: int = ARENAS) -> bool:
    """Cap this process's malloc arenas at ``arenas`` (glibc on Linux; elsewhere, or when
    ``MALLOC_ARENA_MAX`` is set, nothing is changed). True when the cap was set."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt in this C library
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))


def trim() -> bool:
    """Give the memory malloc holds free back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing). True when some was given back."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(malloc_trim(0))
