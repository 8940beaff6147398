"""Issue 46: a follow-up trial's scoring phases on the CPU, before vs after layer-major scoring
with the student's logits kept on the device.

A random model with a large vocabulary is scored against itself with a streamed student: a
LayerMap whose load reads each layer's replacement back from a file (mmap, scaled — as Part B's
stage entries are read, folded and sent), counting the reads. Run it with either checkout's
Python (the script passes ``group`` only where ``score_windows`` takes it):

    python benchmarks/score_layer_major.py [--vocab 65536] [--embd 1024] [--layers 4] [--windows 32]

Prints the phase table (wall, CPU, calls) of the timed pass (the teacher cache and the jit
already warm from a first pass), the student-layer reads, and peak RSS.
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from healsweep.cache import StageCache
from healsweep.data.corpus import Document, load_corpus, write_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.heal.streamed import LayerMap
from healsweep.model import LayerReplacement, open_model
from healsweep.model.synthetic import write_random_model
from healsweep.profile import phase_totals, profiling
from healsweep.score import score_windows


class Student:
    def __init__(self, base, replacements):
        self.base, self.replacements = base, replacements


def random_model_and_windows(root: Path, vocab: int, embd: int, layers: int, n_docs: int):
    """A random model of ``layers`` layers, width ``embd`` and vocabulary ``vocab`` under
    ``root``, and one dev window (up to 256 tokens, 128 scored) from each of ``n_docs``
    documents: ``(model, windows)``. benchmarks/teacher_record.py builds its inputs here too."""
    path = write_random_model(root / "m.gguf", n_layer=layers, n_embd=embd, n_head=8,
                              n_head_kv=4, n_expert=8, n_expert_used=2, n_ff_exp=512,
                              n_ff_shexp=1024, vocab_size=vocab, context_length=1024,
                              seed=1)  # fmt: skip
    model = open_model(path)
    docs = [Document(f"t{i}", "docs", i, "docs",
                     text=" ".join(f"word{(i * 7 + j) % 5000} {j}" for j in range(600)))
            for i in range(1, 2 * n_docs + 1, 2)]  # fmt: skip
    write_corpus(docs, root / "c.jsonl")
    corpus = load_corpus(root / "c.jsonl")
    windows = make_windows(corpus, model.tokenizer(), parity_split(corpus), max_scored=128,
                           max_context=256, max_windows_per_doc=1)  # fmt: skip
    return model, windows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--group", type=int, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="score-bench-"))
    base, windows = random_model_and_windows(root, args.vocab, args.embd, args.layers,
                                             args.windows)
    windows = windows[: args.windows]
    stored = {}
    for i in base.hparams.moe_layers:
        stored[i] = root / f"down{i}.npy"
        np.save(stored[i], base.layer(i)["ffn_down_exps.weight"].astype(np.float32))
    reads = Counter()

    def load(i):
        reads[i] += 1
        return LayerReplacement(down_exps=np.load(stored[i], mmap_mode="r") * np.float32(1.25))

    kwargs = {"batch": args.batch}
    if "group" in inspect.signature(score_windows).parameters:
        kwargs["group"] = args.group
    cache = StageCache(root / "cache")
    for _ in ("warm-up", "timed"):
        reads.clear()
        student = Student(base, LayerMap(base.hparams.moe_layers, load))
        start = time.perf_counter()
        with profiling() as prof:
            rows = [m.kld_mean for _, m in score_windows(base, student, windows, cache, **kwargs)]
        wall = time.perf_counter() - start
    totals = phase_totals(prof.rows())
    print(json.dumps({
        "score_windows_kwargs": kwargs, "windows": len(windows), "wall_s": round(wall, 2),
        "phases": {k: {f: v[f] for f in ("wall_s", "cpu_s", "calls")} for k, v in totals.items()},
        "student_layer_reads": sum(reads.values()), "kld_mean_sum": float(np.sum(rows)),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }, indent=1))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
