"""The sweep report on a results folder with known effects: leaderboard numbers against an
independent float64 computation, verdicts of the decision rule, main effects, pruning, files."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from healsweep.errors import ResultsError
from healsweep.heal.knobs import Knobs
from healsweep.results.aggregate import summarize
from healsweep.results.budget import pareto_front
from healsweep.results.plots import own_front
from healsweep.results.report import leaderboard, write_report
from healsweep.results.schema import knob_columns, to_table, trial_schema, window_schema
from healsweep.results.store import atomic_write_table
from healsweep.sweep.space import config_hash

N = 60
STRATA = ("code", "docs", "json")
RNG = np.random.default_rng(11)
TOKENS = RNG.integers(20, 120, N)
BASE_KLD = RNG.uniform(0.05, 0.3, N)

# (knobs, per-window factor on the baseline's KLD, status, windows scored)
CONFIGS = {
    "base": (Knobs(), np.ones(N), "completed", N),
    "better": (Knobs(gain_d=0.0), 0.8 * np.exp(RNG.normal(0, 0.02, N)), "completed", N),
    "worse": (Knobs(alpha="none"), 1.3 * np.exp(RNG.normal(0, 0.02, N)), "completed", N),
    # better overall, but the json stratum regresses by ~30%: rejected by check (ii)
    "uneven": (
        Knobs(alpha="none", gain_d=0.0),
        np.where(np.arange(N) % 3 == 2, 1.3, 0.6),
        "completed",
        N,
    ),
    "pruned": (Knobs(ridge=False), 1.5 * np.ones(N), "pruned", 8),
}
# reference and external rows: (role, knobs or None, per-window factor, routed bpw)
FIXED = {
    "unhealed": ("reference", Knobs(alpha="none", ridge=False), 1.1 * np.exp(RNG.normal(0, 0.05, N)), 2.25),
    "plain": ("reference", Knobs(quantizer="plain", alpha="none", ridge=False), 2.0 * np.ones(N), 2.25),
    "q2k": ("external", None, 0.9 * np.exp(RNG.normal(0, 0.05, N)), 2.625),
}  # fmt: skip


def _pooled(factor):
    return (BASE_KLD * factor * TOKENS).sum() / TOKENS.sum()


def _folder(tmp_path):
    windows = tmp_path / "windows"
    windows.mkdir()
    trials = []
    for name, (knobs, factor, status, scored) in CONFIGS.items():
        chash = config_hash(knobs)
        kld = BASE_KLD * factor
        rows = [
            {
                "sweep": "s",
                "trial_id": name,
                "config_hash": chash,
                "is_baseline": name == "base",
                **knob_columns(knobs),
                "window_id": f"w{i:03d}",
                "window_index": i,
                "windows_total": N,
                "stratum": STRATA[i % 3],
                "kld_sum": float(kld[i] * TOKENS[i]),
                "kld_count": int(TOKENS[i]),
                "kld_mean": float(kld[i]),
                "top1": 0.9,
                "top1_count": int(0.9 * TOKENS[i]),
                "pruned": status == "pruned",
            }
            for i in range(scored)
        ]
        atomic_write_table(to_table(rows, window_schema()), windows / f"trial-{name}.parquet")
        trials.append(
            {
                "sweep": "s",
                "trial_id": name,
                "config_hash": chash,
                "is_baseline": name == "base",
                "role": "baseline" if name == "base" else "trial",
                "routed_bpw": 2.25,
                **knob_columns(knobs),
                "status": status,
                "windows_scored": scored,
                "windows_total": N,
                "kld_sum": float((kld * TOKENS)[:scored].sum()),
                "kld_count": int(TOKENS[:scored].sum()),
                "kld_mean": float((kld * TOKENS)[:scored].sum() / TOKENS[:scored].sum()),
            }
        )
    for name, (role, knobs, factor, bpw) in FIXED.items():
        trial_id = f"{role[:3]}-{name}"
        ident = {"role": role, "label": name, "config_hash": f"{role}-{name}"}
        knob_cols = knob_columns(knobs)
        kld = BASE_KLD * factor
        rows = [
            {"sweep": "s", "trial_id": trial_id, **ident, **knob_cols, "is_baseline": False,
             "window_id": f"w{i:03d}", "window_index": i, "windows_total": N,
             "stratum": STRATA[i % 3], "kld_sum": float(kld[i] * TOKENS[i]),
             "kld_count": int(TOKENS[i]), "kld_mean": float(kld[i]), "top1": 0.9,
             "top1_count": int(0.9 * TOKENS[i]), "pruned": False}
            for i in range(N)
        ]  # fmt: skip
        atomic_write_table(to_table(rows, window_schema()), windows / f"trial-{trial_id}.parquet")
        trials.append(
            {"sweep": "s", "trial_id": trial_id, **ident, **knob_cols, "is_baseline": False,
             "routed_bpw": bpw, "status": "completed", "windows_scored": N, "windows_total": N,
             "kld_mean": _pooled(factor)}
        )  # fmt: skip
    atomic_write_table(to_table(trials, trial_schema()), tmp_path / "trials.parquet")
    manifest = {"sweep": "s", "spec_hash": "ab" * 32, "split_lock_id": "cd" * 32,
                "model_fingerprint": "ef" * 32, "package_version": "0", "seeds": {},
                "planned_trials": 5}  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def test_leaderboard_numbers_and_verdicts(tmp_path):
    summary = summarize(_folder(tmp_path), n_boot=2000)
    by_trial = {c.trial_ids[0]: c for c in summary.configs}
    assert summary.configs[0] is summary.baseline is by_trial["base"]
    order = [c.trial_ids[0] for c in summary.configs if not c.is_fixed]
    pooled = {n: (BASE_KLD * CONFIGS[n][1] * TOKENS).sum() for n in ("better", "worse", "uneven")}
    assert order == ["base", *sorted(pooled, key=pooled.get), "pruned"]  # finished before pruned
    for name in ("better", "worse", "uneven"):
        factor = CONFIGS[name][1]
        expected = (BASE_KLD * factor * TOKENS).sum() / (BASE_KLD * TOKENS).sum() - 1
        comp = by_trial[name].comparison
        assert comp.rel_change == pytest.approx(expected, rel=1e-9)
        lo, hi = comp.rel_change_ci()
        assert lo <= comp.rel_change <= hi
    assert by_trial["better"].verdict.accepted
    assert not by_trial["worse"].verdict.accepted
    uneven = by_trial["uneven"].verdict
    assert not uneven.accepted and uneven.checks == {
        "kld_improves": True, "no_stratum_regression": False, "top1_noninferior": True
    }  # fmt: skip
    header, rows = leaderboard(summary)
    verdicts = {row[1]: row[-1] for row in rows}
    assert verdicts["gain_d=0"] == "ACCEPT" and verdicts["alpha=none"] == "reject"
    assert verdicts["ridge=False"] == "pruned (not judged)" and rows[-1][5] == f"8/{N}"
    assert header[2] == "trial" and {row[1]: row[2] for row in rows}["gain_d=0"] == "better"
    assert verdicts["unhealed"] == verdicts["plain"] == "reference"


def test_every_config_against_each_reference(tmp_path):
    summary = summarize(_folder(tmp_path), n_boot=2000)
    by_label = {c.label: c for c in summary.configs if c.is_fixed}
    assert [r.label for r in summary.references] == ["unhealed", "plain"]
    assert by_label["q2k"].role == "external" and by_label["q2k"].routed_bpw == 2.625
    better = next(c for c in summary.configs if c.trial_ids == ["better"])
    for ref in ("unhealed", "plain"):
        expected = _pooled(CONFIGS["better"][1]) / _pooled(FIXED[ref][2]) - 1
        comp = better.vs_references[ref]
        assert comp.rel_change == pytest.approx(expected, rel=1e-9)
        lo, hi = comp.rel_change_ci()
        assert lo <= comp.rel_change <= hi
    # the references themselves against the baseline and against each other
    plain_vs_unhealed = by_label["plain"].vs_references["unhealed"].rel_change
    assert plain_vs_unhealed == pytest.approx(
        2.0 / (_pooled(FIXED["unhealed"][2]) / _pooled(1.0)) - 1
    )
    assert "plain" not in by_label["plain"].vs_references
    header, rows = leaderboard(summary)
    assert "Δ KLD vs unhealed [95% CI]" in header and "Δ KLD vs plain [95% CI]" in header
    row = {r[1]: r for r in rows}
    assert row["plain"][3] == "reference" and row["q2k"][3] == "external"
    assert row["q2k"][6] == "2.625" and row["baseline"][6] == "2.25"  # IQ2_XXS: 2.0625
    # references are not trials: no main effect of `quantizer`, not in the pruning count
    assert "quantizer" not in {e["knob"] for e in summary.effects}
    assert summary.pruning["trials"] == len(CONFIGS)


def test_main_effects_and_pruning_summary(tmp_path):
    summary = summarize(_folder(tmp_path), n_boot=200)
    effects = {(e["knob"], e["value"]): e for e in summary.effects}
    # fully scored configs: base, better (gain_d 0), worse (alpha none), uneven (both)
    pooled = {
        name: (BASE_KLD * CONFIGS[name][1] * TOKENS).sum() / TOKENS.sum()
        for name in ("base", "better", "worse", "uneven")
    }
    rel = {name: pooled[name] / pooled["base"] - 1 for name in pooled}
    assert effects[("gain_d", 0.0)]["rel_change"] == pytest.approx(
        (rel["better"] + rel["uneven"]) / 2
    )
    assert effects[("alpha", "none")]["configs"] == 2
    assert ("ridge", False) not in effects  # only the pruned config changed it
    assert summary.pruning == {
        "trials": 5, "pruned": 1, "windows_scored": 4 * N + 8, "windows_saved": N - 8,
        "saved_fraction": (N - 8) / (5 * N),
    }  # fmt: skip


def test_report_files(tmp_path):
    paths = write_report(_folder(tmp_path), n_boot=200)
    text = paths["markdown"].read_text()
    for piece in ("Leaderboard", "95% CI", "Per-stratum", "Main effects", "Pruning", "ACCEPT",
                  "Δ KLD vs unhealed", "Δ KLD vs plain", "| reference |", "| external |"):  # fmt: skip
        assert piece in text
    # the forest plot is the report's first picture
    first_picture = text[text.index("![") :].split("\n")[0]
    assert first_picture.endswith("(forest.png)")
    assert "<table>" in paths["html"].read_text()
    for name in ("forest.png", "paired_windows.png", "knob_effects.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_needs_a_scored_baseline(tmp_path):
    folder = _folder(tmp_path)
    (folder / "windows" / "trial-base.parquet").unlink()
    with pytest.raises(ResultsError, match="baseline has no scored windows"):
        summarize(folder)


def test_budget_tiers_healing_pairs_and_the_over_budget_count(tmp_path):
    """With a budget of 2.3 and 2.7 routed bpw: the trials (2.25) fit both tiers, llama.cpp's
    Q2_K file (2.625) the second only; each tier's best trial against the files inside it and
    every healed config against its allocation unhealed (paired Δ, float64 pooled ratios)."""
    from healsweep.results.budget import healing_pairs, tiers

    folder = _folder(tmp_path)
    (folder / "spec.json").write_text(
        json.dumps({"name": "s", "budget": {"routed_bpw": [2.7, 2.3]}})
    )
    over = {"abc": {"knobs": {"type_d": "q4_k"}, "routed_bpw": 2.875, "file_bytes": 3 * 2**20}}
    (folder / "over_budget.json").write_text(json.dumps(over))
    summary = summarize(folder, n_boot=500)
    low, high = tiers(summary)
    assert (low.limit, high.limit, low.label) == (2.3, 2.7, "2.3 bpw")
    assert "q2k" not in {c.label for c in low.configs} and "q2k" in {c.label for c in high.configs}
    assert low.best is high.best and low.best.trial_ids == ["better"]  # lowest completed trial
    assert low.vs_externals == [] and [e.label for e, _ in high.vs_externals] == ["q2k"]
    expected = _pooled(CONFIGS["better"][1]) / _pooled(FIXED["q2k"][2]) - 1
    assert high.vs_externals[0][1].rel_change == pytest.approx(expected, rel=1e-9)
    pairs = {p.healed.trial_ids[0]: p for p in healing_pairs(summary)}
    assert set(pairs) == {"base", "worse", "pruned"}  # those whose knobs unhealed were scored
    assert all(p.unhealed.label == "unhealed" for p in pairs.values())
    expected = _pooled(1.0) / _pooled(FIXED["unhealed"][2]) - 1
    assert pairs["base"].comparison.rel_change == pytest.approx(expected, rel=1e-9)
    from healsweep.results.findings import findings

    found = findings(summary)
    assert [f.scope for f in found] == ["budget ≤ 2.3 bpw", "budget ≤ 2.7 bpw"]
    assert all(f.best.trial_ids == ["better"] for f in found)
    assert [v.name for v in found[0].versus] == ["baseline", "unhealed", "plain"]
    assert [v.name for v in found[1].versus] == ["baseline", "unhealed", "plain", "q2k"]
    q2k = found[1].versus[-1]
    assert q2k.kind == "llama.cpp" and q2k.comparison.rel_change == pytest.approx(
        high.vs_externals[0][1].rel_change, rel=1e-12
    )
    report = write_report(folder, summary=summary)["markdown"].read_text()
    assert "- **budget ≤ 2.3 bpw**: the best config is gain_d=0, trial `better`" in report
    assert f"--trial better --out {folder.name}-2.3.gguf`" in report
    assert "against the external file q2k" in report
    assert "1 configs over budget, not scored (budget: 2.3 bpw, 2.7 bpw)." in report
    assert "## Best config per budget against llama.cpp" in report
    assert "## What healing adds on top of each allocation" in report
    assert (folder / "report" / "kld_vs_bpw.png").stat().st_size > 10_000
    # the plot's front is healsweep's own: llama.cpp's files are reference points beside it
    sized = [c for c in summary.configs if c.routed_bpw is not None and c.pooled]
    external = next(c for c in sized if c.role == "external")
    best = min(sized, key=lambda c: c.pooled["kld_mean"])
    smaller = dataclasses.replace(external, routed_bpw=1.5625, pooled={"kld_mean": 1e-3})
    assert pareto_front([*sized, smaller])[0] is smaller  # smaller and better than every config
    own = own_front([*sized, smaller])
    assert own == pareto_front([c for c in sized if c.role != "external"]) and own[0] is best


def _pooled_sums(factor, idx):
    """Token-pooled KLD of a config on resampled windows ``idx`` ([B, N] indices), float64."""
    return (BASE_KLD * factor * TOKENS)[idx].sum(axis=1)


def test_knob_effects_carry_a_bootstrap_ci_of_the_group_mean(tmp_path):
    """The CI of a knob value's mean Δ resamples windows once for every config of the group
    (the same draw for each, as the paired bootstrap draws them): recomputed here in float64
    from the raw per-window figures with the same generator."""
    n_boot = 500
    summary = summarize(_folder(tmp_path), n_boot=n_boot, seed=3)
    idx = np.random.default_rng(3).integers(0, N, size=(n_boot, N))
    base = _pooled_sums(np.ones(N), idx)
    rel = {name: _pooled_sums(CONFIGS[name][1], idx) / base - 1
           for name in ("better", "worse", "uneven")}  # fmt: skip
    effects = {(e["knob"], e["value"]): e for e in summary.effects}
    groups = {("gain_d", 0.0): ["better", "uneven"], ("gain_d", 0.3): ["worse"],
              ("alpha", "none"): ["worse", "uneven"], ("alpha", "gaussian"): ["better"]}  # fmt: skip
    for key, names in groups.items():
        size = effects[key]["configs"]  # the baseline counts as a config with no change
        mean = sum(rel[n] for n in names) / size
        want = np.quantile(mean, [0.025, 0.975])
        assert effects[key]["ci"] == pytest.approx(tuple(want), rel=1e-9, abs=1e-12), key
        lo, hi = effects[key]["ci"]
        assert lo <= effects[key]["rel_change"] <= hi
    from healsweep.results.report import effects_table

    header, rows = effects_table(summary)
    assert header[-1] == "mean Δ vs baseline [95% CI]" and all("[" in row[-1] for row in rows)


def test_the_report_opens_with_what_the_sweep_found(tmp_path):
    """Without a budget: the best completed config by pooled KLD with its trial id, each
    comparison (baseline, references, the external file) with its CI and the decision rule's
    word, the export command; and the trial export --best takes (the best accepted one)."""
    from healsweep.results.findings import best_accepted, findings
    from healsweep.results.report import counts_line, found_lines

    folder = _folder(tmp_path)
    summary = summarize(folder, n_boot=500)
    done = {n: _pooled(CONFIGS[n][1]) for n in ("base", "better", "worse", "uneven")}
    best_name = min(done, key=done.get)
    (found,) = findings(summary)
    assert found.scope == "all configs" and found.best.trial_ids == [best_name]
    against = {v.name: v for v in found.versus}
    assert set(against) == {"baseline", "unhealed", "plain", "q2k"}
    for name, factor in (("unhealed", FIXED["unhealed"][2]), ("q2k", FIXED["q2k"][2])):
        expected = done[best_name] / _pooled(factor) - 1
        assert against[name].comparison.rel_change == pytest.approx(expected, rel=1e-9)
    assert best_accepted(summary).trial_ids == ["better"]  # uneven regresses a stratum
    text = "\n".join(found_lines(summary, "results/s"))
    assert f"trial `{best_name}`" in text
    assert f"healsweep export results/s --trial {best_name} --out s-best.gguf" in text
    assert "`healsweep export results/s --best --out MODEL.gguf` takes trial `better`" in text
    lo, hi = against["q2k"].comparison.rel_change_ci()
    assert f"[{lo:+.2%}, {hi:+.2%}]".replace("-", "−") in text
    report = write_report(folder, summary=summary)["markdown"].read_text()
    assert report.index("## What the sweep found") < report.index("## Leaderboard")
    # the counts: 5 trials (one pruned after 8 windows), 3 fixed rows, nothing replayed
    assert counts_line(summary).startswith(
        f"5 trials (the baseline included), 2 reference rows, 1 external file on {N} dev "
        f"windows each; {4 * N + 8 + 3 * N} windows scored; "
    )


def test_a_window_named_by_several_rows_of_one_student_is_counted_once():
    from healsweep.results.aggregate import window_counts

    same = Knobs(gain_d=0.0)
    rows = [
        {"config_hash": h, "role": role, "is_baseline": False, **knob_columns(same),
         "window_id": f"w{i}"}
        for h, role in (("trial-hash", "trial"), ("ref-hash", "reference")) for i in range(3)
    ]  # fmt: skip
    rows.append({"config_hash": "ext", "role": "external", "is_baseline": False,
                 "window_id": "w0"})  # fmt: skip
    assert window_counts(rows) == {"scored": 4, "recorded": 7, "replayed": 3}


def test_report_json_and_text_name_the_same_trials(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    folder = _folder(tmp_path)
    cli = Path(__file__).resolve().parents[1] / "cli.py"
    run = subprocess.run([sys.executable, str(cli), "report", str(folder), "--json",
                          "--n-boot", "200"], capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    (found,) = out["findings"]
    assert found["scope"] == "all configs" and found["best"]["trial_id"] in CONFIGS
    assert {a["name"] for a in found["against"]} == {"baseline", "unhealed", "plain", "q2k"}
    assert all(a["rel_change_ci"][0] <= a["rel_change"] <= a["rel_change_ci"][1]
               for a in found["against"])  # fmt: skip
    assert out["counts"]["windows"]["scored"] == 4 * N + 8 + 3 * N
    assert {row["trial"] for row in out["leaderboard"]} >= set(CONFIGS)
    assert Path(out["files"]["markdown"]).is_file()
    text = subprocess.run([sys.executable, str(cli), "report", str(folder), "--n-boot", "200"],
                          capture_output=True, text=True)  # fmt: skip
    assert text.returncode == 0 and f"trial `{found['best']['trial_id']}`" in text.stdout
