"""``report/report.md`` of a sweep (the tables and plots of :func:`_sections`, the leaderboard
first) and ``report/report.html`` (the same Markdown rendered), with PNG plots beside them.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from healsweep._atomic import atomic_write_text
from healsweep.heal.knobs import Knobs
from healsweep.results.aggregate import ConfigResult, SweepSummary, summarize
from healsweep.results.budget import (
    allocation,
    allocation_rows,
    compact_layers,
    file_mib,
    healing_pairs,
    over_budget_lines,
    sensitivity_lines,
    tiers,
)
from healsweep.results.contenders import beside_sweep, contenders, role_word
from healsweep.results.findings import (
    best_accepted,
    best_by_kld,
    export_command,
    findings,
    tune_trial_id,
    types_of,
    verdict_word,
)
from healsweep.results.placement import pool_line
from healsweep.results.plots import FOREST_CAPTION, write_plots
from healsweep.results.schema import Role, TrialStatus

Table = tuple[list[str], list[list[str]]]


def describe(config: ConfigResult, baseline: ConfigResult) -> str:
    """``alpha=mse, ridge=False`` — the knobs where a config differs from the baseline; a
    reference or external row by its name; the names of every row of one student together
    (``alpha=none, ridge=False = unhealed``)."""
    names = [_name(config.role, config.label, config.knobs, baseline)]
    names += [_name(a.role, a.label, a.knobs, baseline) for a in config.also]
    return " = ".join(dict.fromkeys(names))


def _name(role: Role, label: str | None, knobs: Knobs | None, baseline: ConfigResult) -> str:
    if role == Role.BASELINE:
        return "baseline"
    if not role.tuned:
        return str(label)
    base = baseline.knob_values
    values = {} if knobs is None else knobs.model_dump()
    changed = [f"{k}={compact_layers(v) if k == 'layer_types' else _value(v)}"
               for k, v in values.items() if v != base.get(k)]  # fmt: skip
    return ", ".join(changed) or "= baseline"


def _roles(config: ConfigResult) -> str:
    """``trial``, or the roles of every row of its student (``trial, reference``)."""
    return ", ".join(dict.fromkeys([config.role, *(a.role for a in config.also)]))


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _fmt(value: float | None, spec: str = "+.2%") -> str:
    """``value`` in ``spec`` (a signed percentage unless told); "-" when missing or not finite."""
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _verdict(config: ConfigResult) -> str:
    if config.verdict is None:
        return config.role if config.role in (Role.BASELINE, Role.REFERENCE) else "-"
    if config.status != TrialStatus.COMPLETED:
        return f"{config.status} (not judged)"
    return "ACCEPT" if config.verdict.accepted else "reject"


def _ci(rel: float | None, lo: float | None, hi: float | None) -> str:
    return f"{_fmt(rel)} [{_fmt(lo)}, {_fmt(hi)}]"


def _delta(comp: Any, level: float) -> str:
    return "-" if comp is None else _ci(comp.rel_change, *comp.rel_change_ci(level))


def _cache_cells(config: ConfigResult) -> list[str]:
    figures = config.cache or {}  # {}: scored without a cache, both cells "-"
    return [_fmt(figures.get("hit_rate"), ".2%"), _fmt(figures.get("mib_per_token"), ".3g")]


def leaderboard(summary: SweepSummary) -> Table:
    """Rank, config, trial ids (every row that names its student), role, status, windows, routed
    bpw, file MiB, pooled KLD (with an expert cache: hit rate, MiB/token), Δ KLD [CI] vs the baseline and vs each reference row, top-1, top-1 Δ,
    wins/losses, verdict."""
    level = summary.rule.ci_level
    refs = [str(r.reference) for r in summary.references]
    cached = any(c.cache for c in summary.configs)  # scored through a simulated expert cache
    header = ["#", "config", "trial", "role", "status", "windows", "bpw", "file MiB", "pooled KLD",
              *(["hit rate", "MiB/token"] if cached else []),
              f"Δ KLD vs baseline [{level:.0%} CI]",
              *(f"Δ KLD vs {name} [{level:.0%} CI]" for name in refs),
              "top-1", "Δ top-1 (pt)", "wins/losses", "verdict"]  # fmt: skip
    rows = []
    for rank, config in enumerate(summary.configs):
        comp = config.comparison
        rows.append(
            [
                str(rank),
                describe(config, summary.baseline),
                ", ".join(config.trial_ids),
                _roles(config),
                config.status,
                f"{len(config.windows)}/{summary.windows_total}",
                _fmt(config.routed_bpw, ".5g"),
                _fmt(file_mib(config), ".2f"),
                f"{config.pooled['kld_mean']:.5f}",
                *(_cache_cells(config) if cached else []),
                _delta(comp, level),
                *(_delta(config.vs_references.get(name), level) for name in refs),
                f"{config.pooled['top1']:.2%}",
                "-" if comp is None else f"{comp.top1_delta_points:+.2f}",
                "-" if comp is None else f"{comp.wins}/{comp.losses}",
                _verdict(config),
            ]
        )
    return header, rows


def strata_table(summary: SweepSummary) -> Table:
    """Token-pooled KLD per stratum, with the paired relative change vs the baseline."""
    header = ["config", *summary.strata]
    base = summary.baseline.pooled.get("per_stratum", {})
    rows = []
    for config in summary.configs:
        per = config.pooled.get("per_stratum", {})
        paired = config.comparison.per_stratum if config.comparison is not None else {}
        cells = []
        for stratum in summary.strata:
            if stratum not in per:
                cells.append("-")
                continue
            kld = per[stratum]["kld_mean"]
            if stratum in paired:  # on the windows both scored (all of them unless pruned)
                rel = paired[stratum].rel_change
            else:
                rel = kld / base[stratum]["kld_mean"] - 1 if stratum in base else math.nan
            cells.append(f"{kld:.5f}" + ("" if config is summary.baseline else f" ({_fmt(rel)})"))
        rows.append([describe(config, summary.baseline), *cells])
    return header, rows


def effects_table(summary: SweepSummary) -> Table:
    """Main effect of each varied knob: mean pooled KLD and mean Δ vs baseline per value, with
    the bootstrap CI of that mean over windows."""
    level = summary.rule.ci_level
    header = ["knob", "value", "configs", "mean pooled KLD", f"mean Δ vs baseline [{level:.0%} CI]"]
    rows = [
        [
            e["knob"],
            _value(e["value"]),
            str(e["configs"]),
            f"{e['kld_mean']:.5f}",
            _ci(e["rel_change"], *e["ci"]),
        ]
        for e in summary.effects
    ]
    return header, rows


def pruning_table(summary: SweepSummary) -> Table:
    """Trials pruned and the windows pruning saved (against scoring every trial on every
    window; the windows scored are counted once, in the report's opening lines)."""
    p = summary.pruning
    header = ["trials", "pruned", "windows saved by pruning", "saved"]
    row = [str(p["trials"]), str(p["pruned"]), str(p["windows_saved"]),
           f"{p['saved_fraction']:.1%}"]  # fmt: skip
    return header, [row]


def confirmed_table(summary: SweepSummary, milestone: dict) -> Table:
    """The table of one milestone ``healsweep confirm`` opened (a ``confirm.json`` summary): each
    frozen config's dev figures next to its test figures (pooled KLD, relative change vs the
    baseline with its CI, top-1 change, verdict)."""
    level = summary.rule.ci_level
    header = ["config", "dev pooled KLD", f"dev Δ KLD [{level:.0%} CI]", "dev verdict",
              f"test pooled KLD ({milestone['windows']} windows)", f"test Δ KLD [{level:.0%} CI]",
              "test Δ top-1 (pt)", "test verdict", "ledger"]  # fmt: skip
    dev = {chash: c for c in summary.configs for chash in c.config_hashes}
    rows = []
    for entry in milestone["configs"]:
        config = dev.get(entry["config_hash"])
        comp, verdict = entry["comparison"], entry["verdict"]
        dev_cells = ["-"] * 3
        if config is not None:
            kld = f"{config.pooled['kld_mean']:.5f}"
            dev_cells = [kld, _delta(config.comparison, level), _verdict(config)]
        rows.append(
            [
                describe(config, summary.baseline) if config else entry["config_hash"][:12],
                *dev_cells,
                f"{entry['pooled']['kld_mean']:.5f}",
                "-" if comp is None else _ci(comp["rel_change"], *comp["rel_change_ci"]),
                "-" if comp is None else f"{comp['top1_delta_points']:+.2f}",
                "baseline" if verdict is None else ("ACCEPT" if verdict["accepted"] else "reject"),
                milestone.get("integrity", "-"),
            ]
        )
    return header, rows


def tier_table(summary: SweepSummary, tier: Any) -> Table:
    """The configs inside one budget tier, by pooled KLD."""
    level = summary.rule.ci_level
    header = ["#", "config", "role", "status", "bpw", "file MiB", "pooled KLD",
              f"Δ KLD vs baseline [{level:.0%} CI]"]  # fmt: skip
    rows = [
        [
            str(rank),
            describe(config, summary.baseline),
            _roles(config),
            config.status,
            _fmt(config.routed_bpw, ".5g"),
            _fmt(file_mib(config), ".2f"),
            f"{config.pooled['kld_mean']:.5f}",
            _delta(config.comparison, level),
        ]  # fmt: skip
        for rank, config in enumerate(tier.configs, 1)
    ]
    return header, rows


def best_per_tier_table(summary: SweepSummary, found: list[Any]) -> Table:
    """Per tier, the best completed trial against each llama.cpp (external) file inside the
    tier, and against its own allocation unhealed (paired Δ of the best: negative = better)."""
    level = summary.rule.ci_level
    header = ["budget", "best config", "bpw", "pooled KLD", "against", "its bpw", "its KLD",
              f"Δ KLD of best [{level:.0%} CI]"]  # fmt: skip
    rows = []
    for tier in found:
        best = tier.best
        if best is None:
            rows.append([tier.label, "(no completed trial)", *["-"] * 6])
            continue
        head = [tier.label, f"{describe(best, summary.baseline)} ({allocation(best)})", _fmt(best.routed_bpw, ".5g"),
                f"{best.pooled['kld_mean']:.5f}"]  # fmt: skip
        others = [
            *tier.vs_externals,
            *([(tier.unhealed, tier.vs_unhealed)] if tier.unhealed else []),
        ]
        for other, comp in others or [(None, None)]:
            name = (
                "-"
                if other is None
                else (str(other.label) if other.role == Role.EXTERNAL else "same, unhealed")
            )
            rows.append([*head, name,
                         "-" if other is None else _fmt(other.routed_bpw, ".5g"),
                         "-" if other is None else f"{other.pooled['kld_mean']:.5f}",
                         _delta(comp, level)])  # fmt: skip
    return header, rows


def healing_table(summary: SweepSummary) -> Table:
    """What healing adds on top of each allocation: each healed config against the same knobs
    with ``alpha: none, ridge: false`` on the windows both scored (pooled KLD of each there, and
    the paired Δ, negative = healing helps)."""
    level = summary.rule.ci_level
    header = ["types (gate-up/down)", "unhealed config", "healing", "bpw", "shared windows",
              "unhealed KLD", "healed KLD", f"Δ KLD [{level:.0%} CI]"]  # fmt: skip
    rows = []
    for pair in healing_pairs(summary):
        base, comp = pair.unhealed.knob_values, pair.comparison
        healing = [f"{k}={_value(v)}" for k, v in pair.healed.knob_values.items() if v != base[k]]
        rows.append([allocation(pair.unhealed), describe(pair.unhealed, summary.baseline),
                     ", ".join(healing), _fmt(pair.healed.routed_bpw, ".5g"),
                     str(comp.n_windows), f"{comp.base_kld:.5f}", f"{comp.variant_kld:.5f}",
                     _delta(comp, level)])  # fmt: skip
    return header, rows


def allocations_table(summary: SweepSummary) -> Table:
    """Each non-uniform allocation beside the best uniform recipe of at most its size (paired Δ
    of the allocation against it: negative = the allocation is better), with the allocator's
    predicted change against its base where it proposed the allocation."""
    level = summary.rule.ci_level
    header = ["allocation (gate-up/down)", "config", "bpw", "pooled KLD", "predicted Δ KLD",
              "best uniform no larger", "its bpw", "its KLD",
              f"Δ KLD vs uniform [{level:.0%} CI]"]  # fmt: skip
    rows = []
    for row in allocation_rows(summary):
        config, uniform = row.config, row.uniform
        rows.append([
            allocation(config), describe(config, summary.baseline), _fmt(config.routed_bpw, ".5g"),
            f"{config.pooled['kld_mean']:.5f}", _fmt(row.predicted, "+.5f"),
            "-" if uniform is None else f"{describe(uniform, summary.baseline)} "
            f"({allocation(uniform)})",
            "-" if uniform is None else _fmt(uniform.routed_bpw, ".5g"),
            "-" if uniform is None else f"{uniform.pooled['kld_mean']:.5f}",
            _delta(row.comparison, level),
        ])  # fmt: skip
    return header, rows


def contenders_table(summary: SweepSummary, beside: list[SweepSummary] = ()) -> Table:
    """Per budget tier, the allocator's best beside the best uniform config and the best config
    of a search (tpe/random; from this sweep or one put beside it), each labelled, with the
    allocator's paired Δ against the other two (negative: the allocator's choice is better)."""
    level = summary.rule.ci_level
    header = ["budget", "which", "config (gate-up/down)", "from", "bpw", "file MiB", "pooled KLD",
              f"the allocator's Δ KLD against it [{level:.0%} CI]"]  # fmt: skip
    rows = []
    for tier in contenders(summary, beside):
        for row in tier.rows:
            config = row.candidate.config
            same = row.comparison is None and row is not tier.rows[0]  # the allocator's own
            rows.append([tier.label, str(row.origin),
                         f"{describe(config, summary.baseline)} ({allocation(config)})",
                         role_word(row.candidate), _fmt(config.routed_bpw, ".5g"),
                         _fmt(file_mib(config), ".2f"), f"{config.pooled['kld_mean']:.5f}",
                         "the same config" if same else _delta(row.comparison, level)])  # fmt: skip
    return header, rows


def _budget_sections(
    summary: SweepSummary, beside: list[SweepSummary] = ()
) -> list[tuple[str, list[str]]]:
    """The size budget's sections (none without a budget), the healing pairs, and the
    allocations beside uniform recipes (with the allocator's sensitivity table)."""
    pairs = healing_table(summary)
    healing = [("What healing adds on top of each allocation", _md(pairs))] if pairs[1] else []
    mixed = allocations_table(summary)
    allocations = [("Allocations beside the best uniform recipe of their size", _md(mixed))]
    allocations = allocations if mixed[1] else []
    if summary.allocator.get("sensitivity"):
        lines = sensitivity_lines(summary.allocator["sensitivity"])
        allocations.append(("Sensitivity of each tensor group", lines))
    if summary.budget is None:
        return healing + allocations
    found = tiers(summary)
    three = contenders_table(summary, beside)
    side_by_side = "The allocator beside the best uniform and searched configs per budget"
    return [
        ("Best config per budget against llama.cpp", _md(best_per_tier_table(summary, found))),
        *([(side_by_side, _md(three))] if three[1] else []),
        *((f"Configs within {tier.label}", _md(tier_table(summary, tier))) for tier in found),
        *allocations,
        *healing,
        ("Over budget", over_budget_lines(summary)),
    ]


def _signed(value: float) -> str:
    return _fmt(value).replace("-", "−")


_REFERENCE_WORDS = {
    "unhealed": "the baseline without Part A and B",
    "plain": "round-to-nearest Q2_0",
}


def found_lines(summary: SweepSummary, sweep_dir: str) -> list[str]:
    """The report's opening: per budget tier (or for the whole sweep) the best config with its
    trial id, its Δ against the baseline, its own types unhealed, the other references and each
    llama.cpp file of its size, with CIs and the decision rule's word, and the command that
    exports it; then what ``export --best`` would take."""

    level = summary.rule.ci_level
    lines = []
    for found in findings(summary):
        best = found.best
        if best is None:
            lines.append(f"- **{found.scope}**: no completed trial fits it.")
            continue
        tid = tune_trial_id(best)
        who = "the baseline" if best is summary.baseline else describe(best, summary.baseline)
        size = "" if best.routed_bpw is None else f", {best.routed_bpw:.5g} routed bpw"
        lines.append(
            f"- **{found.scope}**: the best config is {who}, trial `{tid}` "
            f"({types_of(best)}{size}), pooled KLD {best.pooled['kld_mean']:.5f}:"
        )
        for v in found.versus:
            lo, hi = v.comparison.rel_change_ci(level)
            what = {"baseline": "the baseline",
                    "unhealed": "its own knobs without healing (Part A and B off)",
                    "llama.cpp": f"the external file {v.name}",
                    "reference": f"the reference row {v.name} ({_REFERENCE_WORDS.get(v.name, '')})",
                    }[v.kind]  # fmt: skip
            lines.append(
                f"  - against {what} ({v.comparison.base_kld:.5f}): "
                f"{_signed(v.comparison.rel_change)} [{_signed(lo)}, {_signed(hi)}], "
                f"{verdict_word(v.verdict)}"
            )
        if not found.versus:
            lines.append("  - nothing else was scored in this scope to compare it with")
        lines.append(f"  - export it: `{export_command(sweep_dir, tid, found.scope)}`")
    accepted, top = best_accepted(summary), best_by_kld(summary)
    if accepted is not None:
        lines += ["", f"`healsweep export {sweep_dir} --best --out MODEL.gguf` takes trial "
                  f"`{tune_trial_id(accepted)}` ({describe(accepted, summary.baseline)}), the "
                  "best trial the decision rule accepts against the baseline."]  # fmt: skip
    elif top is not None:
        comp = top.comparison
        lo, hi = comp.rel_change_ci(level) if comp is not None else (math.nan, math.nan)
        lines += ["", "No trial passes the decision rule against the baseline: the best by dev "
                  f"KLD, trial `{tune_trial_id(top)}` ({describe(top, summary.baseline)}), is "
                  f"{_signed(comp.rel_change if comp else math.nan)} [{_signed(lo)}, "
                  f"{_signed(hi)}] against it, {verdict_word(top.verdict)}; `export --best` "
                  "refuses it unless given `--allow-rejected`."]  # fmt: skip
    n = len(summary.baseline.windows)
    lines += [
        "",
        f"Δ is the relative change of the best config's token-pooled KLD against the other's on "
        f"the same dev windows ({n} here; negative = closer to the unquantized model), with its "
        f"{level:.0%} paired-bootstrap CI over windows; *accepted* means the decision rule "
        f"passes: the CI lies below 0, no stratum is more than "
        f"{summary.rule.max_stratum_regression:.0%} worse and top-1 drops by at most "
        f"{summary.rule.max_top1_drop_points:.1f} pt. These are dev figures: `healsweep confirm` "
        "scores chosen configs once on the sealed test split.",
    ]
    return lines


def _md(table: Table) -> list[str]:
    header, rows = table
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]


