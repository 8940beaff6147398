"""Q2_0 quantize throughput from a source checkout; the same table as ``healsweep bench quant``.

    python benchmarks/bench_quant.py [--rows 2048] [--cols 2048] [--repeats 5]

The benchmark lives in :mod:`healsweep.bench.quant` (its docstring says what is timed).
"""

from __future__ import annotations

import argparse

from healsweep.bench.quant import quant_table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(
        quant_table(args.rows, args.cols, args.repeats, progress=lambda row: print(row, flush=True))
    )


if __name__ == "__main__":
    main()
