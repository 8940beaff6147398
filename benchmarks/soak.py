"""Soak: a long TPE sweep on the demo model, with memory sampled while it runs; prints a table.

Runs ``healsweep sweep run`` (a real subprocess with its embedded Ray) on a 50-trial Optuna TPE
sweep over the five continuous healing knobs, with Wilcoxon pruning and 2 concurrent trials, and
every ``--interval`` seconds samples with psutil:

- the driver's RSS (the ``healsweep`` process);
- the Ray worker processes (``ray::`` / ``default_worker``): their RSS sum and max, and how many;
- Ray's own daemons (gcs, raylet, ...): their RSS sum;
- trials completed / pruned / failed, from the sweep's ``trials.parquet``.

At the end it prints the peaks, the RSS growth of the driver between the first and the last
quarter of the run (a leak shows as steady growth), and whether every trial finished with its
windows recorded exactly once.

    .venv/bin/python benchmarks/soak.py [--trials 50] [--windows 8] [--interval 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024


def soak_spec(trials: int, windows: int) -> dict:
    """The soak's sweep spec: demo model, TPE over five knobs, Wilcoxon pruning, 2 at a time."""
    return {
        "name": "soak",
        "model": "demo",
        "corpus": "demo",
        "split": str(ROOT / "configs" / "splits" / "demo.yaml"),
        "calibration": {"max_tokens": 1024, "chunk_length": 256},
        "fixed": {"alpha": "gaussian", "ridge": True},
        "search_space": {
            "gamma": {"low": 0.0, "high": 1.0},
            "gain_gu": {"low": 0.0, "high": 1.0},
            "gain_d": {"low": 0.0, "high": 1.0},
            "rho": {"low": 0.5, "high": 100.0, "log": True},
            "eta": {"low": 0.0, "high": 0.6},
        },
        "sampler": {"type": "tpe", "seed": 0},
        "pruner": {"type": "wilcoxon", "p_threshold": 0.1, "n_startup_steps": 4},
        "num_samples": trials,
        "max_concurrent": 2,
        "max_failures": 1,
        "scoring": {"max_scored": 32, "max_context": 64, "max_windows": windows, "batch": 4},
        "seed": 0,
    }


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def _is_worker(proc: psutil.Process) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return cmd.startswith("ray::") or "default_worker.py" in cmd


def sample(driver: psutil.Process) -> dict[str, float]:
    """RSS (MiB) of the driver, of its Ray workers (sum, max, count) and of Ray's daemons."""
    try:
        family = driver.children(recursive=True)
    except psutil.Error:
        family = []
    workers = [_rss(p) for p in family if _is_worker(p)]
    daemons = [_rss(p) for p in family if not _is_worker(p)]
    return {
        "driver": _rss(driver) / MB,
        "workers_sum": sum(workers) / MB,
        "workers_max": max(workers, default=0) / MB,
        "workers_n": len(workers),
        "daemons_sum": sum(daemons) / MB,
    }


def trial_counts(sweep_dir: Path) -> Counter:
    """Trials by status from ``trials.parquet`` (empty before the first trial starts)."""
    path = sweep_dir / "trials.parquet"
    try:
        return Counter(r["status"] for r in pq.read_table(path, columns=["status"]).to_pylist())
    except (OSError, ValueError):
        return Counter()


def windows_check(sweep_dir: Path) -> tuple[int, int]:
    """(rows in the windows dataset as files hold them, distinct (config, window) keys)."""
    rows = pq.read_table(sweep_dir / "windows", columns=["config_hash", "window_id"]).to_pylist()
    return len(rows), len({(r["config_hash"], r["window_id"]) for r in rows})


def _row(t: float, s: dict, counts: Counter) -> str:
    return (
        f"{t:>7.0f} {s['driver']:>10.0f} {s['workers_sum']:>12.0f} {s['workers_max']:>11.0f} "
        f"{s['workers_n']:>3d} {s['daemons_sum']:>11.0f} {counts['completed']:>5d} "
        f"{counts['pruned']:>6d} {counts['error']:>5d}"
    )


def soak(workdir: Path, trials: int, windows: int, interval: float) -> int:
    """Run the soak sweep, print the table and the summary; the sweep's exit code."""
    spec_path = workdir / "soak.json"
    spec_path.write_text(json.dumps(soak_spec(trials, windows)))
    results = workdir / "results"
    env = {**os.environ, "HEALSWEEP_CACHE": os.environ.get("HEALSWEEP_CACHE", str(workdir / "cache"))}
    log = open(workdir / "sweep.log", "w")
    cmd = [sys.executable, "-m", "healsweep", "sweep", "run", str(spec_path), "--results", str(results)]
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    driver = psutil.Process(proc.pid)
    print(f"soak: {trials} trials, {windows} windows each, sampling every {interval:.0f} s")
    print(f"{'time_s':>7} {'driver_MiB':>10} {'workers_MiB':>12} {'worker_max':>11} {'n':>3} "
          f"{'ray_daemons':>11} {'done':>5} {'pruned':>6} {'error':>5}")  # fmt: skip
    samples: list[tuple[float, dict]] = []
    while proc.poll() is None:
        s = sample(driver)
        t = time.time() - start
        if proc.poll() is None and s["driver"]:
            samples.append((t, s))
            print(_row(t, s, trial_counts(results / "soak")), flush=True)
        time.sleep(interval)
    wall = time.time() - start
    log.close()
    counts = trial_counts(results / "soak")
    print(f"sweep exit code {proc.returncode} after {wall:.0f} s; trials: {dict(counts)}")
    if not samples:
        return proc.returncode or 1
    quarter = max(1, len(samples) // 4)
    first = sum(s["driver"] for _, s in samples[:quarter]) / quarter
    last = sum(s["driver"] for _, s in samples[-quarter:]) / quarter
    print(f"peak driver RSS {max(s['driver'] for _, s in samples):.0f} MiB; "
          f"peak workers RSS sum {max(s['workers_sum'] for _, s in samples):.0f} MiB, "
          f"max one worker {max(s['workers_max'] for _, s in samples):.0f} MiB; "
          f"peak Ray daemons {max(s['daemons_sum'] for _, s in samples):.0f} MiB")  # fmt: skip
    print(f"driver RSS mean, first quarter {first:.0f} MiB -> last quarter {last:.0f} MiB")
    if (results / "soak" / "windows").is_dir():
        n_rows, n_keys = windows_check(results / "soak")
        print(f"windows dataset: {n_rows} rows, {n_keys} distinct (config, window) keys")
    return proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--windows", type=int, default=8, help="dev windows per trial")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="healsweep-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sys.exit(soak(workdir, args.trials, args.windows, args.interval))


if __name__ == "__main__":
    main()
