"""n-gram leakage between calibration tokens and scored tokens, against a brute-force count."""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.data.leakage import check_leakage
from healsweep.data.windows import Window
from healsweep.errors import SplitError


def _window(wid: str, tokens, scored_from: int) -> Window:
    tokens = np.asarray(tokens, dtype=np.int32)
    return Window(
        wid,
        f"doc-{wid}",
        "src",
        1,
        "s",
        "dev",
        "text",
        tokens,
        scored_from,
        len(tokens) - scored_from,
    )


def _brute(cal: list[list[int]], w: Window, n: int) -> int:
    grams = {tuple(c[i : i + n]) for c in cal for i in range(len(c) - n + 1)}
    toks = w.tokens.tolist()
    return sum(
        tuple(toks[j - n + 1 : j + 1]) in grams
        for j in range(w.scored_from, w.scored_from + w.n_scored)
        if j - n + 1 >= 0
    )


def test_counts_match_a_brute_force_count_and_no_16gram_passes():
    rng = np.random.default_rng(0)
    cal = [rng.integers(0, 50, 300).tolist(), rng.integers(0, 50, 40).tolist()]
    windows = []
    for k in range(6):
        toks = rng.integers(0, 50, 60)
        if k == 2:  # an 8-gram straddling context and scored text, plus one inside scored
            toks[16:26] = cal[0][100:110]
            toks[40:48] = cal[1][3:11]
        windows.append(_window(f"w{k}", toks, 20))
    report = check_leakage(cal, windows)
    for w in windows:
        assert report.hits[8][w.window_id] == _brute(cal, w, 8)
        assert report.hits[16][w.window_id] == 0
    assert report.leaking_windows(8) == ["w2"] and report.total(8) == _brute(cal, windows[2], 8)
    assert report.total(8) >= 4
    assert "8-gram" in report.summary() and report.n_scored == 6 * 40


def test_a_16gram_hit_is_an_error_unless_allowed():
    cal = [list(range(100, 140))]
    toks = list(range(30)) + list(range(110, 130)) + list(range(30))
    windows = [_window("clean", list(range(70)), 10), _window("leaky", toks, 25)]
    with pytest.raises(SplitError, match="leaky.*doc-leaky"):
        check_leakage(cal, windows)
    report = check_leakage(cal, windows, allow_leakage=True)
    assert report.leaking_windows(16) == ["leaky"]
    assert report.hits[16]["leaky"] == _brute(cal, windows[1], 16) == 5
    assert report.hits[16]["clean"] == 0


def test_calibration_tokens_are_the_calibration_documents_of_the_split(tmp_path):
    from healsweep.data.corpus import Document, load_corpus, write_corpus
    from healsweep.data.leakage import calibration_tokens
    from healsweep.data.split import parity_split
    from healsweep.demo.tokenizer import load_demo_tokenizer

    docs = [
        Document("e1", "src", 1, "s", text="an eval text that is long enough"),
        Document("k1", "cal", 0, "s", text="calibration words here", pool="calibration"),
    ]
    write_corpus(docs, tmp_path / "c.jsonl")
    corpus = load_corpus(tmp_path / "c.jsonl")
    tok = load_demo_tokenizer()
    (got,) = calibration_tokens(corpus, parity_split(corpus), tok)
    assert got.dtype == np.int32
    assert tok.decode(got.tolist()) == "calibration words here"
