"""Where a trial's time goes: wall, CPU and device-busy seconds and stage-cache bytes, per phase
and layer (:class:`PhaseProfile`).

A phase is a named stretch of a trial's work (``calib_trace``, ``quantize``, ``ridge_basis``,
``teacher_record``, ``scoring``, ...), charged to a layer where it runs per layer. Phases nest (a
stage computes its upstream stages inside it), and each is charged its own time without the
phases inside it, so the rows add up to the work's wall time. Per phase:

- ``wall_s``: wall seconds;
- ``cpu_s``: CPU seconds of the whole process over the same stretch (every thread: BLAS, XLA's
  CPU client, ggml's quantizer threads). ``cpu_s / wall_s`` is the cores a phase kept busy; a
  host phase near 1.0 on a machine of many cores is a phase running on one thread. Work on a
  background thread (the ridge's held-out solves) is charged to whatever phase runs meanwhile;
- ``device_s``: seconds the trial's GPU was busy (NVML's utilization, sampled every
  :data:`SAMPLE_S` and charged to the phase open at the sample), None where no GPU is visible;
- ``compile_s``: of its wall seconds, those JAX spent tracing, lowering and compiling
  (``jax.monitoring``'s compile durations on the phase's thread; a persistent compilation cache
  hit costs none): what the phase's first call of a new shape costs on top of the work;
- ``cache_bytes``: bytes of the stage-cache entries the phase computed and stored.

The profile of the work now running is the runtime's (:meth:`Runtime.owned`), so stages, the
forward and the scorer charge it without a parameter on every call; :func:`profiling` starts a
fresh one for a trial and gives it back when the trial ends.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from healsweep.runtime import current

V = TypeVar("V")
SAMPLE_S = 0.2  # NVML's utilization is itself an average over its last 1/6 to 1 s


@dataclass
class PhaseTotals:
    """What one (phase, layer) cost; see the module docstring."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    device_s: float | None = None
    cache_bytes: int = 0
    calls: int = 0
    compile_s: float = 0.0

    def as_row(self, phase: str, layer: int | None) -> dict[str, Any]:
        return {
            "phase": phase,
            "layer": layer,
            "wall_s": round(self.wall_s, 4),
            "cpu_s": round(self.cpu_s, 4),
            "device_s": None if self.device_s is None else round(self.device_s, 4),
            "cache_bytes": self.cache_bytes,
            "calls": self.calls,
            "compile_s": round(self.compile_s, 4),
        }


class _Open:
    """A phase being timed on one thread: where it started, and what its nested phases took."""

    __slots__ = ("phase", "layer", "wall", "cpu", "inner_wall", "inner_cpu")

    def __init__(self, phase: str, layer: int | None) -> None:
        self.phase, self.layer = phase, layer
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.inner_wall = self.inner_cpu = 0.0


