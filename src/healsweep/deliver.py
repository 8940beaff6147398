"""``export``: from a sweep's trial to a deployable GGUF.

A sweep stores, per trial, every knob (``trials.parquet``) and, per sweep, the model and the
calibration settings (``spec.json``, ``manifest.json``). That is all a student needs: the trial's
student is rebuilt through the stage cache (``build_student``; whatever the cache lacks is
recomputed) and written as in ``healsweep heal`` (experts as healed by default).

A trial confirmed on the test split is found by its frozen hash (knobs, model fingerprint,
calibration with its corpus content: exactly what ``confirm`` froze) among the sweep's
``test/*/confirm.json`` whose result the ledger holds; the file then records the milestone and the
ledger's ``confirm-result`` entry hash. Otherwise the export says, in one line, that the trial
was never confirmed. Every export records the head of the sweep's ledger it saw
(``healsweep.ledger_head``); a ledger that does not extend the heads the sweep recorded
(:mod:`healsweep.ledger_heads`) counts no confirmation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from healsweep.cache import StageCache, canonical_json
from healsweep.confirm import (
    calibration_identity,
    frozen_hash,
    read_confirmed,
    sweep_ledger,
    sweep_model,
    trial_by_id,
)
from healsweep.errors import HealsweepError, ResultsError
from healsweep.heal.export import write_healed_gguf
from healsweep.heal.knobs import Knobs
from healsweep.heal.pipeline import build_student
from healsweep.ledger_heads import checked_ledger
from healsweep.results.aggregate import summarize
from healsweep.results.findings import best_accepted, best_by_kld, tune_trial_id, verdict_word
from healsweep.results.report import describe
from healsweep.results.schema import Role, TrialStatus, knobs_of, row_role
from healsweep.results.store import read_manifest, read_trials
from healsweep.sweep.manifest import read_spec

Progress = Callable[[str, str], None]


@dataclass(frozen=True)
class Confirmation:
    """Where a trial's config was scored on test: the milestone and its ledger entries."""

    milestone: str
    result_entry_hash: str
    open_entry_hash: str
    accepted: bool | None  # the decision rule's verdict vs the baseline (None for the baseline)


@dataclass
class ExportResult:
    """What ``export_trial`` wrote and what it knows about the trial."""

    path: Path
    trial: dict[str, Any]
    knobs: Knobs
    frozen_hash: str
    confirmation: Confirmation | None
    notes: list[str] = field(default_factory=list)
    chosen: str | None = None  # why this trial, when export chose it (--best)


def pick_trial(trials: list[dict[str, Any]], trial_id: str, where: Path) -> dict[str, Any]:
    """The row of ``trial_id`` (an external GGUF is refused: it has no student to rebuild)."""

    row = trial_by_id(trials, trial_id, where)
    if row_role(row) == Role.EXTERNAL:
        raise ResultsError(
            f"{where}: {trial_id} is the external GGUF {row['external_path']}, scored as it "
            "is; there is no student to rebuild (copy that file instead)"
        )
    return row


def choose_best(
    sweep_dir: Path, trials: list[dict[str, Any]], allow_rejected: bool = False
) -> tuple[dict[str, Any], str]:
    """``export --best``: the trial row of the best completed trial the decision rule accepts
    against the baseline (:func:`healsweep.results.findings.best_accepted`), and one line on
    why it. When no trial passes, ResultsError naming the best trial by dev KLD and its
    verdict, unless ``allow_rejected``: then that trial (the baseline when nothing beat it),
    with a line that says it was not accepted."""

    summary = summarize(sweep_dir)
    level = summary.rule.ci_level

    def delta(config: Any) -> str:
        lo, hi = config.comparison.rel_change_ci(level)
        return f"{config.comparison.rel_change:+.2%} [{lo:+.2%}, {hi:+.2%}] vs the baseline"

    accepted = best_accepted(summary)
    if accepted is not None:
        tid = tune_trial_id(accepted)
        why = (f"trial {tid} ({describe(accepted, summary.baseline)}): the best trial the "
               f"decision rule accepts against the baseline, {delta(accepted)}")  # fmt: skip
        return trial_by_id(trials, tid, sweep_dir), why
    top = best_by_kld(summary)
    if top is None or top.pooled["kld_mean"] >= summary.baseline.pooled["kld_mean"]:
        base = tune_trial_id(summary.baseline)
        what = (
            "no trial completed besides the baseline"
            if top is None
            else f"no completed trial beat the baseline on dev (the best, trial "
            f"{tune_trial_id(top)}, is {delta(top)})"
        )
        if not allow_rejected:
            raise ResultsError(
                f"{sweep_dir}: {what}; nothing passes the decision rule. Export the baseline "
                f"with --best --allow-rejected (or --trial {base}), or any trial with --trial ID"
            )
        return trial_by_id(trials, base, sweep_dir), f"{what}: exporting the baseline, trial {base}"
    tid = tune_trial_id(top)
    verdict = f"trial {tid} ({describe(top, summary.baseline)}) is {delta(top)}, " + verdict_word(
        top.verdict
    )
    if not allow_rejected:
        raise ResultsError(
            f"{sweep_dir}: no trial passes the decision rule against the baseline: the best by "
            f"dev KLD, {verdict}; export it anyway with --best --allow-rejected (or --trial "
            f"{tid}), or run more trials"
        )
    return trial_by_id(trials, tid, sweep_dir), f"{verdict} (exported with --allow-rejected)"


