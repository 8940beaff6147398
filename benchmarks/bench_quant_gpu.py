"""Q2_0 kernel on a GPU: weights/s of several chunk layouts against the two ceilings.

Run by ``bench_quant.py`` when JAX's default backend is not the CPU. Every variant is timed on
device-resident chunks (``q2_0._quantize_rows``, what ``quantize_matrix`` calls per chunk), best
of ``repeats`` after a warm-up, and its codes are compared with the CPU backend's on one chunk.
Ceilings: fp32 arithmetic = peak FLOP/s / FLOPS_PER_WEIGHT; memory = bandwidth /
BYTES_PER_WEIGHT, with the bandwidth both from the datasheet and measured here (a copy).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
from bench_quant import BYTES_PER_WEIGHT, FLOPS_PER_WEIGHT, GAIN, make_inputs

# H200 SXM: 132 SMs x 128 fp32 lanes x 2 flops (FMA) x 1.98 GHz boost; HBM3e 4.8 TB/s.
DATASHEET = {"fp32_flops": 132 * 128 * 2 * 1.98e9, "bytes_per_s": 4.8e12}
COLS = 2048
VARIANTS = (  # _quantize_rows options; lanes also sets the importance grouping
    {"lanes": 32, "tiles": False, "unroll": True, "compare_round": True},
    {"lanes": 32, "tiles": False, "unroll": True, "compare_round": False},
    {"lanes": 32, "tiles": True, "keep_extras": False, "compare_round": False},
)
CHUNK_WEIGHTS = (1 << 24, 1 << 22, 1 << 26)  # every variant at the first, the best at the rest
TIME_BUDGET_S = 270.0


def _best_of(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def measured_bandwidth(repeats: int) -> float:
    """Bytes/s of an elementwise pass over 1 GiB (read + write), the memory ceiling's input."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 28,), jnp.float32)
    scale = jax.jit(lambda v: v * 1.0001)
    seconds = _best_of(lambda: scale(x), repeats)
    return 2 * x.nbytes / seconds


def _row_order(d, opts: dict, n_rows: int) -> np.ndarray:
    from healsweep.kernels import q2_0

    d = np.asarray(d)
    return q2_0._untile_np(d, n_rows) if opts.get("tiles", True) else d


def _agreement(opts: dict) -> tuple[float, float]:
    """Fractions of blocks whose codes, and whose fp16 scales, equal the CPU backend's (its
    default layout) on one chunk."""
    import jax

    from healsweep.kernels import q2_0

    n_rows = 256
    w, imp = make_inputs(n_rows, COLS, seed=1)
    outs = []
    for device, o in ((jax.devices()[0], opts), (jax.devices("cpu")[0], {})):
        lanes = o.get("lanes", q2_0.LANES)
        groups = np.ascontiguousarray(np.broadcast_to(imp, (n_rows // lanes, COLS)))
        args = jax.device_put((w, groups, np.float32(GAIN)), device)
        d, q, _ = q2_0._quantize_rows(*args, **o)
        outs.append((_row_order(d, o, n_rows).reshape(-1), np.asarray(q).reshape(-1, 64)))
    (d_dev, q_dev), (d_cpu, q_cpu) = outs
    return float((q_dev == q_cpu).all(axis=1).mean()), float((d_dev == d_cpu).mean())


def gpu_table(repeats: int) -> tuple[list[dict], list[str]]:
    import jax

    from healsweep.kernels import q2_0

    start_all = time.perf_counter()
    bandwidth = measured_bandwidth(repeats)
    compute_ceiling = DATASHEET["fp32_flops"] / FLOPS_PER_WEIGHT
    memory_ceiling = bandwidth / BYTES_PER_WEIGHT
    table, notes = [], []
    gain = np.float32(GAIN)
    plan = [(CHUNK_WEIGHTS[0], v) for v in VARIANTS]
    inputs = {}
    while plan:
        chunk, opts = plan.pop(0)
        if time.perf_counter() - start_all > TIME_BUDGET_S:
            notes.append(f"time budget reached: skipped {opts} at chunk {chunk}")
            continue
        if chunk not in inputs:
            inputs = {chunk: make_inputs(chunk // COLS, COLS, seed=0)}
        w, imp = inputs[chunk]
        groups = np.ascontiguousarray(np.broadcast_to(imp, (w.shape[0] // opts["lanes"], COLS)))
        call = partial(q2_0._quantize_rows, jax.device_put(w), jax.device_put(groups), gain, **opts)
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        compile_s = time.perf_counter() - t0
        rate = w.size / _best_of(call, repeats)
        name = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in opts.items())
        table.append(
            {
                "contender": f"2^{chunk.bit_length() - 1} {name}",
                "weights_per_s": rate,
                "of_fp32_ceiling": rate / compute_ceiling,
                "of_memory_ceiling": rate / memory_ceiling,
                "compile_s": compile_s,
                "options": opts,
            }
        )
        if not plan and chunk == CHUNK_WEIGHTS[0]:
            top = max(table, key=lambda r: r["weights_per_s"])["options"]
            plan = [(c, top) for c in CHUNK_WEIGHTS[1:]]
    best = max(table, key=lambda r: r["weights_per_s"])
    notes += [
        f"device {jax.devices()[0].device_kind}; {FLOPS_PER_WEIGHT} flops/weight (FMA = 2); "
        f"{BYTES_PER_WEIGHT:.3f} bytes/weight",
        f"fp32 ceiling {compute_ceiling / 1e9:.0f} G weights/s "
        f"({DATASHEET['fp32_flops'] / 1e12:.1f} TFLOP/s datasheet); memory ceiling "
        f"{memory_ceiling / 1e9:.0f} G weights/s (copy measured {bandwidth / 1e12:.2f} TB/s; "
        f"datasheet {DATASHEET['bytes_per_s'] / BYTES_PER_WEIGHT / 1e9:.0f} G weights/s)",
        f"binding ceiling: {'fp32' if compute_ceiling < memory_ceiling else 'memory'}; best "
        f"{best['contender']} at {best['weights_per_s'] / 1e9:.1f} G weights/s",
    ]
    same_q, same_d = _agreement(best["options"])
    notes.append(
        f"best variant vs the CPU backend's default layout on 256x{COLS}: codes equal in "
        f"{100 * same_q:.2f}% of blocks, fp16 scales in {100 * same_d:.2f}%"
    )
    return table, notes
