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

from healsweep.cache import StageCache
from healsweep.data.corpus import Document, load_corpus, write_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model
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
        path = write_random_model(root / "m.gguf", n_layer=args.layers, n_embd=args.embd,
                                  n_head=8, n_head_kv=4, n_expert=8, n_expert_used=2,
                                  n_ff_exp=512, n_ff_shexp=1024, vocab_size=args.vocab,
                                  context_length=1024, seed=1)  # fmt: skip
        model = open_model(path)
        docs = [Document(f"t{i}", "docs", i, "docs",
                         text=" ".join(f"word{(i * 7 + j) % 5000} {j}" for j in range(600)))
                for i in range(1, 4 * args.windows + 1, 2)]  # fmt: skip
        write_corpus(docs, root / "c.jsonl")
        corpus = load_corpus(root / "c.jsonl")
        windows = make_windows(corpus, model.tokenizer(), parity_split(corpus), max_scored=128,
                               max_context=256, max_windows_per_doc=1)  # fmt: skip
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
