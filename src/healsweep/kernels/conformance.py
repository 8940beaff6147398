"""Kernel conformance: every kernel jitted on the default backend and on CPU, compared.

On a Mac the default backend is the Metal plugin. A kernel that fails to lower, compile or run
on the default device (or on the CPU reference) is reported as failing: nothing moves a kernel to
the CPU at run time, so a kernel the device cannot run is a kernel the runtime cannot run, and
``healsweep doctor`` exits 1 for it. (Q2_0's Pallas GPU kernel falls back to the XLA kernel on the
same device when it does not lower; the XLA kernel is the one checked here.)

``backend_violations`` walks a kernel's jaxpr for what the Metal plugins cannot run:
float64/complex values and linear-algebra primitives (Cholesky, triangular solves, eigh, LU, QR,
...). Kernels that are CPU-placed by
design (the Part B solve) are exempt from the primitive rule, never from the dtype rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

FORBIDDEN_PRIMITIVES = frozenset(
    {
        "cholesky",
        "triangular_solve",
        "eigh",
        "eig",
        "lu",
        "lu_pivots_to_permutation",
        "qr",
        "householder_product",
        "svd",
        "schur",
        "custom_linear_solve",
        "tridiagonal_solve",
    }
)


@dataclass(frozen=True)
class KernelCase:
    """One kernel with example inputs: ``fn(*make_inputs(rng))`` returns a pytree of arrays."""

    name: str
    fn: Callable
    make_inputs: Callable[[np.random.Generator], tuple]
    rtol: float = 1e-5
    cpu_placed: bool = False


@dataclass(frozen=True)
class ConformanceResult:
    """One kernel's verdict: where it ran, whether it lowered and ran there, its error vs CPU.

    ``lowered`` is False when the kernel failed to lower, compile or run on ``backend``; then
    ``max_rel_err`` is infinite, ``ok`` is False, ``note`` says which step failed and ``error``
    holds the first line of the exception.
    """

    name: str
    backend: str
    lowered: bool
    max_rel_err: float
    ok: bool
    note: str = ""
    error: str = ""


def iter_eqns(jaxpr) -> Iterator:
    """Every equation of a jaxpr, descending into sub-jaxprs (pjit, scan, cond, while, custom_*)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                yield from iter_eqns(sub)


def _sub_jaxprs(param) -> Iterator:
    if hasattr(param, "jaxpr") and hasattr(param, "consts"):  # ClosedJaxpr
        yield param.jaxpr
    elif hasattr(param, "eqns"):  # Jaxpr
        yield param
    elif isinstance(param, (tuple, list)):
        for item in param:
            yield from _sub_jaxprs(item)


def backend_violations(fn: Callable, *args, cpu_placed: bool = False) -> list[str]:
    """What in ``fn``'s jaxpr a Metal plugin cannot run; empty when the kernel conforms."""
    import jax

    closed = jax.make_jaxpr(fn)(*args)
    problems = []
    top = closed.jaxpr
    for var in list(top.invars) + list(top.constvars) + list(top.outvars):
        problems += _dtype_problem(var, "argument, constant or result")
    for eqn in iter_eqns(closed.jaxpr):
        if eqn.primitive.name in FORBIDDEN_PRIMITIVES and not cpu_placed:
            problems.append(
                f"primitive {eqn.primitive.name} cannot be lowered by the Metal plugins"
            )
        for var in list(eqn.invars) + list(eqn.outvars):
            problems += _dtype_problem(var, f"value of {eqn.primitive.name}")
    return sorted(set(problems))


def _dtype_problem(var, where: str) -> list[str]:
    aval = getattr(var, "aval", None)
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return []
    dtype = np.dtype(dtype)
    if dtype == np.float64 or np.issubdtype(dtype, np.complexfloating):
        return [f"{dtype} {where}"]
    return []


def _leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]


def _max_rel_err(got, want) -> float:
    """Worst error over the leaves of two pytrees, relative to each ``want`` leaf's max |value|.

    Integer leaves must match exactly; NaNs and infinities must sit at the same places with the
    same values (a NaN where the reference has a number is an infinite error, never ignored).
    """
    worst = 0.0
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        worst = max(worst, _leaf_rel_err(a, b))
    return worst


def _leaf_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    if not np.issubdtype(b.dtype, np.floating):
        return 0.0 if np.array_equal(a, b) else float("inf")
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    finite = np.isfinite(b32)
    same_nonfinite = np.array_equal(np.isfinite(a32), finite) and np.array_equal(
        a32[~finite], b32[~finite], equal_nan=True
    )
    if not same_nonfinite:
        return float("inf")
    if not finite.any():
        return 0.0
    diff = np.abs(a32[finite] - b32[finite])
    scale = max(float(np.max(np.abs(b32[finite]))), float(np.finfo(np.float32).tiny))
    return float(np.max(diff)) / scale


class _KernelFailed(Exception):
    """A kernel did not lower, compile or run on a device; ``step`` says which."""

    def __init__(self, step: str, platform: str, cause: Exception):
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        super().__init__(first)
        self.step, self.platform, self.first_line = step, platform, first[:160]


def _run_on(fn: Callable, inputs: tuple, device):
    """``fn(*inputs)`` jitted for ``device`` with its inputs committed there, run to completion."""
    import jax

    args = jax.device_put(inputs, device)
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as exc:  # any lowering/compile failure is this kernel's verdict
        raise _KernelFailed("lower", device.platform, exc) from exc
    try:
        return jax.block_until_ready(compiled(*args))
    except Exception as exc:
        raise _KernelFailed("run", device.platform, exc) from exc


def run_case(case: KernelCase, seed: int = 0) -> ConformanceResult:
    """Run one kernel on CPU and on the default device and compare.

    A kernel that fails to lower or run on either is reported as failing (``ok`` False), never
    compared with itself.
    """
    import jax

    cpu = jax.devices("cpu")[0]
    default = jax.devices()[0]
    inputs = case.make_inputs(np.random.default_rng(seed))
    try:
        want = _run_on(case.fn, inputs, cpu)
        if case.cpu_placed:
            return ConformanceResult(
                case.name, default.platform, True, 0.0, True, "CPU-placed by design"
            )
        got = _run_on(case.fn, inputs, default)
    except _KernelFailed as failed:
        note = f"fails to {failed.step} on {failed.platform}"
        return ConformanceResult(
            case.name, failed.platform, False, float("inf"), False, note, failed.first_line
        )
    err = _max_rel_err(got, want)
    return ConformanceResult(case.name, default.platform, True, err, err <= case.rtol)


def run_conformance(cases: list[KernelCase] | None = None) -> list[ConformanceResult]:
    """Every registered kernel case, in order."""
    return [run_case(case) for case in (cases if cases is not None else kernel_cases())]


def kernel_cases() -> list[KernelCase]:
    """The registered kernels with small example inputs."""
    from healsweep.kernels._cases import CASES

    return list(CASES)
