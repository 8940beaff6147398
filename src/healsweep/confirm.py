"""``confirm``: score frozen configs of a finished sweep on the sealed test split, once per milestone.

The order of events is the discipline (audit section 3.2):

1. read the sweep's manifest and spec; refuse while the sweep's driver still runs, when the
   model or the split changed since the sweep (the split lock id is rebuilt from the corpus and
   compared with the manifest's), and when the ledger (``RESULTS_ROOT/ledger.jsonl``) does not
   verify;
2. freeze the chosen configs (the baseline, plus the given trials or else the sweep's best
   trial, :func:`~healsweep.results.schema.best_trial`, refused when that is the baseline):
   sha256 of the canonical JSON of the full
   knob set, the model fingerprint and the calibration settings with the calibration corpus's
   content;
3. append the ``confirm-open`` entry *before* any test window exists (a second confirm of the same
   split lock id and milestone is refused there, atomically, under the ledger's file lock);
4. build the test windows with the grant in this process (all of them, or the first
   ``max_windows`` by window id, as a sweep selects dev windows: ``first_windows``), compute
   every window's teacher record, then score every frozen config (baseline included) on every
   window (JAX's compiled code dropped around each student's build: :func:`release_compiled`),
   write ``RESULTS/<sweep>/test/<milestone>/windows.parquet``;
5. write ``confirm.json`` (pooled figures per config, paired comparisons vs the baseline with
   CIs, decision-rule verdicts), then record the sha256 of the windows file as the milestone's
   ``confirm-result`` (``confirm.json`` then also names that entry).

A crash after step 3 leaves the milestone open without a result. Rerunning the same command with
``resume=True`` (``--resume``) appends a ``confirm-resume`` entry, which re-issues the grant only
for exactly the config hashes frozen at the opening, and scores them again from the start.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import pyarrow as pa

from healsweep._atomic import atomic_write_text
from healsweep._inputs import MIB, read_text
from healsweep._malloc import trim
from healsweep.cache import StageCache, canonical_json, forget_recent
from healsweep.data.corpus import load_corpus
from healsweep.data.split import split_lock_id
from healsweep.errors import LedgerError, ResultsError, SplitError
from healsweep.heal.pipeline import build_student
from healsweep.ledger import LEDGER_NAME, Ledger, head_record
from healsweep.ledger_heads import checked_ledger
from healsweep.model import open_model
from healsweep.results.schema import (
    Role,
    best_trial,
    knob_columns,
    knobs_of,
    row_role,
    window_schema,
)
from healsweep.results.store import read_manifest, read_trials, write_windows
from healsweep.score.expert_cache import ExpertCacheConfig
from healsweep.score.record import WindowMetrics, WindowRecord
from healsweep.score.runner import score_windows
from healsweep.score.stats import DecisionRule, decision, paired_compare, pooled
from healsweep.score.teacher_cache import teacher_outputs
from healsweep.score.windows import scoring_windows
from healsweep.sweep.manifest import append_ledger_head, ledger_head, read_spec, recorded_ledger
from healsweep.sweep.status import driver_running
from healsweep.sweep.work import spec_split, window_options

if TYPE_CHECKING:
    from healsweep.cache import StageCache
    from healsweep.data.corpus import Corpus
    from healsweep.data.split import SplitConfig
    from healsweep.data.windows import Window
    from healsweep.gguf_io import GGUFModel
    from healsweep.heal.knobs import CalibrationConfig, Knobs
    from healsweep.ledger import Grant, Ledger
    from healsweep.sweep.spec import SweepSpec

TEST_DIR = "test"
WINDOWS_FILE = "windows.parquet"
SUMMARY_FILE = "confirm.json"
_FREEZE_TAG = "healsweep-frozen-config-v1"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class FrozenConfig:
    """One config chosen for the test split: its sweep identity and its frozen hash."""

    trial_id: str
    config_hash: str  # the sweep's short knob hash (joins test rows with dev rows)
    knobs: Knobs
    is_baseline: bool
    frozen_hash: str  # what the ledger records


def frozen_hash(knobs: Knobs, model_fingerprint: str, calibration: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the full knobs, model fingerprint and calibration."""
    body = {
        "tag": _FREEZE_TAG,
        "knobs": knobs.identity(),
        "model_fingerprint": model_fingerprint,
        "calibration": calibration,
    }
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def calibration_identity(calibration: CalibrationConfig) -> dict[str, Any]:
    """The calibration settings that change a student, with the calibration corpus's content."""

    corpus = load_corpus(calibration.corpus)
    rows = sorted((d.doc_id, d.content_hash) for d in corpus.documents)
    digest = hashlib.sha256(canonical_json(rows).encode("utf-8")).hexdigest()
    return {**calibration.key_inputs(), "corpus_content": digest}


