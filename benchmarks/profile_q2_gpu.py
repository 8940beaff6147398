"""Run the accelerator Q2_0 kernel twice on one 16 M-weight chunk, for a profiler to look at.

    ncu --clock-control none -k regex:fusion --launch-count 6 \\
        --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section WarpStateStats python benchmarks/profile_q2_gpu.py

The layout is the accelerator default of ``q2_0._backend_options`` (a thread per block, seeds
unrolled into one fusion), with importance shared by groups of 32 rows as in the benchmark.
"""

from __future__ import annotations

import jax
import numpy as np

from healsweep.kernels import q2_0

ROWS, COLS, LANES = 8192, 2048, 32

if __name__ == "__main__":
    rng = np.random.default_rng(0)
    w = (rng.standard_t(5.0, (ROWS, COLS)) * 0.02).astype(np.float32)
    imp = np.broadcast_to(rng.uniform(0.2, 5.0, COLS).astype(np.float32), (ROWS // LANES, COLS))
    args = jax.device_put((w, np.ascontiguousarray(imp), np.float32(0.3)))
    options = {**q2_0._backend_options(), "lanes": LANES}
    for _ in range(2):
        jax.block_until_ready(q2_0._quantize_rows(*args, **options))
