"""Expert-cache figures of a sweep's configs: leaderboard columns and the KLD-vs-I/O plot.

Configs scored through a simulated expert cache (knob ``cache_experts`` > 0) carry per-window
cache counts; here they are token-pooled per config (nothing recomputed from logits) and shown
next to KLD: the bonus trades quality for bytes read, and this is where both sides meet.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from healsweep.results.aggregate import ConfigResult, SweepSummary
from healsweep.score.expert_cache import pooled_cache

COLUMNS = ("hit rate", "MiB/token")


def config_cache(config: ConfigResult) -> dict[str, Any] | None:
    """Token-pooled cache figures of a config's windows (None without a cache)."""
    return pooled_cache([w.metrics.to_dict() for w in config.windows.values()])


def with_cache_columns(
    summary: SweepSummary, header: list[str], rows: list[list[str]]
) -> tuple[list[str], list[list[str]]]:
    """The leaderboard with hit rate and MiB/token right after pooled KLD, when any config of
    the sweep was scored through an expert cache (else unchanged)."""
    figures = [config_cache(c) for c in summary.configs]
    if not any(figures):
        return header, rows
    at = header.index("pooled KLD") + 1
    cells = [
        ["-", "-"] if f is None else [f"{f['hit_rate']:.2%}", f"{f['mib_per_token']:.3g}"]
        for f in figures
    ]
    return (
        [*header[:at], *COLUMNS, *header[at:]],
        [[*row[:at], *cell, *row[at:]] for row, cell in zip(rows, cells, strict=True)],
    )


def kld_vs_mib(summary: SweepSummary, path: Path, label: Callable[[ConfigResult], str]) -> Path:
    """Pooled KLD against MiB read per token, one point per config; configs that differ only
    in ``moce_bonus`` are joined in bonus order (the bonus's trade-off curve)."""
    from healsweep.results.plots import _pyplot, save

    plt = _pyplot()
    points = [(c, f) for c in summary.configs if (f := config_cache(c)) is not None]
    curves: dict[tuple, list[tuple[ConfigResult, dict]]] = {}
    for config, figures in points:
        rest = tuple(sorted((k, str(v)) for k, v in config.knobs.items() if k != "moce_bonus"))
        curves.setdefault(rest, []).append((config, figures))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for curve in curves.values():
        curve.sort(key=lambda p: p[0].knobs.get("moce_bonus") or 0.0)
        xs = [f["mib_per_token"] for _, f in curve]
        ys = [c.pooled["kld_mean"] for c, _ in curve]
        ax.plot(xs, ys, marker="o", lw=1, label=label(curve[0][0])[:48])  # the lowest bonus
        for (config, _), x, y in zip(curve, xs, ys, strict=True):
            ax.annotate(f"{config.knobs.get('moce_bonus') or 0:g}", (x, y), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
    if all(f["mib_per_token"] > 0 for _, f in points):
        ax.set_xscale("log")
    ax.legend(fontsize=6, title="config (points: moce_bonus)", title_fontsize=6)
    ax.set_xlabel("MiB of experts read per token (misses x stored expert size)")
    ax.set_ylabel("pooled KLD")
    ax.set_title("quality vs expert I/O per config", fontsize=9)
    return save(fig, path)


def cache_plots(
    summary: SweepSummary, folder: Path, label: Callable[[ConfigResult], str]
) -> dict[str, Path]:
    """``{caption: path}`` of the cache plot, or {} when no config was scored with a cache."""
    if not any(config_cache(c) for c in summary.configs):
        return {}
    return {"KLD vs MiB read per token": kld_vs_mib(summary, folder / "kld_vs_mib.png", label)}


__all__ = ["COLUMNS", "cache_plots", "config_cache", "kld_vs_mib", "with_cache_columns"]