def sweep_model(
    sweep_dir: Path, spec: SweepSpec, manifest: dict[str, Any], remedy: str
) -> GGUFModel:
    """The sweep's model, opened; ResultsError (ending in ``remedy``) when its fingerprint is
    not the one the manifest recorded."""

    teacher = open_model(spec.model)
    if manifest.get("model_fingerprint") not in (None, teacher.fingerprint):
        raise ResultsError(
            f"{sweep_dir}: the model {spec.model} changed after the sweep (fingerprint "
            f"{teacher.fingerprint[:12]}... vs the manifest's {manifest['model_fingerprint'][:12]}"
            f"...); {remedy}"
        )
    return teacher


def trial_by_id(trials: list[dict[str, Any]], trial_id: str, where: Path) -> dict[str, Any]:
    """The row of ``trial_id`` in a sweep's trials, or a one-line ResultsError naming a few."""
    for row in trials:
        if row["trial_id"] == trial_id:
            return row
    known = sorted(t["trial_id"] for t in trials)
    raise ResultsError(
        f"{where}: no trial {trial_id!r} in trials.parquet; pick one of {known[:8]}"
        f"{' ...' if len(known) > 8 else ''} (see `healsweep sweep status`)"
    )


def best_row(trials: list[dict[str, Any]], where: Path, purpose: str) -> dict[str, Any]:
    """The sweep's best trial (:func:`~healsweep.results.schema.best_trial`: the completed
    trial with the lowest dev pooled KLD, the baseline included); ResultsError when none has
    completed (``purpose`` ends its message, e.g. "to confirm")."""

    best = best_trial(trials)
    if best is None:
        raise ResultsError(
            f"{where}: no completed trial {purpose}; let the sweep finish or name one with --trial"
        )
    return dict(best)


def choose_configs(
    trials: list[dict[str, Any]], trial_ids: Sequence[str] | None, where: Path
) -> list[tuple[dict[str, Any], bool]]:
    """``(trial row, is_baseline)`` to confirm: the baseline first, then the given trials, or the
    sweep's best trial (refused when that is the baseline: nothing beat it on dev); one row per
    config. Reference and external rows are refused: they are scored on dev beside the trials,
    not confirmed."""

    baseline = next((t for t in trials if row_role(t) == Role.BASELINE), None)
    if baseline is None:
        raise ResultsError(f"{where}: the sweep has no baseline trial; nothing to compare on test")
    if trial_ids:
        chosen = [trial_by_id(trials, t, where) for t in trial_ids]
        for row in chosen:
            if not row_role(row).tuned:
                raise ResultsError(
                    f"{where}: {row['trial_id']} is the {row_role(row)} row {row['label']!r}, "
                    "not a trial; confirm opens the test split for the baseline and tuned "
                    "trials only (reference and external rows are dev figures)"
                )
    else:
        chosen = [best_row(trials, where, "to confirm")]
        if chosen[0]["config_hash"] == baseline["config_hash"]:
            raise ResultsError(
                f"{where}: the best completed dev trial is the baseline itself (pooled KLD "
                f"{chosen[0]['kld_mean']:.5f}); no tuned config beats it on dev, so there is "
                "nothing to confirm against it: name a trial with --trial to test one anyway"
            )
    picked: dict[str, tuple[dict[str, Any], bool]] = {baseline["config_hash"]: (baseline, True)}
    for row in chosen:
        picked.setdefault(row["config_hash"], (row, False))
    return list(picked.values())


