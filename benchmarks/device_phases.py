"""The three phases a CUDA device took over from the host, timed before and after on this backend.

    python benchmarks/device_phases.py                    # real-size shapes (a GPU's)
    python benchmarks/device_phases.py --small            # seconds on a CPU (the smoke run)

Per phase, ``before`` is the host path as it was (reproduced here, so the comparison runs on one
machine in one process) and ``after`` the library's path now:

- ``teacher_record``: W windows of n positions over V tokens, from the window's log-probs as
  the teacher pass leaves them. Before: the [n, V] rows to the host, top-K on the device, the
  log-softmax rows back to the host, float64 numpy tail draws over the host's threads. After:
  :func:`healsweep.score.compact.compact_record` on the device rows.
- ``routed_q``: y_q of T trace tokens (x in f16) through E Q2_0-packed experts, top-k. Before:
  every 2048-token chunk widened and padded on the host, the experts' stored bytes sent with
  each chunk, each chunk waited for. After: :func:`healsweep.heal.stages.routed_output`.
- ``ridge_basis``: the eigenbasis of an Fs x Fs Gram. Before: LAPACK float32 on the host
  (:func:`healsweep.heal.ridge.eigen_basis`, ``on="host"``); after: ``on="device"`` (float64).

Each phase reports wall and process CPU seconds of its best of ``--rounds`` (after one warm-up
call that compiles), and how far after is from before: the fraction of tail draws that moved
(within float32 rounding of a token edge), y_q's max relative difference, dW's relative
difference at rho 0.3. Prints a markdown table; ``--json`` writes the rows too.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.conformance import references as ref
from healsweep.heal import ridge, stages
from healsweep.kernels.kld import log_softmax
from healsweep.kernels.kld_compact import teacher_top
from healsweep.kernels.q2_0 import Q2Packed
from healsweep.model.layers import expert_tile_rows
from healsweep.score.compact import COMPACT, compact_record, tail_strata, window_seed
from healsweep.score.metrics import _bucket, _pad_rows

REAL = {"vocab": 151_936, "positions": 128, "windows": 4, "tokens": 16_384, "embd": 2048,
        "ff": 1408, "experts": 60, "top": 4, "fs": 5632}  # fmt: skip  (Qwen1.5-MoE-A2.7B)
SMALL = {"vocab": 20_000, "positions": 32, "windows": 2, "tokens": 2_500, "embd": 256,
         "ff": 128, "experts": 8, "top": 2, "fs": 384}  # fmt: skip


def timed(fn: Callable[[], object], rounds: int) -> tuple[object, float, float]:
    """(result, wall s, process CPU s) of the best of ``rounds`` calls after a warm-up."""
    result = jax.block_until_ready(fn())
    best = (float("inf"), 0.0)
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        result = jax.block_until_ready(fn())
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    return result, *best


# --- teacher_record ----------------------------------------------------------------------------


def record_before(logprobs: jax.Array, next_ids: np.ndarray, window_id: str) -> np.ndarray:
    """The host path: rows to the host, top-K on the device, rows back, float64 draws threaded
    over rows (what score.compact did before the device draws). Returns the tail ids."""
    host = np.asarray(logprobs)  # [n, V] to the host, as run_teacher left them
    n, rows = len(next_ids), _bucket(len(next_ids))
    top = teacher_top(_pad_rows(host, rows), _pad_rows(next_ids, rows), COMPACT.top_k)
    logp, top_ids = (np.asarray(a)[:n] for a in top[:2])
    strata = tail_strata(window_seed(window_id), n, COMPACT.tail_samples)
    threads = min(os.cpu_count() or 1, n)
    parts = [range(t, n, threads) for t in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        drawn = pool.map(lambda r: ref.tail_draws(logp[r], top_ids[r], strata[r])[0], parts)
    ids = np.empty(strata.shape, np.int64)
    for r, part in zip(parts, drawn, strict=True):
        ids[r] = part
    return ids


def bench_record(size: dict, rounds: int, rng: np.random.Generator) -> dict:
    n, vocab, windows = size["positions"], size["vocab"], size["windows"]
    logits = [jnp.asarray(rng.standard_normal((n, vocab), np.float32) * 4) for _ in range(windows)]
    rows = [log_softmax(x) for x in logits]  # on the device, as run_teacher leaves them now
    next_ids = rng.integers(0, vocab, n).astype(np.int32)
    router = np.zeros((n, 1, 1), np.int32)
    before, wall_b, cpu_b = timed(
        lambda: [record_before(r, next_ids, f"w{i}") for i, r in enumerate(rows)], rounds
    )
    after, wall_a, cpu_a = timed(
        lambda: [compact_record(r, next_ids, router, f"w{i}") for i, r in enumerate(rows)], rounds
    )
    moved = float(np.mean([np.mean(a.tail_ids != b) for a, b in zip(after, before, strict=True)]))
    label = f"{windows} x {n} positions, V = {vocab:,}"
    return _row("teacher_record", label, wall_b, cpu_b, wall_a, cpu_a, f"{moved:.2%} draws moved")


# --- routed_q ----------------------------------------------------------------------------------


def routed_before(experts: stages.ExpertStacks, trace: dict, n_expert: int) -> np.ndarray:
    """routed_output as it was: host widening and padding, experts re-sent with every chunk,
    each chunk waited for."""
    x, ids, weights = trace["x"], trace["ids"], trace["weights"]
    chunk = min(stages.ROUTED_CHUNK, -(-len(x) // 64) * 64)
    tile = expert_tile_rows(chunk * ids.shape[1], n_expert)
    out = np.empty(x.shape, np.float32)
    for a in range(0, len(x), chunk):
        b = min(a + chunk, len(x))
        pad = ((0, chunk - (b - a)), (0, 0))
        xs = np.pad(np.asarray(x[a:b], np.float32), pad)
        y = stages._routed(xs, np.pad(ids[a:b], pad), np.pad(weights[a:b], pad), tuple(experts),
                           n_expert, tile)  # fmt: skip
        out[a:b] = np.asarray(y)[: b - a]
    return out


def bench_routed(size: dict, rounds: int, rng: np.random.Generator) -> dict:
    t, d, f, e, k = (size[n] for n in ("tokens", "embd", "ff", "experts", "top"))

    def packed(out: int, inp: int) -> Q2Packed:  # stored bytes, as a quantize entry holds them
        scale = rng.standard_normal((e, out, inp // 64)).astype(np.float16) * np.float16(0.02)
        return Q2Packed(scale, rng.integers(0, 256, (e, out, inp // 4), dtype=np.uint8))

    experts = stages.ExpertStacks(packed(f, d), packed(f, d), packed(d, f))
    trace = {
        "x": rng.standard_normal((t, d)).astype(np.float16),
        "ids": np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32),
        "weights": rng.dirichlet(np.ones(k), t).astype(np.float32),
    }
    before, wall_b, cpu_b = timed(lambda: routed_before(experts, trace, e), rounds)
    after, wall_a, cpu_a = timed(lambda: stages.routed_output(experts, trace, e), rounds)
    diff = float(np.max(np.abs(after - before)) / np.max(np.abs(before)))
    label = f"T = {t:,}, D = {d}, {e} experts of {f}, top-{k}, Q2_0"
    return _row("routed_q", label, wall_b, cpu_b, wall_a, cpu_a, f"y_q max rel diff {diff:.1e}")


# --- ridge_basis -------------------------------------------------------------------------------


def bench_basis(size: dict, rounds: int, rng: np.random.Generator) -> dict:
    fs = size["fs"]
    z = jnp.asarray(rng.standard_normal((2 * fs, fs), np.float32))
    gram = jax.block_until_ready(z.T @ z)  # on the device, as basis_from_design leaves it
    rhs = rng.standard_normal((fs, 64)).astype(np.float64)
    lam = float(0.3 * jnp.trace(gram) / fs)
    (vb, sb), wall_b, cpu_b = timed(lambda: ridge.eigen_basis(gram, on="host"), rounds)
    (va, sa), wall_a, cpu_a = timed(lambda: ridge.eigen_basis(gram, on="device"), rounds)

    def fit(v, s):
        v = v.astype(np.float64)
        return v @ ((v.T @ rhs) / (np.maximum(s, 0) + lam)[:, None])

    diff = np.linalg.norm(fit(va, sa) - fit(vb, sb)) / np.linalg.norm(fit(vb, sb))
    label = f"Fs = {fs}: host f32 syevd vs device f64 eigh"
    return _row("ridge_basis", label, wall_b, cpu_b, wall_a, cpu_a, f"dW rel diff {diff:.1e}")


def _row(phase, shape, wall_b, cpu_b, wall_a, cpu_a, agreement) -> dict:
    return {"phase": phase, "shape": shape, "before_wall_s": round(wall_b, 3),
            "before_cpu_s": round(cpu_b, 3), "after_wall_s": round(wall_a, 3),
            "after_cpu_s": round(cpu_a, 3), "agreement": agreement}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes (smoke run)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    size = SMALL if args.small else REAL
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}: {jax.devices()[0]}")
    rows = [bench(size, args.rounds, rng) for bench in (bench_record, bench_routed, bench_basis)]
    print("| phase | shape | before wall s | before CPU s | after wall s | after CPU s | after vs before |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": jax.default_backend(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
