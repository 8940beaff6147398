"""The size side of a sweep report: configs per budget tier, what healing adds on top of each
allocation, and the configs the budget kept from being scored.

- **Per tier** (a spec's ``budget`` limits, ascending): every scored config whose size fits the
  limit (trials, references and the external llama.cpp files alike), ranked by pooled KLD; the
  best completed trial of the tier against each external file of the tier's size (inside it, not
  inside the tier below; paired Δ and CI: negative = ours better) and against its own allocation
  without healing.
- **Healing pairs**: configs that differ only in the healing knobs (``alpha``, ``gamma``,
  ``alpha_granularity``, ``ridge``, ``rho``, ``eta``) share their allocation and quantizers; each
  healed one is compared with the unhealed one (``alpha: none, ridge: false``) of its group.
- **Over budget**: the configs a grid expanded or a sampler proposed that were never scored
  (``over_budget.json``), counted, with their sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from healsweep.heal.knobs import Knobs
from healsweep.heal.reads import student_key
from healsweep.results.aggregate import ConfigResult, SweepSummary, paired
from healsweep.results.schema import Role, TrialStatus, is_candidate

MAX_LISTED = 20  # over-budget configs listed one by one (the count is always given)
# the routed experts' tensor groups, then the whole file's others (one group each, every layer)
GROUP_NAMES = {"gu": "gate/up", "d": "down", "attn": "attention", "shexp": "shared expert",
               "embd": "token embeddings", "output": "output", "dense": "dense layers"}  # fmt: skip


@dataclass
class Tier:
    """One budget limit: the configs inside it and its best trial's comparisons."""

    limit: float
    label: str
    configs: list[ConfigResult]  # scored configs that fit, by pooled KLD
    best: ConfigResult | None  # the best completed trial (baseline included) that fits
    vs_externals: list[tuple[ConfigResult, Any]]  # (external, best vs it)
    unhealed: ConfigResult | None  # best's allocation without healing, if scored
    vs_unhealed: Any


@dataclass
class HealingPair:
    """A healed config and the unhealed config of the same allocation."""

    unhealed: ConfigResult
    healed: ConfigResult
    comparison: Any  # healed vs unhealed


def measured(config: ConfigResult, measure: str) -> float | None:
    """A config's size in ``measure`` (``routed_bpw`` or ``file_bytes``) as its row recorded
    it; None from rows without the column."""
    value = config.routed_bpw if measure == "routed_bpw" else config.file_bytes
    return None if value is None else float(value)


def _scored(summary: SweepSummary) -> list[ConfigResult]:
    return [c for c in summary.configs if c.windows]


def unhealed_twin(config: ConfigResult, configs: list[ConfigResult]) -> ConfigResult | None:
    """The scored config with ``config``'s knobs but healing off (Part A and B)."""
    if config.knobs is None:
        return None
    want = student_key(config.knobs.replace(**Knobs.UNHEALED))
    return next((c for c in configs if c.knobs is not None and student_key(c.knobs) == want
                 and c is not config), None)  # fmt: skip


def _best(configs: list[ConfigResult]) -> ConfigResult | None:
    """The best of ``configs`` by the sweep's one rule (:func:`~healsweep.results.schema.
    best_trial`: the completed trial, baseline included, of lowest pooled KLD; first on a tie)."""
    done = [c for c in configs if is_candidate(c.role, c.status, c.pooled.get("kld_mean"))]
    return min(done, key=lambda c: c.pooled["kld_mean"], default=None)


def tiers(summary: SweepSummary) -> list[Tier]:
    """Every budget tier of the sweep ([] without a budget)."""
    budget = summary.budget
    if budget is None:
        return []
    scored = _scored(summary)
    out = []
    for limit in budget.limits:
        inside = [
            c
            for c in scored
            if (value := measured(c, budget.measure)) is not None and budget.within(value, limit)
        ]
        inside.sort(key=lambda c: (c.status != TrialStatus.COMPLETED, c.pooled["kld_mean"]))
        best = _best(inside)
        # the files of this tier's size: inside it, and not inside the tier below
        below = budget.limits[budget.limits.index(limit) - 1] if limit != budget.limits[0] else None
        externals = [
            c for c in inside if c.role == Role.EXTERNAL
            and (below is None or not budget.within(measured(c, budget.measure), below))
        ]  # fmt: skip
        vs = [(e, paired(e, best, n_boot=summary.n_boot, seed=summary.seed)) for e in externals]
        twin = unhealed_twin(best, scored) if best is not None else None
        healing = paired(twin, best, n_boot=summary.n_boot, seed=summary.seed) if twin else None
        out.append(Tier(limit, budget.label(limit), inside, best,
                        [(e, c) for e, c in vs if c is not None], twin, healing))  # fmt: skip
    return out


