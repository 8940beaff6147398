"""End to end through the real pipeline: `healsweep sweep run` (embedded Ray, real heal and
score stages) on a small random GGUF and corpus, then `sweep status` and `healsweep report`.

A recorded window's KLD is recomputed independently (float64 numpy over the forward's logits of
the teacher and of the healed student) and the windows are checked to be exactly the dev split.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from _tiny_corpus import write_tiny_corpus
from healsweep.cache import StageCache
from healsweep.data.corpus import load_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.model import forward, open_model
from healsweep.model.synthetic import write_random_model

ROOT = Path(__file__).resolve().parents[1]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_cli_sweep_on_the_real_pipeline_then_status_and_report(tmp_path, tiny_tokenizer):
    model_path = write_random_model(
        tmp_path / "m.gguf", n_layer=2, n_ff_exp=64, seed=5, tokenizer=tiny_tokenizer
    )
    corpus_path = write_tiny_corpus(tmp_path / "corpus.jsonl")
    spec = {
        "name": "e2e",
        "model": str(model_path),
        "corpus": str(corpus_path),
        "calibration": {"chunk_length": 64, "min_tokens_per_expert": 4},
        "search_space": {"gain_d": [0.3, 0.0]},
        "max_concurrent": 1,
        # exact teacher cache: the float64 check below is to rounding (compact: tests/test_score*)
        "scoring": {"max_scored": 24, "max_context": 40, "batch": 4, "teacher_cache": "exact"},
    }
    spec_path = tmp_path / "e2e.yaml"
    spec_path.write_text(json.dumps(spec))  # JSON is YAML
    # The teacher's records made ahead of scoring, as on a GPU (score.runner.teacher_ahead): a
    # real sweep's trials build their student beside that thread, in fresh processes (where the
    # stage keys' first parse of the sources met the thread's: _code's parse lock).
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache"), "HEALSWEEP_TEACHER_AHEAD": "on"}
    run = _cli("sweep", "run", str(spec_path), "--results", str(tmp_path / "results"), env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        "2 trials (2 completed); reference unhealed completed, reference plain completed"
        in run.stdout
    )
    assert "Token authentication" not in run.stdout + run.stderr  # the embedded Ray's notice

    sweep_dir = tmp_path / "results" / "e2e"
    rows = pq.read_table(sweep_dir / "windows").to_pylist()
    model = open_model(model_path)
    corpus = load_corpus(corpus_path)
    dev = make_windows(corpus, model.tokenizer(), parity_split(corpus), split="dev",
                       max_scored=24, max_context=40)  # fmt: skip
    assert {r["window_id"] for r in rows} == {w.window_id for w in dev}
    assert len(rows) == 4 * len(dev)  # 2 trials + the unhealed and plain reference rows
    assert all(int(r["doc_id"].split("-")[1]) % 2 == 1 for r in rows)  # dev = odd index only
    trials = pq.read_table(sweep_dir / "trials.parquet").to_pylist()
    assert sorted(t["role"] for t in trials) == ["baseline", "reference", "reference", "trial"]
    references = {t["label"]: t for t in trials if t["role"] == "reference"}
    assert all(t["status"] == "completed" and not t["pruned"] for t in references.values())
    assert all(not r["pruned"] for r in rows if r["role"] == "reference")

    # a reference row is exactly a direct score of the same student on the same windows
    from healsweep.score.runner import score_windows

    calib = CalibrationConfig(**spec["calibration"], corpus=str(corpus_path))
    cache = StageCache(tmp_path / "cache")
    for name, knobs in (("unhealed", Knobs(alpha="none", ridge=False)),
                        ("plain", Knobs(quantizer="plain", alpha="none", ridge=False))):  # fmt: skip
        student = build_student(model, knobs, calib, cache)
        direct = {w.window_id: m.to_dict() for w, m in
                  score_windows(model, student, dev, cache, batch=4, teacher_cache="exact")}  # fmt: skip
        recorded = [r for r in rows if r["trial_id"] == references[name]["trial_id"]]
        assert {r["window_id"] for r in recorded} == set(direct)
        for r in recorded:
            assert r["kld_sum"] == pytest.approx(direct[r["window_id"]]["kld_sum"], rel=1e-5)
            assert r["top1_count"] == direct[r["window_id"]]["top1_count"]

    # one baseline window recomputed independently: float64 KL over the forward's logits
    window = next(w for w in dev if w.kind == "answer")
    row = next(r for r in rows if r["window_id"] == window.window_id and r["is_baseline"])
    student = build_student(model, Knobs(), CalibrationConfig(**spec["calibration"], corpus=str(corpus_path)),
                            StageCache(tmp_path / "cache"))  # fmt: skip
    positions = np.arange(window.scored_from - 1, window.scored_from - 1 + window.n_scored)
    teacher = forward(model, [window.tokens]).logits[0][positions]
    healed = forward(model, [window.tokens], replacements=student.replacements).logits[0][positions]
    p_log, q_log = _log_softmax(teacher), _log_softmax(healed)
    kld = (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)
    assert row["kld_count"] == window.n_scored
    assert row["kld_sum"] == pytest.approx(kld.sum(), rel=2e-3, abs=1e-6)
    assert row["top1"] == pytest.approx(np.mean(teacher.argmax(-1) == healed.argmax(-1)))

    status = _cli("sweep", "status", str(sweep_dir), env=env)
    assert status.returncode == 0 and "2 completed" in status.stdout, status.stderr
    report = _cli("report", str(sweep_dir), "--n-boot", "500", env=env)
    assert report.returncode == 0, report.stderr
    text = (sweep_dir / "report" / "report.md").read_text()
    # leaderboard rows: config, its trial ids, role, status
    assert re.search(r"\| gain_d=0 \| [\w-]+ \| trial \| completed \|", text) and "95% CI" in text
    assert re.search(r"\| unhealed \| ref-[\w-]+ \| reference \| completed \|", text), text
    assert re.search(r"\| plain \| ref-[\w-]+ \| reference \|", text)
    assert "Δ KLD vs unhealed [95% CI]" in text and "Δ KLD vs plain [95% CI]" in text
    assert ("ACCEPT" in text) or ("reject" in text)
    for png in ("forest.png", "paired_windows.png", "knob_effects.png"):
        assert (sweep_dir / "report" / png).read_bytes()[:4] == b"\x89PNG"
    assert "<table>" in (sweep_dir / "report" / "report.html").read_text()
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert manifest["model_fingerprint"] == model.fingerprint
