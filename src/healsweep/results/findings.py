"""What a sweep found, in a few lines: the opening of its report, ``report --json``'s
``findings`` and the trial ``export --best`` takes.

- **Scopes.** Each budget tier of the spec (:func:`healsweep.results.budget.tiers`), or, without
  a budget, the whole sweep. A scope's *best* is its completed tuned config (the baseline
  included) with the lowest pooled dev KLD.
- **What the best is measured against**, each paired on the windows both scored (Δ = relative
  change of the best's pooled KLD, negative = better, with the paired-bootstrap CI) and judged by
  the decision rule: the baseline (unless it is the baseline), its own knobs without healing
  (``unhealed``: Part A's alpha and Part B's ridge off) where the sweep scored that, the other
  reference rows, and every llama.cpp (external) file of the scope's size.
- **The accepted best** (:func:`best_accepted`): the completed trial with the lowest pooled KLD
  among those the decision rule accepts against the baseline; what ``export --best`` exports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from healsweep.results.aggregate import ConfigResult, SweepSummary, paired
from healsweep.results.budget import allocation, tiers, unhealed_twin
from healsweep.results.schema import Role, TrialStatus
from healsweep.score.stats import decision


@dataclass
class Versus:
    """The best of a scope against one other config."""

    name: str  # baseline | unhealed | plain | an external's label
    kind: str  # baseline | reference | unhealed | llama.cpp
    other: ConfigResult
    comparison: Any  # best vs other (a paired Comparison)
    verdict: Any  # the decision rule on it


@dataclass
class Finding:
    """One scope's best config and what it was measured against."""

    scope: str  # "budget ≤ 2.0625 bpw" | "all configs"
    best: ConfigResult | None
    versus: list[Versus] = field(default_factory=list)


def findings(summary: SweepSummary) -> list[Finding]:
    """One :class:`Finding` per budget tier, or one for the whole sweep without a budget."""
    rule = summary.rule

    def versus(best: ConfigResult, other: ConfigResult, name: str, kind: str, comp: Any = None):
        comp = comp if comp is not None else paired(other, best, n_boot=summary.n_boot,
                                                    seed=summary.seed)  # fmt: skip
        return None if comp is None else Versus(name, kind, other, comp, decision(comp, rule))

    out = []
    if summary.budget is not None:
        for tier in tiers(summary):
            found = Finding(f"budget ≤ {tier.label}", tier.best)
            if tier.best is not None:
                found.versus = _against(summary, tier.best, versus, tier.unhealed,
                                        [e for e, _ in tier.vs_externals])  # fmt: skip
            out.append(found)
        return out
    done = [c for c in summary.configs
            if c.role.tuned and c.status == TrialStatus.COMPLETED and c.pooled]  # fmt: skip
    best = min(done, key=lambda c: c.pooled["kld_mean"], default=None)
    found = Finding("all configs", best)
    if best is not None:
        scored = [c for c in summary.configs if c.windows]
        externals = [c for c in scored if c.role == Role.EXTERNAL]
        found.versus = _against(summary, best, versus, unhealed_twin(best, scored), externals)
    return [found]


def _against(
    summary: SweepSummary,
    best: ConfigResult,
    versus: Any,
    twin: ConfigResult | None,
    externals: list[ConfigResult],
) -> list[Versus]:
    rows = []
    if best is not summary.baseline:
        rows.append(versus(best, summary.baseline, "baseline", "baseline", best.comparison))
    if twin is not None and twin is not best:
        rows.append(versus(best, twin, "unhealed", "unhealed"))
    for reference in summary.references:  # the other reference rows (plain), when scored
        if reference is not twin and reference is not best and reference is not summary.baseline:
            rows.append(versus(best, reference, str(reference.reference), "reference"))
    rows += [versus(best, e, str(e.label), "llama.cpp") for e in externals]
    return [r for r in rows if r is not None]


def best_accepted(summary: SweepSummary) -> ConfigResult | None:
    """The completed trial with the lowest pooled KLD that the decision rule accepts against the
    baseline (references, externals and the baseline itself are not candidates); None when no
    trial is accepted."""
    accepted = [c for c in summary.configs
                if c.role == Role.TRIAL and c.status == TrialStatus.COMPLETED
                and c.verdict is not None and c.verdict.accepted]  # fmt: skip
    return min(accepted, key=lambda c: c.pooled["kld_mean"], default=None)


def best_by_kld(summary: SweepSummary) -> ConfigResult | None:
    """The completed trial (not the baseline) with the lowest pooled KLD, accepted or not."""
    done = [c for c in summary.configs if c.role == Role.TRIAL and c.status == TrialStatus.COMPLETED]
    return min(done, key=lambda c: c.pooled["kld_mean"], default=None)


def tune_trial_id(config: ConfigResult) -> str:
    """The id to pass to ``export --trial`` / ``confirm --trial``: a Tune trial's, else the
    first row's."""
    return next((t for t in config.trial_ids if not t.startswith(("ref-", "ext-"))),
                config.trial_ids[0])  # fmt: skip


def verdict_word(verdict: Any) -> str:
    """``accepted`` or ``not accepted`` (and the first check that failed)."""
    if verdict.accepted:
        return "accepted"
    failed = next((r for r in verdict.reasons if r.endswith("fail")), "")
    return "not accepted" + (f" ({failed.removesuffix(': fail')})" if failed else "")


def types_of(config: ConfigResult) -> str:
    """The routed types of a config (``iq2_xs/iq2_xs``) or, for a file, its label."""
    return allocation(config) if config.knobs is not None else str(config.label)


def to_json(summary: SweepSummary, found: list[Finding], sweep_dir: str) -> list[dict[str, Any]]:
    """The findings as JSON-ready dicts (``report --json``)."""
    level = summary.rule.ci_level
    out = []
    for f in found:
        entry: dict[str, Any] = {"scope": f.scope, "best": None, "against": []}
        if f.best is not None:
            tid = tune_trial_id(f.best)
            entry["best"] = {
                "trial_id": tid,
                "is_baseline": f.best is summary.baseline,
                "types": types_of(f.best),
                "routed_bpw": f.best.routed_bpw,
                "pooled_kld": f.best.pooled["kld_mean"],
                "top1": f.best.pooled["top1"],
                "export": export_command(sweep_dir, tid, f.scope),
            }
            entry["against"] = [
                {
                    "name": v.name,
                    "kind": v.kind,
                    "trial_id": v.other.trial_ids[0],
                    "pooled_kld": v.comparison.base_kld,
                    "best_kld": v.comparison.variant_kld,
                    "windows": v.comparison.n_windows,
                    "rel_change": v.comparison.rel_change,
                    "rel_change_ci": list(v.comparison.rel_change_ci(level)),
                    "accepted": v.verdict.accepted,
                    "reasons": list(v.verdict.reasons),
                }
                for v in f.versus
            ]
        out.append(entry)
    return out


def export_command(sweep_dir: str, trial_id: str, scope: str) -> str:
    """The command that writes a trial as a GGUF."""
    name = Path(sweep_dir).name
    tag = "".join(ch for ch in scope if ch.isdigit() or ch == ".") or "best"
    return f"healsweep export {sweep_dir} --trial {trial_id} --out {name}-{tag}.gguf"
