"""What would Wilcoxon (+ futility) pruning have saved on a sweep that ran without it? Prints a table.

Replays the per-window results of an unpruned sweep (``RESULTS/<name>/windows``) through the real
pruning scheduler (``healsweep.sweep.pruning.WindowPruningScheduler`` on a scratch journal): trials
in their start order (baseline first), ``--concurrency`` at a time with their windows interleaved,
each in the order it actually scored them. For each threshold (and futility confidence and
minimum windows, 0 = off): windows saved, when each pruned trial would have stopped, and whether
the sweep's best config would have been pruned. (A live
TPE sweep adapts to what pruning tells it, so its configs would differ a little.)

    .venv/bin/python benchmarks/pruning_replay.py results/tune-unpruned --p 0.1 0.05 0.02 \
        --confidence 0 0.8 0.9 --min-windows 8 16
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ray.tune.schedulers import TrialScheduler

from healsweep.results.schema import row_role
from healsweep.results.store import read_trials, read_windows
from healsweep.sweep.pruning import WindowPruningScheduler
from healsweep.sweep.spec import PrunerSpec


@dataclass
class _Trial:
    trial_id: str

    def should_recover(self) -> bool:
        return False


def replay(
    sweep_dir: Path, p: float, startup: int, concurrency: int, futility: dict | None = None
) -> dict:
    """Windows scored and pruned trials had the sweep been pruned at ``p`` (and ``futility``)."""
    trials = [t for t in read_trials(sweep_dir).to_pylist()  # fixed rows are never pruned
              if t["status"] == "completed" and row_role(t) in ("trial", "baseline")]  # fmt: skip
    trials.sort(key=lambda t: (not t["is_baseline"], t["started_at"]))
    rows = read_windows(sweep_dir).to_pylist()
    total = max(t["windows_total"] for t in trials)
    scored, pruned = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        pruner = PrunerSpec(
            type="wilcoxon", p_threshold=p, n_startup_steps=startup, futility=futility or False
        )
        sched = WindowPruningScheduler(Path(tmp) / "journal", pruner)
        for start in range(0, len(trials), concurrency):
            group = trials[start : start + concurrency]
            orders = {
                t["trial_id"]: sorted(
                    (r for r in rows if r["trial_id"] == t["trial_id"]), key=lambda r: r["position"]
                )
                for t in group
            }
            alive = {t["trial_id"] for t in group}
            for step in range(total):
                for t in group:
                    if t["trial_id"] not in alive:
                        continue
                    row = orders[t["trial_id"]][step]
                    scored += 1
                    result = {"window_index": row["window_index"], "kld_mean": row["kld_mean"],
                              "windows_done": step + 1, "windows_total": total,
                              "is_baseline": t["is_baseline"], "config_hash": t["config_hash"]}  # fmt: skip
                    if (
                        sched.on_trial_result(None, _Trial(t["trial_id"]), result)
                        == TrialScheduler.STOP
                    ):
                        alive.discard(t["trial_id"])
                        pruned.append((t, step + 1))
            for t in group:
                if t["trial_id"] in alive:
                    final = {"running_kld_mean": t["kld_mean"], "windows_done": total,
                             "windows_total": total}  # fmt: skip
                    sched.on_trial_complete(None, _Trial(t["trial_id"]), final)
    best = min(trials, key=lambda t: t["kld_mean"])
    return {
        "saved": 1 - scored / (total * len(trials)),
        "pruned": [(t["kld_mean"] / best["kld_mean"] - 1, at) for t, at in pruned],
        "best_pruned": any(t["trial_id"] == best["trial_id"] for t, _ in pruned),
        "trials": len(trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--p", type=float, nargs="+", default=[0.1, 0.05, 0.02])
    parser.add_argument("--startup", type=int, nargs="+", default=[6])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--confidence", type=float, nargs="+", default=[0.0], help="0: off")
    parser.add_argument("--min-windows", type=int, nargs="+", default=[12])
    args = parser.parse_args()
    print(f"{'p':>6} {'startup':>7} {'conf':>5} {'min':>4} {'saved':>7} {'pruned':>6}  "
          "best pruned  pruned at (window: final KLD vs best)")  # fmt: skip
    grid = [(p, s, c, m) for p in args.p for s in args.startup for c in args.confidence
            for m in (args.min_windows if c else [0])]  # fmt: skip
    for p, startup, conf, least in grid:
        futility = {"confidence": conf, "min_windows": least} if conf else None
        r = replay(args.sweep_dir, p, startup, args.concurrency, futility)
        stops = ", ".join(
            f"{at}: {rel:+.1%}" for rel, at in sorted(r["pruned"], key=lambda x: x[1])
        )
        print(f"{p:>6} {startup:>7} {conf:>5} {least:>4} {r['saved']:>7.1%} {len(r['pruned']):>6}  "
              f"{'YES' if r['best_pruned'] else 'no':>11}  {stops}")  # fmt: skip


if __name__ == "__main__":
    main()
