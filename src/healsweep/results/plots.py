"""PNG plots of a sweep report (matplotlib, Agg backend: no display needed): ``forest.png``
(the report's first picture), ``paired_windows.png``, ``knob_effects.png`` and, for configs
scored through a simulated expert cache, ``kld_vs_mib.png``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

from healsweep.results.aggregate import ConfigResult, SweepSummary
from healsweep.results.budget import pareto_front
from healsweep.results.schema import Role, TrialStatus

MAX_PANELS = 16  # the 12-config methods grid and its two reference rows
FOREST_CAPTION = "every config: Δ KLD vs baseline with its paired-bootstrap CI (forest plot)"


def _pyplot():
    # lazy: heavy (matplotlib)
    import matplotlib

    matplotlib.use("Agg", force=True)
    # lazy: heavy (matplotlib)
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Write a finished figure to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def paired_scatter(summary: SweepSummary, path: Path, label: Callable[[ConfigResult], str]) -> Path:
    """Window KLD of each config vs the baseline's on the same windows, one panel per config
    (log-log; points below the diagonal are windows the config improves)."""
    others = [c for c in summary.configs[1:] if c.comparison is not None][:MAX_PANELS]
    cols = min(4, max(1, len(others)))
    rows = max(1, math.ceil(len(others) / cols))
    fig, axes = _pyplot().subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    base = summary.baseline.windows
    for ax, config in zip(axes.flat, others, strict=False):
        shared = [w for w in config.windows if w in base]
        x = [base[w].metrics.kld_mean for w in shared]
        y = [config.windows[w].metrics.kld_mean for w in shared]
        colour = "tab:red" if config.status == TrialStatus.PRUNED else "tab:blue"
        ax.scatter(x, y, s=10, alpha=0.7, color=colour)
        lo, hi = min(x + y), max(x + y)
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        if lo > 0:
            # lazy: heavy (matplotlib)
            from matplotlib.ticker import NullFormatter

            ax.set(xscale="log", yscale="log")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_minor_formatter(NullFormatter())
        ax.set_title(label(config)[:48], fontsize=8)
        ax.set_xlabel("baseline window KLD", fontsize=7)
        ax.set_ylabel("config window KLD", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(others) :]:
        ax.axis("off")
    return save(fig, path)


# role -> (marker, colour, legend); a trial is coloured by its verdict instead.
_ROLE_STYLE = {
    Role.REFERENCE: ("D", "tab:orange", "reference (unhealed, plain)"),
    Role.EXTERNAL: ("s", "tab:purple", "external GGUF"),
}
_ROLE_TAG = {Role.REFERENCE: "[ref] ", Role.EXTERNAL: "[ext] "}
_STRATUM_MARKERS = "^v<>pP*Xh"
_STRATUM_STYLE = {"color": "black", "markersize": 4, "fillstyle": "none", "alpha": 0.5}


def _trial_style(config: ConfigResult) -> tuple[str, str, str]:
    if config.role in _ROLE_STYLE:
        return _ROLE_STYLE[config.role]
    if config.status != TrialStatus.COMPLETED:
        return "o", "tab:gray", f"trial ({config.status}: not judged)"
    if config.verdict is not None and config.verdict.accepted:
        return "o", "tab:green", "trial, accepted"
    return "o", "tab:blue", "trial, rejected"


def forest(summary: SweepSummary, path: Path, label: Callable[[ConfigResult], str]) -> Path:
    """Every config's Δ pooled KLD vs the baseline (%) with its CI, best at the top; reference
    and external rows marked by shape and colour, each stratum's point estimate as a small
    marker (the per-stratum bars this replaces reused colours past ten configs and had no CIs)."""
    level = summary.rule.ci_level
    configs = sorted(
        (c for c in summary.configs if c.comparison is not None),
        key=lambda c: c.comparison.rel_change,
        reverse=True,  # the last row is drawn at the top
    )
    fig, ax = _pyplot().subplots(figsize=(8.5, 1.2 + 0.32 * max(1, len(configs))))
    for y, config in enumerate(configs):
        comp = config.comparison
        lo, hi = comp.rel_change_ci(level)
        x = 100 * comp.rel_change
        xerr = [[100 * (comp.rel_change - lo)], [100 * (hi - comp.rel_change)]]
        marker, colour, legend = _trial_style(config)  # the error bars take the marker's colour
        ax.errorbar(x, y, xerr=xerr, fmt=marker, color=colour, capsize=3, ms=6, label=legend)
        for stratum, shape in zip(summary.strata, itertools.cycle(_STRATUM_MARKERS)):
            if stratum in comp.per_stratum:
                rel = 100 * comp.per_stratum[stratum].rel_change
                ax.plot(rel, y, shape, **_STRATUM_STYLE, label=f"stratum {stratum}")
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(range(len(configs)))
    ax.set_yticklabels([_ROLE_TAG.get(c.role, "") + label(c)[:48] for c in configs], fontsize=7)
    ax.set_ylim(-0.7, len(configs) - 0.3)
    ax.set_xlabel(f"Δ pooled KLD vs baseline (%), {level:.0%} paired-bootstrap CI", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("every config against the baseline (negative = better)", fontsize=9)
    if configs:  # one legend entry per label
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=6, loc="best")
    else:
        ax.text(0.5, 0.5, "no config shares windows with the baseline yet", ha="center")
    return save(fig, path)


def knob_effects(summary: SweepSummary, path: Path) -> Path:
    """One panel per varied knob: mean relative change vs the baseline per value, with the
    bootstrap CI of that mean as error bars."""
    knobs = list(dict.fromkeys(e["knob"] for e in summary.effects))
    panels = max(1, len(knobs))
    fig, axes = _pyplot().subplots(1, panels, figsize=(3.2 * panels, 3.2), squeeze=False)
    for ax, knob in zip(axes.flat, knobs, strict=False):
        rows = [e for e in summary.effects if e["knob"] == knob]
        values = [str(e["value"]) for e in rows]
        means = [100 * e["rel_change"] for e in rows]
        below = [m - 100 * e["ci"][0] for m, e in zip(means, rows, strict=True)]
        above = [100 * e["ci"][1] - m for m, e in zip(means, rows, strict=True)]
        ax.bar(values, means, color="tab:green", yerr=[below, above], capsize=4,
               error_kw={"elinewidth": 1, "ecolor": "black"})  # fmt: skip
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_title(knob, fontsize=9)
        ax.set_ylabel(f"mean Δ KLD vs baseline (%), {summary.rule.ci_level:.0%} CI", fontsize=7)
        ax.tick_params(labelsize=7)
    if not knobs:
        axes.flat[0].text(0.5, 0.5, "no knob varied across fully scored configs", ha="center")
        axes.flat[0].axis("off")
    return save(fig, path)


def kld_vs_mib(summary: SweepSummary, path: Path, label: Callable[[ConfigResult], str]) -> Path:
    """Pooled KLD against MiB read per token, one point per config; configs that differ only
    in ``moce_bonus`` are joined in bonus order (the bonus's trade-off curve)."""
    points = [(c, f) for c in summary.configs if (f := c.cache) is not None]
    curves: dict[tuple, list[tuple[ConfigResult, dict]]] = {}
    for config, figures in points:
        knobs = config.knob_values
        rest = tuple(sorted((k, str(v)) for k, v in knobs.items() if k != "moce_bonus"))
        curves.setdefault(rest, []).append((config, figures))
    fig, ax = _pyplot().subplots(figsize=(6.4, 4.4))
    for curve in curves.values():
        curve.sort(key=lambda p: p[0].knob_values.get("moce_bonus") or 0.0)
        xs = [f["mib_per_token"] for _, f in curve]
        ys = [c.pooled["kld_mean"] for c, _ in curve]
        ax.plot(xs, ys, marker="o", lw=1, label=label(curve[0][0])[:48])  # the lowest bonus
        for (config, _), x, y in zip(curve, xs, ys, strict=True):
            ax.annotate(f"{config.knob_values.get('moce_bonus') or 0:g}", (x, y), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
    if all(f["mib_per_token"] > 0 for _, f in points):
        ax.set_xscale("log")
    ax.legend(fontsize=6, title="config (points: moce_bonus)", title_fontsize=6)
    ax.set_xlabel("MiB of experts read per token (misses x stored expert size)")
    ax.set_ylabel("pooled KLD")
    ax.set_title("quality vs expert I/O per config", fontsize=9)
    return save(fig, path)


KLD_VS_BPW_CAPTION = (
    "pooled KLD against routed bits per weight: each config with its paired-bootstrap CI, "
    "healsweep's Pareto front, llama.cpp's files (external) and the budget"
)
# The routed bpw the plot always spans (issues 39, 49): llama.cpp's IQ1_S (1.5625) to Q4_K
# (4.5), so sweeps of different types share one axis and the reference points line up.
BPW_RANGE = (1.5, 4.5)


def own_front(configs: list[ConfigResult]) -> list[ConfigResult]:
    """The Pareto front (routed bpw, pooled KLD) of healsweep's own configs: external files are
    reference points beside it, never on it."""
    return pareto_front([c for c in configs if c.role != Role.EXTERNAL])


def kld_vs_bpw(summary: SweepSummary, path: Path, label: Callable[[ConfigResult], str]) -> Path:
    """Pooled KLD (log) against the routed experts' stored bits per weight, one point per sized
    config (pruned or unfinished ones faint, without bars: their KLD is of a few windows). Bars:
    its paired-bootstrap CI against the baseline on the shared windows, as a range
    of its own KLD (baseline KLD x (1 + CI of the relative change)); the Pareto front (no config
    is both smaller and better) of healsweep's own configs joined, the external files
    (llama.cpp's uniform quants: reference points, never on the front) labelled; a routed-bpw
    budget's limits as vertical lines. The x axis spans at least :data:`BPW_RANGE`."""

    level = summary.rule.ci_level
    sized = [c for c in summary.configs if c.routed_bpw is not None and c.pooled]
    fig, ax = _pyplot().subplots(figsize=(8.4, 5.0))
    for config in sized:
        x, y = config.routed_bpw, config.pooled["kld_mean"]
        comp = config.comparison
        yerr = None
        if comp is not None:
            lo, hi = comp.rel_change_ci(level)
            yerr = [
                [max(0.0, y - comp.base_kld * (1 + lo))],
                [max(0.0, comp.base_kld * (1 + hi) - y)],
            ]
        marker, colour, legend = _trial_style(config)
        if config.is_baseline:
            marker, colour, legend = "*", "black", "baseline"
        if config.status != TrialStatus.COMPLETED:  # KLD of its first windows only: faint
            ax.plot(x, y, marker, color=colour, ms=4, alpha=0.35, label=legend)
            continue
        ax.errorbar(x, y, yerr=yerr, fmt=marker, color=colour, capsize=2, ms=6, label=legend)
    front = own_front(sized)
    if len(front) > 1:
        ax.step([c.routed_bpw for c in front], [c.pooled["kld_mean"] for c in front],
                where="post", color="tab:green", lw=1, alpha=0.7, label="Pareto front")  # fmt: skip
    for config in front:
        ax.plot(config.routed_bpw, config.pooled["kld_mean"], "o", ms=11, fillstyle="none",
                color="tab:green")  # fmt: skip
    budget = summary.budget
    if budget is not None and budget.measure == "routed_bpw":
        for limit in budget.limits:
            ax.axvline(limit, color="tab:red", ls="--", lw=0.8, alpha=0.45, label="budget")
    if any(c.pooled["kld_mean"] > 0 for c in sized):
        ax.set_yscale("log")
    xs = [c.routed_bpw for c in sized]
    lo, hi = min([BPW_RANGE[0], *xs]), max([BPW_RANGE[1], *xs])
    ax.set_xlim(lo - 0.02 * (hi - lo), hi + 0.02 * (hi - lo))
    _label_points(ax, [c for c in sized if c.status == TrialStatus.COMPLETED
                       and (c.role == Role.EXTERNAL or c.is_baseline)], label)  # fmt: skip
    ax.set_xlabel("routed experts: stored bits per weight")
    ax.set_ylabel(f"pooled KLD ({level:.0%} paired CI vs baseline)")
    ax.set_title("quality against size (lower left is better)", fontsize=9)
    if sized:
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=6, loc="best")
    else:
        ax.text(0.5, 0.5, "no config has a recorded size", ha="center", transform=ax.transAxes)
    return save(fig, path)


# where a label may sit beside its point (offset in points, alignment), tried in turn until it
# overprints no label placed before it: right and above, right and below, then the left side
_LABEL_SPOTS = (((5, 4), "left"), ((5, -10), "left"), ((-5, 4), "right"), ((-5, -10), "right"),
                ((5, 12), "left"), ((5, -18), "left"))  # fmt: skip


def _label_points(ax, configs: list[ConfigResult], label: Callable[[ConfigResult], str]) -> None:
    """Name each of ``configs`` beside its point (llama.cpp's files, the baseline) on a white
    ground, so that a budget line or an error bar behind it does not hide it, each at the first
    spot where it overprints no earlier label (by bpw; the axes' limits are set before)."""
    renderer = ax.figure.canvas.get_renderer()
    placed = []
    for config in sorted(configs, key=lambda c: c.routed_bpw):
        for offset, align in _LABEL_SPOTS:
            text = ax.annotate(label(config)[:24], (config.routed_bpw, config.pooled["kld_mean"]),
                               xytext=offset, textcoords="offset points", ha=align, fontsize=6.5,
                               bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                                     "alpha": 0.8})  # fmt: skip
            box = text.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            if (offset, align) != _LABEL_SPOTS[-1]:
                text.remove()  # the last spot stays, overprinting or not
        placed.append(box)


def write_plots(
    summary: SweepSummary, folder: Path, label: Callable[[ConfigResult], str]
) -> dict[str, Path]:
    """All plots into ``folder``; returns ``{caption: path}``."""
    plots = {
        FOREST_CAPTION: forest(summary, folder / "forest.png", label),
        "per-window KLD vs baseline": paired_scatter(summary, folder / "paired_windows.png", label),
        "knob main effects": knob_effects(summary, folder / "knob_effects.png"),
    }
    if summary.budget is not None or len({c.routed_bpw for c in summary.configs}) > 1:
        plots[KLD_VS_BPW_CAPTION] = kld_vs_bpw(summary, folder / "kld_vs_bpw.png", label)
    if any(c.cache for c in summary.configs):
        plots["KLD vs MiB read per token"] = kld_vs_mib(summary, folder / "kld_vs_mib.png", label)
    return plots