def healing_pairs(summary: SweepSummary) -> list[HealingPair]:
    """Each healed config against the unhealed config of its allocation (see the module)."""
    scored = [c for c in _scored(summary) if c.knobs is not None]
    pairs = []
    for config in scored:
        values = config.knob_values
        if all(values[k] == v for k, v in Knobs.UNHEALED.items()):
            continue
        twin = unhealed_twin(config, scored)
        if twin is not None:
            comparison = paired(twin, config, n_boot=summary.n_boot, seed=summary.seed)
            if comparison is not None:
                pairs.append(HealingPair(twin, config, comparison))
    return sorted(pairs, key=lambda p: (p.unhealed.routed_bpw or 0.0, p.comparison.rel_change))


def allocation(config: ConfigResult) -> str:
    """The routed experts' types of a config's knobs: ``iq2_xxs/iq2_xs`` (gate/up, down), with
    its edge-layer steps and per-layer overrides when it has them."""
    return _types(config.knob_values) if config.knob_values else "-"


def _types(values: dict[str, Any]) -> str:
    parts = [f"{values['type_gu']}/{values['type_d']}"]
    parts += [f"{k}={values[k]}" for k in ("up_first", "up_last") if values.get(k)]
    parts += [f"layers {compact_layers(values['layer_types'])}"] if values.get("layer_types") else []
    return ", ".join(parts)


def compact_layers(layer_types: str) -> str:
    """A ``layer_types`` value with each run of consecutive layers (counted from the first; a
    negative index, counted from the last, stays alone) of one type pair written once: ``0:iq1_s/iq1_s,1:iq1_s/iq1_s,2:iq1_m/iq2_xs`` -> ``0-1:iq1_s/iq1_s,2:iq1_m/iq2_xs``."""
    runs: list[list] = []  # [first layer, last layer, types]
    for entry in filter(None, layer_types.split(",")):
        layer, types = entry.split(":", 1)
        if runs and runs[-1][2] == types and int(layer) == runs[-1][1] + 1 > 0:
            runs[-1][1] = int(layer)
        else:
            runs.append([int(layer), int(layer), types])
    return ",".join(f"{a}{'' if a == b else f'-{b}'}:{t}" for a, b, t in runs)


def pareto_front(configs: list[ConfigResult]) -> list[ConfigResult]:
    """The configs no other beats on both routed bpw and pooled KLD (completed, sized), by bpw."""
    sized = [c for c in configs
             if c.routed_bpw is not None and c.status == TrialStatus.COMPLETED and c.pooled]  # fmt: skip
    front = []
    for config in sorted(sized, key=lambda c: (c.routed_bpw, c.pooled["kld_mean"])):
        if not front or config.pooled["kld_mean"] < front[-1].pooled["kld_mean"]:
            front.append(config)
    return front


def file_mib(config: ConfigResult) -> float | None:
    """The config's file size in MiB (None when not recorded)."""
    return None if config.file_bytes is None else config.file_bytes / 2**20


def over_budget_lines(summary: SweepSummary) -> list[str]:
    """The count of configs over budget (not scored) and the first of them with their sizes
    (each named by its types and the other knobs where it differs from the baseline)."""
    if summary.budget is None:
        return []
    over = sorted(summary.over_budget.items(), key=lambda kv: kv[1].get("routed_bpw") or 0.0)
    limits = ", ".join(summary.budget.label(limit) for limit in summary.budget.limits)
    lines = [f"{len(over)} configs over budget, not scored (budget: {limits})."]
    if over:
        lines.append("")
    base = summary.baseline.knob_values
    for chash, entry in over[:MAX_LISTED]:
        knobs = Knobs(**entry.get("knobs", {})).model_dump()
        types = _types(knobs)
        rest = ", ".join(f"{k}={v}" for k, v in knobs.items()
                         if k not in Knobs.TYPES and v != base.get(k))  # fmt: skip
        lines.append(f"- `{chash[:12]}` {entry['routed_bpw']:.4g} bpw, "
                     f"{entry['file_bytes'] / 2**20:.2f} MiB: {types}"
                     f"{'; ' + rest if rest else ''}")  # fmt: skip
    if len(over) > MAX_LISTED:
        lines.append(f"- ... and {len(over) - MAX_LISTED} more (over_budget.json)")
    return lines


