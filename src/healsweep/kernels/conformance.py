"""Kernel conformance: every kernel jitted on the default backend and on CPU, compared.

On a Mac the default backend is the Metal plugin; an op it cannot lower is reported and the
kernel is routed to the CPU device (the result is still checked). ``backend_violations`` walks a
kernel's jaxpr for what the Metal plugins cannot run: float64/complex values and linear-algebra
primitives (Cholesky, triangular solves, eigh, LU, QR, ...). Kernels that are CPU-placed by
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
    """One kernel's verdict: where it ran, whether it lowered there, its error vs CPU."""

    name: str
    backend: str
    lowered: bool
    max_rel_err: float
    ok: bool
    note: str = ""


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


def run_case(case: KernelCase, seed: int = 0) -> ConformanceResult:
    """Run one kernel on CPU and on the default device and compare."""
    import jax

    cpu = jax.devices("cpu")[0]
    default = jax.devices()[0]
    inputs = case.make_inputs(np.random.default_rng(seed))
    with jax.default_device(cpu):
        want = jax.block_until_ready(jax.jit(case.fn)(*inputs))
    if case.cpu_placed or default.platform == "cpu":
        got, lowered, note = want, True, "CPU-placed by design" if case.cpu_placed else ""
        if not case.cpu_placed:
            with jax.default_device(default):
                got = jax.block_until_ready(jax.jit(case.fn)(*inputs))
    else:
        try:
            with jax.default_device(default):
                got = jax.block_until_ready(jax.jit(case.fn)(*inputs))
            lowered, note = True, ""
        except Exception as exc:  # a plugin that cannot lower an op: route to CPU, report it
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            got, lowered = want, False
            note = f"fails to lower on {default.platform} ({first[:120]}); routed to CPU"
    err = _max_rel_err(got, want)
    return ConformanceResult(case.name, default.platform, lowered, err, err <= case.rtol, note)


def run_conformance(cases: list[KernelCase] | None = None) -> list[ConformanceResult]:
    """Every registered kernel case, in order."""
    return [run_case(case) for case in (cases if cases is not None else kernel_cases())]


def kernel_cases() -> list[KernelCase]:
    """The registered kernels with small example inputs."""
    from healsweep.kernels._cases import CASES

    return list(CASES)