class PhaseProfile:
    """Per (phase, layer): :class:`PhaseTotals`. Thread-safe; phases nest per thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, int | None], PhaseTotals] = {}
        self._stacks = threading.local()
        self._main: list[_Open] | None = None  # the profiled thread's stack (device samples)
        self.device_sampled = False

    def _stack(self) -> list[_Open]:
        stack = getattr(self._stacks, "open", None)
        if stack is None:
            stack = self._stacks.open = []
            if self._main is None:
                self._main = stack
        return stack

    def _entry(self, phase: str, layer: int | None) -> PhaseTotals:
        found = self._totals.get((phase, layer))
        if found is None:
            found = self._totals[(phase, layer)] = PhaseTotals()
        return found

    @contextmanager
    def phase(self, name: str, layer: int | None = None) -> Iterator[None]:
        """Time the block as phase ``name`` (of ``layer``), less the phases nested in it."""
        stack = self._stack()
        with self._lock:
            self._entry(name, layer)  # rows in the order phases first open
        opened = _Open(name, layer)
        stack.append(opened)
        try:
            yield
        finally:
            wall = time.perf_counter() - opened.wall
            cpu = time.process_time() - opened.cpu
            stack.pop()
            if stack:
                stack[-1].inner_wall += wall
                stack[-1].inner_cpu += cpu
            with self._lock:
                entry = self._entry(name, layer)
                entry.wall_s += wall - opened.inner_wall
                entry.cpu_s += max(0.0, cpu - opened.inner_cpu)
                entry.calls += 1

    def timed(self, name: str, fn: Callable[[], V], layer: int | None = None) -> V:
        """``fn()`` as phase ``name``."""
        with self.phase(name, layer):
            return fn()

    def add_bytes(self, n: int, stage: str) -> None:
        """Charge ``n`` bytes of a ``stage`` entry stored in the stage cache to the phase open
        on this thread (its layer's row), else to the one open on the profiled thread (work it
        handed to a pool, such as the trace's layers), else to a phase named ``stage``."""
        phase, layer = self._open_here() or (stage, None)
        with self._lock:
            self._entry(phase, layer).cache_bytes += int(n)

    def add_compile(self, seconds: float) -> None:
        """Charge ``seconds`` of JAX tracing, lowering or compiling to the phase open on this
        thread, else on the profiled thread (nothing when none is open)."""
        found = self._open_here()
        if found is not None:
            with self._lock:
                self._entry(*found).compile_s += seconds

    def _open_here(self) -> tuple[str, int | None] | None:
        """``(phase, layer)`` open on this thread, else on the profiled thread, else None."""
        stack = getattr(self._stacks, "open", None) or self._main
        try:
            return (stack[-1].phase, stack[-1].layer) if stack else None
        except IndexError:  # the profiled thread's phase closed meanwhile
            return None

    def _sample_device(self, busy_s: float) -> None:
        """Charge ``busy_s`` device seconds to the phase open on the profiled thread now."""
        stack = self._main
        if not stack:
            return
        try:
            top = stack[-1]
        except IndexError:  # closed meanwhile
            return
        with self._lock:
            entry = self._entry(top.phase, top.layer)
            entry.device_s = (entry.device_s or 0.0) + busy_s

    def rows(self) -> list[dict[str, Any]]:
        """One row per (phase, layer), in the order phases first ran; ``device_s`` None
        everywhere when no device was sampled, 0 for a phase with no busy sample."""
        with self._lock:
            items = list(self._totals.items())
        rows = []
        for (phase, layer), totals in items:
            row = totals.as_row(phase, layer)
            if self.device_sampled and row["device_s"] is None:
                row["device_s"] = 0.0
            rows.append(row)
        return rows

    def seconds(self) -> dict[str, float]:
        """Wall seconds per phase, summed over layers."""
        return {phase: total["wall_s"] for phase, total in phase_totals(self.rows()).items()}


def phase_totals(rows: list[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows of :meth:`PhaseProfile.rows` (one trial's, or several trials') summed per phase:
    ``{phase: {wall_s, cpu_s, device_s, cache_bytes, calls, layers}}``, phases in first-seen
    order."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        total = out.setdefault(
            row["phase"],
            {"wall_s": 0.0, "cpu_s": 0.0, "device_s": None, "cache_bytes": 0, "calls": 0,
             "layers": 0, "compile_s": 0.0},
        )  # fmt: skip
        total["wall_s"] += row["wall_s"]
        total["cpu_s"] += row["cpu_s"]
        total["compile_s"] += row.get("compile_s") or 0.0  # rows written before it: none
        if row.get("device_s") is not None:
            total["device_s"] = (total["device_s"] or 0.0) + row["device_s"]
        total["cache_bytes"] += row["cache_bytes"]
        total["calls"] += row["calls"]
        total["layers"] += row["layer"] is not None
    for total in out.values():
        for key in ("wall_s", "cpu_s", "device_s", "compile_s"):
            if total[key] is not None:
                total[key] = round(total[key], 3)
    return out


class _Slot:
    """The runtime's profile of the work now running (None: nothing charged), and whether JAX's
    compile durations are reported to it (:func:`_listen_to_compiles`, once a process)."""

    def __init__(self) -> None:
        self.profile: PhaseProfile | None = None
        self.listening = False


# JAX's durations of a new shape's trace, lowering and XLA compile: the events it reports through
# jax.monitoring, under the same names from jax 0.4.30 to 0.11.
COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})  # fmt: skip


