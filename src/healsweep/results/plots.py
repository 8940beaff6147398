"""PNG plots of a sweep report (matplotlib, Agg backend: no display needed).

- ``paired_windows.png``: per window, a config's KLD against the baseline's on the same window
  (one panel per config, log-log, the diagonal = no change; points below it are windows the
  config improves);
- ``strata.png``: relative change of pooled KLD vs the baseline per stratum and config;
- ``knob_effects.png``: mean relative change vs the baseline per value of each varied knob.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from healsweep.results.aggregate import ConfigResult, SweepSummary

MAX_PANELS = 12


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def paired_scatter(summary: SweepSummary, path: Path, label: Callable[[ConfigResult], str]) -> Path:
    """Window KLD of each config vs the baseline's on the same windows."""
    plt = _pyplot()
    others = [c for c in summary.configs[1:] if c.comparison is not None][:MAX_PANELS]
    cols = min(4, max(1, len(others)))
    rows = max(1, math.ceil(len(others) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    base = summary.baseline.windows
    for ax, config in zip(axes.flat, others, strict=False):
        shared = [w for w in config.windows if w in base]
        x = [base[w]["kld_mean"] for w in shared]
        y = [config.windows[w]["kld_mean"] for w in shared]
        ax.scatter(
            x, y, s=10, alpha=0.7, color="tab:red" if config.status == "pruned" else "tab:blue"
        )
        lo, hi = min(x + y), max(x + y)
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        if lo > 0:
            from matplotlib.ticker import NullFormatter

            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(label(config)[:48], fontsize=8)
        ax.set_xlabel("baseline window KLD", fontsize=7)
        ax.set_ylabel("config window KLD", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(others) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def strata_bars(summary: SweepSummary, path: Path, label: Callable[[ConfigResult], str]) -> Path:
    """Grouped bars: per stratum, each config's relative change of pooled KLD vs the baseline."""
    plt = _pyplot()
    base = summary.baseline.pooled.get("per_stratum", {})
    configs = [c for c in summary.configs[1:] if c.pooled][:MAX_PANELS]
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(summary.strata)), 4))
    for i, config in enumerate(configs):
        per = config.pooled.get("per_stratum", {})
        paired = config.comparison.per_stratum if config.comparison is not None else {}
        values = [
            100 * paired[s].rel_change
            if s in paired
            else (
                100 * (per[s]["kld_mean"] / base[s]["kld_mean"] - 1)
                if s in per and s in base
                else 0.0
            )
            for s in summary.strata
        ]
        xs = [j + i * width for j in range(len(summary.strata))]
        ax.bar(xs, values, width=width, label=label(config)[:40])
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(summary.strata))])
    ax.set_xticklabels(summary.strata)
    ax.set_ylabel("Δ pooled KLD vs baseline (%)")
    if configs:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def knob_effects(summary: SweepSummary, path: Path) -> Path:
    """One panel per varied knob: mean relative change vs the baseline per value."""
    plt = _pyplot()
    knobs = list(dict.fromkeys(e["knob"] for e in summary.effects))
    fig, axes = plt.subplots(
        1, max(1, len(knobs)), figsize=(3.2 * max(1, len(knobs)), 3.2), squeeze=False
    )
    for ax, knob in zip(axes.flat, knobs, strict=False):
        rows = [e for e in summary.effects if e["knob"] == knob]
        ax.bar(
            [str(e["value"]) for e in rows],
            [100 * e["rel_change"] for e in rows],
            color="tab:green",
        )
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_title(knob, fontsize=9)
        ax.set_ylabel("mean Δ KLD vs baseline (%)", fontsize=7)
        ax.tick_params(labelsize=7)
    if not knobs:
        axes.flat[0].text(0.5, 0.5, "no knob varied across fully scored configs", ha="center")
        axes.flat[0].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(
    summary: SweepSummary, folder: Path, label: Callable[[ConfigResult], str]
) -> dict[str, Path]:
    """All plots into ``folder``; returns ``{caption: path}``."""
    from healsweep.results.expert_cache import cache_plots

    return {
        "per-window KLD vs baseline": paired_scatter(summary, folder / "paired_windows.png", label),
        "per-stratum change vs baseline": strata_bars(summary, folder / "strata.png", label),
        "knob main effects": knob_effects(summary, folder / "knob_effects.png"),
        **cache_plots(summary, folder, label),  # KLD vs MiB/token, with an expert cache
    }


__all__ = ["knob_effects", "paired_scatter", "strata_bars", "write_plots"]
