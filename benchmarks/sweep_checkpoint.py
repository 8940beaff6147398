"""How much does checkpointing a trial after every window cost? Prints a table.

One trial reports N windows whose "scoring" is instant (a formula), so the time per window is
pure orchestration: ``tune.report`` round trips, the per-window Parquet row on the driver, and
the JSON checkpoint of all finished windows (``scoring.checkpoint_every``). Compare the
per-window cost at several checkpoint intervals with the time the real scorer needs per window.

    .venv/bin/python benchmarks/sweep_checkpoint.py [--windows 200] [--every 1 4 16 0]

``--every 0`` means a checkpoint only after the last window.
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
from healsweep.sweep.spec import spec_from_dict
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


def measure(root: Path, n_windows: int, every: int) -> dict[str, float]:
    """Seconds per window (first to last row written) and wall time of one sweep."""
    import functools

    name = f"ckpt-{every}"
    spec = spec_from_dict(
        {
            "name": name,
            "search_space": {},
            "max_concurrent": 1,
            "scoring": {"checkpoint_every": every or n_windows},
        }
    )
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
    ckpts = len(list((root / name).glob("trial_*/checkpoint_*")))
    return {
        "every": every,
        "per_window_ms": 1000 * per_window,
        "wall_s": wall,
        "checkpoints": ckpts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=200)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4, 16, 0])
    args = parser.parse_args()
    ray.init(
        num_cpus=1, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for every in args.every:
            results.append(measure(Path(tmp), args.windows, every))
    ray.shutdown()
    print(f"{args.windows} windows, one trial, instant scoring")
    print(f"{'checkpoint_every':>16} {'checkpoints':>11} {'ms/window':>10} {'wall s':>8}")
    for r in results:
        label = "end only" if r["every"] == 0 else str(r["every"])
        print(f"{label:>16} {r['checkpoints']:>11} {r['per_window_ms']:>10.1f} {r['wall_s']:>8.1f}")


if __name__ == "__main__":
    main()
