"""A sweep's results as figures: every config pooled and compared with the baseline and each
reference row, knob main effects, pruning.

Nothing is recomputed from logits: every figure comes from the window records, pooled and
compared with :mod:`healsweep.score.stats`. A config is one student
(:func:`~healsweep.results.schema.student_of`): rows that name the same student (a reference and
the grid point with its knobs, trials that differ only in inert knobs, one config run by more
than one trial) are one config, listed under all their names, each window counted once. The
decision rule judges trials and external GGUFs only; main effects and the pruning summary count
the Tune trials only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from healsweep.errors import ResultsError
from healsweep.heal.knobs import Knobs
from healsweep.heal.size import Budget
from healsweep.results.placement import pool_summary
from healsweep.results.schema import REFERENCES, Role, TrialStatus, knobs_of, row_role, student_of
from healsweep.results.store import (
    read_allocator,
    read_manifest,
    read_over_budget,
    read_stored_spec,
    read_trials,
    read_windows,
)
from healsweep.score.expert_cache import pooled_cache
from healsweep.score.record import WindowRecord
from healsweep.score.stats import (
    DecisionRule,
    decision,
    paired_compare,
    percentile_ci,
    pooled,
)

MAX_LEVELS = 6


class Alias(NamedTuple):
    """Another row that names a config's student (its role, label, knobs and config hash)."""

    role: Role
    label: str | None
    knobs: Knobs | None
    config_hash: str


@dataclass
class ConfigResult:
    """One config: its knobs, trials, windows and (for non-baselines) the paired comparison."""

    config_hash: str
    knobs: Knobs | None  # None for an external GGUF
    is_baseline: bool
    status: str
    trial_ids: list[str]
    windows: dict[str, WindowRecord] = field(repr=False)
    pooled: dict[str, Any] = field(default_factory=dict)
    comparison: Any = None
    verdict: Any = None
    role: Role = Role.TRIAL
    label: str | None = None  # a reference's or external's name
    routed_bpw: float | None = None
    file_bytes: int | None = None  # the file's bytes (heal.size; an external's file size)
    vs_references: dict[str, Any] = field(default_factory=dict)  # label -> Comparison
    also: list[Alias] = field(default_factory=list)  # the other rows of its student

    @property
    def is_fixed(self) -> bool:
        """A reference or external row (not a trial of the Tune experiment)."""
        return not self.role.tuned

    @property
    def knob_values(self) -> dict[str, Any]:
        """``{knob: value}`` ({} for an external GGUF)."""
        return {} if self.knobs is None else self.knobs.model_dump()

    @property
    def reference(self) -> str | None:
        """The name of the reference row it is (or that names its student), if any."""
        names = [(self.role, self.label), *((a.role, a.label) for a in self.also)]
        return next((str(label) for role, label in names if role == Role.REFERENCE), None)

    @property
    def config_hashes(self) -> list[str]:
        """The config hashes of every row that names it."""
        return [self.config_hash, *(alias.config_hash for alias in self.also)]

    @property
    def cache(self) -> dict[str, Any] | None:
        """Token-pooled expert-cache figures of its windows (None when scored without a cache)."""
        return pooled_cache([w.metrics.to_dict() for w in self.windows.values()])


@dataclass
class SweepSummary:
    """Everything the report shows."""

    name: str
    manifest: dict[str, Any]
    baseline: ConfigResult
    configs: list[ConfigResult]  # baseline first, then by pooled KLD
    references: list[ConfigResult]  # the reference rows with windows (unhealed, plain)
    strata: list[str]
    windows_total: int
    effects: list[dict[str, Any]]
    pruning: dict[str, Any]
    rule: Any
    pool: dict[str, Any] | None = None  # results.placement.pool_summary of the trial rows
    budget: Budget | None = None  # the spec's size budget, if it states one
    over_budget: dict[str, dict[str, Any]] = field(default_factory=dict)  # never scored
    n_boot: int = 10_000  # the paired bootstrap's replicates and seed (further comparisons)
    seed: int = 0
    rows: dict[str, int] = field(default_factory=dict)  # trials.parquet rows by role
    window_counts: dict[str, int] = field(default_factory=dict)  # :func:`window_counts`
    allocator: dict[str, Any] = field(default_factory=dict)  # allocator.json (its sampler's)
    sampler: str = "grid"  # the spec's sampler type (grid, tpe, random, allocator)


# Which status a config shows when its rows differ, and which row names it first.
_STATUS_RANK = [TrialStatus.COMPLETED, TrialStatus.PRUNED, TrialStatus.RUNNING,
                TrialStatus.RETRYING, TrialStatus.ERROR, TrialStatus.PENDING]  # fmt: skip