def milestone_dir(sweep_dir: str | Path, milestone: str) -> Path:
    """``RESULTS/<sweep>/test/<milestone>``."""
    return Path(sweep_dir) / TEST_DIR / milestone


def result_schema() -> pa.Schema:
    """The windows schema of the sweep plus the milestone, frozen hash and split lock id."""

    extra = [pa.field(n, pa.string()) for n in ("milestone", "frozen_hash", "split_lock_id")]
    return pa.schema([*window_schema(), *extra])


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class _Context:
    """What confirm reads from the sweep folder and rebuilds from its inputs."""

    sweep_dir: Path
    manifest: dict[str, Any]
    spec: SweepSpec
    teacher: GGUFModel
    corpus: Corpus
    split_cfg: SplitConfig
    lock_id: str


def load_context(sweep_dir: str | Path) -> _Context:
    """Manifest, spec, teacher, corpus and split of a finished sweep; refuses a sweep whose
    driver still runs, and a model or split that changed since the sweep."""

    sweep_dir = Path(sweep_dir)
    manifest = read_manifest(sweep_dir)
    running = driver_running(sweep_dir)
    if running:
        raise ResultsError(
            f"{sweep_dir}: the sweep is still running ({running}); its best dev trial is not "
            "final yet: confirm once `healsweep sweep status` shows no driver"
        )
    spec = read_spec(sweep_dir)
    teacher = sweep_model(
        sweep_dir, spec, manifest, "restore the model the sweep tuned on, or run a new sweep"
    )
    corpus, split_cfg = spec_split(spec)
    lock_id = split_lock_id(split_cfg, corpus.documents)
    if manifest.get("split_lock_id") != lock_id:
        raise SplitError(
            f"{sweep_dir}: the split changed after the sweep (split lock {lock_id[:12]}... now, "
            f"{str(manifest.get('split_lock_id'))[:12]}... in the manifest); the configs were "
            "tuned on another dev set: restore that split and corpus, or run a new sweep"
        )
    return _Context(sweep_dir, manifest, spec, teacher, corpus, split_cfg, lock_id)


def freeze_configs(ctx: _Context, trial_ids: Sequence[str] | None) -> list[FrozenConfig]:
    """The configs to confirm (baseline first), each with its frozen hash."""

    trials = read_trials(ctx.sweep_dir).to_pylist()
    calibration = calibration_identity(ctx.spec.calibration)
    frozen = []
    for row, is_base in choose_configs(trials, trial_ids, ctx.sweep_dir):
        knobs = knobs_of(row)
        assert knobs is not None  # a trial, not an external GGUF
        fingerprint = frozen_hash(knobs, ctx.teacher.fingerprint, calibration)
        frozen.append(
            FrozenConfig(row["trial_id"], row["config_hash"], knobs, is_base, fingerprint)
        )
    return frozen


def open_grant(
    ledger: Ledger, ctx: _Context, milestone: str, configs: list[FrozenConfig], *,
    resume: bool, allow_split_change: bool,
) -> Grant:  # fmt: skip
    """Append ``confirm-open`` (or ``confirm-resume``) and return the grant."""
    hashes = [c.frozen_hash for c in configs]
    if resume:
        return ledger.resume_milestone(ctx.lock_id, milestone, hashes)
    stalled = [
        m for m in ledger.milestones_for(ctx.lock_id) if m.milestone == milestone and not m.closed
    ]
    if stalled:
        raise LedgerError(
            f"milestone {milestone!r} was opened at {stalled[0].time} by {stalled[0].user} and has "
            f"no result in {ledger.path}: another confirm is running, or one stopped before it "
            "finished; if none is running, rerun with --resume (same configs, recorded as a resume)"
        )
    trial_ids = [c.trial_id for c in configs]
    return ledger.open_milestone(
        ctx.lock_id, milestone, hashes, trial_ids, allow_split_change=allow_split_change
    )


