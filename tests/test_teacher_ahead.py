"""The teacher's records made ahead of scoring on a thread (score.runner.teacher_ahead).

Real parts throughout: a random GGUF, the real forward, the stage cache on disk. Checked by
property: the records the thread made are the ones scoring reads (scoring computes none), and
every window's metrics equal those of a run without the thread, bit for bit.
"""

from __future__ import annotations

import time
from dataclasses import fields

import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.data.corpus import Document, load_corpus, write_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.errors import SettingError
from healsweep.model import LayerReplacement, open_model
from healsweep.model.synthetic import write_random_model
from healsweep.profile import phase_totals, profiling
from healsweep.score import score_windows
from healsweep.score.runner import TEACHER_AHEAD_ENV, teacher_ahead, teacher_ahead_on
from healsweep.score.teacher_cache import STAGE, teacher_key

BATCH = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "m.gguf"
    return open_model(write_random_model(path, seed=9, n_layer=2))


@pytest.fixture(scope="module")
def windows(base, tmp_path_factory):
    docs = [
        Document(f"t{i}", "docs", i, "docs", text=f"Tokens {i} and more {i} words here. " * (2 + i))
        for i in range(1, 12, 2)
    ]
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    write_corpus(docs, path)
    corpus = load_corpus(path)
    found = make_windows(corpus, base.tokenizer(), parity_split(corpus), max_scored=16,
                         max_context=60, max_windows_per_doc=1)  # fmt: skip
    assert len(found) >= 5
    return found[:5]


class Student:
    def __init__(self, base):
        self.base = base
        self.replacements = {
            i: LayerReplacement(down_exps=base.layer(i)["ffn_down_exps.weight"] * 0.8)
            for i in base.hparams.moe_layers
        }


def _stored(cache, base, windows) -> int:
    return sum(cache.path(STAGE, teacher_key(base, w, "compact")).is_file() for w in windows)


def test_records_made_ahead_are_what_scoring_reads(base, windows, tmp_path, monkeypatch):
    plain = list(score_windows(base, Student(base), windows, StageCache(tmp_path / "a"),
                               batch=BATCH))  # fmt: skip
    monkeypatch.setenv(TEACHER_AHEAD_ENV, "on")
    cache = StageCache(tmp_path / "b")
    with profiling() as profile, cache.holding(), teacher_ahead(base, windows, cache, BATCH):
        deadline = time.monotonic() + 120
        while _stored(cache, base, windows) < len(windows) and time.monotonic() < deadline:
            time.sleep(0.05)  # the student's build would run here
        assert _stored(cache, base, windows) == len(windows)
        ahead = list(score_windows(base, Student(base), windows, cache, batch=BATCH))
    assert cache.computed[STAGE] == len(windows)  # all by the thread: scoring computed none
    assert cache.hits[STAGE] >= len(windows)
    assert [w.window_id for w, _ in ahead] == [w.window_id for w, _ in plain]
    for (_, got), (_, want) in zip(ahead, plain, strict=True):
        for field in fields(got):
            np.testing.assert_array_equal(getattr(got, field.name), getattr(want, field.name))
    totals = phase_totals(profile.rows())
    assert totals["teacher_ahead"]["calls"] == 1 and totals["teacher_ahead"]["wall_s"] > 0


def test_the_thread_stops_after_its_batch_in_flight(base, windows, tmp_path, monkeypatch):
    monkeypatch.setenv(TEACHER_AHEAD_ENV, "on")
    cache = StageCache(tmp_path / "c")
    with cache.holding(), teacher_ahead(base, windows, cache, BATCH):
        pass  # the block ends at once: at most the batch already started is made
    assert _stored(cache, base, windows) <= BATCH
    scored = list(score_windows(base, Student(base), windows, cache, batch=BATCH))
    assert len(scored) == len(windows) and _stored(cache, base, windows) == len(windows)


@pytest.mark.parametrize(("setting", "expected"), [("on", True), ("off", False), ("auto", None)])
def test_it_runs_on_cuda_by_default_and_where_asked(setting, expected, monkeypatch):
    import jax

    monkeypatch.setenv(TEACHER_AHEAD_ENV, setting)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    assert teacher_ahead_on() is (gpu if expected is None else expected)


def test_a_bad_setting_is_a_clear_error_before_a_sweep_starts(tmp_path, monkeypatch):
    """`sweep run` refuses it with exit code 1, one line, before Ray starts or a folder exists."""
    import subprocess
    import sys
    from pathlib import Path

    monkeypatch.setenv(TEACHER_AHEAD_ENV, "yes")
    with pytest.raises(SettingError, match="HEALSWEEP_TEACHER_AHEAD='yes' is not on, off or auto"):
        teacher_ahead_on()
    root = Path(__file__).resolve().parents[1]
    spec = root / "sweeps" / "demo-ablation.yaml"
    env = {**__import__("os").environ, TEACHER_AHEAD_ENV: "yes"}
    done = subprocess.run(
        [sys.executable, str(root / "cli.py"), "sweep", "run", str(spec), "--results",
         str(tmp_path / "results")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "HEALSWEEP_TEACHER_AHEAD='yes' is not on, off or auto" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "results").exists()
