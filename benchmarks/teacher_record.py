"""Issue 46: the cold trial's teacher record on the CPU, before vs after the device-side path.

A random model with a large vocabulary; the teacher's compact records of W windows computed cold
(an empty stage cache), batch by batch as scoring asks for them. Prints wall and CPU seconds of
the timed pass (a first pass over other windows warms the jit), the records' digest (equal
before and after: the same records, bit for bit) and peak RSS:

    python benchmarks/teacher_record.py [--vocab 151936] [--embd 1024] [--layers 4] [--windows 16]
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from score_layer_major import random_model_and_windows  # this folder: run as a script

from healsweep.cache import StageCache
from healsweep.score.teacher_cache import teacher_outputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="teacher-bench-"))
    try:
        model, windows = random_model_and_windows(root, args.vocab, args.embd, args.layers,
                                                  2 * args.windows)
        warm, timed = windows[: args.batch], windows[args.batch : args.batch + args.windows]
        cache = StageCache(root / "cache")
        teacher_outputs(model, warm, cache)
        wall, cpu = time.perf_counter(), time.process_time()
        digest = hashlib.sha256()
        for start in range(0, len(timed), args.batch):
            for out in teacher_outputs(model, timed[start : start + args.batch], cache):
                for field in out:
                    digest.update(np.ascontiguousarray(field).tobytes())
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("| windows | V | wall s | CPU s | peak RSS MiB | records sha256 |")
        print(f"| {len(timed)} | {args.vocab} | {wall:.1f} | {cpu:.1f} | {rss:.0f} | "
              f"{digest.hexdigest()[:16]} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