def sealed_windows(ctx: _Context, grant: Grant, max_windows: int | None) -> list[Window]:
    """The test windows (needs the grant), sorted by id, the first ``max_windows`` when capped:
    selected as a sweep selects its dev windows (:func:`~healsweep.data.windows.first_windows`)."""
    options = window_options(ctx.spec.scoring, ctx.teacher)
    found = scoring_windows(ctx.corpus, ctx.teacher, ctx.split_cfg, "test", options, max_windows,
                            grant)  # fmt: skip
    return found.windows


def score_config(
    ctx: _Context, config: FrozenConfig, windows: list[Window], cache: StageCache, say: Progress
) -> list[dict[str, Any]]:
    """Build one frozen config's student through the caches and score it on every window."""

    knobs = config.knobs
    release_compiled()  # the scoring shapes of the config before: none serves the build
    student = build_student(ctx.teacher, knobs, ctx.spec.calibration, cache)
    release_compiled()  # the build's stages: scoring never runs them
    forget_recent()  # nor reads the trace and upstream entries the build kept mapped
    columns = {
        "sweep": ctx.spec.name,
        "trial_id": config.trial_id,
        "config_hash": config.config_hash,
        "is_baseline": config.is_baseline,
        **knob_columns(config.knobs),
        "pruned": False,
        "frozen_hash": config.frozen_hash,
    }
    scored = score_windows(
        ctx.teacher,
        student,
        windows,
        cache,
        batch=ctx.spec.scoring.batch,
        teacher_cache=ctx.spec.scoring.teacher_cache,
        expert_cache=ExpertCacheConfig.from_knobs(knobs),  # as the sweep scored it on dev
        # one batch at a time unless the spec says otherwise: the test split's windows in one
        # layer-major group would carry all their hidden states at once (issue 47: confirm
        # stays under 1 GB); the metrics are the same either way
        group=ctx.spec.scoring.group or ctx.spec.scoring.batch,
    )
    rows: list[dict[str, Any]] = []
    for i, (window, metrics) in enumerate(scored):
        say(f"  window {i + 1}/{len(windows)} {window.window_id}: KLD {metrics.kld_mean:.5f}")
        record = WindowRecord.of(window, metrics, i, len(windows), i)
        rows.append({**record.to_dict(), **columns})
    return rows


def teach_windows(ctx: _Context, windows: list[Window], cache: StageCache, say: Progress) -> None:
    """The teacher's records of every test window, into the stage cache, before any config is
    scored (each config then reads them). A record is a function of its window alone, so this
    changes none of them; what it changes is what is compiled at once: the teacher's forward
    takes a shape per window length, the students' a shape per batch, and computed beside the
    first config's scoring both sets stayed compiled together (issue 47)."""
    fmt, batch = ctx.spec.scoring.teacher_cache, ctx.spec.scoring.batch
    say(f"teacher records of {len(windows)} test windows")
    for start in range(0, len(windows), batch):
        teacher_outputs(ctx.teacher, windows[start : start + batch], cache, fmt)


def release_compiled() -> None:
    """Drop JAX's compiled executables and give their memory back to the OS. Each holds about
    1.4-3.6 MiB, JAX keeps every one for the life of the process, and a student's build and
    its scoring compile different functions: without this a confirm held the build's, then the
    scoring's, then the next config's build's (a 2-config demo confirm peaked at 2.0 GB, issue
    47). What runs again is compiled again, to the same code: the results are the same bits."""
    jax.clear_caches()
    gc.collect()  # executables referenced from cycles go now, not at the next collection
    trim()