def _listen_to_compiles(slot: _Slot) -> None:
    """Report JAX's compile durations to the active profile, from now on in this process."""
    if slot.listening:
        return
    # lazy: heavy (jax); a profile is only opened around work that runs JAX
    import jax.monitoring

    def charge(event: str, seconds: float, **_: Any) -> None:
        profile = slot.profile
        if profile is not None and event in COMPILE_EVENTS:
            profile.add_compile(seconds)

    jax.monitoring.register_event_duration_secs_listener(charge)
    slot.listening = True


def active() -> PhaseProfile | None:
    """The profile the running work charges, if any."""
    return current().owned(_Slot).profile


@contextmanager
def phase(name: str, layer: int | None = None) -> Iterator[None]:
    """Charge the block to phase ``name`` of the active profile (nothing without one)."""
    profile = active()
    if profile is None:
        yield
        return
    with profile.phase(name, layer):
        yield


@contextmanager
def profiling() -> Iterator[PhaseProfile]:
    """A fresh profile for the block, active in this process's runtime (the one before is put
    back after), with the visible GPU's busy time sampled where NVML can read it."""
    slot = current().owned(_Slot)
    _listen_to_compiles(slot)
    previous, slot.profile = slot.profile, PhaseProfile()
    profile = slot.profile
    profile._stack()  # the calling thread is the one whose phases the device samples charge
    sampler = _DeviceSampler(profile)
    try:
        with sampler:
            yield profile
    finally:
        slot.profile = previous


# --- the device's busy time, from NVML (libnvidia-ml, the NVIDIA driver's own library) ---------


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


def _nvml_devices() -> tuple[Any, list[ctypes.c_void_p]] | None:
    """(libnvidia-ml, handles of the GPUs this process sees), or None: no NVIDIA driver, no
    GPU visible, or ``CUDA_VISIBLE_DEVICES`` naming devices NVML cannot resolve."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):
        return None
    count = ctypes.c_uint(0)
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
        return None
    names = [v.strip() for v in visible.split(",")] if visible else [
        str(i) for i in range(count.value)
    ]
    handles = []
    for name in names:
        handle = ctypes.c_void_p()
        if name.isdigit():
            found = nvml.nvmlDeviceGetHandleByIndex_v2(int(name), ctypes.byref(handle))
        else:
            found = nvml.nvmlDeviceGetHandleByUUID(name.encode(), ctypes.byref(handle))
        if found != 0:
            return None
        handles.append(handle)
    return (nvml, handles) if handles else None


class _DeviceSampler:
    """Samples the busy share of the first GPU the process sees while the profile runs."""

    def __init__(self, profile: PhaseProfile) -> None:
        self.profile = profile
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _DeviceSampler:
        found = _nvml_devices()
        if found is None:
            return self
        nvml, handles = found
        self.profile.device_sampled = True

        def run() -> None:
            usage = _Utilization()
            last = time.perf_counter()
            while not self._stop.wait(SAMPLE_S):
                now = time.perf_counter()
                if nvml.nvmlDeviceGetUtilizationRates(handles[0], ctypes.byref(usage)) == 0:
                    self.profile._sample_device((now - last) * usage.gpu / 100.0)
                last = now

        self._thread = threading.Thread(target=run, name="device-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


__all__ = ["PhaseProfile", "PhaseTotals", "active", "phase", "phase_totals", "profiling"]
