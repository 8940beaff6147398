"""Run a GPU Q2_0 kernel twice on one 16 M-weight chunk, for a profiler to look at.

    XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --clock-control none \\
        -k regex:q2_0 --launch-count 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python benchmarks/profile_q2_gpu.py pallas

``pallas`` runs the NVIDIA kernel (``q2_0_gpu``, importance shared by groups of 16 rows);
``xla`` (the default) the XLA fusion other accelerators use (its kernels are named ``fusion``).
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from healsweep.kernels import q2_0

ROWS, COLS = 8192, 2048

if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "xla"
    lanes = 16 if kind == "pallas" else 32
    rng = np.random.default_rng(0)
    w = (rng.standard_t(5.0, (ROWS, COLS)) * 0.02).astype(np.float32)
    imp = np.broadcast_to(rng.uniform(0.2, 5.0, COLS).astype(np.float32), (ROWS // lanes, COLS))
    args = jax.device_put((w, np.ascontiguousarray(imp), np.float32(0.3)))
    if kind == "pallas":
        from healsweep.kernels import q2_0_gpu

        def run():
            return q2_0_gpu.quantize_rows(*args)
    else:
        options = {"tiles": False, "unroll": True, "keep_extras": False, "lanes": lanes}

        def run():
            return q2_0._quantize_rows(*args, **options)

    for _ in range(2):
        jax.block_until_ready(run())