def _sections(
    summary: SweepSummary,
    plots: dict[str, str],
    confirmed: list[dict] | None = None,
    sweep_dir: str = "RESULTS/NAME",
    beside: list[SweepSummary] = (),
) -> list[tuple[str, list[str]]]:
    """Each section's title and Markdown lines, in order (``plots``: {caption: file name})."""

    m = summary.manifest
    reasons = []
    for config in summary.configs:
        if config.verdict is not None and config.status == TrialStatus.COMPLETED:
            reasons.append(f"- **{describe(config, summary.baseline)}**")
            reasons += [f"  - {line}" for line in config.verdict.reasons]
    identity = (
        ["spec hash", "split lock id", "model fingerprint", "package", "seeds (window order, sampler)"],
        [[m.get("spec_hash", "-")[:16], str(m.get("split_lock_id", "-"))[:16],
          str(m.get("model_fingerprint", "-"))[:16], str(m.get("package_version", "-")),
          f"{m.get('seeds', {}).get('window_order')}, {m.get('seeds', {}).get('sampler')}"]],
    )  # fmt: skip
    first = [f"![{c}]({path})" for c, path in plots.items() if c == FOREST_CAPTION]
    rest = [f"![{c}]({path})" for c, path in plots.items() if c != FOREST_CAPTION]
    return [
        ("What the sweep found", found_lines(summary, sweep_dir)),
        ("Leaderboard against the baseline and the references", _md(leaderboard(summary))),
        *([("Every config against the baseline", first)] if first else []),
        *_budget_sections(summary, beside),
        *(
            (f"Dev and test (milestone {ms['milestone']})", _md(confirmed_table(summary, ms)))
            for ms in confirmed or []
        ),
        ("Decision-rule reasons", reasons),
        ("Per-stratum pooled KLD", _md(strata_table(summary))),
        ("Main effects per knob", _md(effects_table(summary))),
        ("Pruning", _md(pruning_table(summary))),
        *([("Pool", [pool_line(summary.pool)])] if summary.pool else []),
        ("Plots", rest),
        ("Manifest", _md(identity)),
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def counts_line(summary: SweepSummary) -> str:
    """What was scored, in the counts progress and ``sweep status`` show: trials (the baseline
    included), reference rows, external files, and the windows scored once per student."""
    rows, windows = summary.rows, summary.window_counts
    trials = rows.get(Role.TRIAL, 0) + rows.get(Role.BASELINE, 0)
    fixed = [_count(rows[role], name) for role, name in
             ((Role.REFERENCE, "reference row"), (Role.EXTERNAL, "external file"))
             if rows.get(role)]  # fmt: skip
    replayed = windows.get("replayed", 0)
    again = (
        f" ({replayed} more rows name a student another row already scored: recorded, not "
        "scored again)"
        if replayed else ""
    )  # fmt: skip
    return (
        f"{_count(trials, 'trial')} (the baseline included)" + "".join(f", {f}" for f in fixed)
        + f" on {summary.windows_total} dev windows each; "
        f"{_count(windows.get('scored', 0), 'window')} scored{again}; "
        f"{_count(len(summary.configs), 'distinct config')} below."
    )


def _intro(summary: SweepSummary) -> str:
    base = summary.baseline
    return (
        f"{counts_line(summary)} Baseline pooled "
        f"KLD {base.pooled['kld_mean']:.5f}, top-1 {base.pooled['top1']:.2%}. Δ KLD is the "
        "relative change of token-pooled KLD vs the baseline (or a reference row) on the same "
        "windows (negative = better), with a paired bootstrap CI over windows. Reference rows "
        "(unhealed: the baseline's quantizer without Part A and Part B; plain: round-to-nearest "
        "Q2_0 with d = amax/2) and external GGUFs are scored on the same windows, never pruned "
        "and not tuned; bpw = stored bits per weight of the routed experts, file MiB = the "
        "model file with them in the config's types. Trial ids are those `sweep status`, "
        "`export --trial` and `confirm --trial` take. A config is "
        "accepted when the CI lies below 0, no stratum regresses by more than "
        f"{summary.rule.max_stratum_regression:.0%}, and top-1 drops by at most "
        f"{summary.rule.max_top1_drop_points:.1f} pt."
    )


def render_markdown(
    summary: SweepSummary,
    plots: dict[str, str],
    confirmed: list[dict] | None = None,
    sweep_dir: str = "RESULTS/NAME",
    beside: list[SweepSummary] = (),
) -> str:
    """The Markdown report (``sweep_dir``: the folder as the user names it, for the commands
    it prints; ``beside``: other sweeps of the same model and split whose configs the
    allocator's table compares)."""
    out = [f"# Sweep report: {summary.name}", "", _intro(summary), ""]
    for title, lines in _sections(summary, plots, confirmed, sweep_dir, beside):
        out += [f"## {title}", "", *lines, ""]
    return "\n".join(out)


_STYLE = (
    "body{font-family:sans-serif;max-width:1200px;margin:2em auto}table{border-collapse:"
    "collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    "td:nth-child(2),th:nth-child(2){text-align:left}img{max-width:100%}"
)


def render_html(name: str, markdown: str) -> str:
    """The HTML page of sweep ``name``: its Markdown report rendered (raw HTML in a cell is
    escaped, not passed)."""
    # lazy: heavy (markdown_it)
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)}</title>"
        f"<style>{_STYLE}</style></head><body>\n{body}</body></html>"
    )


