"""Sweep benchmarks on the demo model; prints tables.

``ablation``: the 12-config ablation (``sweeps/demo-ablation.yaml``) with a cold stage cache, then
again with the warm cache (targets: <= 10 min cold, <= 3 min warm on a 2-core machine).

``pruning``: the TPE sweep (``sweeps/demo-tune.yaml``) without pruning and with its pruner
(Wilcoxon + futility), once per sampler seed: windows scored (target: >= 30% fewer with pruning)
and whether the pruned sweep's best config is the same as, or statistically indistinguishable from
(paired-bootstrap 95% CI of the relative change includes 0), the unpruned sweep's best.

    .venv/bin/python benchmarks/sweep_demo.py ablation pruning [--samples 20] [--workdir DIR] \
        [--seed 0 1 2]

The unpruned sweep runs first with cold caches (a finished one of the same seed in ``--workdir``
is reused) and the pruned one after it with warm ones, so compare their windows, not their wall
times. ``benchmarks/pruning_replay.py`` answers the same question for any threshold from one
unpruned sweep.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

from healsweep.results.schema import row_role
from healsweep.results.store import read_trials, read_windows
from healsweep.score.record import WindowMetrics
from healsweep.score.stats import paired_compare
from healsweep.sweep.driver import run_sweep
from healsweep.sweep.spec_files import load_spec

ROOT = Path(__file__).resolve().parents[1]


def _run(spec_file: str, name: str, root: Path, **changes) -> tuple[float, Path]:
    spec = load_spec(ROOT / "sweeps" / spec_file).model_copy(update={"name": name, **changes})
    start = time.time()
    run = run_sweep(spec, results_root=root)
    return time.time() - start, run.sweep_dir


def ablation(work: Path) -> None:
    """Cold then warm cache, wall time of the 12-config ablation."""
    os.environ["HEALSWEEP_CACHE"] = str(work / "cache-ablation")
    cold, cold_dir = _run("demo-ablation.yaml", "ablation-cold", work)
    warm, warm_dir = _run("demo-ablation.yaml", "ablation-warm", work)
    print(f"{'ablation (12 configs)':<24} {'wall':>8} {'trials':>7} {'windows':>8}")
    for label, seconds, folder in (("cold cache", cold, cold_dir), ("warm cache", warm, warm_dir)):
        trials = read_trials(folder).to_pylist()
        done = sum(t["status"] == "completed" for t in trials)
        print(f"{label:<24} {seconds / 60:>7.1f}m {done:>7} {read_windows(folder).num_rows:>8}")


def _best(folder: Path) -> dict:
    trials = [t for t in read_trials(folder).to_pylist()
              if t["status"] == "completed" and row_role(t) in ("trial", "baseline")]  # fmt: skip
    return min(trials, key=lambda t: t["kld_mean"])


def pruning(work: Path, samples: int, seed: int) -> None:
    """Windows scored with and without pruning at one sampler seed, and the two bests compared.

    The unpruned sweep runs first; a finished one of the same seed in ``work`` is reused."""
    os.environ["HEALSWEEP_CACHE"] = str(work / "cache-tune")
    tune = load_spec(ROOT / "sweeps" / "demo-tune.yaml")
    sampler = tune.sampler.model_copy(update={"seed": seed})
    none = tune.pruner.model_copy(update={"type": "none", "futility": None})
    full_dir = work / f"tune-unpruned-seed{seed}"
    full_s = math.nan
    if sum(t["status"] == "completed" for t in _trials(full_dir)) < samples:
        full_s, full_dir = _run("demo-tune.yaml", full_dir.name, work, num_samples=samples,
                                sampler=sampler, pruner=none)  # fmt: skip
    pruned_s, pruned_dir = _run(
        "demo-tune.yaml", f"tune-pruned-seed{seed}", work, num_samples=samples, sampler=sampler
    )
    rows = {d: read_windows(d).to_pylist() for d in (pruned_dir, full_dir)}
    tuned = {d: sum(row_role(r) in ("trial", "baseline") for r in rows[d]) for d in rows}
    print(f"{'TPE, ' + str(samples) + ' trials, seed ' + str(seed):<24} {'wall':>8} {'windows':>8} "
          f"{'(trials)':>8} {'pruned':>7} {'best KLD':>9}  best knobs")  # fmt: skip
    for label, seconds, folder in (
        ("no pruning", full_s, full_dir),
        (tune.pruner.type, pruned_s, pruned_dir),
    ):
        trials = read_trials(folder).to_pylist()
        n_pruned = sum(t["status"] == "pruned" for t in trials)
        best = _best(folder)
        print(
            f"{label:<24} {seconds / 60:>7.1f}m {len(rows[folder]):>8} {tuned[folder]:>8} {n_pruned:>7} "
            f"{best['kld_mean']:>9.5f}  {_knobs(best)}"
        )
    saved = 1 - len(rows[pruned_dir]) / len(rows[full_dir])
    saved_tuned = 1 - tuned[pruned_dir] / tuned[full_dir]
    print(f"windows saved by pruning: {saved:.1%} ({saved_tuned:.1%} of the trials' windows; "
          "the reference rows are never pruned)")  # fmt: skip
    best_p, best_f = _best(pruned_dir), _best(full_dir)
    by_p = {r["window_id"]: r for r in rows[pruned_dir] if r["trial_id"] == best_p["trial_id"]}
    by_f = {r["window_id"]: r for r in rows[full_dir] if r["trial_id"] == best_f["trial_id"]}
    ids = sorted(set(by_p) & set(by_f))
    metrics = WindowMetrics.from_dict
    comp = paired_compare([metrics(by_f[w]) for w in ids], [metrics(by_p[w]) for w in ids],
                          [by_f[w]["stratum"] for w in ids])  # fmt: skip
    lo, hi = comp.rel_change_ci()
    same = best_p["config_hash"] == best_f["config_hash"]
    print(f"pruned best vs unpruned best: {comp.rel_change:+.2%} [95% CI {lo:+.2%}, {hi:+.2%}]"
          f" ({'same config' if same else ('inside the CI' if lo <= 0 <= hi else 'outside')})")  # fmt: skip


def _trials(folder: Path) -> list[dict]:
    return read_trials(folder).to_pylist() if folder.exists() else []


def _knobs(trial: dict) -> str:
    names = ("gamma", "gain_gu", "gain_d", "rho", "eta")
    return " ".join(f"{k}={trial['knob_' + k]:.3g}" for k in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", choices=["ablation", "pruning"])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="sampler seeds (pruning)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "ablation" in args.parts:
            ablation(work)
        if "pruning" in args.parts:
            for seed in args.seed:
                pruning(work, args.samples, seed)


if __name__ == "__main__":
    main()
