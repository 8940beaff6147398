"""`healsweep export RESULTS/NAME`: a sweep's trial rebuilt from its stored knobs and written.

The sweep folder is made with the sweep's own writers (spec + manifest by ``start_manifest``,
``trials.parquet`` in the trial schema) on a tiny random model, so no Ray run is needed; the test
split is opened by the real ``confirm``, whose ledger entries are read back as raw JSON lines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _tiny_corpus import write_tiny_corpus
from healsweep.cache import StageCache
from healsweep.errors import ResultsError
from healsweep.heal.knobs import Knobs
from healsweep.heal.pipeline import build_student
from healsweep.model import open_model
from healsweep.quant.formats import Q2_0

ROOT = Path(__file__).resolve().parents[1]
N = 30  # dev windows: each trial's window rows carry its KLD times a small per-window wobble
TRIALS = {  # trial id -> (is_baseline, status, dev KLD, knob changes)
    "base": (True, "completed", 0.30, {}),
    "t-good": (False, "completed", 0.20, {"gain_d": 0.0}),
    "t-worse": (False, "completed", 0.25, {"eta": 0.3}),
    "t-pruned": (False, "pruned", 0.10, {"rho": 2.0}),
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_tokenizer):
    from healsweep.model.synthetic import write_random_model
    from healsweep.results.schema import knob_columns, to_table, trial_schema
    from healsweep.results.store import TRIALS_FILE, atomic_write_table
    from healsweep.sweep.manifest import start_manifest
    from healsweep.sweep.space import config_hash
    from healsweep.sweep.spec_files import spec_from_dict
    from healsweep.sweep.work import sweep_identity

    root = tmp_path_factory.mktemp("export-trial")
    model = write_random_model(
        root / "m.gguf", n_layer=2, n_ff_exp=64, seed=5, tokenizer=tiny_tokenizer
    )
    spec = spec_from_dict({
        "name": "tiny", "model": str(model), "corpus": str(write_tiny_corpus(root / "c.jsonl")),
        "calibration": {"chunk_length": 64, "min_tokens_per_expert": 4},
        "search_space": {"gain_d": [0.3, 0.0]},
        "scoring": {"max_scored": 24, "max_context": 40, "batch": 4},
    })  # fmt: skip
    sweep_dir = root / "results" / "tiny"
    sweep_dir.mkdir(parents=True)
    start_manifest(sweep_dir, spec, sweep_identity(spec), "run")
    rows = []
    for trial_id, (is_base, status, kld, changes) in TRIALS.items():
        knobs = Knobs(**changes)
        rows.append({"sweep": "tiny", "trial_id": trial_id, "config_hash": config_hash(knobs),
                     "is_baseline": is_base, **knob_columns(knobs), "status": status,
                     "pruned": status == "pruned", "kld_mean": kld,
                     "role": "baseline" if is_base else "trial"})  # fmt: skip
        write_dev_windows(sweep_dir, rows[-1], kld, 8 if status == "pruned" else N)
    atomic_write_table(to_table(rows, trial_schema()), sweep_dir / TRIALS_FILE)
    return {"root": root, "sweep": sweep_dir, "spec": spec}


def write_dev_windows(sweep_dir: Path, trial: dict, kld: float, scored: int) -> None:
    """The dev window rows of ``trial`` (its row of trials.parquet): ``kld`` on every window, times
    a fixed wobble shared by all trials (so that paired differences are exact ratios)."""
    from healsweep.results.schema import to_table, window_schema
    from healsweep.results.store import atomic_write_table

    wobble = np.random.default_rng(3).uniform(0.8, 1.2, N)
    keep = ("sweep", "trial_id", "config_hash", "is_baseline", "role")
    knobs = {k: v for k, v in trial.items() if k.startswith("knob_")}
    rows = [
        {**{k: trial[k] for k in keep}, **knobs, "window_id": f"w{i:03d}", "window_index": i,
         "windows_total": N, "stratum": ("code", "docs")[i % 2], "kld_sum": kld * wobble[i] * 50,
         "kld_count": 50, "kld_mean": kld * wobble[i], "top1": 0.9, "top1_count": 45,
         "pruned": trial["status"] == "pruned"}
        for i in range(scored)
    ]  # fmt: skip
    folder = sweep_dir / "windows"
    folder.mkdir(exist_ok=True)
    atomic_write_table(to_table(rows, window_schema()), folder / f"trial-{trial['trial_id']}.parquet")


@pytest.fixture()
def sweep_copy(sweep, tmp_path):
    target = tmp_path / "results" / "tiny"
    shutil.copytree(sweep["sweep"], target)
    return target


def _cli(*args, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HEALSWEEP_CACHE": str(cache)}
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), "export", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip


def test_best_trial_is_rebuilt_from_its_knobs_and_says_it_is_unconfirmed(sweep, tmp_path):
    out = tmp_path / "best.gguf"
    run = _cli(sweep["sweep"], "--out", out, cache=tmp_path / "cold-cache")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "trial t-good" in run.stdout  # t-pruned has a lower KLD but did not complete
    assert "[best] trial t-good" in run.stdout and "decision rule accepts" in run.stdout
    lines = [line for line in run.stdout.splitlines() if line.startswith("[test]")]
    assert len(lines) == 1 and "not confirmed" in lines[0]
    model = open_model(out)
    knobs = Knobs(**TRIALS["t-good"][3])
    assert json.loads(model.metadata("healsweep.knobs")) == knobs.model_dump()
    assert model.metadata("healsweep.trial_id") == "t-good"
    assert model.metadata("healsweep.ledger_entry") is None
    student = build_student(
        open_model(sweep["spec"].model), knobs, sweep["spec"].calibration,
        StageCache(tmp_path / "cache"),
    )  # fmt: skip
    assert model.metadata("healsweep.student_key") == student.key
    for layer, replacement in student.replacements.items():
        raw = model.raw_rows(f"blk.{layer}.ffn_down_exps.weight")
        np.testing.assert_array_equal(raw, Q2_0.gguf_rows(replacement.down_exps))
    # `model info` shows what the file carries: knobs, types, teacher, trial, test-split state
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cold-cache")}
    info = subprocess.run([sys.executable, str(ROOT / "cli.py"), "model", "info", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert info.returncode == 0, info.stderr
    shown = info.stdout[info.stdout.index("healsweep    written by healsweep"):]
    assert "knobs        gain_d=0.0 (others at defaults)" in shown
    assert f"teacher      {model.metadata('healsweep.teacher_fingerprint')}" in shown
    assert f"trial t-good (config {model.metadata('healsweep.config_hash')})" in shown
    assert "not confirmed on the test split" in shown
    assert "experts      q2_0, routed experts 2.25 bits per weight" in shown
    assert "layer types  0:q2_0/q2_0,1:q2_0/q2_0 (layer:gate-up/down)" in shown


def test_a_named_trial_and_the_baseline_export_their_own_knobs(sweep, tmp_path):
    from healsweep.deliver import export_trial

    cache = StageCache(tmp_path / "cache")
    for trial_id in ("t-worse", "base"):
        result = export_trial(sweep["sweep"], tmp_path / f"{trial_id}.gguf", trial_id=trial_id,
                              cache=cache)  # fmt: skip
        model = open_model(result.path)
        assert (
            json.loads(model.metadata("healsweep.knobs"))
            == Knobs(**TRIALS[trial_id][3]).model_dump()
        )
        assert result.confirmation is None


def test_a_confirmed_trial_records_its_ledger_entry(sweep_copy, tmp_path, monkeypatch):
    from healsweep.confirm import confirm
    from healsweep.deliver import export_trial

    monkeypatch.setenv("HEALSWEEP_CACHE", str(tmp_path / "cache"))
    confirm(sweep_copy, "m1", trial_ids=["t-good"], n_boot=200)
    entries = [json.loads(x) for x in (sweep_copy.parent / "ledger.jsonl").read_text().splitlines()]
    result_entry = next(e for e in entries if e["kind"] == "confirm-result")
    opened = next(e for e in entries if e["kind"] == "confirm-open")
    result = export_trial(sweep_copy, tmp_path / "c.gguf", trial_id="t-good")
    assert result.frozen_hash in opened["config_hashes"]
    model = open_model(result.path)
    assert model.metadata("healsweep.ledger_entry") == result_entry["hash"]
    assert model.metadata("healsweep.ledger_open_entry") == opened["hash"]
    assert model.metadata("healsweep.confirmed_milestone") == "m1"
    info = subprocess.run([sys.executable, str(ROOT / "cli.py"), "model", "info", str(result.path)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert (f"test         confirmed in milestone 'm1'; ledger entry {result_entry['hash']}"
            in info.stdout), info.stdout + info.stderr  # fmt: skip
    head = json.loads(model.metadata("healsweep.ledger_head"))  # the head this export saw
    assert head == {"entries": len(entries), "hash": entries[-1]["hash"]}
    # A ledger cut back below a head the sweep recorded counts no confirmation (issue 40).
    ledger = sweep_copy.parent / "ledger.jsonl"
    kept = ledger.read_bytes()
    ledger.write_text("".join(kept.decode().splitlines(keepends=True)[:-1]))
    (sweep_copy.parent / "ledger.jsonl.head").write_text(
        json.dumps({"entries": len(entries) - 1, "hash": entries[-2]["hash"]}))  # fmt: skip
    cut = export_trial(sweep_copy, tmp_path / "cut.gguf", trial_id="t-good")
    assert cut.confirmation is None and "no confirmation counts" in cut.notes[-1]
    assert "entries were removed or the ledger was replaced" in cut.notes[-1]
    ledger.write_bytes(kept)
    (sweep_copy.parent / "ledger.jsonl.head").write_text(
        json.dumps({"entries": len(entries), "hash": entries[-1]["hash"]}))  # fmt: skip
    # A trial the milestone did not score stays unconfirmed.
    other = export_trial(sweep_copy, tmp_path / "w.gguf", trial_id="t-worse")
    assert other.confirmation is None
    # A windows file changed after the fact no longer counts (the ledger holds another hash).
    windows = sweep_copy / "test" / "m1" / "windows.parquet"
    windows.write_bytes(windows.read_bytes() + b"x")
    again = export_trial(sweep_copy, tmp_path / "c2.gguf", trial_id="t-good")
    assert again.confirmation is None and "file changed" in again.notes[0]
    assert open_model(again.path).metadata("healsweep.ledger_entry") is None


def test_unknown_trial_and_changed_model_are_one_line(sweep_copy, sweep, tmp_path):
    run = _cli(sweep_copy, "--trial", "nope", "--out", tmp_path / "x.gguf", cache=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "'nope'" in run.stderr
    assert not (tmp_path / "x.gguf").exists()
    spec = json.loads((sweep_copy / "spec.json").read_text())
    other = tmp_path / "other.gguf"
    shutil.copy(spec["model"], other)
    with open(other, "r+b") as fh:  # one tensor byte changed: another model
        fh.seek(-3, 2)
        fh.write(b"\x11")
    spec["model"] = str(other)
    (sweep_copy / "spec.json").write_text(json.dumps(spec))
    run = _cli(sweep_copy, "--best", "--out", tmp_path / "y.gguf", cache=tmp_path)
    assert run.returncode == 1 and "changed after the sweep" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_best_exports_only_an_accepted_trial_unless_told(sweep_copy, tmp_path):
    """``export --best`` takes the best trial the decision rule accepts; when none is accepted
    it refuses, naming the best trial by dev KLD and its verdict, and exports that one only with
    ``--allow-rejected``; when nothing beat the baseline, --allow-rejected exports the baseline."""
    from healsweep.deliver import choose_best
    from healsweep.results.store import read_trials

    trials = read_trials(sweep_copy).to_pylist()
    row, why = choose_best(sweep_copy, trials)
    assert row["trial_id"] == "t-good" and "accepts" in why
    by_id = {t["trial_id"]: t for t in trials}
    # t-good now 5% better on average but 60% worse on every "docs" window: not accepted
    wobble = np.random.default_rng(3).uniform(0.8, 1.2, N)
    write_dev_windows(sweep_copy, by_id["t-good"], 0.0, N)  # rewritten below, per window
    from healsweep.results.schema import to_table, window_schema
    from healsweep.results.store import atomic_write_table, read_windows

    rows = [r for r in read_windows(sweep_copy).to_pylist() if r["trial_id"] == "t-good"]
    for r in rows:
        factor = 0.3 if r["stratum"] == "code" else 1.6
        r["kld_mean"] = 0.30 * factor * wobble[r["window_index"]]
        r["kld_sum"] = r["kld_mean"] * 50
    atomic_write_table(to_table(rows, window_schema()),
                       sweep_copy / "windows" / "trial-t-good.parquet")  # fmt: skip
    write_dev_windows(sweep_copy, by_id["t-worse"], 0.31, N)  # worse than the baseline
    run = _cli(sweep_copy, "--best", "--out", tmp_path / "r.gguf", cache=tmp_path / "c")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "no trial passes the decision rule" in run.stderr and "trial t-good" in run.stderr
    assert "not accepted (" in run.stderr and "--allow-rejected" in run.stderr
    assert not (tmp_path / "r.gguf").exists()
    row, why = choose_best(sweep_copy, trials, allow_rejected=True)
    assert row["trial_id"] == "t-good" and "exported with --allow-rejected" in why
    # nothing beats the baseline: refused, and --allow-rejected takes the baseline
    write_dev_windows(sweep_copy, by_id["t-good"], 0.32, N)
    with pytest.raises(ResultsError, match="no completed trial beat the baseline"):
        choose_best(sweep_copy, trials)
    row, why = choose_best(sweep_copy, trials, allow_rejected=True)
    assert row["trial_id"] == "base" and "exporting the baseline" in why
    run = _cli(sweep_copy, "--trial", "t-good", "--allow-rejected", "--out", tmp_path / "x.gguf",
               cache=tmp_path / "c")  # fmt: skip
    assert run.returncode != 0 and "--allow-rejected goes with --best" in run.stderr
