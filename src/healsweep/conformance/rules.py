"""What the Metal plugins cannot run, read off a kernel's jaxpr.

``backend_violations`` walks a kernel's jaxpr for float64/complex values and linear-algebra
primitives (Cholesky, triangular solves, eigh, LU, QR, ...). Kernels that are CPU-placed by
design (the Part B solve) are exempt from the primitive rule, never from the dtype rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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
    # lazy: heavy (jax)
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
