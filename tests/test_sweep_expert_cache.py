"""moce_bonus and cache_experts as sweep knobs: a real sweep (embedded Ray, real heal and score
stages) over the bonus on a small random GGUF, then the report's cache columns and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from _tiny_corpus import write_tiny_corpus
from healsweep.model.synthetic import write_random_model

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip


@pytest.mark.slow  # 26-66 s each: the default tier stays near 15 minutes (stop 44)
def test_a_bonus_sweep_heals_once_and_reports_hit_rate_and_mib(tmp_path, tiny_tokenizer):
    model_path = write_random_model(tmp_path / "m.gguf", n_layer=2, n_expert=8, n_ff_exp=64,
                                    seed=5, tokenizer=tiny_tokenizer)  # fmt: skip
    spec = {
        "name": "cache",
        "model": str(model_path),
        "corpus": str(write_tiny_corpus(tmp_path / "corpus.jsonl")),
        # unhealed Q2_0 (no calibration trace needed), a cache of 3 of the 8 experts
        "baseline": {"alpha": "none", "ridge": False, "cache_experts": 3},
        "search_space": {"moce_bonus": [0.0, 0.3]},
        "max_concurrent": 1,
        "scoring": {"max_scored": 24, "max_context": 40, "batch": 4},
        # the baseline is already unhealed: that reference row re-uses its quantized layers
        # (the plain reference would quantize each layer once more)
        "references": ["unhealed"],
    }
    spec_path = tmp_path / "cache.yaml"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache")}
    run = _cli("sweep", "run", str(spec_path), "--results", str(tmp_path / "results"), env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 trials (2 completed)" in run.stdout

    # both trials heal the same student: each (layer, tensor group) was quantized once (one
    # quantize entry per layer for gate/up and one for down)
    assert len(list((tmp_path / "cache" / "quantize").rglob("*.hsc"))) == 2 * 2

    sweep_dir = tmp_path / "results" / "cache"
    rows = pq.read_table(sweep_dir / "windows").to_pylist()
    by_bonus: dict[float, list[dict]] = {}
    for row in rows:
        assert row["knob_cache_experts"] == 3
        assert row["cache_tokens"] == row["kld_count"] and row["cache_lookups"] == row["kld_count"] * 2 * 2  # layers x k
        by_bonus.setdefault(row["knob_moce_bonus"], []).append(row)

    def hit_rate(rs):
        return 1 - sum(r["cache_misses"] for r in rs) / sum(r["cache_lookups"] for r in rs)

    assert hit_rate(by_bonus[0.3]) > hit_rate(by_bonus[0.0])

    report = _cli("report", str(sweep_dir), "--n-boot", "200", env=env)
    assert report.returncode == 0, report.stderr
    assert "hit rate" in report.stdout and "MiB/token" in report.stdout
    text = (sweep_dir / "report" / "report.md").read_text()
    assert "| pooled KLD | hit rate | MiB/token |" in text
    assert f"| {hit_rate(by_bonus[0.0]):.2%} |" in text
    assert (sweep_dir / "report" / "kld_vs_mib.png").read_bytes()[:4] == b"\x89PNG"
