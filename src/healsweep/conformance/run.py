"""Run a conformance case: the kernel on the CPU and on the default device, each against its
float64 reference, and (on an accelerator) the device against the CPU.

A kernel that fails to lower, compile or run on a device is failing there: nothing moves a kernel
to the CPU at run time, so a kernel the device cannot run is one the runtime cannot run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# check(got, want, inputs) -> (error figure, failure reason or None when within tolerance)
Check = Callable[[Any, Any, tuple], tuple[float, str | None]]


@dataclass(frozen=True)
class KernelCase:
    """A kernel, example inputs and its independent float64 reference.

    ``fn(*make_inputs(rng))`` returns a pytree of arrays; it is jitted for each device with its
    inputs committed there. With ``driver`` it is instead a host function, called as
    ``fn(*inputs, platform=...)`` under ``jax.default_device``, that takes the production path
    for that platform itself (``path(platform)`` names it). ``reference(*inputs)`` returns the
    same structure in float64 numpy. ``check`` compares a result with the reference; by default
    the largest error relative to each reference leaf's largest magnitude must be at most
    ``rtol`` (integer and boolean leaves exactly). ``device_rtol`` bounds the default device
    against the CPU the same way (None: only the reference judges, for kernels whose float
    arithmetic legitimately differs by backend, such as the Pallas kernel's FMAs).
    """

    name: str
    fn: Callable
    make_inputs: Callable[[np.random.Generator], tuple]
    reference: Callable[..., Any]
    rtol: float = 1e-5
    device_rtol: float | None = 1e-5
    check: Check | None = None
    driver: bool = False
    path: Callable[[str], str] | None = None
    cpu_placed: bool = False


@dataclass(frozen=True)
class ConformanceResult:
    """One case's verdict on this machine.

    ``backend`` is the default device's platform; ``err`` is its result's error against the
    float64 reference (on a CPU-only host the CPU's), ``cpu_err`` the CPU's and ``device_err``
    the device against the CPU (both NaN on a CPU-only host). ``lowered`` is False when the
    kernel failed to lower, compile or run somewhere; ``note`` says what failed, ``error`` holds
    the exception's first line.
    """

    name: str
    backend: str
    lowered: bool
    err: float
    ok: bool
    note: str = ""
    error: str = ""
    cpu_err: float = math.nan
    device_err: float = math.nan
    path: str = ""


def leaves(tree: Any) -> list[np.ndarray]:
    """The arrays of a result or reference in order: tuples and lists (NamedTuples too) item by
    item, dicts by insertion order, anything else one leaf."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in leaves(item)]
    return [np.asarray(tree)]


def max_rel_err(got: Any, want: Any) -> float:
    """Worst error over the leaves of two results, relative to each ``want`` leaf's max |value|.

    Integer and boolean leaves must match exactly; NaNs and infinities must sit at the same
    places with the same values (a NaN where the reference has a number is an infinite error).
    """
    got_leaves, want_leaves = leaves(got), leaves(want)
    if len(got_leaves) != len(want_leaves):
        return math.inf
    pairs = zip(got_leaves, want_leaves, strict=True)
    return max((_leaf_rel_err(a, b) for a, b in pairs), default=0.0)


def _leaf_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    if not np.issubdtype(b.dtype, np.floating) or not np.issubdtype(a.dtype, np.floating):
        return 0.0 if np.array_equal(a, b) else math.inf
    with np.errstate(invalid="ignore"):  # NaN payloads
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(b64)
    same_nonfinite = np.array_equal(np.isfinite(a64), finite) and np.array_equal(
        a64[~finite], b64[~finite], equal_nan=True
    )
    if not same_nonfinite:
        return math.inf
    if not finite.any():
        return 0.0
    diff = np.abs(a64[finite] - b64[finite])
    scale = max(float(np.max(np.abs(b64[finite]))), float(np.finfo(np.float32).tiny))
    return float(np.max(diff)) / scale


def within(rtol: float) -> Check:
    """The default check: :func:`max_rel_err` at most ``rtol``."""

    def check(got: Any, want: Any, inputs: tuple) -> tuple[float, str | None]:
        err = max_rel_err(got, want)
        if err <= rtol:
            return err, None
        return err, f"max rel err {err:.2e} vs the float64 reference, beyond {rtol:.0e}"

    return check


class _KernelFailed(Exception):
    """A kernel did not lower, compile or run on a device; ``step`` says which."""

    def __init__(self, step: str, platform: str, cause: Exception):
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        super().__init__(first)
        self.step, self.platform, self.first_line = step, platform, first[:160]


def _run_on(case: KernelCase, inputs: tuple, device) -> Any:
    """The case on ``device``: jitted with its inputs committed there (or, for a driver, called
    with ``device`` as the default), run to completion."""
    # lazy: heavy (jax)
    import jax

    if case.driver:
        try:
            with jax.default_device(device):
                return jax.block_until_ready(case.fn(*inputs, platform=device.platform))
        except Exception as exc:  # any failure of the production path is this case's verdict
            raise _KernelFailed("run", device.platform, exc) from exc
    args = jax.device_put(inputs, device)
    try:
        compiled = jax.jit(case.fn).lower(*args).compile()
    except Exception as exc:  # any lowering/compile failure is this kernel's verdict
        raise _KernelFailed("lower", device.platform, exc) from exc
    try:
        return jax.block_until_ready(compiled(*args))
    except Exception as exc:
        raise _KernelFailed("run", device.platform, exc) from exc


def run_case(case: KernelCase, seed: int = 0) -> ConformanceResult:
    """The case on the CPU and, on an accelerator, on the default device: each against the
    float64 reference, and the device against the CPU."""
    # lazy: heavy (jax)
    import jax

    cpu = jax.devices("cpu")[0]
    default = jax.devices()[0]
    inputs = case.make_inputs(np.random.default_rng(seed))
    path = case.path(default.platform) if case.path else ""
    try:
        want = case.reference(*inputs)
    except Exception as exc:  # noqa: BLE001 (a case nothing can check is reported, not skipped)
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        return ConformanceResult(
            case.name, default.platform, True, math.inf, False, "no reference", first, path=path
        )
    check = case.check or within(case.rtol)
    try:
        on_cpu = _run_on(case, inputs, cpu)
        cpu_err, cpu_bad = check(on_cpu, want, inputs)
        if default.platform == "cpu":
            return ConformanceResult(
                case.name, "cpu", True, cpu_err, cpu_bad is None, cpu_bad or "", path=path
            )
        if case.cpu_placed:
            note = f"CPU: {cpu_bad}" if cpu_bad else "CPU-placed by design"
            return ConformanceResult(
                case.name, default.platform, True, cpu_err, cpu_bad is None, note, path=path
            )
        got = _run_on(case, inputs, default)
    except _KernelFailed as failed:
        note = f"fails to {failed.step} on {failed.platform}"
        return ConformanceResult(
            case.name, failed.platform, False, math.inf, False, note, failed.first_line, path=path
        )
    err, bad = check(got, want, inputs)
    device_err, device_bad = math.nan, None
    if case.device_rtol is not None:
        device_err = max_rel_err(got, on_cpu)
        if device_err > case.device_rtol:
            device_bad = f"max rel err {device_err:.2e} vs CPU, beyond {case.device_rtol:.0e}"
    reasons = [r for r in (bad, f"CPU: {cpu_bad}" if cpu_bad else None, device_bad) if r]
    return ConformanceResult(
        case.name,
        default.platform,
        True,
        err,
        not reasons,
        "; ".join(reasons),
        cpu_err=cpu_err,
        device_err=device_err,
        path=path,
    )
