"""In-graph decode throughput of every routed-expert type, against Q2_0 and Q4_K.

    python benchmarks/bench_decode.py [--rows 1024] [--cols 2048] [--rounds 15] [--tokens 64]

For each type of ``healsweep.kernels.ggml_types.ROUTED_TYPES``: a jitted ``decode_rows`` of a
``[rows, cols]`` matrix of random stored bytes (decode cost does not depend on the values), and
the same decode followed by ``x @ W.T`` for ``--tokens`` tokens (what the forward does per expert
tile). Types are timed round-robin, ``--rounds`` times, and each keeps its fastest run, so a
machine whose load changes during the run slows every type alike; the ratio to Q2_0 in the same
run is the figure to compare across machines.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels.ggml_decode import decode_rows
from healsweep.kernels.ggml_types import ROUTED_TYPES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((args.tokens, args.cols)), jnp.float32)
    cases = {}
    for t in ROUTED_TYPES:
        raw = rng.integers(0, 256, (args.rows, t.row_bytes(args.cols)), dtype=np.uint8)
        raw = jax.device_put(raw)
        decode = jax.jit(lambda r, q=t.ggml_id: decode_rows(r, q, args.cols))
        matmul = jax.jit(lambda r, x, q=t.ggml_id: x @ decode_rows(r, q, args.cols).T)
        decode(raw).block_until_ready(), matmul(raw, x).block_until_ready()  # compile
        cases[t.name] = (t, raw, decode, matmul)
    best = {name: [np.inf, np.inf] for name in cases}
    for _ in range(args.rounds):
        for name, (_, raw, decode, matmul) in cases.items():
            start = time.perf_counter()
            decode(raw).block_until_ready()
            middle = time.perf_counter()
            matmul(raw, x).block_until_ready()
            end = time.perf_counter()
            best[name] = [min(best[name][0], middle - start), min(best[name][1], end - middle)]
    weights = args.rows * args.cols
    q2_0 = best["q2_0"][0]
    print(f"decode of [{args.rows}, {args.cols}] on {jax.devices()[0].platform}; "
          f"matmul with {args.tokens} tokens")  # fmt: skip
    print(f"{'type':8} {'bpw':>6} {'Mweights/s':>11} {'GB/s stored':>12} {'vs q2_0':>8} "
          f"{'decode+matmul ms':>17}")  # fmt: skip
    for name, (t, raw, _, _) in cases.items():
        seconds, with_matmul = best[name]
        print(f"{name:8} {t.bits_per_weight:6.3f} {weights / seconds / 1e6:11.0f} "
              f"{raw.nbytes / seconds / 1e9:12.3f} {q2_0 / seconds:8.2f} "
              f"{with_matmul * 1e3:17.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