def summarize_test(
    rows: list[dict[str, Any]], configs: list[FrozenConfig], n_boot: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Pooled figures per config and, for every non-baseline config, the paired comparison with
    the baseline on the same test windows and the decision rule's verdict."""

    rule = DecisionRule()
    by_config: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_config.setdefault(row["config_hash"], {})[row["window_id"]] = row
    base = by_config[configs[0].config_hash]
    ids = sorted(base)
    strata = [base[w]["stratum"] for w in ids]
    out = []
    for config in configs:
        mine = by_config[config.config_hash]
        entry: dict[str, Any] = {
            "trial_id": config.trial_id,
            "config_hash": config.config_hash,
            "frozen_hash": config.frozen_hash,
            "is_baseline": config.is_baseline,
            "knobs": config.knobs.model_dump(),
            "pooled": pooled([WindowMetrics.from_dict(mine[w]) for w in ids], strata),
            "comparison": None,
            "verdict": None,
        }
        if not config.is_baseline:
            comp = paired_compare(
                [WindowMetrics.from_dict(base[w]) for w in ids],
                [WindowMetrics.from_dict(mine[w]) for w in ids],
                strata,
                n_boot=n_boot,
                seed=seed,
            )
            verdict = decision(comp, rule)
            entry["comparison"] = comp.to_dict(rule.ci_level)
            entry["verdict"] = {
                "accepted": verdict.accepted,
                "checks": verdict.checks,
                "reasons": list(verdict.reasons),
            }
        out.append(entry)
    return out


def parse_pairs(pairs: Sequence[str], trial_ids: Sequence[str] | None) -> list[tuple[str, str]]:
    """``TRIAL:OTHER`` strings → ``(trial, other)``, both among the trials named with
    ``--trial`` (so both are frozen and scored on test before the comparison); ResultsError
    otherwise, before the ledger is touched."""
    named = set(trial_ids or ())
    out = []
    for text in pairs:
        trial, sep, other = text.partition(":")
        if not sep or not trial or not other or trial == other:
            raise ResultsError(f"--pair {text!r}: expected TRIAL:OTHER, two different trial ids")
        missing = [t for t in (trial, other) if t not in named]
        if missing:
            raise ResultsError(
                f"--pair {text!r}: {', '.join(missing)} not confirmed here; name every trial of "
                "a pair with --trial too (both are frozen and scored on test)"
            )
        out.append((trial, other))
    return out


def compare_pairs(
    rows: list[dict[str, Any]], configs: list[FrozenConfig], pairs: Sequence[tuple[str, str]],
    n_boot: int, seed: int = 0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Each ``(trial, other)``: the paired comparison of ``trial`` against ``other`` on the same
    test windows and the decision rule's verdict (as every trial against the baseline), e.g. a
    healed config against the unhealed config that writes llama.cpp's own file."""

    rule = DecisionRule()
    hashes = {c.trial_id: c.config_hash for c in configs}
    by_config: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_config.setdefault(row["config_hash"], {})[row["window_id"]] = row
    out = []
    for trial, other in pairs:
        mine, theirs = by_config[hashes[trial]], by_config[hashes[other]]
        ids = sorted(theirs)
        comp = paired_compare(
            [WindowMetrics.from_dict(theirs[w]) for w in ids],
            [WindowMetrics.from_dict(mine[w]) for w in ids],
            [theirs[w]["stratum"] for w in ids],
            n_boot=n_boot,
            seed=seed,
        )
        verdict = decision(comp, rule)
        out.append({
            "trial_id": trial,
            "against": other,
            "comparison": comp.to_dict(rule.ci_level),
            "verdict": {"accepted": verdict.accepted, "checks": verdict.checks,
                        "reasons": list(verdict.reasons)},
        })  # fmt: skip
    return out


def _json_safe(value: Any) -> Any:
    """NaN/inf become null so that confirm.json is strict JSON."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _dumps(summary: dict[str, Any]) -> str:
    return json.dumps(_json_safe(summary), indent=2, sort_keys=True, allow_nan=False)


def confirm(
    sweep_dir: str | Path,
    milestone: str,
    *,
    trial_ids: Sequence[str] | None = None,
    results_root: str | Path | None = None,
    max_windows: int | None = None,
    resume: bool = False,
    allow_split_change: bool = False,
    n_boot: int = 10_000,
    progress: Progress | None = None,
    pairs: Sequence[str] = (),
    cache_max_gb: float | str | None = None,
) -> dict[str, Any]:
    """Open milestone ``milestone`` of a sweep's split and score its frozen configs on test.
    ``pairs`` (``TRIAL:OTHER``, both among ``trial_ids``) add comparisons between two confirmed
    trials beside each trial's against the baseline. ``cache_max_gb``: the stage cache's size
    limit (default: the sweep spec's ``cache_max_gb``, else ``HEALSWEEP_CACHE_MAX_GB``).

    Returns the ``confirm.json`` summary (also written under ``RESULTS/<sweep>/test/<milestone>``).
    The ledger is ``results_root/ledger.jsonl`` (default: the one the sweep recorded,
    :func:`sweep_ledger`). Refusals (before anything is written): a changed model or split, a
    ledger that does not verify or does not extend a head recorded for it (missing, shorter,
    rewritten: :mod:`healsweep.ledger_heads`), a milestone already opened on this split
    (``--resume`` continues one without a result), and a split other than the ledger's latest
    unless ``allow_split_change``. The sweep's manifest records the ledger's head after the
    opening and after the result, ``confirm.json`` the head after the result.
    """

    say = progress or (lambda message: None)
    if max_windows is not None and max_windows < 1:
        raise ResultsError(f"max_windows must be >= 1, got {max_windows}")
    sweep_dir = Path(sweep_dir)
    pairs_of = parse_pairs(pairs, trial_ids)
    ledger = sweep_ledger(sweep_dir, results_root)
    ctx, cache, configs = _checked_context(ledger, sweep_dir, trial_ids, cache_max_gb)
    grant = open_grant(
        ledger, ctx, milestone, configs, resume=resume, allow_split_change=allow_split_change
    )
    append_ledger_head(sweep_dir, ledger_head(ledger, sweep_dir, f"confirm {milestone} opened"))
    verb = "resumed" if resume else "opened"
    say(f"{verb} milestone {milestone!r} in {ledger.path} (split lock {ctx.lock_id[:12]}...)")
    windows = sealed_windows(ctx, grant, max_windows)
    rows = _score_configs(ctx, configs, windows, cache, say, milestone)
    out = milestone_dir(sweep_dir, milestone)
    out.mkdir(parents=True, exist_ok=True)
    write_windows(rows, out / WINDOWS_FILE, result_schema())
    summary = {
        "sweep": ctx.spec.name,
        "milestone": milestone,
        "split_lock_id": ctx.lock_id,
        "model_fingerprint": ctx.teacher.fingerprint,
        "ledger": str(ledger.path.resolve()),
        "open_hash": grant.entry_hash,
        "resumed": resume,
        "windows": len(windows),
        "max_windows": max_windows,
        "window_selection": "first by window id",  # before this key: round-robin over strata
        "result_file": WINDOWS_FILE,
        "result_hash": file_sha256(out / WINDOWS_FILE),
        "configs": summarize_test(rows, configs, n_boot),
    }
    if pairs_of:  # only then, so a summary without pairs keeps its former keys
        summary["pairs"] = compare_pairs(rows, configs, pairs_of, n_boot)
    _record_result(ledger, grant, sweep_dir, out, summary, say)
    return summary


def _checked_context(
    ledger: Ledger,
    sweep_dir: Path,
    trial_ids: Sequence[str] | None,
    cache_max_gb: float | str | None,
) -> tuple[_Context, StageCache, list[FrozenConfig]]:
    """The sweep's context, its stage cache and its frozen configs, once the ledger extends
    every head recorded for it; all before the ledger is touched (a bad size limit or trial id
    is refused with nothing opened)."""
    # the ledger must extend every head the sweep recorded (whichever ledger it names) and every
    # head recorded for it under its results root: not removed, replaced or cut back
    checked_ledger(ledger, sweeps=[sweep_dir], roots=[ledger.path.parent, sweep_dir.parent])
    ctx = load_context(sweep_dir)
    limit = cache_max_gb if cache_max_gb is not None else ctx.spec.cache_max_gb
    cache = StageCache(max_gb=limit)
    return ctx, cache, freeze_configs(ctx, trial_ids)


def _score_configs(
    ctx: _Context,
    configs: list[FrozenConfig],
    windows: list[Window],
    cache: StageCache,
    say: Progress,
    milestone: str,
) -> list[dict[str, Any]]:
    """Every frozen config healed and scored on the test windows: the result rows."""
    rows: list[dict[str, Any]] = []
    with cache.holding():  # the teacher records, computed first, stay until the last config
        teach_windows(ctx, windows, cache, say)
        for n, config in enumerate(configs, start=1):
            label = "baseline" if config.is_baseline else f"trial {config.trial_id}"
            say(f"config {n}/{len(configs)} ({label}, {config.frozen_hash[:12]}...): healing")
            rows += score_config(ctx, config, windows, cache, say)
    for row in rows:
        row.update(milestone=milestone, split_lock_id=ctx.lock_id)
    return rows


def _record_result(
    ledger: Ledger, grant: Grant, sweep_dir: Path, out: Path, summary: dict[str, Any], say: Progress
) -> None:
    """Write the summary, record the result in the ledger, then write the summary again with
    the entry. The summary is on disk before the result is recorded, so a crash in between
    leaves it readable (the report marks it "not in ledger") rather than a recorded result with
    no summary."""
    milestone = summary["milestone"]
    atomic_write_text(out / SUMMARY_FILE, _dumps(summary))
    entry = ledger.record_result(grant, summary["result_hash"])
    append_ledger_head(sweep_dir, ledger_head(ledger, sweep_dir, f"confirm {milestone} result"))
    summary.update(result_entry_hash=entry["hash"], confirmed_at=entry["time"],
                   ledger_head=head_record(ledger, out))  # fmt: skip
    atomic_write_text(out / SUMMARY_FILE, _dumps(summary))
    say(f"recorded result {summary['result_hash'][:12]}... in {ledger.path}; wrote "
        f"{out / SUMMARY_FILE}")  # fmt: skip


def sweep_ledger(sweep_dir: str | Path, results_root: str | Path | None = None) -> Ledger:
    """The ledger a sweep's confirms record in: ``RESULTS_ROOT/ledger.jsonl`` when a results
    root is given, else the one the sweep recorded (its spec's ``ledger``, else
    ``RESULTS/ledger.jsonl`` beside the sweep folder)."""

    if results_root is not None:
        return Ledger.in_results(Path(results_root))
    return recorded_ledger(Path(sweep_dir), read_manifest(sweep_dir))


def read_confirmed(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every milestone confirmed for a sweep (``test/*/confirm.json``), oldest first.

    Each summary gains ``integrity``: ``"recorded"`` when its windows file still hashes to the
    result hash and the sweep's ledger holds that result for the milestone's opening,
    ``"file changed"`` or ``"not in ledger"`` otherwise (the report shows it).
    """

    found = []
    for path in sorted(Path(sweep_dir).glob(f"{TEST_DIR}/*/{SUMMARY_FILE}")):
        try:
            summary = json.loads(read_text(path, "confirm summary", 64 * MIB, error=ResultsError))
        except (OSError, json.JSONDecodeError, RecursionError) as exc:
            raise ResultsError(
                f"{path} is unreadable ({exc}); restore it or rerun confirm"
            ) from None
        results = path.parent / summary.get("result_file", WINDOWS_FILE)
        if not results.exists() or file_sha256(results) != summary.get("result_hash"):
            summary["integrity"] = "file changed"
        else:
            entries = _ledger_entries([summary.get("ledger", ""), path.parents[3] / LEDGER_NAME])
            recorded = any(
                e["kind"] == "confirm-result"
                and e["open_hash"] == summary.get("open_hash")
                and e["result_hash"] == summary["result_hash"]
                for e in entries
            )
            summary["integrity"] = "recorded" if recorded else "not in ledger"
        found.append(summary)
    return sorted(found, key=lambda s: (s.get("confirmed_at", ""), s["milestone"]))


def _ledger_entries(candidates: list[Any]) -> list[dict[str, Any]]:
    """The entries of the first ledger file that exists ([] when none does or it is tampered)."""

    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            try:
                return Ledger(candidate).entries()
            except LedgerError:
                return []
    return []
