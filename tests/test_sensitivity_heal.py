"""The sensitivity pass and the allocator with the real healer and scorer, through the CLI (slow
tier: the types of the ladder need ggml's quantizer, llama-cpp-python).

On a random two-layer model whose rows fill blocks of 256 and a tiny corpus:
``healsweep sensitivity`` measures every move of the base config; a moved config, written by
``healsweep heal`` and scored by ``healsweep score`` as a GGUF file (another path through the
writer, the reader and the scorer), scores the pooled KLD the pass recorded for it; a
``sweep run`` of the same spec reads the pass back from the stage cache, scores the allocator's
proposal as a trial and reports it beside the best uniform recipe of its size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from healsweep.heal.knobs import Knobs

pytestmark = pytest.mark.slow

ROWS256 = dict(n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4, n_expert_used=2)
SCORING = {"max_scored": 24, "max_context": 40, "batch": 4, "max_windows": 3}
CALIBRATION = {"chunk_length": 64, "min_tokens_per_expert": 4}


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    code = "from healsweep.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=1800, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def setup(random_gguf, tmp_path_factory):
    from _tiny_corpus import write_tiny_corpus

    root = tmp_path_factory.mktemp("sens")
    model = random_gguf("qwen2moe", seed=11, **ROWS256)
    corpus = write_tiny_corpus(root / "corpus.jsonl")
    spec = {
        "name": "alloc", "model": str(model), "corpus": str(corpus),
        "calibration": CALIBRATION, "scoring": SCORING, "references": False,
        "max_concurrent": 1, "pruner": "none", "sampler": "allocator",
        "budget": {"routed_bpw": 2.1},
        "baseline": {"type_gu": "iq2_xxs", "type_d": "iq2_xxs", "alpha": "mse", "ridge": False},
        "allocator": {"ladder": ["iq1_m", "iq2_xxs", "iq2_xs"], "proposals": 1, "windows": 2},
    }  # fmt: skip
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(root / "cache")}
    return root, model, corpus, path, env


def test_the_pass_from_the_cli_and_a_moved_config_scored_as_a_file(setup):
    root, model, corpus, spec, env = setup
    out = root / "sens.json"
    run = _cli("sensitivity", str(spec), "--json", str(out), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sensitivity of 8 moves around iq2_xxs/iq2_xxs at 2.062 routed bpw" in run.stderr
    assert "| layer | group | move | Δ routed bpw |" in run.stdout
    assert "proposal within 2.1 bpw: " in run.stdout
    record = json.loads(out.read_text())
    table = record["sensitivity"]
    moves = [(m["layer"], m["group"], m["to"]) for m in table["moves"]]
    assert moves == [(0, "gu", "iq1_m"), (0, "gu", "iq2_xs"), (0, "d", "iq1_m"),
                     (0, "d", "iq2_xs"), (1, "gu", "iq1_m"), (1, "gu", "iq2_xs"),
                     (1, "d", "iq1_m"), (1, "d", "iq2_xs")]  # fmt: skip
    assert table["windows"] == 2
    for m in table["moves"]:
        assert m["delta_kld"] == pytest.approx(m["kld"] - table["base"]["kld"])
        lo, hi = m["rel_change_ci"]
        assert lo <= m["rel_change"] <= hi

    move = table["moves"][0]
    knobs = root / "moved.yaml"
    knobs.write_text(yaml.safe_dump(move["knobs"]))
    healed = root / "moved.gguf"
    heal = _cli("heal", str(model), "--knobs", str(knobs), "--out", str(healed),
                "--corpus", str(corpus), "--chunk-length", "64", "--min-tokens-per-expert", "4",
                env=env)  # fmt: skip
    assert heal.returncode == 0, heal.stderr[-3000:]
    scored = root / "moved-score.json"
    score = _cli("score", "--model", str(healed), "--ref", str(model), "--corpus", str(corpus),
                 "--max-windows", "2", "--max-scored", "24", "--max-context", "40",
                 "--json", str(scored), env=env)  # fmt: skip
    assert score.returncode == 0, score.stderr[-3000:]
    pooled = json.loads(scored.read_text())["pooled"]["kld_mean"]
    assert pooled == pytest.approx(move["kld"], rel=2e-3)


def test_an_allocator_sweep_reads_the_pass_back_and_reports_its_proposal(setup):
    root, _, _, spec, env = setup
    results = root / "results"
    run = _cli("sweep", "run", str(spec), "--results", str(results), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "configs cached, 0 to score" in run.stderr  # the CLI's pass, read back
    sweep_dir = results / "alloc"
    record = json.loads((sweep_dir / "allocator.json").read_text())
    proposal = Knobs(**record["proposals"][0]["knobs"])
    trials = pq.read_table(sweep_dir / "trials.parquet").to_pylist()
    rows = [t for t in trials if Knobs(**{k[5:]: v for k, v in t.items()
                                          if k.startswith("knob_")}) == proposal]  # fmt: skip
    assert rows and rows[0]["status"] == "completed" and rows[0]["routed_bpw"] <= 2.1
    report = _cli("report", str(sweep_dir), "--n-boot", "200", env=env)
    assert report.returncode == 0, report.stderr[-3000:]
    text = (sweep_dir / "report" / "report.md").read_text()
    assert "## Sensitivity of each tensor group" in text
    if proposal.layer_types or proposal.type_gu != proposal.type_d:
        assert "## Allocations beside the best uniform recipe of their size" in text


def test_a_ladder_without_the_base_type_is_one_line(setup):
    root, _, _, spec, env = setup
    raw = yaml.safe_load(Path(spec).read_text())
    raw["allocator"]["ladder"] = ["iq1_m", "iq2_xs"]
    bad = root / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    run = _cli("sensitivity", str(bad), env=env)
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "field 'allocator.ladder' = ['iq1_m', 'iq2_xs'] lacks iq2_xxs" in run.stderr
