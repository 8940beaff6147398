"""Reference and external rows: the ``plain`` quantizer against a float64 re-implementation of its
definition, its stage and export, an external GGUF scored in a real sweep (embedded Ray) beside
the ``plain`` reference it was exported from, and one-line spec errors for bad externals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from _tiny_corpus import write_tiny_corpus
from healsweep.cache import StageCache
from healsweep.conformance.references import q2_0_plain as _plain_f64
from healsweep.gguf_io import routed_expert_bpw
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.quantize import reads_trace
from healsweep.heal.reads import stage_reads
from healsweep.kernels import q2_0_plain
from healsweep.model import open_model
from healsweep.model.synthetic import train_tiny_tokenizer, write_random_model

ROOT = Path(__file__).resolve().parents[1]
CAL = {"chunk_length": 64, "min_tokens_per_expert": 4}
PLAIN = Knobs(quantizer="plain", alpha="none", ridge=False)


def test_plain_codes_and_scales_are_the_definition_and_round_trip_within_half_a_step():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 8, 256)) * rng.uniform(1e-3, 2, (3, 8, 1))).astype(np.float32)
    w[0, 0, :64] = 0.0  # an all-zero block: d = 0, every code 0
    w[0, 1, 5] = -9.0  # a block whose extreme is negative: a negative d mirrors the grid
    w[1, 2, 64:128] *= 1e-9  # a tiny block
    d, q = (np.asarray(a) for a in q2_0_plain.quantize(w))
    d_ref, q_ref = _plain_f64(w)
    assert d.dtype == np.float16 and q.dtype == np.int8 and d.shape == (3, 8, 4)
    np.testing.assert_array_equal(d.view(np.uint16), d_ref.view(np.uint16))
    np.testing.assert_array_equal(q, q_ref)
    assert set(np.unique(q)) <= {-1, 0, 1, 2}
    assert d[0, 0, 0] == 0 and not q[0, 0, :64].any()
    assert d[0, 1, 0] == np.float16(-4.5) and q[0, 1, 5] == 2  # the extreme is exactly 2·d
    # round trip: within |d|/2 where w/d >= -1.5 (the grid's long side), |d| elsewhere, up to
    # the fp16 rounding of d (relative 2^-11, or the subnormal quantum 2^-24 times |q| <= 2)
    blocks = w.astype(np.float64).reshape(3, 8, 4, 64)
    d64 = np.broadcast_to(d.astype(np.float64)[..., None], blocks.shape)
    err = np.abs(blocks - q.reshape(blocks.shape) * d64)
    step, tol = np.abs(d64), 1e-3 * np.abs(d64) + 2.0**-23
    with np.errstate(divide="ignore", invalid="ignore"):
        long_side = np.where(step > 0, blocks / d64 >= -1.5, True)
    assert np.all(err[long_side] <= step[long_side] / 2 + tol[long_side])
    assert np.all(err <= step + tol)
    assert (~long_side).any()  # the short side was exercised


def test_plain_reads_no_knob_and_exports_as_ordinary_q2_0(tmp_path, tiny_tokenizer):
    from healsweep.heal.export import write_healed_gguf
    from healsweep.heal.quantize import layer_keys

    assert stage_reads(PLAIN, "quantize") == {"quantizer": "plain"}
    assert not any(reads_trace(PLAIN, group, "q2_0") for group in ("gu", "d"))
    path = write_random_model(tmp_path / "m.gguf", n_layer=2, n_ff_exp=64, seed=5,
                              tokenizer=tiny_tokenizer)  # fmt: skip
    model = open_model(path)
    other = PLAIN.replace(gain_d=0.0, gain_gu=1.0, importance="act")  # read by search, not plain
    assert layer_keys(model, PLAIN, None, 0) == layer_keys(model, other, "trace", 0)
    corpus = str(write_tiny_corpus(tmp_path / "c.jsonl"))
    cache = StageCache(tmp_path / "cache")
    student = build_student(model, PLAIN, CalibrationConfig(corpus=corpus, **CAL), cache)
    assert student.report["calibration"] is None  # no teacher pass
    for name in ("gate", "up", "down"):
        d, q = _plain_f64(np.asarray(model.tensor(f"blk.1.ffn_{name}_exps.weight"), np.float32))
        experts = student.replacements[1]
        got = getattr(experts, f"{name}_exps")
        np.testing.assert_array_equal(np.asarray(got.d).view(np.uint16), d.view(np.uint16))
        np.testing.assert_array_equal(got.q, q)
    exported = write_healed_gguf(student, tmp_path / "plain.gguf")
    assert routed_expert_bpw(open_model(exported)) == 2.25


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    """A tiny model and corpus, and the model's `plain` student exported as a type-42 GGUF."""
    from healsweep.heal.export import write_healed_gguf

    root = tmp_path_factory.mktemp("refs")
    model = write_random_model(root / "m.gguf", n_layer=2, n_ff_exp=64, seed=5,
                               tokenizer=tiny_tokenizer)  # fmt: skip
    corpus = write_tiny_corpus(root / "corpus.jsonl")
    cal = CalibrationConfig(corpus=str(corpus), **CAL)
    student = build_student(open_model(model), PLAIN, cal, StageCache(root / "cache"))
    exported = write_healed_gguf(student, root / "plain-export.gguf")
    return {"root": root, "model": model, "corpus": corpus, "exported": exported}


