"""`healsweep score` through the real entry point: the JSON contract, recomputed independently."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _cli import run_cli
from healsweep.conformance.references import log_softmax as _np_log_softmax
from healsweep.data.corpus import Document, Message, write_corpus
from healsweep.model import forward, open_model
from healsweep.model.synthetic import train_tiny_tokenizer, write_random_model


def _cli(tmp_path, *args):
    return run_cli("score", *args, cache=tmp_path / "cache", timeout=600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("score-cli")
    ref = write_random_model(root / "ref.gguf", seed=1)
    q4 = write_random_model(root / "q4.gguf", seed=1, types="Q4_0")
    docs = []
    for i in range(1, 8, 2):
        answer = f"<think>\nRoute token {i} to two experts.\n</think>\n\nThe answer is {i * 3}."
        messages = (
            Message("user", f"How many experts for token {i}? " * 3),
            Message("assistant", answer),
        )
        docs.append(Document(f"c{i}", "chat", i, "chat" if i < 5 else "math", messages=messages))
    write_corpus(docs, root / "corpus.jsonl")
    return root, ref, q4


def test_json_windows_can_be_recomputed_independently(setup, tmp_path):
    root, ref, q4 = setup
    out = tmp_path / "out.json"
    run = _cli(
        tmp_path,
        "--model",
        q4,
        "--ref",
        ref,
        "--corpus",
        root / "corpus.jsonl",
        "--json",
        out,
        "--max-windows",
        6,
        "--batch",
        3,
        "--max-context",
        40,
        "--teacher-cache",
        "exact",
    )
    assert run.returncode == 0, run.stderr
    assert "identical token lists" in run.stdout and "pooled" in run.stdout
    assert "6/6 windows" in run.stderr  # progress on stderr
    record = json.loads(out.read_text())
    assert record["teacher_cache"] == "exact"
    windows = record["windows"]
    assert len(windows) == 6 and {w["stratum"] for w in windows} == {"chat", "math"}
    for key in ("window_id", "stratum", "tokens", "scored_from", "n_scored", "kld_mean", "top1"):
        assert all(key in w for w in windows), key

    # recompute one window from its JSON alone: a fresh forward of each model, float64 numpy
    w = windows[1]
    tokens = np.asarray(w["tokens"], dtype=np.int32)
    pos = np.arange(w["n_scored"]) + w["scored_from"] - 1
    lt = _np_log_softmax(forward(open_model(ref), [tokens]).logits[0][pos])
    ls = _np_log_softmax(forward(open_model(q4), [tokens]).logits[0][pos])
    kld = (np.exp(lt) * (lt - ls)).sum(axis=1)
    assert w["kld_mean"] == pytest.approx(kld.mean(), rel=1e-3)
    assert w["top1"] == pytest.approx((lt.argmax(1) == ls.argmax(1)).mean())

    pooled = record["pooled"]
    n = sum(x["n_scored"] for x in windows)
    assert pooled["kld_mean"] == pytest.approx(sum(x["kld_sum"] for x in windows) / n)
    math_windows = [x for x in windows if x["stratum"] == "math"]
    assert pooled["per_stratum"]["math"]["kld_mean"] == pytest.approx(
        sum(x["kld_sum"] for x in math_windows) / sum(x["n_scored"] for x in math_windows)
    )
    assert pooled["per_stratum"]["math"]["top1"] == pytest.approx(
        sum(x["top1_count"] for x in math_windows) / sum(x["n_scored"] for x in math_windows)
    )


def test_the_default_compact_cache_keeps_top1_exact_and_kld_close(setup, tmp_path):
    root, ref, q4 = setup
    out = tmp_path / "out.json"
    args = ("--model", q4, "--ref", ref, "--corpus", root / "corpus.jsonl", "--max-context", 40)
    run = _cli(tmp_path, *args, "--max-windows", 2, "--json", out)
    assert run.returncode == 0, run.stderr
    record = json.loads(out.read_text())
    assert record["teacher_cache"] == "compact:128:128"
    w = record["windows"][1]
    tokens = np.asarray(w["tokens"], dtype=np.int32)
    pos = np.arange(w["n_scored"]) + w["scored_from"] - 1
    lt = _np_log_softmax(forward(open_model(ref), [tokens]).logits[0][pos])
    ls = _np_log_softmax(forward(open_model(q4), [tokens]).logits[0][pos])
    rows = np.arange(len(pos))
    next_ids = tokens[pos + 1]
    assert w["top1"] == pytest.approx((lt.argmax(1) == ls.argmax(1)).mean())
    assert w["teacher_nll_sum"] == pytest.approx(-lt[rows, next_ids].sum(), rel=1e-4)
    assert w["kld_mean"] == pytest.approx((np.exp(lt) * (lt - ls)).sum(axis=1).mean(), rel=0.05)
    bad = _cli(tmp_path, *args, "--teacher-cache", "approx")
    assert bad.returncode == 2 and "teacher cache 'approx'" in bad.stderr


def test_different_tokenizers_fail_with_one_clear_line(setup, tmp_path):
    root, ref, _ = setup
    other = write_random_model(
        tmp_path / "other.gguf", tokenizer=train_tiny_tokenizer(("another vocabulary",) * 5)
    )
    run = _cli(tmp_path, "--model", other, "--ref", ref, "--corpus", root / "corpus.jsonl")
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "tokenizers" in lines[0] and "differ" in lines[0]


def test_calibration_text_in_scored_windows_stops_the_run(setup, tmp_path):
    root, ref, q4 = setup
    from healsweep.data.corpus import load_corpus

    docs = load_corpus(root / "corpus.jsonl").documents
    leaked = Document("cal0", "cal", 0, "chat", messages=docs[0].messages, pool="calibration")
    write_corpus([*docs, leaked], tmp_path / "leaky.jsonl")
    run = _cli(tmp_path, "--model", q4, "--ref", ref, "--corpus", tmp_path / "leaky.jsonl")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "calibration text leaks" in run.stderr and "16-gram" in run.stderr


def test_expert_cache_flags_add_io_figures_and_leave_quality_alone_at_bonus_zero(setup, tmp_path):
    root, ref, q4 = setup
    args = ("--model", q4, "--ref", ref, "--corpus", root / "corpus.jsonl", "--max-context", 40,
            "--max-windows", 3, "--teacher-cache", "exact")  # fmt: skip
    plain, cached = tmp_path / "plain.json", tmp_path / "cached.json"
    assert _cli(tmp_path, *args, "--json", plain).returncode == 0
    run = _cli(tmp_path, *args, "--json", cached, "--moce-bonus", 0, "--cache-experts", 3)
    assert run.returncode == 0, run.stderr
    assert "experts    cache bonus 0, 3 experts per layer, cold" in run.stdout
    assert "hit rate" in run.stdout
    a, b = json.loads(plain.read_text()), json.loads(cached.read_text())
    for wa, wb in zip(a["windows"], b["windows"], strict=True):
        assert {k: v for k, v in wb.items() if not k.startswith(("cache_", "hit_", "misses_",
                                                                 "mib_"))} == wa  # fmt: skip
        assert wb["hit_rate"] == 1 - wb["cache_misses"] / wb["cache_lookups"]
    pooled = b["expert_cache"]["pooled"]
    tokens = sum(w["n_scored"] for w in b["windows"])
    assert pooled["misses_per_token"] == sum(w["cache_misses"] for w in b["windows"]) / tokens
    assert b["expert_cache"]["capacity"] == [3, 3] and b["expert_cache"]["bonus"] == 0.0
    bad = _cli(tmp_path, *args, "--moce-bonus", 0.5)
    assert bad.returncode == 2 and "need a cache size" in " ".join(
        bad.stderr.replace("│", " ").split()
    )
