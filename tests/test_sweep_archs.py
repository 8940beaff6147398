"""heal → score → a 4-config sweep, end to end, on random deepseek2 and glm4moe files with Part B
active (slow tier: embedded Ray, real stages). The wall time is printed for the closing note."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from _tiny_corpus import write_tiny_corpus
from healsweep.model.synthetic import write_random_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "deepseek2": dict(n_leading_dense=1, kv_b_split=True, n_expert_groups=4, n_group_used=2,
                      yarn_factor=40.0, yarn_orig_ctx=64, yarn_log_mul=0.1),
    "glm4moe": dict(n_leading_dense=1, n_expert_groups=4, n_group_used=2, norm_topk_prob=True,
                    expert_weights_scale=2.0),
}


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_a_four_config_sweep_with_part_b(tmp_path, tiny_tokenizer, arch):
    model_path = write_random_model(tmp_path / "m.gguf", arch, n_layer=3, n_ff_exp=64, seed=5,
                                    tokenizer=tiny_tokenizer, **MODELS[arch])
    spec = {
        "name": f"e2e-{arch}",
        "model": str(model_path),
        "corpus": str(write_tiny_corpus(tmp_path / "corpus.jsonl")),
        "calibration": {"chunk_length": 64, "min_tokens_per_expert": 4},
        "fixed": {"ridge": True},
        "search_space": {"rho": [0.1, 1.0], "eta": [0.5, 1.0]},
        "max_concurrent": 1,
        "scoring": {"max_scored": 24, "max_context": 40, "batch": 4},
    }
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache")}
    started = time.perf_counter()
    run = subprocess.run([sys.executable, str(ROOT / "cli.py"), "sweep", "run", str(spec_path),
                          "--results", str(tmp_path / "results")],
                         capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - started
    print(f"{arch}: 4-config sweep in {wall:.0f} s")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "5 trials (5 completed)" in run.stdout, run.stdout[-2000:]  # 4 configs + baseline
    rows = pq.read_table(tmp_path / "results" / f"e2e-{arch}" / "windows").to_pylist()
    assert rows and all(r["kld_count"] > 0 for r in rows)