def _spec(tiny: dict, **extra) -> dict:
    return {
        "name": "refs",
        "model": str(tiny["model"]),
        "corpus": str(tiny["corpus"]),
        "calibration": CAL,
        "max_concurrent": 1,
        "scoring": {"max_scored": 24, "max_context": 40, "batch": 4, "teacher_cache": "exact",
                    "max_windows": 6},
        **extra,
    }  # fmt: skip


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


@pytest.mark.slow  # 26-66 s each: the default tier stays near 15 minutes (stop 44)
def test_an_external_gguf_is_scored_like_a_trial_beside_the_reference_it_came_from(tiny, tmp_path):
    from healsweep.results.aggregate import summarize

    spec = _spec(tiny, references=["plain"],
                 external=[{"name": "plain-export", "path": str(tiny["exported"])}])  # fmt: skip
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(tiny["root"] / "cache")}
    run = _cli("sweep", "run", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"), env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert (
        "1 trials (1 completed); reference plain completed, external plain-export completed"
        in run.stdout
    )
    sweep_dir = tmp_path / "r" / "refs"
    trials = {t["trial_id"]: t for t in pq.read_table(sweep_dir / "trials.parquet").to_pylist()}
    ext = trials["ext-plain-export"]
    assert ext["role"] == "external" and ext["external_path"] == str(tiny["exported"])
    assert ext["routed_bpw"] == 2.25 and ext["status"] == "completed" and not ext["pruned"]
    assert ext["knob_alpha"] is None  # no knobs: a file, not a config
    rows = pq.read_table(sweep_dir / "windows").to_pylist()
    by = {}
    for r in rows:
        by.setdefault(r["trial_id"], {})[r["window_id"]] = r
    assert set(by["ext-plain-export"]) == set(by["ref-plain"]) == set(by[next(
        t for t in trials if trials[t]["role"] == "baseline")])  # fmt: skip
    # the exported file runs the plain student's forward: the same KLD on every window
    for window_id, row in by["ext-plain-export"].items():
        assert row["role"] == "external"
        assert row["kld_sum"] == pytest.approx(by["ref-plain"][window_id]["kld_sum"], rel=1e-4)
    summary = summarize(sweep_dir, n_boot=200)
    external = next(c for c in summary.configs if c.role == "external")
    assert external.verdict is not None and "plain" in external.vs_references
    assert abs(external.vs_references["plain"].rel_change) < 1e-4

    # a second run of the same spec under a new name re-uses nothing it should not, and a
    # resume of the finished sweep scores no reference or external window again
    before = len(rows)
    again = _cli("sweep", "resume", str(sweep_dir), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert pq.read_table(sweep_dir / "windows").num_rows == before


@pytest.mark.slow  # 26-66 s each: the default tier stays near 15 minutes (stop 44)
def test_a_grid_point_that_is_a_reference_is_scored_once_and_listed_with_it(tiny, tmp_path):
    """``unhealed`` is the baseline without Part A and B, and so is the grid point ``alpha:
    none, ridge: false``: one student. The reference scores it (before the trials); the trial
    replays those very records (same scoring time and host, not a second scoring), and the
    report lists the two names as one config."""
    from healsweep.results.aggregate import summarize
    from healsweep.results.report import describe, leaderboard

    spec = _spec(tiny, references=["unhealed"],
                 search_space={"alpha": ["gaussian", "none"], "ridge": [True, False]})  # fmt: skip
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(tiny["root"] / "cache")}
    run = _cli("sweep", "run", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"), env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "4 trials (4 completed); reference unhealed completed" in run.stdout
    sweep_dir = tmp_path / "r" / "refs"
    rows = pq.read_table(sweep_dir / "windows").to_pylist()
    by: dict[tuple, dict] = {}
    for r in rows:
        by.setdefault((r["knob_alpha"], r["knob_ridge"], r["role"]), {})[r["window_id"]] = r
    reference, trial = by[("none", False, "reference")], by[("none", False, "trial")]
    assert set(reference) == set(trial) and len(trial) == 6
    for window_id, row in trial.items():
        scored = reference[window_id]
        for key in ("kld_sum", "kld_count", "top1_count", "scored_at", "scored_hostname"):
            assert row[key] == scored[key], key  # the reference's record, not a second scoring
    others = [w for key, w in by.items() if key[:2] != ("none", False)]
    assert len(others) == 3 and all(set(w) == set(trial) for w in others)
    assert all(  # a student of its own is scored on its own (another scoring time)
        w[i]["scored_at"] != trial[i]["scored_at"] for w in others for i in trial
    )
    summary = summarize(sweep_dir, n_boot=200)
    assert len(summary.configs) == 4  # baseline, two trials, and one row for the shared student
    shared = next(c for c in summary.configs if c.also)
    assert describe(shared, summary.baseline) == "alpha=none, ridge=False = unhealed"
    assert shared.role == "trial" and shared.verdict is not None  # judged as the trial it is
    assert [r.reference for r in summary.references] == ["unhealed"]
    header, table = leaderboard(summary)
    assert "Δ KLD vs unhealed [95% CI]" in header
    assert [row[3] for row in table if row[1].endswith("= unhealed")] == ["trial, reference"]


@pytest.mark.parametrize("problem", ["missing", "garbage", "vocabulary"])
def test_a_bad_external_is_one_line_at_spec_load_and_nothing_starts(tiny, tmp_path, problem):
    path = tmp_path / f"{problem}.gguf"
    if problem == "garbage":
        path.write_bytes(b"GGUF" + b"\x00" * 40)
    elif problem == "vocabulary":
        write_random_model(path, n_layer=2, n_ff_exp=64, seed=5,
                           tokenizer=train_tiny_tokenizer(vocab_size=320))  # fmt: skip
    spec = _spec(tiny, external=[{"name": "llama-q2k", "path": str(path)}])
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    run = _cli("sweep", "run", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "field 'external[0]' (llama-q2k)" in run.stderr
    expected = {"missing": "no such file", "garbage": "garbage.gguf",
                "vocabulary": "tokenizers of"}[problem]  # fmt: skip
    assert expected in run.stderr, run.stderr
    assert not (tmp_path / "r").exists()  # nothing started
