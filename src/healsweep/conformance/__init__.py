"""Conformance: every kernel, every in-graph GGUF decoder and one model layer, run down the
production path of the backend at hand and checked against independent float64 references.

``healsweep doctor`` runs :func:`run_conformance`. Each case (:class:`KernelCase`) runs on the
CPU and, where JAX has an accelerator, on it too: each result against the case's float64 numpy
reference (:mod:`healsweep.conformance.references`), and the device against the CPU. A kernel
that fails to lower or run on a device is reported failing, never moved to the CPU.
:func:`backend_violations` reads a kernel's jaxpr for what the Metal plugins cannot run.

It sits above ``model`` in the layer order (it checks the forward), so ``kernels`` holds none
of it. The references import numpy alone; the tests use the same references.
"""

from healsweep.conformance.rules import FORBIDDEN_PRIMITIVES, backend_violations, iter_eqns
from healsweep.conformance.run import ConformanceResult, KernelCase, max_rel_err, run_case
from healsweep.conformance.suite import all_cases, run_conformance

__all__ = [
    "FORBIDDEN_PRIMITIVES",
    "ConformanceResult",
    "KernelCase",
    "all_cases",
    "backend_violations",
    "iter_eqns",
    "max_rel_err",
    "run_case",
    "run_conformance",
]
