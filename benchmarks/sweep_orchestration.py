"""What does the sweep machinery cost per window? Prints a table.

One trial reports N windows whose "scoring" is instant (a formula), so the time per window is
pure orchestration: the ``tune.report`` round trip and the per-window Parquet row on the driver.
Compare it with the time the real scorer needs per window.

    .venv/bin/python benchmarks/sweep_orchestration.py [--windows 200] [--repeats 2]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import ray

from healsweep.score.record import WindowRecord
from healsweep.sweep.driver import run_sweep
from healsweep.sweep.spec_files import spec_from_dict
from healsweep.sweep.work import trial_order

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def instant_work(spec, knobs, done, seed, *, n_windows: int):
    """Windows with made-up metrics, produced as fast as the trainable can take them."""
    ids = sorted(hashlib.sha256(f"w{i}".encode()).hexdigest()[:16] for i in range(n_windows))
    for position, wi in enumerate(trial_order(n_windows, seed)):
        if ids[wi] in done:
            continue
        metrics = {
            "kld_sum": 1.0,
            "kld_count": 100,
            "kld_mean": 0.01,
            "top1": 0.9,
            "top1_count": 90,
        }
        yield WindowRecord(ids[wi], wi, position, n_windows, "s", "src", f"d{wi}", "text", metrics)


def measure(root: Path, n_windows: int, repeat: int) -> dict[str, float]:
    """Seconds per window (first to last row written) and wall time of one sweep."""
    import functools

    name = f"orchestration-{repeat}"
    spec = spec_from_dict({"name": name, "search_space": {}, "max_concurrent": 1})
    start = time.time()
    run_sweep(
        spec,
        results_root=root,
        work_fn=functools.partial(instant_work, n_windows=n_windows),
        identity_fn=lambda spec: {},
    )
    wall = time.time() - start
    rows = pq.read_table(root / name / "windows").to_pylist()
    written = sorted(r["written_at"].timestamp() for r in rows)
    per_window = (written[-1] - written[0]) / (len(written) - 1)
    return {"per_window_ms": 1000 * per_window, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ray.init(
        num_cpus=1, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            results.append(measure(Path(tmp), args.windows, repeat))
    ray.shutdown()
    print(f"{args.windows} windows, one trial, instant scoring")
    print(f"{'run':>4} {'ms/window':>10} {'wall s':>8}")
    for i, r in enumerate(results):
        print(f"{i + 1:>4} {r['per_window_ms']:>10.1f} {r['wall_s']:>8.1f}")


if __name__ == "__main__":
    main()
