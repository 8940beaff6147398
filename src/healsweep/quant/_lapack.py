"""Host Cholesky factorizations that run beside other work: GIL-free and on one BLAS thread.

GPTQ factors one ``n × n`` float64 matrix per routed expert on the host while the device
quantizes the experts factored before. Two things stood in the way (measured on this project's
2-core CPU):

- scipy's ``lapack.dpotrf`` holds the GIL for the whole call (0.1-0.5 s for ``n = 2048``), so
  the thread that dispatches the device's work stalled behind it. The same LAPACK routine is
  called here through the function pointer scipy publishes for Cython
  (``scipy.linalg.cython_lapack``), by ``ctypes``, which releases the GIL during the call;
- OpenBLAS spreads each call over every core. Beside XLA's threads, or on a machine shared with
  other jobs, its threads wait on each other: one 2048² factorization took 0.15 s on one
  thread and 0.25-2.3 s on two under load. Factoring several matrices at once, one per host
  thread, each on one OpenBLAS thread, is faster and robust. OpenBLAS 0.3.27+ sets that per
  calling thread (``openblas_set_num_threads_local``); scipy's and numpy's wheels each bundle
  their own copy, so every OpenBLAS loaded in the process is set. Elsewhere (another BLAS, an
  older OpenBLAS, no ``/proc``) :func:`one_blas_thread` does nothing: only speed depends on it.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from healsweep.threads import host_threads, one_thread, openblas_paths

_INT_P = ctypes.POINTER(ctypes.c_int)


@cache
def _dpotrf():
    """LAPACK's ``dpotrf`` as scipy links it, callable without the GIL."""
    # lazy: heavy (scipy)
    from scipy.linalg import cython_lapack

    capsule = cython_lapack.__pyx_capi__["dpotrf"]
    api = ctypes.pythonapi
    name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", api))
    pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", api)
    )
    address = pointer(capsule, name(capsule))
    # void dpotrf(char *uplo, int *n, double *a, int *lda, int *info)
    return ctypes.CFUNCTYPE(None, ctypes.c_char_p, _INT_P, ctypes.c_void_p, _INT_P, _INT_P)(address)


def cholesky_lower(a: np.ndarray) -> int:
    """Factor the symmetric positive definite ``a`` [n, n] (C-contiguous float64) in place: on
    return its lower triangle holds ``L`` with ``a = L·Lᵀ``; its strict upper triangle is left
    as it was. Returns LAPACK's ``info`` (0: factored; > 0: not positive definite).

    A C array is the transpose of the Fortran array LAPACK sees, so LAPACK's ``U`` (``UᵀU``) is
    this ``Lᵀ``: no transposing copies.
    """
    if a.dtype != np.float64 or not a.flags.c_contiguous or a.ndim != 2 or len(set(a.shape)) > 1:
        raise ValueError(
            f"cholesky_lower: expected a square C-contiguous float64 matrix, got {a.dtype} "
            f"{a.shape}"
        )
    n, info = ctypes.c_int(a.shape[0]), ctypes.c_int(0)
    _dpotrf()(b"U", ctypes.byref(n), a.ctypes.data, ctypes.byref(n), ctypes.byref(info))
    return info.value


@cache
def _local_thread_setters() -> tuple:
    """``openblas_set_num_threads_local`` of each OpenBLAS this process has loaded."""
    _dpotrf()  # scipy's LAPACK (and so its OpenBLAS) is loaded by now
    setters = []
    for path in openblas_paths():  # none without /proc (macOS: scipy on Accelerate)
        try:
            setter = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        setters.append(setter)
    return tuple(setters)


def one_blas_thread() -> None:
    """Make this thread's BLAS and LAPACK calls single-threaded (an executor's initializer)."""
    one_thread()
    for setter in _local_thread_setters():
        setter(1)


def threads_for_factoring(limit: int) -> int:
    """Host threads to factor matrices side by side: up to ``limit``, one of the process's host
    threads (:func:`~healsweep.threads.host_threads`) left to the device's driver (and on a CPU
    backend to XLA); 1 where LAPACK's own threads cannot be
    limited per thread (each call then spreads over the cores itself)."""
    if not _local_thread_setters():
        return 1
    return max(1, min(limit, host_threads() - 1))
