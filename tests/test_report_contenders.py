"""The allocator's choice beside the best uniform and the best searched config of its budget tier
(results/contenders.py, the report's table): real Parquet results folders written with the
project's writers, one allocator sweep and one TPE sweep of the same model and split, every
figure checked against float64 token-pooled ratios computed here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from healsweep.errors import ResultsError
from healsweep.heal.knobs import Knobs
from healsweep.results.aggregate import summarize
from healsweep.results.contenders import Origin, beside_sweep, contenders
from healsweep.results.report import write_report
from healsweep.results.schema import Role, knob_columns, to_table, trial_schema, window_schema
from healsweep.results.store import atomic_write_table
from healsweep.sweep.space import config_hash

N = 48
RNG = np.random.default_rng(5)
TOKENS = RNG.integers(20, 120, N)
BASE_KLD = RNG.uniform(0.01, 0.2, N)
HEAL = {"quantizer": "gptq", "alpha": "mse", "eta": 0.3}


def _knobs(gu: str, d: str, layers: str = "") -> Knobs:
    return Knobs(type_gu=gu, type_d=d, layer_types=layers, **HEAL)


BASE = _knobs("iq2_xxs", "iq2_xxs")  # 2.0625 bpw, uniform
PROPOSAL = _knobs("iq2_xxs", "iq2_xxs", "0:iq2_xs/iq3_xxs")
WIDE = _knobs("iq2_xs", "iq2_xs")  # 2.3125, uniform
# trial id -> (knobs, per-window factor on BASE_KLD, routed bpw)
ALLOCATOR_SWEEP = {
    "base": (BASE, np.ones(N), 2.0625),
    "grid-xs": (WIDE, 0.85 * np.exp(RNG.normal(0, 0.05, N)), 2.3125),
    "proposal": (PROPOSAL, 0.7 * np.exp(RNG.normal(0, 0.05, N)), 2.25),
}
TPE_SWEEP = {
    "tpe-base": (BASE, np.ones(N), 2.0625),
    "tpe-mixed": (_knobs("iq2_xxs", "iq2_xs"), 0.9 * np.exp(RNG.normal(0, 0.05, N)), 2.1458),
    "tpe-big": (_knobs("iq2_xs", "q3_k"), 0.5 * np.ones(N), 2.6875),  # over the 2.35 tier
}
LIMITS = [2.1, 2.35, 2.7]


def _pooled(factor: np.ndarray) -> float:
    return float((BASE_KLD * factor * TOKENS).sum() / TOKENS.sum())


def _write_sweep(folder: Path, name: str, configs: dict, sampler: str, model: str = "ef") -> Path:
    """A results folder as a sweep writes one: window and trial Parquet, manifest and spec."""
    (folder / "windows").mkdir(parents=True)
    trials = []
    for trial_id, (knobs, factor, bpw) in configs.items():
        kld, first = BASE_KLD * factor, trial_id.endswith("base")
        ident = {"sweep": name, "trial_id": trial_id, "config_hash": config_hash(knobs),
                 "is_baseline": first, **knob_columns(knobs)}  # fmt: skip
        rows = [{**ident, "window_id": f"w{i:03d}", "window_index": i, "windows_total": N,
                 "stratum": "docs", "kld_sum": float(kld[i] * TOKENS[i]),
                 "kld_count": int(TOKENS[i]), "kld_mean": float(kld[i]), "top1": 0.9,
                 "top1_count": int(0.9 * TOKENS[i]), "pruned": False} for i in range(N)]  # fmt: skip
        atomic_write_table(
            to_table(rows, window_schema()), folder / "windows" / f"{trial_id}.parquet"
        )
        trials.append({**ident, "role": "baseline" if first else "trial", "routed_bpw": bpw,
                       "status": "completed", "windows_scored": N, "windows_total": N,
                       "kld_mean": _pooled(factor)})  # fmt: skip
    atomic_write_table(to_table(trials, trial_schema()), folder / "trials.parquet")
    manifest = {"sweep": name, "spec_hash": "ab" * 32, "split_lock_id": "cd" * 32,
                "model_fingerprint": model * 32, "package_version": "0", "seeds": {}}  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    spec = {"name": name, "sampler": {"type": sampler, "seed": 0},
            "budget": {"routed_bpw": LIMITS}}  # fmt: skip
    (folder / "spec.json").write_text(json.dumps(spec))
    return folder


def _allocator_sweep(tmp_path: Path) -> Path:
    folder = _write_sweep(tmp_path / "alloc", "alloc", ALLOCATOR_SWEEP, "allocator")
    proposal = {"limit": 2.35, "knobs": PROPOSAL.model_dump(mode="json"),
                "predicted_delta_kld": -0.01, "routed_bpw": 2.25, "file_bytes": 1, "moves": []}  # fmt: skip
    (folder / "allocator.json").write_text(json.dumps({"proposals": [proposal]}))
    return folder


def test_the_allocator_beside_the_best_uniform_and_the_best_searched_config(tmp_path):
    alloc = summarize(_allocator_sweep(tmp_path), n_boot=400)
    tpe = summarize(_write_sweep(tmp_path / "tpe", "tpe", TPE_SWEEP, "tpe"), n_boot=400)
    assert (alloc.sampler, tpe.sampler) == ("allocator", "tpe")
    alone = contenders(alloc)
    # 2.1 holds no proposal; at 2.35 the proposal, the grid's IQ2_XS and no search of its own
    assert [t.label for t in alone] == ["2.35 bpw", "2.7 bpw"]
    assert [r.origin for r in alone[0].rows] == [Origin.ALLOCATOR, Origin.UNIFORM]
    tiers = contenders(alloc, [tpe])
    low, high = tiers
    assert [(r.origin, r.candidate.config.trial_ids[0]) for r in low.rows] == [
        (Origin.ALLOCATOR, "proposal"),
        (Origin.UNIFORM, "grid-xs"),
        (Origin.SEARCH, "tpe-mixed"),
    ]
    # the TPE search's better config at 2.69 bpw is its best in the larger tier only
    assert high.rows[2].candidate.config.trial_ids == ["tpe-big"]
    mine = _pooled(ALLOCATOR_SWEEP["proposal"][1])
    others = (ALLOCATOR_SWEEP["grid-xs"], TPE_SWEEP["tpe-mixed"])
    for row, other in zip(low.rows[1:], others, strict=True):
        assert row.comparison.rel_change == pytest.approx(mine / _pooled(other[1]) - 1, rel=1e-9)
        lo, hi = row.comparison.rel_change_ci(0.95)
        assert lo < row.comparison.rel_change < hi < 0  # the allocator's choice is better
    big = high.rows[2].comparison
    assert big.rel_change == pytest.approx(mine / _pooled(0.5 * np.ones(N)) - 1, rel=1e-9)
    assert big.rel_change > 0  # there the search's larger config wins


def test_the_report_labels_each_of_the_three(tmp_path):
    folder = _allocator_sweep(tmp_path)
    other = _write_sweep(tmp_path / "tpe", "tpe", TPE_SWEEP, "tpe")
    report = write_report(folder, n_boot=300, beside=[other])["markdown"].read_text()
    section = report.split("## The allocator beside the best uniform and searched configs")[1]
    rows = [
        line for line in section.split("\n## ")[0].splitlines() if line.startswith("| 2.35 bpw")
    ]
    assert [r.split(" | ")[1] for r in rows] == ["the allocator's best", "best uniform",
                                                 "best search"]  # fmt: skip
    assert "the allocator's choice, sweep alloc" in rows[0] and "tpe trial, sweep tpe" in rows[2]
    assert "grid point, sweep alloc" in rows[1] and "iq2_xs/iq2_xs" in rows[1]
    # a grid or TPE sweep without allocator proposals has no such table
    plain = write_report(other, n_boot=300)["markdown"].read_text()
    assert "The allocator beside" not in plain


def test_a_sweep_of_another_model_is_refused_beside_it(tmp_path):
    alloc = summarize(_allocator_sweep(tmp_path), n_boot=200)
    other = summarize(_write_sweep(tmp_path / "x", "x", TPE_SWEEP, "tpe", model="00"), n_boot=200)
    with pytest.raises(ResultsError, match="model_fingerprint"):
        beside_sweep(alloc, other)
    cli = Path(__file__).resolve().parents[1] / "cli.py"
    run = subprocess.run([sys.executable, str(cli), "report", str(tmp_path / "alloc"), "--beside",
                          str(tmp_path / "x"), "--n-boot", "200"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().startswith("error:") and "model_fingerprint" in run.stderr


def test_a_grid_point_another_sweeps_allocator_proposed_is_the_allocators(tmp_path):
    """A grid sweep that scores the allocator's choice as one of its points: alone it has no
    allocator row; with the allocator's sweep beside it, that point is the allocator's."""
    alloc = summarize(_allocator_sweep(tmp_path), n_boot=200)
    configs = {"base": ALLOCATOR_SWEEP["base"], "chosen": (PROPOSAL, 0.6 * np.ones(N), 2.25)}
    grid = summarize(_write_sweep(tmp_path / "grid", "grid", configs, "grid"), n_boot=200)
    assert contenders(grid) == []
    low = contenders(grid, [alloc])[0]
    assert low.rows[0].origin == Origin.ALLOCATOR
    assert (low.rows[0].candidate.sweep, low.rows[0].candidate.config.trial_ids) == (
        "grid",
        ["chosen"],
    )  # the better of the two scorings of that student (0.6 against 0.7)


def test_the_labels_of_close_points_do_not_overprint():
    """llama.cpp's files a few hundredths of a bit apart (IQ3_S and Q3_K share 3.4375): each
    label finds a spot where it overprints none placed before it."""
    from healsweep.results.aggregate import ConfigResult
    from healsweep.results.plots import _label_points, _pyplot

    fig, ax = _pyplot().subplots(figsize=(8.4, 5.0))
    points = [(1.5625, 0.024), (1.75, 0.022), (2.5625, 0.0068), (2.625, 0.0094), (3.4375, 0.0034),
              (3.4375, 0.0035), (4.25, 0.00088), (4.25, 0.00068)]  # fmt: skip
    files = [
        ConfigResult(f"h{i}", None, False, "completed", [f"e{i}"], {}, pooled={"kld_mean": y},
                     role=Role.EXTERNAL, label=f"llama-file-{i}", routed_bpw=x)
        for i, (x, y) in enumerate(points)
    ]  # fmt: skip
    ax.plot([x for x, _ in points], [y for _, y in points], "s")
    ax.set_yscale("log")
    ax.set_xlim(1.44, 4.56)
    _label_points(ax, files, label=lambda c: c.label)
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) == len(points)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    _pyplot().close(fig)


@pytest.mark.parametrize(
    "layer_types",
    ["0:iq1_s/iq1_s,1:iq1_s/iq1_s,2:iq1_s/iq1_s,3:iq1_s/iq1_s",
     "0:iq2_xxs/iq2_xxs,1:iq1_s/iq1_s,2:iq1_m/iq2_xxs,3:iq1_m/iq1_s",
     "0:iq2_xs/iq3_xxs,1:iq2_xs/iq3_xxs,-1:iq2_xs/iq3_xxs", "-2:q2_k/q2_k,-1:q2_k/q2_k", ""],
)  # fmt: skip
def test_a_compact_layer_list_names_the_same_layers(layer_types):
    """The report's short form of ``layer_types`` expands back to the canonical value."""
    from healsweep.results.budget import compact_layers

    short = compact_layers(layer_types)
    expanded = []
    for entry in filter(None, short.split(",")):
        layers, types = entry.split(":")
        first, _, last = layers.partition("-") if not layers.startswith("-") else (layers, "", "")
        expanded += [f"{i}:{types}" for i in range(int(first), int(last or first) + 1)]
    assert ",".join(expanded) == layer_types
    assert len(short) <= len(layer_types)
    if layer_types.startswith("0:iq1_s"):
        assert short == "0-3:iq1_s/iq1_s"


def test_under_a_file_budget_a_uniform_config_retypes_every_group_alike():
    """Routed IQ2_XS with IQ4_XS attention is the allocator's kind of file, not a uniform one;
    every retyped group in IQ2_XS (or left as the teacher stores it) is."""
    from healsweep.results.aggregate import ConfigResult
    from healsweep.results.contenders import is_uniform_under

    def config(**types):
        return ConfigResult("h", _knobs("iq2_xs", "iq2_xs").replace(**types), False, "completed",
                            ["t"], {})  # fmt: skip

    mixed, alike = config(type_attn="iq4_xs"), config(type_attn="iq2_xs", type_embd="iq2_xs")
    assert is_uniform_under(mixed, "routed_bpw") and not is_uniform_under(mixed, "file_bytes")
    assert is_uniform_under(alike, "file_bytes") and is_uniform_under(config(), "file_bytes")
    assert not is_uniform_under(ConfigResult("h", PROPOSAL, False, "completed", [], {}), "routed_bpw")
