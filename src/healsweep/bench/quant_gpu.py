"""Q2_0 kernel on a GPU: weights/s of the kernel variants against the two ceilings.

Run by :func:`healsweep.bench.quant.quant_table` when JAX's default backend is not the CPU. Every variant is timed on
device-resident chunks (what ``quantize_matrix`` feeds the device per call), best of ``repeats``
after a warm-up, and the codes and scales of the best are compared with the CPU backend's on one
chunk. Ceilings: fp32 arithmetic = peak FLOP/s / the variant's flops per weight; memory =
bandwidth / BYTES_PER_WEIGHT (read fp32 once, write 2.25 bits), with the bandwidth measured
here (a copy) and from the datasheet.

Variants: the Pallas kernel that NVIDIA GPUs use (``q2_0_gpu``) and the XLA fusion that other
accelerators use (``q2_0._quantize_rows``). Each runs in a child process with a time limit, so a
compile that runs away costs one row, not the table. "weights/s" issues ten calls back to back
and waits once (the device's rate); "one call" waits for each (dispatch and launch included).
A last note times ``quantize_matrix`` on a host (numpy) matrix: transfers included.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from healsweep.bench._quant_table import (
    BYTES_PER_WEIGHT,
    FLOPS_PER_WEIGHT,
    GAIN,
    format_table,
    make_inputs,
)
from healsweep.kernels import q2_0, q2_0_gpu

# H200 SXM: 132 SMs x 128 fp32 lanes x 2 flops (FMA) x 1.98 GHz boost; HBM3e 4.8 TB/s.
DATASHEET = {"fp32_flops": 132 * 128 * 2 * 1.98e9, "bytes_per_s": 4.8e12}
COLS = 2048
VARIANTS = (  # (kind, flags); lanes: rows sharing one importance row
    ("pallas", {"lanes": 16}),  # q2_0_gpu: the NVIDIA default
    ("xla", {"lanes": 32, "tiles": False, "unroll": True, "keep_extras": False}),  # fallback
)
CHUNK_WEIGHTS = (1 << 24, 1 << 22, 1 << 26)  # every variant at the first, the best at the rest
TIME_BUDGET_S = 300.0
VARIANT_TIMEOUT_S = {"xla": 120.0, "pallas": 120.0}


def _best_of(fn, repeats: int, inner: int = 1) -> float:
    """Seconds a call, best of ``repeats``: each times ``inner`` calls issued back to back and
    waits once, so that with ``inner > 1`` the host's dispatch overlaps the device's work."""
    # lazy: heavy (jax)
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(inner)])
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def measured_bandwidth(repeats: int) -> float:
    """Bytes/s of an elementwise pass over 1 GiB (read + write), the memory ceiling's input."""
    # lazy: heavy (jax)
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 28,), jnp.float32)
    scale = jax.jit(lambda v: v * 1.0001)
    seconds = _best_of(lambda: scale(x), repeats)
    return 2 * x.nbytes / seconds


def _kernel(kind: str, opts: dict):
    """``(w, importance_rows, gain) -> (d, q)`` on device arrays, with one importance row per
    ``opts["lanes"]`` weight rows (see :func:`_inputs`); ``d`` in row order (no ``tiles``)."""

    opts = dict(opts)
    lanes = opts.pop("lanes")
    if kind == "pallas":

        return q2_0_gpu.quantize_rows

    def run(w, imp, gain):
        d, q, _ = q2_0._quantize_rows(w, imp, gain, lanes=lanes, **opts)
        return d, q

    return run


def _flops(kind: str) -> int:
    if kind == "pallas":

        return q2_0_gpu.flops_per_weight()
    return FLOPS_PER_WEIGHT


