"""The Ray Tune function trainable of a sweep (one trial = one config, reported window by
window) and the window book its trials share.

A trial scores its dev windows in a seeded per-trial order and calls ``tune.report`` after each
with the window's record and the running token-pooled KLD and top-1. The trainable itself is a
light coordinator on the head node (a sliver of the head's own resource, so Tune counts it
against ``max_concurrent`` but never against a worker's CPUs or GPUs); the scoring runs as a Ray
task with the trial's resources, placed where its stage entries are
(:mod:`healsweep.sweep.placed`), and each report carries where it ran and what its caches did.
A trial that starts or
restarts takes the windows its student has finished from the :class:`WindowBook` and *replays*
them (reports them again, flagged ``replayed``) instead of scoring them twice; the recorder
writes no row twice. The book is keyed by student
(:meth:`~healsweep.heal.knobs.Knobs.student_key`), so a trial whose student a reference row or
another trial has scored replays those windows: a sweep scores each student once. It is filled
from the Parquet rows, the one record of what is finished, so a trial keeps no Tune checkpoint
of its own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import ray
from ray import tune

from healsweep.results.schema import scored_all, student_of
from healsweep.results.store import read_windows
from healsweep.score.record import WindowMetrics, WindowRecord
from healsweep.sweep.budget import budget_of
from healsweep.sweep.holders import HEAD_NODE_RESOURCE
from healsweep.sweep.placed import PlacedWork
from healsweep.sweep.space import TrialIdentity, trial_identity
from healsweep.sweep.spec import SweepSpec
from healsweep.sweep.work import WorkFn

TARGET_METRIC = "running_kld_mean"
# What a trial's coordinator (the Tune trainable) takes: a sliver of the head's resource.
COORDINATOR_RESOURCES = {HEAD_NODE_RESOURCE: 0.001}


@ray.remote(num_cpus=0, max_restarts=0)
class WindowBook:
    """``{student key: {window_id: WindowRecord}}`` of one sweep run: trials add each window
    they finish and ask for their student's when they start, so a trial retried (on this
    machine or another) scores no window twice, nor one another row scored for the same
    student. It dies with the driver; a resumed sweep fills a new one from the Parquet rows."""

    def __init__(self, prior: Mapping[str, Mapping[str, WindowRecord]]) -> None:
        self._done = {student: dict(windows) for student, windows in prior.items()}

    def add(self, student: str, record: WindowRecord) -> None:
        """Record one finished window of ``student``."""
        self._done.setdefault(student, {})[record.window_id] = record

    def done(self, student: str) -> dict[str, WindowRecord]:
        """Every finished window of ``student`` (by window id)."""
        return self._done.get(student, {})


def prior_windows(sweep_dir: Path) -> dict[str, dict[str, WindowRecord]]:
    """Finished windows per student (:func:`~healsweep.results.schema.student_of`), from the
    sweep's Parquet rows: whichever rows scored a window for a student, it is done for all."""
    prior: dict[str, dict[str, WindowRecord]] = {}
    students: dict[str, str] = {}  # config hash -> its student
    for row in read_windows(sweep_dir).to_pylist():
        student = students.setdefault(row["config_hash"], student_of(row))
        prior.setdefault(student, {}).setdefault(row["window_id"], WindowRecord.from_dict(row))
    return prior


def open_book(prior: Mapping[str, Mapping[str, WindowRecord]]) -> ray.actor.ActorHandle:
    """Start the book on the head node with the windows finished so far.

    Not on "the driver's node": a driver on a machine that hosts several nodes (or a worker)
    may be attached to a worker node, and a book there dies with that worker, failing every
    retry of the trials it was meant to rescue. The cluster cannot outlive its head anyway.
    """
    return WindowBook.options(resources={HEAD_NODE_RESOURCE: 0.001}).remote(dict(prior))


