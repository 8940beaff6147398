"""How many host threads this process's work may use, and the libraries told so.

A trial holds a share of a node (DESIGN.md): on a GPU node one GPU and cores ÷ GPUs of its cores,
alone on a node all of them. Ray starts the trial's worker with ``OMP_NUM_THREADS`` set to the
task's ``num_cpus``, which OpenBLAS (numpy's and scipy's BLAS and LAPACK) reads when it loads; a
GPU trial that asked for one CPU then ran its host phases (the ridge's eigendecomposition, the
Gram and held-out products, ggml's quantizer) on one core of sixteen. :func:`use_threads` sets
every pool the work's host phases run on to the trial's count:

- every OpenBLAS loaded in the process (numpy's and scipy's wheels each bundle one), at once,
  through ``openblas_set_num_threads``;
- the environment (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``), for
  libraries loaded later and processes started from this one;
- XLA's CPU client (``NPROC``, read when JAX's CPU backend starts: effective in a process whose
  backend has not started yet, as a trial's worker before its first computation);
- ggml's quantizer, whose row ranges run on :func:`host_threads` threads
  (:func:`healsweep.gguf_io._ggml_lib.quantize_rows`).

:func:`seen` reports what the process's work actually sees, for a trial's row and the tests.
"""

from __future__ import annotations

import ctypes
import os
import threading
from functools import cache
from typing import Any

from healsweep.runtime import current

THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
XLA_THREADS_ENV = "NPROC"  # XLA's CPU client sizes its thread pool by it (jaxlib 0.5 to 0.10)


def cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS has no affinity
        return max(1, os.cpu_count() or 1)


def available_memory() -> int:
    """Bytes of memory the process can still take without swapping (``MemAvailable``), or the
    machine's memory where that cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class _Count:
    """The runtime's thread count (None: not set, so every core), and the threads that are
    themselves one of a pool's (each does its share on one thread)."""

    def __init__(self) -> None:
        self.threads: int | None = None
        self.pooled = threading.local()


def host_threads() -> int:
    """Threads this process's host work may use: what :func:`use_threads` set, else every core
    it may run on; 1 on a thread of a pool that already spreads the work
    (:func:`one_thread`)."""
    count = current().owned(_Count)
    if getattr(count.pooled, "one", False):
        return 1
    return count.threads or cores()


def one_thread() -> None:
    """Mark the calling thread as one of a pool's (an executor's initializer): the work it runs
    asks for no threads of its own (ggml's row ranges), so pools do not nest."""
    current().owned(_Count).pooled.one = True


def openblas_paths() -> list[str]:
    """Paths of the OpenBLAS libraries loaded in this process (numpy's, and scipy's once
    ``scipy.linalg`` is imported); empty without ``/proc`` (macOS: Accelerate)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if "openblas" in os.path.basename(p).lower())


# The names OpenBLAS builds give its thread setter and getter: plain, and the prefixed ones of
# the scipy-openblas wheels that numpy (64-bit integers) and scipy bundle.
_PREFIXES = ("", "scipy_", "scipy_")
_SUFFIXES = ("", "64_", "")


@cache
def _openblas(path: str) -> tuple[Any, Any] | None:
    """``(set_num_threads, get_num_threads)`` of the OpenBLAS at ``path``, or None."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for prefix, suffix in zip(_PREFIXES, _SUFFIXES, strict=True):
        try:
            setter = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}")
            getter = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}")
        except AttributeError:
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], None
        getter.argtypes, getter.restype = [], ctypes.c_int
        return setter, getter
    return None


def _loaded_openblas() -> list[tuple[Any, Any]]:
    # lazy: heavy (scipy); both are imported here for the OpenBLAS each loads
    import numpy  # noqa: F401  (its OpenBLAS)
    import scipy.linalg  # noqa: F401  (scipy's own OpenBLAS, which LAPACK calls use)

    return [lib for lib in map(_openblas, openblas_paths()) if lib is not None]


def use_threads(n: int) -> int:
    """Let this process's host work use ``n`` threads (see the module docstring); returns ``n``."""
    if n < 1:
        raise ValueError(f"use_threads: expected at least 1 thread, got {n}")
    current().owned(_Count).threads = n
    for name in THREAD_ENV:
        os.environ[name] = str(n)
    os.environ[XLA_THREADS_ENV] = str(n)
    for setter, _ in _loaded_openblas():
        setter(n)
    return n


def blas_threads() -> list[int]:
    """The thread count each loaded OpenBLAS uses now (empty where none can be asked)."""
    return [int(getter()) for _, getter in _loaded_openblas()]


def xla_cpu_threads() -> int | None:
    """Threads in XLA's CPU client pool, as configured for a backend started now (``NPROC``),
    None when unset (every core)."""
    value = os.environ.get(XLA_THREADS_ENV)
    return int(value) if value and value.isdigit() else None


def seen() -> dict[str, object]:
    """What this process's work sees: ``threads`` (:func:`host_threads`), ``blas_threads``,
    ``omp_num_threads`` and ``xla_cpu_threads``."""
    return {
        "threads": host_threads(),
        "blas_threads": blas_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "xla_cpu_threads": xla_cpu_threads(),
    }


__all__ = [
    "available_memory", "blas_threads", "cores", "host_threads", "one_thread", "seen", "use_threads",
    "xla_cpu_threads",
]  # fmt: skip