def _inputs(n_rows: int, opts: dict, seed: int, device=None):
    """``(w, importance rows, gain)`` on ``device``: one importance row per ``lanes`` rows."""
    # lazy: heavy (jax)
    import jax

    w, imp = make_inputs(n_rows, COLS, seed=seed)
    groups = np.ascontiguousarray(np.broadcast_to(imp, (n_rows // opts["lanes"], COLS)))
    return jax.device_put((w, groups, np.float32(GAIN)), device)


def _agreement(kind: str, opts: dict) -> tuple[float, float]:
    """Fractions of blocks whose codes, and whose fp16 scales, equal the CPU backend's default
    kernel on one chunk of 256 x COLS."""
    # lazy: heavy (jax)
    import jax

    n_rows = 256
    d_dev, q_dev = _kernel(kind, opts)(*_inputs(n_rows, opts, seed=1))
    cpu = jax.devices("cpu")[0]
    d_cpu, q_cpu, _ = q2_0._quantize_rows(*_inputs(n_rows, {"lanes": 16}, 1, cpu))
    d_cpu = q2_0._untile_np(np.asarray(d_cpu), n_rows)
    same_q = (np.asarray(q_dev).reshape(-1, 64) == np.asarray(q_cpu).reshape(-1, 64)).all(axis=1)
    return float(same_q.mean()), float((np.asarray(d_dev).reshape(-1) == d_cpu.reshape(-1)).mean())


def _measure(chunk: int, kind: str, opts: dict, repeats: int) -> dict:
    """Compile and time one variant on a device-resident chunk: weights/s with calls issued
    back to back (the device's rate), weights/s of one call waited for (dispatch and launch
    included), and the compile seconds."""
    # lazy: heavy (jax)
    import jax

    args = _inputs(chunk // COLS, opts, seed=0)
    call = partial(_kernel(kind, opts), *args)
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    compile_s = time.perf_counter() - t0
    return {
        "weights_per_s": chunk / _best_of(call, repeats, inner=10),
        "one_call_weights_per_s": chunk / _best_of(call, repeats),
        "compile_s": compile_s,
    }


def _measure_isolated(chunk: int, kind: str, opts: dict, repeats: int, timeout: float) -> dict:
    """:func:`_measure` in a child process, so that a compile that runs away (or crashes the
    compiler) costs one row and ``timeout`` seconds, not the whole table."""
    job = json.dumps({"chunk": chunk, "kind": kind, "opts": opts, "repeats": repeats})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "healsweep.bench.quant_gpu", job],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s (compile included)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = [ln for ln in done.stderr.splitlines() if "Error" in ln.split(":")[0]]
        return {"error": (errors or [f"exit {done.returncode}"])[-1]}
    return json.loads(lines[-1])


def end_to_end(repeats: int) -> float:
    """Weights/s of ``q2_0.quantize_matrix`` on a host matrix of 2^26 weights (the default
    kernel, chunking and both transfers included), best of ``repeats`` after a warm-up."""

    w, imp = make_inputs((1 << 26) // COLS, COLS, seed=2)
    q2_0.quantize_matrix(w, imp, GAIN)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        q2_0.quantize_matrix(w, imp, GAIN)
        best = min(best, time.perf_counter() - start)
    return w.size / best


def gpu_table(
    repeats: int, progress: Callable[[str], None] | None = None
) -> tuple[list[dict], list[str]]:
    """Every variant at the first chunk size, the fastest at the others; ``progress`` gets each
    row as it is measured (a run takes minutes)."""
    # lazy: heavy (jax)
    import jax

    start_all = time.perf_counter()
    bandwidth = measured_bandwidth(repeats)
    memory_ceiling = bandwidth / BYTES_PER_WEIGHT
    table, notes = [], []
    plan = [(CHUNK_WEIGHTS[0], kind, opts) for kind, opts in VARIANTS]
    while plan:
        chunk, kind, opts = plan.pop(0)
        name = f"2^{chunk.bit_length() - 1} {kind} " + " ".join(f"{k}={v}" for k, v in opts.items())
        left = TIME_BUDGET_S - (time.perf_counter() - start_all)
        if left < 20:
            notes.append(f"time budget reached: skipped {name}")
            continue
        got = _measure_isolated(chunk, kind, opts, repeats, min(VARIANT_TIMEOUT_S[kind], left))
        if "error" in got:
            notes.append(f"{name}: {got['error'][:300]}")
            continue
        rate = got["weights_per_s"]
        compute_ceiling = DATASHEET["fp32_flops"] / _flops(kind)
        table.append(
            {
                "contender": name,
                "weights_per_s": rate,
                "one_call_weights_per_s": got["one_call_weights_per_s"],
                "of_fp32_ceiling": rate / compute_ceiling,
                "of_memory_ceiling": rate / memory_ceiling,
                "compile_s": got["compile_s"],
                "variant": (kind, opts),
            }
        )
        if progress is not None:
            progress(format_table(table[-1:], []).splitlines()[-1])
        if not plan and chunk == CHUNK_WEIGHTS[0] and table:
            top = max(table, key=lambda r: r["weights_per_s"])["variant"]
            plan = [(c, *top) for c in CHUNK_WEIGHTS[1:]]
    if not table:
        return table, notes
    best = max(table, key=lambda r: r["weights_per_s"])
    kind = best["variant"][0]
    compute_ceiling = DATASHEET["fp32_flops"] / _flops(kind)
    notes += [
        f"device {jax.devices()[0].device_kind}; flops/weight (FMA = 2): pallas "
        f"{_flops('pallas')}, xla {_flops('xla')}; {BYTES_PER_WEIGHT:.3f} bytes/weight",
        f"fp32 ceiling of the best ({kind}) {compute_ceiling / 1e9:.0f} G weights/s "
        f"({DATASHEET['fp32_flops'] / 1e12:.1f} TFLOP/s datasheet); memory ceiling "
        f"{memory_ceiling / 1e9:.0f} G weights/s (copy measured {bandwidth / 1e12:.2f} TB/s; "
        f"datasheet {DATASHEET['bytes_per_s'] / BYTES_PER_WEIGHT / 1e9:.0f} G weights/s)",
        f"binding ceiling: {'fp32' if compute_ceiling < memory_ceiling else 'memory'}; best "
        f"{best['contender']} at {best['weights_per_s'] / 1e9:.1f} G weights/s = "
        f"{100 * best['weights_per_s'] / min(compute_ceiling, memory_ceiling):.1f}% of it",
    ]
    same_q, same_d = _agreement(*best["variant"])
    notes.append(
        f"best variant vs the CPU backend's kernel on 256x{COLS}: codes equal in "
        f"{100 * same_q:.2f}% of blocks, fp16 scales in {100 * same_d:.2f}%",
    )
    notes.append(
        f"end to end, quantize_matrix on a host matrix of 2^26 weights (default kernel, "
        f"transfers included): {end_to_end(3) / 1e9:.1f} G weights/s"
    )
    return table, notes


if __name__ == "__main__":  # one isolated measurement (see _measure_isolated): a JSON job
    job = json.loads(sys.argv[1])
    print(json.dumps(_measure(job["chunk"], job["kind"], job["opts"], job["repeats"])))
