"""The residual table behind `healsweep bench heal`: disjoint held-out slice, float64 re-derivation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from healsweep.cache import StageCache
from healsweep.cli import _register
from healsweep.cli._apps import app
from healsweep.data.corpus import load_corpus
from healsweep.heal import stages
from healsweep.heal.evaluate import VARIANTS, heldout_split, residual_table
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.quantize import layer_keys
from healsweep.heal.trace import LAYER_STAGE, calibration_trace, layer_key
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model

CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)


def _corpus(path):
    rows = []
    for i in range(8):
        text = [
            f"Document {i}: the quick brown fox jumps over the lazy dog {i} times. ",
            f"Experts route token {i}; healing repairs the damage. ",
        ][i % 2] * (3 + i % 3)
        rows.append(
            {
                "doc_id": f"cal-{i}",
                "source": "cal",
                "index": i,
                "stratum": "odd" if i % 2 else "even",
                "pool": "calibration",
                "text": text,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = open_model(write_random_model(root / "m.gguf", n_layer=2, n_ff_exp=64))
    corpus = load_corpus(_corpus(root / "c.jsonl"))
    cache = StageCache(root / "cache")
    return model, corpus, cache, residual_table(model, corpus, cache, CAL, every=2)


def test_heldout_split_is_disjoint_per_stratum_and_covers_the_pool(tmp_path):
    corpus = load_corpus(_corpus(tmp_path / "c.jsonl"))
    fit, held = heldout_split(corpus, CAL, every=2)
    all_ids = {d.doc_id for d in corpus.pool("calibration")}
    fit_ids = all_ids - set(fit.exclude_doc_ids)
    held_ids = all_ids - set(held.exclude_doc_ids)
    assert fit_ids.isdisjoint(held_ids) and fit_ids | held_ids == all_ids
    assert {corpus.get(i).stratum for i in held_ids} == {"odd", "even"}


def test_table_rederived_in_float64_and_mse_never_loses_in_sample(table):
    model, corpus, cache, result = table
    fit_cfg, held_cfg = heldout_split(corpus, CAL, every=2)
    fit_trace = calibration_trace(model, fit_cfg, cache, corpus)
    for row in result["rows"]:
        assert row["cal.mse"] <= row["cal.alpha_1"] + 1e-9
        arrays = cache.get(LAYER_STAGE, layer_key(fit_trace.key, row["layer"]))[0]
        qkeys = layer_keys(model, Knobs(), fit_trace.key, row["layer"])
        y_q = cache.get("routed_q", stages.routed_q_key(qkeys, fit_trace.key, row["layer"]))[0][
            "y_q"
        ]
        y_ref = arrays["y_ref"].astype(np.float64)
        for name, alpha in (
            ("alpha_1", 1.0),
            ("gaussian", row["alpha_gaussian"]),
            ("mse", row["alpha_mse"]),
        ):
            want = np.sum((y_ref - alpha * y_q) ** 2) / np.sum(y_ref**2)
            assert row[f"cal.{name}"] == pytest.approx(want, rel=1e-6)
        assert row["alpha_mse"] == pytest.approx(
            np.sum(y_ref * y_q) / np.sum(y_q.astype(np.float64) ** 2), rel=1e-4
        )
        assert row["ridge.in_sample_change"] <= 0
    assert set(result["pooled"]) == {f"{s}.{v}" for s in ("cal", "heldout") for v in VARIANTS}
    assert result["tokens"]["cal"] > 0 and result["tokens"]["heldout"] > 0
    n = model.hparams.n_layer
    assert result["trial_eta_only"]["executed"] == {"part_b": n}
    assert result["trial_rho_only"]["executed"] == {  # no new basis
        "ridge_fit": n,
        "ridge_heldout": n,
        "part_b": n,
    }
    assert result["trial_quant_only"]["executed"] == {
        "quantize": n,
        "routed_q": n,
        "part_a": n,
        "residuals": n,
        "ridge_rhs": n,
        "ridge_fit": n,
        "ridge_heldout": n,
        "part_b": n,
    }


def test_bench_heal_prints_the_table(table, tmp_path):
    model, corpus, _, _ = table
    _register()
    run = CliRunner().invoke(
        app,
        [
            "bench",
            "heal",
            str(model.path),
            "--corpus",
            str(corpus.path),
            "--chunk-length",
            "64",
            "--heldout-every",
            "2",
            "--cache",
            str(tmp_path / "c"),
        ],
    )
    assert run.exit_code == 0, run.output
    assert "pooled over layers" in run.output and "only eta changed" in run.output
    assert run.output.count("%|") >= 8