_ROLE_RANK = [Role.BASELINE, Role.TRIAL, Role.REFERENCE, Role.EXTERNAL]


def _configs(rows: list[dict[str, Any]], trials: list[dict[str, Any]]) -> dict[str, ConfigResult]:
    """``{student: ConfigResult}``: the trials.parquet rows grouped by student (the baseline's
    row, else a trial's, names the group), with the windows of every row of the group."""
    by_student: dict[str, list[dict[str, Any]]] = {}
    for trial in sorted(trials, key=lambda t: _ROLE_RANK.index(row_role(t))):
        by_student.setdefault(student_of(trial), []).append(trial)
    configs: dict[str, ConfigResult] = {}
    of_hash: dict[str, ConfigResult] = {}
    for student, group in by_student.items():
        first, role = group[0], row_role(group[0])
        config = ConfigResult(
            first["config_hash"], knobs_of(first), role == Role.BASELINE, first["status"], [],
            {}, role=role, label=first.get("label"),
            routed_bpw=first.get("routed_bpw"),  # None in rows from before the column
            file_bytes=first.get("file_bytes"),
        )  # fmt: skip
        for trial in group:
            config.trial_ids.append(trial["trial_id"])
            if _rank(trial["status"]) < _rank(config.status):
                config.status = trial["status"]
            if trial["config_hash"] not in config.config_hashes:
                alias = Alias(row_role(trial), trial.get("label"), knobs_of(trial),
                              trial["config_hash"])  # fmt: skip
                config.also.append(alias)
            of_hash[trial["config_hash"]] = config
        configs[student] = config
    for row in rows:
        config = of_hash.get(row["config_hash"])
        if config is not None:
            config.windows.setdefault(row["window_id"], WindowRecord.from_dict(row))
    return configs


def _rank(status: str) -> int:
    return _STATUS_RANK.index(TrialStatus(status))


def summarize(
    sweep_dir: str | Path, n_boot: int = 10_000, seed: int = 0, rule: Any = None
) -> SweepSummary:
    """Pool, compare and rank every config of a sweep against its baseline."""

    sweep_dir = Path(sweep_dir)
    manifest = read_manifest(sweep_dir)
    rows = read_windows(sweep_dir).to_pylist()
    trials = read_trials(sweep_dir).to_pylist()
    configs = _configs(rows, trials)
    baseline = next((c for c in configs.values() if c.is_baseline and c.windows), None)
    if baseline is None:
        raise ResultsError(
            f"{sweep_dir}: the baseline has no scored windows yet; let the sweep run (or resume "
            "it) until the baseline trial has finished"
        )
    rule = rule or DecisionRule()
    references = sorted(
        (c for c in configs.values() if c.reference is not None and c.windows),
        key=lambda c: (
            REFERENCES.index(c.reference) if c.reference in REFERENCES else 9,
            str(c.reference),
        ),
    )

    def compare(base: ConfigResult, config: ConfigResult) -> Any:
        return paired(base, config, n_boot=n_boot, seed=seed)

    for config in configs.values():
        if not config.windows:
            continue
        windows = [config.windows[w] for w in sorted(config.windows)]
        config.pooled = pooled([w.metrics for w in windows], [w.stratum for w in windows])
        config.comparison = compare(baseline, config)
        if config.comparison is not None and config.role in (Role.TRIAL, Role.EXTERNAL):
            config.verdict = decision(config.comparison, rule)
        for reference in references:
            if (found := compare(reference, config)) is not None:
                config.vs_references[str(reference.reference)] = found
    ranked = sorted(
        (c for c in configs.values() if c is not baseline and c.windows),
        key=lambda c: (c.status != TrialStatus.COMPLETED, c.pooled["kld_mean"]),
    )
    windows_total = max((int(r["windows_total"]) for r in rows if r["windows_total"]), default=0)
    spec = read_stored_spec(sweep_dir)
    return SweepSummary(
        name=manifest.get("sweep", sweep_dir.name),
        manifest=manifest,
        baseline=baseline,
        configs=[baseline, *ranked],
        references=references,
        strata=sorted({w.stratum for w in baseline.windows.values()}),
        windows_total=windows_total,
        effects=main_effects(
            [baseline, *(c for c in ranked if not c.is_fixed)], windows_total, rule.ci_level
        ),
        pruning=pruning_summary([t for t in trials if row_role(t).tuned], windows_total),
        rule=rule,
        pool=pool_summary(trials),
        budget=Budget.from_mapping(spec.get("budget")),
        over_budget=read_over_budget(sweep_dir),
        n_boot=n_boot,
        seed=seed,
        rows=dict(Counter(str(row_role(t)) for t in trials)),
        window_counts=window_counts(rows),
        allocator=read_allocator(sweep_dir),
        sampler=_sampler_type(spec.get("sampler")),
    )


