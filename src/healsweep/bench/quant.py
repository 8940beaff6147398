"""Q2_0 quantize throughput: the jitted kernel side by side with C loops, numpy and naive jnp.

    healsweep bench quant [--rows 2048] [--cols 2048] [--repeats 5]
    python benchmarks/bench_quant.py [...]     (the same table, from a source checkout)

Part of the installed package (the C source ships as package data), so the command works
outside a checkout. On a CPU backend the contenders run interleaved, round after round, on the
same weights ``[rows, cols]`` with one importance per input channel (the production case); each
row reports its best round. The C loop (``c/q2_0_ref.c`` beside this module, the same search
written plainly) is compiled on the fly at three flag sets when gcc is present. On a GPU backend the kernel is timed on device-resident
chunks of several shapes and set against the fp32-arithmetic and memory-bandwidth ceilings.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from healsweep.bench._quant_table import (
    GAIN,
    format_table,
    make_inputs,
)
from healsweep.bench.quant_gpu import gpu_table
from healsweep.kernels import q2_0

C_SOURCE = Path(__file__).resolve().parent / "c" / "q2_0_ref.c"
C_FLAGS = {
    "C gcc -O3": ["-O3"],
    "C gcc -O3 -march=native": ["-O3", "-march=native"],
    "C gcc -O3 -march=native -ffast-math": ["-O3", "-march=native", "-ffast-math"],
}
SEEDS = np.array([0.42, 0.55, 0.68, 0.81, 0.94, -0.42, -0.55, -0.68, -0.81, -0.94], np.float32)
def numpy_search(w: np.ndarray, imp: np.ndarray, gain: float) -> tuple[np.ndarray, np.ndarray]:
    """The search vectorized over blocks in float32 numpy: ``(d [N] f32, q [N, 64] int8)``."""
    blocks = w.reshape(-1, 64)
    a = np.broadcast_to(imp.reshape(-1, 64), (w.shape[0], imp.size // 64, 64)).reshape(-1, 64)
    amax = np.abs(blocks).max(axis=1)
    best_score = np.full(len(blocks), -1.0, np.float32)
    best_q = np.zeros(blocks.shape, np.float32)
    for s in SEEDS:
        d0 = np.where(amax > 0, s * amax, 1.0).astype(np.float32)
        q = np.clip(np.rint(blocks / d0[:, None]), -1, 2)
        sqw, sqq = (a * q * blocks).sum(1), (a * q * q).sum(1)
        d1 = np.where(sqq > 0, sqw / np.where(sqq > 0, sqq, 1), d0)
        q = np.clip(np.rint(blocks / d1[:, None]), -1, 2)
        sqw, sqq = (a * q * blocks).sum(1), (a * q * q).sum(1)
        score = np.where(sqq > 0, sqw * sqw / np.where(sqq > 0, sqq, 1), 0)
        better = score > best_score
        best_score = np.where(better, score, best_score)
        best_q[better] = q[better]
    sqw, sqq, saw2 = (a * best_q * blocks).sum(1), (a * best_q**2).sum(1), (a * blocks**2).sum(1)
    d_ls = np.where(sqq > 0, sqw / np.where(sqq > 0, sqq, 1), 0)
    r2 = np.where(saw2 > 0, best_score / np.where(saw2 > 0, saw2, 1), 1)
    return d_ls * np.maximum(r2, 0.25) ** (-gain / 2), best_q.astype(np.int8)


def naive_jnp():
    """The search as a straightforward jnp program on [N, 64] rows (jitted), for reference."""
    # lazy: heavy (jax)
    import jax
    import jax.numpy as jnp

    @jax.jit
    def search(blocks, a):
        amax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
        best_score = jnp.full(amax.shape, -1.0)
        best_q = jnp.zeros_like(blocks)
        for s in SEEDS:
            q = jnp.clip(jnp.round(blocks / (s * amax)), -1, 2)
            d1 = jnp.sum(a * q * blocks, 1, keepdims=True) / jnp.sum(a * q * q, 1, keepdims=True)
            q = jnp.clip(jnp.round(blocks / d1), -1, 2)
            sqw, sqq = (
                jnp.sum(a * q * blocks, 1, keepdims=True),
                jnp.sum(a * q * q, 1, keepdims=True),
            )
            better = sqw * sqw / sqq > best_score
            best_score = jnp.where(better, sqw * sqw / sqq, best_score)
            best_q = jnp.where(better, q, best_q)
        return best_q.astype(jnp.int8)

    def run(w, imp):
        a = np.broadcast_to(imp.reshape(-1, 64), (w.shape[0], imp.size // 64, 64)).reshape(-1, 64)
        return np.asarray(search(w.reshape(-1, 64), a))

    return run


def build_c(workdir: Path) -> tuple[dict[str, Path], list[str]]:
    """Compile the C reference at each flag set; notes say what was skipped and why."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return {}, ["C rows skipped: gcc not found on PATH"]
    if not C_SOURCE.exists():
        return {}, [f"C rows skipped: {C_SOURCE} not found (the package was installed without it)"]
    binaries, notes = {}, []
    for i, (name, flags) in enumerate(C_FLAGS.items()):
        out = workdir / f"q2_0_ref_{i}"
        done = subprocess.run(
            [gcc, *flags, str(C_SOURCE), "-o", str(out), "-lm"], capture_output=True
        )
        if done.returncode == 0:
            binaries[name] = out
        else:
            notes.append(f"{name} skipped: gcc failed: {done.stderr.decode()[:200]}")
    return binaries, notes


