"""What both Q2_0 quantize benchmarks share (:mod:`healsweep.bench.quant` on a CPU,
:mod:`healsweep.bench.quant_gpu` on a GPU): the inputs, the work per weight, the table layout."""

from __future__ import annotations

import numpy as np

GAIN = 0.3
# Our formulation, per weight (FMA = 2 flops; round, min, max count 1 each): amax 2; each of the
# 20 seed passes 9 (w*step, round, max, min, a*q, two FMAs); the final pass 13; the codes 4.
FLOPS_PER_WEIGHT = 2 + 20 * 9 + 13 + 4
BYTES_PER_WEIGHT = 4 + 2.25 / 8  # read fp32 once, write 2 bits + an fp16 per 64 weights


def make_inputs(rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed weights [rows, cols] and a positive per-input-channel importance [cols]."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(5.0, (rows, cols)) * 0.02).astype(np.float32)
    return w, rng.uniform(0.2, 5.0, cols).astype(np.float32)


_COLUMNS = {  # key: (header, formatter)
    "weights_per_s": ("weights/s", lambda v: f"{v / 1e6:10.1f} M"),
    "one_call_weights_per_s": ("one call", lambda v: f"{v / 1e6:10.1f} M"),
    "vs_best_C": ("vs best C", lambda v: f"{v:.2f}x"),
    "blocks_equal_to_ours": ("same codes", lambda v: f"{100 * v:.2f}%"),
    "of_fp32_ceiling": ("of fp32", lambda v: f"{100 * v:.1f}%"),
    "of_memory_ceiling": ("of memory", lambda v: f"{100 * v:.1f}%"),
    "compile_s": ("compile", lambda v: f"{v:.1f} s"),
}


def format_table(table: list[dict], notes: list[str]) -> str:
    """A fixed-width table of the rows (columns: the keys present), then the notes."""
    keys = [k for k in _COLUMNS if any(k in row for row in table)]
    width = max([len("contender")] + [len(row["contender"]) for row in table])
    lines = [f"{'contender':{width}s}" + "".join(f" {_COLUMNS[k][0]:>12s}" for k in keys)]
    for row in table:
        cells = [_COLUMNS[k][1](row[k]) if row.get(k) is not None else "-" for k in keys]
        lines.append(f"{row['contender']:{width}s}" + "".join(f" {c:>12s}" for c in cells))
    return "\n".join(lines + [f"note: {n}" for n in notes])