def _sampler_type(sampler: Any) -> str:
    """A stored spec's sampler (``tpe`` or ``{type: tpe, seed: 0}``) as its type name."""
    if isinstance(sampler, dict):
        return str(sampler.get("type", "grid"))
    return "grid" if sampler is None else str(sampler)


def paired(base: ConfigResult, config: ConfigResult, *, n_boot: int, seed: int) -> Any:
    """``config`` against ``base`` on the windows both scored (a paired bootstrap
    ``Comparison``), or None when it is ``base`` or they share no window."""

    shared = [w for w in sorted(config.windows) if w in base.windows]
    if config is base or not shared:
        return None
    return paired_compare(
        [base.windows[w].metrics for w in shared],
        [config.windows[w].metrics for w in shared],
        [base.windows[w].stratum for w in shared],
        n_boot=n_boot,
        seed=seed,
    )


def main_effects(
    configs: list[ConfigResult], windows_total: int, level: float = 0.95
) -> list[dict[str, Any]]:
    """Per knob that varies among fully scored configs: per value, the mean pooled KLD and the
    mean relative change vs the baseline over the configs with that value (the ablation view),
    with a ``level`` bootstrap CI of that mean (``ci``: (lo, hi)).

    The CI resamples windows: every fully scored config was compared with the baseline on the
    same windows in the same order with the same bootstrap seed, so replicate ``b`` of each
    config's comparison resampled the same windows, and the mean over a value's configs of
    their replicates is a replicate of the mean. A config without replicates (the baseline
    itself: 0 in every replicate) counts as no change.

    Knobs with more than ``MAX_LEVELS`` distinct values (continuous knobs of a tpe/random
    sweep) are left out: one config per value says nothing about a main effect.
    """
    full = [c for c in configs if c.windows and len(c.windows) == windows_total]
    if not full:
        return []
    base_kld = configs[0].pooled["kld_mean"]
    effects = []
    for knob in full[0].knob_values:
        values = sorted({c.knob_values[knob] for c in full}, key=str)
        if not 2 <= len(values) <= MAX_LEVELS:
            continue
        for value in values:
            group = [c for c in full if c.knob_values[knob] == value]
            klds = [c.pooled["kld_mean"] for c in group]
            effects.append(
                {
                    "knob": knob,
                    "value": value,
                    "configs": len(group),
                    "kld_mean": sum(klds) / len(klds),
                    "rel_change": sum(k / base_kld - 1 for k in klds) / len(klds),
                    "ci": percentile_ci(_mean_replicates(group), level),
                }
            )
    return effects


def _mean_replicates(group: list[ConfigResult]) -> Any:
    """The bootstrap replicates of the mean relative change of ``group`` (see main_effects)."""
    reps = [c.comparison.boot_rel_change for c in group if c.comparison is not None]
    if not reps:
        return np.zeros(1)
    zeros = len(group) - len(reps)  # the baseline: no change in any replicate
    return (np.sum(reps, axis=0)) / (len(reps) + zeros)


def window_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many windows a sweep scored, the one count that progress, ``sweep status`` and the
    report show: ``scored`` = distinct (student, window) pairs (a window a student scored once
    is recorded again, not re-scored, under every other row that names the same student);
    ``recorded`` = rows of the windows dataset; ``replayed`` = the difference."""
    students: dict[str, str] = {}  # config hash -> its student (knobs parsed once a config)
    pairs = set()
    for row in rows:
        chash = row["config_hash"]
        if chash not in students:
            students[chash] = student_of(row)
        pairs.add((students[chash], row["window_id"]))
    return {"scored": len(pairs), "recorded": len(rows), "replayed": len(rows) - len(pairs)}


def pruning_summary(trials: list[dict[str, Any]], windows_total: int) -> dict[str, Any]:
    """Trials pruned, windows they scored, and windows saved against scoring every trial fully."""
    pruned = [t for t in trials if t["status"] == TrialStatus.PRUNED]
    scored = sum(int(t["windows_scored"] or 0) for t in trials)
    saved = sum(windows_total - int(t["windows_scored"] or 0) for t in pruned)
    full = windows_total * len(trials)
    return {
        "trials": len(trials),
        "pruned": len(pruned),
        "windows_scored": scored,
        "windows_saved": saved,
        "saved_fraction": saved / full if full else 0.0,
    }