def write_report(
    sweep_dir: str | Path,
    n_boot: int = 10_000,
    seed: int = 0,
    summary: SweepSummary | None = None,
    confirmed: list[dict[str, Any]] | None = None,
    beside: list[str | Path] = (),
) -> dict[str, Path]:
    """Write ``report/report.md``, ``report/report.html`` and the PNG plots; return their paths
    (``summary`` = an already computed :func:`summarize` of the same folder; ``confirmed`` = the
    milestones `healsweep confirm` opened, :func:`healsweep.confirm.read_confirmed`, shown dev
    beside test — passed in, since results sit below confirm in the layer order; ``beside`` =
    other sweeps' folders, of the same model and split, whose best uniform and searched configs
    the allocator's table compares with the allocator's choice)."""

    sweep_dir = Path(sweep_dir)
    summary = summary or summarize(sweep_dir, n_boot=n_boot, seed=seed)
    others = [beside_sweep(summary, summarize(d, n_boot=summary.n_boot, seed=summary.seed))
              for d in beside]  # fmt: skip
    out = sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(summary, out, label=lambda c: describe(c, summary.baseline))
    relative = {caption: path.name for caption, path in plots.items()}
    md, page = out / "report.md", out / "report.html"
    markdown = render_markdown(summary, relative, confirmed, str(sweep_dir), others)
    atomic_write_text(md, markdown)
    atomic_write_text(page, render_html(summary.name, markdown))
    return {"markdown": md, "html": page, **plots}