def find_confirmation(sweep_dir: Path, frozen: str) -> tuple[Confirmation | None, str | None]:
    """The latest ledger-recorded milestone that scored config ``frozen`` on test, and a note
    when a milestone scored it but its record does not check out."""

    found, note = None, None
    for summary in read_confirmed(sweep_dir):
        config = next((c for c in summary.get("configs", []) if c["frozen_hash"] == frozen), None)
        if config is None:
            continue
        if summary["integrity"] != "recorded" or not summary.get("result_entry_hash"):
            note = (
                f"milestone {summary['milestone']!r} scored this config on test but its record "
                f"is {summary['integrity']!r}; not counted as a confirmation"
            )
            continue
        verdict = config.get("verdict")
        found = Confirmation(
            milestone=summary["milestone"],
            result_entry_hash=summary["result_entry_hash"],
            open_entry_hash=summary["open_hash"],
            accepted=None if verdict is None else bool(verdict["accepted"]),
        )
    return found, note


def _ledger_head(sweep_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The head of the sweep's ledger (``{"entries", "hash"}``) once the ledger checks out
    against every head recorded for it, or ``(None, why not)``."""

    ledger = sweep_ledger(sweep_dir)
    try:
        entries = checked_ledger(ledger, sweeps=[sweep_dir], roots=[ledger.path.parent])
    except HealsweepError as exc:
        return None, str(exc)
    return {"entries": len(entries), "hash": entries[-1]["hash"] if entries else "0" * 64}, None


def export_trial(
    sweep_dir: str | Path,
    out: str | Path,
    *,
    trial_id: str | None = None,
    experts: str = "healed",
    cache: StageCache | None = None,
    progress: Progress | None = None,
    allow_rejected: bool = False,
) -> ExportResult:
    """Rebuild a trial's student (``trial_id``, or the best trial the decision rule accepts:
    :func:`choose_best`, ``allow_rejected`` as there) and write it to ``out``.

    Refuses a sweep folder without results, an unknown trial, and a model file that changed
    since the sweep (its knobs were tuned on another model). ``cache`` is a ``StageCache``
    (default: the user's cache).
    """

    sweep_dir = Path(sweep_dir)
    manifest = read_manifest(sweep_dir)
    spec = read_spec(sweep_dir)
    trials = read_trials(sweep_dir).to_pylist()
    if not trials:
        raise ResultsError(f"{sweep_dir}: no trials recorded yet; run the sweep first")
    chosen = None
    if trial_id is not None:
        row = pick_trial(trials, trial_id, sweep_dir)
    else:
        row, chosen = choose_best(sweep_dir, trials, allow_rejected)
        if progress is not None:
            progress("best", chosen)
    teacher = sweep_model(sweep_dir, spec, manifest, "restore the model the sweep tuned on")
    knobs = knobs_of(row)
    assert knobs is not None  # pick_trial refuses an external row
    calibration = spec.calibration
    identity = calibration_identity(calibration)
    frozen = frozen_hash(knobs, teacher.fingerprint, identity)
    confirmation, note = find_confirmation(sweep_dir, frozen)
    notes = [] if note is None else [note]
    head, problem = _ledger_head(sweep_dir)
    if problem is not None:  # no confirmation counts from a ledger that was reset
        notes.append(f"the sweep's ledger does not check out, no confirmation counts: {problem}")
        confirmation = None
    if row["status"] != TrialStatus.COMPLETED:
        notes.append(f"trial {row['trial_id']} ended {row['status']!r} on dev")
    student = build_student(teacher, knobs, calibration, cache or StageCache(), progress=progress)
    metadata: dict[str, Any] = {
        "sweep": spec.name,
        "trial_id": row["trial_id"],
        "config_hash": row["config_hash"],
        "frozen_hash": frozen,
        "calibration": canonical_json({"corpus": str(calibration.corpus), **identity}),
    }
    if row["kld_mean"] is not None:
        metadata["dev_kld_mean"] = float(row["kld_mean"])
    if confirmation is not None:
        metadata.update(
            confirmed_milestone=confirmation.milestone,
            ledger_entry=confirmation.result_entry_hash,
            ledger_open_entry=confirmation.open_entry_hash,
        )
    if head is not None:
        metadata["ledger_head"] = canonical_json(head)
    path = write_healed_gguf(student, out, experts=experts, metadata=metadata)
    return ExportResult(path, row, knobs, frozen, confirmation, notes, chosen)
