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
VARIANTS = (  # (lanes, keep_extras, compare_round)
    (32, False, False),
    (32, False, True),
    (128, False, True),
    (32, True, True),
    (16, True, False),
)
CHUNK_WEIGHTS = (1 << 24, 1 << 22, 1 << 26)  # every variant at the first, the best at the rest
TIME_BUDGET_S = 300.0


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
    seconds = _best_of(lambda: jax.jit(lambda v: v * 1.0001)(x), repeats)
    return 2 * x.nbytes / seconds


def _agreement(lanes, keep, compare) -> float:
    """Fraction of blocks whose codes and fp16 scale equal the CPU backend's, on one chunk."""
    import jax

    from healsweep.kernels import q2_0

    w, imp = make_inputs(256, COLS, seed=1)
    groups = np.ascontiguousarray(np.broadcast_to(imp, (256 // lanes, COLS)))
    outs = []
    for device in (jax.devices()[0], jax.devices("cpu")[0]):
        args = jax.device_put((w, groups, np.float32(GAIN)), device)
        d, q, _ = q2_0._quantize_rows(*args, lanes=lanes, keep_extras=keep, compare_round=compare)
        outs.append((np.asarray(d).reshape(-1), np.asarray(q).reshape(-1, 64)))
    (d_dev, q_dev), (d_cpu, q_cpu) = outs  # d in the same tile order on both devices
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
        chunk, (lanes, keep, compare) = plan.pop(0)
        if time.perf_counter() - start_all > TIME_BUDGET_S:
            notes.append(f"time budget reached: skipped L={lanes} chunk={chunk}")
            continue
        if chunk not in inputs:
            inputs = {chunk: make_inputs(chunk // COLS, COLS, seed=0)}
        w, imp = inputs[chunk]
        groups = np.ascontiguousarray(np.broadcast_to(imp, (w.shape[0] // lanes, COLS)))
        args = (jax.device_put(w), jax.device_put(groups), gain)
        opts = {"lanes": lanes, "keep_extras": keep, "compare_round": compare}
        call = partial(q2_0._quantize_rows, *args, **opts)
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        compile_s = time.perf_counter() - t0
        rate = w.size / _best_of(call, repeats)
        table.append(
            {
                "contender": f"chunk 2^{chunk.bit_length() - 1} L={lanes} extras={keep} "
                f"cmp={compare}",
                "weights_per_s": rate,
                "of_fp32_ceiling": rate / compute_ceiling,
                "of_memory_ceiling": rate / memory_ceiling,
                "compile_s": compile_s,
                "variant": (lanes, keep, compare),
            }
        )
        if not plan and chunk == CHUNK_WEIGHTS[0]:
            top = max(table, key=lambda r: r["weights_per_s"])["variant"]
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
    lanes, keep, compare = best["variant"]
    same_q, same_d = _agreement(lanes, keep, compare)
    notes.append(
        f"vs the CPU backend on 256x{COLS} (L={lanes}): codes equal in {100 * same_q:.2f}% of "
        f"blocks, fp16 scales in {100 * same_d:.2f}%"
    )
    return table, notes