def trial_seed(sweep_seed: int, chash: str) -> int:
    """The seed of a config's window order: stable across retries and resumed runs."""
    digest = hashlib.sha256(f"{sweep_seed}:{chash}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def budget_tier(spec: SweepSpec, trial: TrialIdentity) -> float | None:
    """The smallest limit of the spec's budget that the trial's config fits (None without a
    budget): the tier it competes in (:mod:`healsweep.sweep.pruning`)."""

    budget = budget_of(spec)
    return None if budget is None or trial.size is None else budget.tier(trial.size)


class RunningPool:
    """Token-pooled KLD and top-1 over the distinct windows counted so far, the nodes that
    scored them and the trial's window count: a trial's running figures and the sums of its
    ``trials.parquet`` row."""

    def __init__(self) -> None:
        self.window_ids: set[str] = set()
        self.nodes: set[str] = set()
        self.total = 0  # windows of the trial
        self.kld_sum = 0.0
        self.count = 0
        self.top1_count = 0

    def add(self, row: Mapping[str, Any]) -> None:
        """Count one window row (a flat window record); a window counted before is skipped."""
        self.total = max(self.total, int(row.get("windows_total") or 0))
        if row.get("scored_node_ip"):
            self.nodes.add(str(row["scored_node_ip"]))
        if row["window_id"] in self.window_ids:
            return
        metrics = WindowMetrics.from_dict(row)
        self.window_ids.add(row["window_id"])
        self.kld_sum += metrics.kld_sum
        self.count += metrics.kld_count
        self.top1_count += metrics.top1_count

    def summary(self) -> dict[str, float]:
        """``windows_done``, ``running_kld_mean`` and ``running_top1`` (NaN before a token)."""
        count = self.count or math.nan
        return {
            "windows_done": len(self.window_ids),
            TARGET_METRIC: self.kld_sum / count,
            "running_top1": self.top1_count / count,
        }

    def totals(self) -> dict[str, Any]:
        """The columns of a ``trials.parquet`` row that sum its windows (means None before a
        token)."""
        count = self.count or None
        return {
            "windows_scored": len(self.window_ids),
            "windows_total": self.total or None,
            "kld_sum": self.kld_sum,
            "kld_count": self.count,
            "top1_count": self.top1_count,
            "kld_mean": count and self.kld_sum / count,
            "top1": count and self.top1_count / count,
            "nodes": ",".join(sorted(self.nodes)),
        }


def sweep_trial(
    config: Mapping[str, Any],
    *,
    spec: SweepSpec,
    book: ray.actor.ActorHandle,
    holders: ray.actor.ActorHandle,
    work_fn: WorkFn,
) -> None:
    """The function trainable (wrap with ``tune.with_parameters``); ``book`` and ``holders``
    are the handles of the sweep's :class:`WindowBook` and
    :class:`~healsweep.sweep.holders.StageHolders`. See the module docstring."""

    trial = trial_identity(config, spec.baseline, spec.fixed, spec.model)
    done: dict[str, WindowRecord] = dict(ray.get(book.done.remote(trial.student)))
    pool = RunningPool()
    sent = {
        "config_hash": trial.config_hash,
        "is_baseline": trial.is_baseline,
        "budget_tier": budget_tier(spec, trial),  # the pruner judges it within its tier
    }
    work = PlacedWork(spec, holders, trial.knobs)

    def report(record: WindowRecord, *, replayed: bool) -> None:
        row = record.to_dict()
        pool.add(row)
        tune.report({**row, **sent, "replayed": replayed, **pool.summary(), **work.columns})

    for record in sorted(done.values(), key=lambda r: r.position):
        report(record, replayed=True)
    if done and scored_all(len(done), pool.total):
        return  # every window replayed: no work to place
    seed = trial_seed(spec.seed, trial.config_hash)
    job = partial(work_fn, spec, trial.knobs, frozenset(done), seed)
    # A trial restored from a sweep started before trials were placed still holds the work's
    # CPUs or GPUs itself (Tune keeps a trial's resources): it works here, as trials did then.
    held = tune.get_context().get_trial_resources().required_resources
    here = held.get("CPU", 0.0) > 0 or held.get("GPU", 0.0) > 0
    for record in work.records(job, here=here):
        book.add.remote(trial.student, record)
        report(record, replayed=False)
