"""`healsweep confirm`: the once-per-milestone opening of the test split, on real sweeps.

A small real sweep (embedded Ray, real heal and score stages, a tiny random GGUF) is run once
through the CLI; every test works on its own copy of the sweep folder, so each has its own ledger.
Figures in ``confirm.json`` are re-derived in float64 from the Parquet rows; the ledger is read
as raw JSON lines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from healsweep.confirm import confirm, file_sha256, frozen_hash
from healsweep.data.corpus import Document, Message, load_corpus, write_corpus
from healsweep.errors import LedgerError, SpecError, SplitError, TestSplitSealed
from healsweep.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
ANSWER = '<think>\nExperts route token {i} to a few places.\n</think>\n\n{{"name": "{i}"}}'
SWEEP = "tiny"


def _corpus(path: Path) -> Path:
    docs = []
    for i in range(4):
        text = "Mixture-of-experts models route every token to a few experts. " * (3 + i)
        docs.append(Document(f"cal-{i}", "cal", i, "cal", text=text, pool="calibration"))
    for i in range(6):
        question = "The quick brown fox jumps over the lazy dog? " * (2 + i)
        messages = (Message("user", question), Message("assistant", ANSWER.format(i=i)))
        docs.append(Document(f"chat-{i}", "chat", i, "chat", messages=messages))
        docs.append(Document(f"docs-{i}", "docs", i, "docs", text=f"Numbers {i} 2 3 4 5. " * 8))
    write_corpus(docs, path)
    return path


def _cli(*args: str, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_tokenizer):
    """A finished 2-config sweep (baseline and gain_d=0) on a tiny model, run by the CLI."""
    from healsweep.gguf_io.synthetic import write_random_model

    root = tmp_path_factory.mktemp("confirm")
    model = write_random_model(
        root / "m.gguf", n_layer=2, n_ff_exp=64, seed=5, tokenizer=tiny_tokenizer
    )
    spec = {
        "name": SWEEP,
        "model": str(model),
        "corpus": str(_corpus(root / "corpus.jsonl")),
        "calibration": {"chunk_length": 64, "min_tokens_per_expert": 4},
        "search_space": {"gain_d": [0.3, 0.0]},
        "max_concurrent": 1,
        "scoring": {"max_scored": 24, "max_context": 40, "batch": 4},
    }
    (root / "spec.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(root / "cache")}
    run = _cli("sweep", "run", str(root / "spec.yaml"), "--results", str(root / "results"), env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"root": root, "sweep": root / "results" / SWEEP, "env": env, "spec": spec}


@pytest.fixture()
def sweep_copy(swept, tmp_path, monkeypatch):
    """The sweep folder copied into a fresh results root (so the test has its own ledger)."""
    monkeypatch.setenv("HEALSWEEP_CACHE", swept["env"]["HEALSWEEP_CACHE"])
    target = tmp_path / "results" / SWEEP
    shutil.copytree(swept["sweep"], target)
    return target


def _ledger_lines(results: Path) -> list[dict]:
    path = results / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _trials(sweep_dir: Path) -> list[dict]:
    return pq.read_table(sweep_dir / "trials.parquet").to_pylist()


def _pooled_kld(rows: list[dict]) -> float:
    return float(
        np.sum([r["kld_sum"] for r in rows], dtype=np.float64)
        / np.sum([r["kld_count"] for r in rows], dtype=np.float64)
    )


def test_confirm_opens_before_scoring_records_the_result_and_refuses_a_second(
    sweep_copy, swept, capsys
):
    from healsweep.cli import main
    from healsweep.results.report import write_report

    results = sweep_copy.parent
    kinds_at_first_window: list[list[str]] = []

    def progress(message: str) -> None:
        if message.startswith("  window") and not kinds_at_first_window:
            kinds_at_first_window.append([e["kind"] for e in _ledger_lines(results)])

    summary = confirm(sweep_copy, "m1", n_boot=2000, progress=progress)
    assert kinds_at_first_window == [["confirm-open"]]  # on record before any window is scored
    opened, result = _ledger_lines(results)
    assert (opened["kind"], result["kind"]) == ("confirm-open", "confirm-result")
    trials = _trials(sweep_copy)
    base = next(t for t in trials if t["is_baseline"])
    best = min((t for t in trials if not t["is_baseline"]), key=lambda t: t["kld_mean"])
    assert opened["trial_ids"] == [base["trial_id"], best["trial_id"]]
    manifest = json.loads((sweep_copy / "manifest.json").read_text())
    assert opened["split_lock_id"] == manifest["split_lock_id"] == summary["split_lock_id"]
    frozen = [c["frozen_hash"] for c in summary["configs"]]
    assert opened["config_hashes"] == frozen and len(set(frozen)) == 2

    out = sweep_copy / "test" / "m1"
    digest = hashlib.sha256((out / "windows.parquet").read_bytes()).hexdigest()
    assert result["result_hash"] == digest == summary["result_hash"]
    assert result["open_hash"] == opened["hash"]
    assert json.loads((out / "confirm.json").read_text())["result_hash"] == digest

    rows = pq.read_table(out / "windows.parquet").to_pylist()
    corpus = load_corpus(swept["spec"]["corpus"])
    test_docs = {d.doc_id for d in corpus.documents if d.pool == "eval" and d.index % 2 == 0}
    assert {r["doc_id"] for r in rows} == test_docs  # the even-index documents, all of them
    dev_ids = set(
        pq.read_table(sweep_copy / "windows", columns=["window_id"])["window_id"].to_pylist()
    )
    assert not dev_ids & {r["window_id"] for r in rows}
    assert len(rows) == 2 * summary["windows"] and {r["milestone"] for r in rows} == {"m1"}

    by_config = {
        c: [r for r in rows if r["config_hash"] == c] for c in {r["config_hash"] for r in rows}
    }
    for config in summary["configs"]:
        kld = _pooled_kld(by_config[config["config_hash"]])
        assert config["pooled"]["kld_mean"] == pytest.approx(kld, rel=1e-9)
    base_kld = _pooled_kld(by_config[base["config_hash"]])
    best_kld = _pooled_kld(by_config[best["config_hash"]])
    comp, verdict = summary["configs"][1]["comparison"], summary["configs"][1]["verdict"]
    assert comp["rel_change"] == pytest.approx(best_kld / base_kld - 1, rel=1e-9)
    lo, hi = comp["rel_change_ci"]
    assert lo <= comp["rel_change"] <= hi
    assert verdict["checks"]["kld_improves"] == (hi < 0)

    before = (results / "ledger.jsonl").read_bytes()
    with pytest.raises(LedgerError, match="'m1' was already confirmed.*once per milestone"):
        confirm(sweep_copy, "m1")
    with pytest.raises(SystemExit) as exit_info:
        main(["confirm", str(sweep_copy), "--milestone", "m1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and "already confirmed" in err
    assert (results / "ledger.jsonl").read_bytes() == before

    report = (write_report(sweep_copy, n_boot=500)["markdown"]).read_text()
    section = report.split("## Dev and test (milestone m1)")[1].split("## ")[0]
    assert (
        "dev pooled KLD" in section and f"test pooled KLD ({summary['windows']} windows)" in section
    )
    base_row = next(line for line in section.splitlines() if line.startswith("| baseline |"))
    assert f"| {base_kld:.5f} | - | - | reference | recorded |" in base_row
    best_row = next(line for line in section.splitlines() if line.startswith("| gain_d=0 |"))
    assert f"| {best_kld:.5f} | {comp['rel_change']:+.2%} [{lo:+.2%}, {hi:+.2%}] |" in best_row

    pq.write_table(pq.read_table(out / "windows.parquet").slice(1), out / "windows.parquet")
    report = (write_report(sweep_copy, n_boot=500)["markdown"]).read_text()
    assert "| file changed |" in report  # the result no longer matches its ledger hash
