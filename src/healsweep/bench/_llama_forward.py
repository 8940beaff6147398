"""``python -m healsweep.bench._llama_forward MODEL ...``: llama.cpp's side of ``bench forward``.

Prints one JSON line: tokens/s (best of the timed repeats after one untimed pass) and peak RSS of
this process. Each sequence is evaluated from an empty context with every logit row kept, the
same work as healsweep's teacher-forced forward of the same random tokens.
"""

from __future__ import annotations

import argparse
import json
import time

from healsweep._rss import peak_rss_bytes
from healsweep.bench.forward import bench_sequences


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m healsweep.bench._llama_forward")
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # lazy: optional (llama-cpp-python, an optional extra)
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, n_ctx=args.seq_len, n_batch=args.seq_len,
                n_ubatch=args.seq_len, logits_all=True, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    sequences = bench_sequences(llm.n_vocab(), args.tokens, args.seq_len, args.seed)

    def run() -> float:
        start = time.perf_counter()
        for seq in sequences:
            llm.reset()
            llm.eval(seq.tolist())
        return time.perf_counter() - start

    first = run()
    best = min(run() for _ in range(args.repeats))
    print(json.dumps({"engine": "llama.cpp", "tokens": args.tokens, "threads": args.threads,
                      "first_call_s": first, "tokens_per_s": args.tokens / best,
                      "peak_rss_mib": peak_rss_bytes() / 2**20}))


if __name__ == "__main__":
    main()