def run_c(binary: Path, files: dict[str, Path], rows: int, cols: int):
    """One timed C pass (the program times its own loop); returns (seconds, d, q)."""
    done = subprocess.run(
        [
            str(binary),
            str(rows),
            str(cols),
            "1",
            str(files["w"]),
            str(files["imp"]),
            str(files["out"]),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = rows * cols / float(done.stdout.split()[0])
    raw = files["out"].read_bytes()
    n_blocks = rows * cols // 64
    d = np.frombuffer(raw[: 4 * n_blocks], np.float32)
    q = np.frombuffer(raw[4 * n_blocks :], np.int8).reshape(-1, 64)
    return seconds, d, q


def cpu_table(rows: int, cols: int, repeats: int) -> tuple[list[dict], list[str]]:
    """Interleaved rounds of every contender; the best round of each, and agreement with ours."""
    # lazy: heavy (jax)
    import jax

    w, imp = make_inputs(rows, cols)
    imp_groups = np.broadcast_to(imp, (rows // q2_0.LANES, cols))
    ours = q2_0.quantize_matrix(w, imp, GAIN)  # also compiles the chunk kernel
    our_q = np.asarray(ours.q).reshape(-1, 64)
    # quantize_matrix pads a matrix under 2^16 weights up to a larger chunk; the device-resident
    # contender times the rows that exist, so at least one chunk is timed at any size.
    chunk = min(q2_0._chunk_rows(rows, cols, q2_0._CHUNK_WEIGHTS["cpu"]), rows)
    gain = np.float32(GAIN)
    on_device = [
        jax.device_put(
            (w[lo : lo + chunk], np.ascontiguousarray(imp_groups[: chunk // q2_0.LANES]))
        )
        for lo in range(0, rows - chunk + 1, chunk)
    ]

    def kernel():
        jax.block_until_ready([q2_0._quantize_rows(wc, ic, gain) for wc, ic in on_device])

    kernel()
    naive = naive_jnp()
    naive(w[:64], imp)
    contenders = {
        "jax kernel, chunks already on device": (kernel, len(on_device) * chunk * cols),
        "jax quantize_matrix, end to end": (lambda: q2_0.quantize_matrix(w, imp, GAIN), w.size),
        "numpy, vectorized": (lambda: numpy_search(w, imp, GAIN), w.size),
        "jnp, naive rows": (lambda: naive(w, imp), w.size),
    }
    best = {name: float("inf") for name in contenders}
    outputs: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        binaries, notes = build_c(Path(tmp))
        files = {"w": Path(tmp) / "w.f32", "imp": Path(tmp) / "imp.f32", "out": Path(tmp) / "out"}
        w.tofile(files["w"])
        imp.tofile(files["imp"])
        for name in binaries:
            best[name] = float("inf")
        for _ in range(repeats):
            for name, (fn, n_weights) in contenders.items():
                start = time.perf_counter()
                result = fn()
                best[name] = min(best[name], (time.perf_counter() - start) * w.size / n_weights)
                if name == "numpy, vectorized":
                    outputs[name] = result[1]
                elif name == "jnp, naive rows":
                    outputs[name] = result
            for name, binary in binaries.items():
                seconds, _, q = run_c(binary, files, rows, cols)
                best[name] = min(best[name], seconds)
                outputs[name] = q
    fastest_c = min((best[n] for n in binaries), default=None)
    table = []
    for name, seconds in best.items():
        agree = (outputs[name] == our_q).all(axis=1).mean() if name in outputs else None
        table.append(
            {
                "contender": name,
                "weights_per_s": w.size / seconds,
                "vs_best_C": (fastest_c / seconds) if fastest_c else None,
                "blocks_equal_to_ours": agree,
            }
        )
    notes.append(
        f"{w.size / 1e6:.1f} M weights ({rows}x{cols}), best of {repeats} interleaved rounds; "
        f"jax backend {jax.default_backend()}, {len(jax.devices())} device(s); XLA may use every "
        "core, the C and numpy loops use one"
    )
    return table, notes


def quant_table(
    rows: int, cols: int, repeats: int, progress: Callable[[str], None] | None = None
) -> str:
    """The benchmark for JAX's default backend as a formatted table: :func:`cpu_table` on a CPU,
    the GPU variants against their ceilings otherwise (``progress`` gets each GPU row as it
    is measured)."""
    if rows % 16 or cols % 64:
        raise ValueError(
            f"quant_table: rows must be a multiple of 16 and cols of 64, got {rows} x {cols}"
        )
    # lazy: heavy (jax)
    import jax

    if jax.default_backend() == "cpu":
        table, notes = cpu_table(rows, cols, repeats)
    else:
        table, notes = gpu_table(repeats, progress)
    return format_table(table, notes)