def is_uniform(config: ConfigResult) -> bool:
    """Whether a config stores every routed expert in one type (one type for gate/up and down,
    no edge-layer steps, no per-layer types)."""
    values = config.knob_values
    return bool(values) and values["type_gu"] == values["type_d"] and not (
        values.get("layer_types") or values.get("up_first") or values.get("up_last")
    )


@dataclass
class AllocationRow:
    """A non-uniform allocation beside the best uniform recipe of at most its size."""

    config: ConfigResult
    uniform: ConfigResult | None  # the best completed uniform trial no larger than it
    comparison: Any  # the allocation against that uniform recipe (negative: allocation better)
    predicted: float | None  # the allocator's predicted KLD change, when it proposed it


def allocation_rows(summary: SweepSummary) -> list[AllocationRow]:
    """Every completed non-uniform trial (the allocator's proposals, mixed type pairs, per-layer
    types) beside the best completed uniform trial whose size, in the budget's measure (routed
    bpw without a budget), is no larger; by size, then pooled KLD."""
    measure = summary.budget.measure if summary.budget is not None else "routed_bpw"
    trials = [c for c in _scored(summary)
              if c.role.tuned and c.status == TrialStatus.COMPLETED and c.knobs is not None
              and measured(c, measure) is not None]  # fmt: skip
    uniform = sorted((c for c in trials if is_uniform(c)), key=lambda c: c.pooled["kld_mean"])
    predicted = {
        student_key(Knobs(**p["knobs"])): p["predicted_delta_kld"]
        for p in summary.allocator.get("proposals", [])
    }
    rows = []
    for config in sorted((c for c in trials if not is_uniform(c)),
                         key=lambda c: (measured(c, measure), c.pooled["kld_mean"])):  # fmt: skip
        size = measured(config, measure)
        best = next((u for u in uniform if measured(u, measure) <= size * (1 + 1e-9)), None)
        comparison = (
            paired(best, config, n_boot=summary.n_boot, seed=summary.seed) if best else None
        )
        rows.append(AllocationRow(config, best, comparison,
                                  predicted.get(student_key(config.knobs))))  # fmt: skip
    return rows


def sensitivity_lines(record: dict[str, Any]) -> list[str]:
    """A Markdown table of a sensitivity record (``allocator.json``'s ``sensitivity``, or
    ``healsweep sensitivity --json``'s): each move's change of routed bpw, pooled KLD, change
    against the base with its paired 95% CI, and KLD change per routed bit per weight."""
    base = record["base"]
    knobs = base["knobs"]
    types = f"{knobs.get('type_gu', 'q2_0')}/{knobs.get('type_d', 'q2_0')}"
    lines = [
        f"Base: {types}" + (f" ({knobs['layer_types']})" if knobs.get("layer_types") else "")
        + f", pooled KLD {base['kld']:.5f} on {record['windows']} dev windows"
        + (f"; ladder {', '.join(record['ladder'])}" if record.get("ladder") else "") + ".",
        "",
        "| layer | group | move | Δ routed bpw | pooled KLD | Δ KLD [95% CI] | Δ KLD per Δ bpw |",
        "|---:|---|---|---:|---:|---|---:|",
    ]  # fmt: skip
    for row in record["moves"]:
        lo, hi = row["rel_change_ci"]
        bpw = row["delta_routed_bpw"]
        per = f"{row['delta_kld'] / bpw:+.5f}" if bpw else "-"
        lines.append(
            f"| {'all' if row['layer'] is None else row['layer']} | {GROUP_NAMES[row['group']]} | "
            f"{row['from']}→{row['to']} | "
            f"{bpw:+.4f} | {row['kld']:.5f} | {100 * row['rel_change']:+.2f}% "
            f"[{100 * lo:+.2f}, {100 * hi:+.2f}] | {per} |"
        )
    return lines
