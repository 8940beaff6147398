"""Forward tok/s and peak RSS of healsweep beside llama.cpp, one random file per architecture.

Each architecture's file has the layout of its llama.cpp reference test (``tests/
test_arch_reference.py``: the routing variant, attention kind, leading dense layers) at a larger
width, F16 weights; both forwards score the same random tokens, each in a fresh process
(:func:`healsweep.bench.forward.bench_forward_pair`). Needs the ``bench`` extra for the llama.cpp
column.

    .venv/bin/python benchmarks/arch_forward.py [--tokens 512] [--threads 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from healsweep.bench.forward import bench_forward_pair
from healsweep.model.synthetic import write_random_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_arch_reference import SHAPES  # noqa: E402  (the reference test's layouts)

WIDER = dict(n_embd=512, n_ff_exp=256, n_ff_shexp=512, context_length=1024, types="F16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="healsweep-arch-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        "| architecture | healsweep tok/s | llama.cpp tok/s | ratio | RSS MiB healsweep / llama.cpp |"
    )
    print("|---|---|---|---|---|")
    for label, (arch, shape) in sorted(SHAPES.items()):
        kwargs = {"n_layer": 2, "n_head": 4, "n_expert": 8, "n_expert_used": 2, "seed": 41}
        kwargs.update(shape)
        kwargs.update(WIDER)
        path = write_random_model(work / f"{label}.gguf", arch, **kwargs)
        try:
            row = bench_forward_pair(path, args.tokens, args.seq_len, args.threads)
        except RuntimeError as exc:  # one architecture's failure is a row, not the end
            print(f"| {label} | failed: {str(exc).splitlines()[0][:120]} | | | |", flush=True)
            continue
        ours, theirs = row["healsweep"], row["llama"]
        if theirs is None:
            print(
                f"| {label} | {ours['tokens_per_s']:.0f} | - | - | {ours['peak_rss_mib']:.0f} / - |"
            )
            continue
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        print(
            f"| {label} | {ours['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} | {ratio:.2f} "
            f"| {ours['peak_rss_mib']:.0f} / {theirs['peak_rss_mib']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
