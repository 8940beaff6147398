"""Scoring windows on a small corpus written here, with the real demo tokenizer and ledger."""

from __future__ import annotations

import numpy as np
import pytest

from healsweep.data.corpus import Document, Message, load_corpus, write_corpus
from healsweep.data.split import parity_split, split_lock_id
from healsweep.data.windows import make_windows
from healsweep.demo.tokenizer import load_demo_tokenizer
from healsweep.errors import SplitError, TestSplitSealed
from healsweep.ledger import Ledger

THINK_1 = "The user asks for a sum. Two plus two is four."
ANSWER_1 = "The answer is 4."
THINK_2 = "Now they want the product. Three times three is nine, so I reply with nine."
ANSWER_2 = "It is 9, because 3 * 3 = 9."
PLAIN = "Sure, here is a plain reply without any reasoning block."
LONG_TEXT = " ".join(f"line {i} of the module docs says value_{i} = {i * 7}." for i in range(60))


def _chat(index: int, *turns: tuple[str, str | None]) -> Document:
    messages = [Message("system", "You are a careful assistant.")]
    for question, (think, answer) in zip(("What is 2+2?", "And 3*3?"), turns, strict=False):
        messages.append(Message("user", question))
        body = answer if think is None else f"<think>\n{think}\n</think>\n\n{answer}"
        messages.append(Message("assistant", body))
    return Document(f"chat-{index}", "chat", index, "math", messages=tuple(messages))


@pytest.fixture(scope="module")
def tokenizer():
    return load_demo_tokenizer()


@pytest.fixture
def corpus(tmp_path):
    docs = [
        _chat(1, (THINK_1, ANSWER_1), (THINK_2, ANSWER_2)),
        _chat(2, (THINK_1, ANSWER_1)),
        _chat(3, (None, PLAIN)),
        Document("text-1", "docs", 1, "docs", text=LONG_TEXT),
        Document("text-2", "docs", 2, "docs", text=LONG_TEXT.upper()),
        Document("cal-1", "chat", 5, "math", text="calibration only text here", pool="calibration"),
    ]
    write_corpus(docs, tmp_path / "c.jsonl")
    return load_corpus(tmp_path / "c.jsonl")


def _decode(tok, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _by(windows, doc_id, kind=None):
    return [w for w in windows if w.doc_id == doc_id and (kind is None or w.kind == kind)]


def test_think_and_answer_windows_start_at_the_documented_boundaries(corpus, tokenizer):
    windows = make_windows(corpus, tokenizer, parity_split(corpus))
    think0, think1 = _by(windows, "chat-1", "think")
    answer0, answer1 = _by(windows, "chat-1", "answer")
    assert (think0.turn, think1.turn, answer0.turn, answer1.turn) == (0, 1, 0, 1)
    ctx = _decode(tokenizer, think0.tokens[: think0.scored_from])
    assert ctx.endswith("What is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert _decode(tokenizer, think0.scored_tokens) == f"<think>\n{THINK_1}\n</think>"
    assert _decode(tokenizer, answer0.tokens[: answer0.scored_from]).endswith("</think>")
    assert _decode(tokenizer, answer0.scored_tokens) == f"\n\n{ANSWER_1}<|im_end|>"
    assert _decode(tokenizer, answer1.scored_tokens) == f"\n\n{ANSWER_2}<|im_end|>"
    # the second turn's context holds the whole first exchange
    assert ANSWER_1 in _decode(tokenizer, think1.tokens[: think1.scored_from])


def test_a_turn_without_think_gives_one_answer_window(corpus, tokenizer):
    windows = make_windows(corpus, tokenizer, parity_split(corpus))
    (only,) = _by(windows, "chat-3")
    assert only.kind == "answer"
    assert _decode(tokenizer, only.scored_tokens) == f"{PLAIN}<|im_end|>"
    assert _decode(tokenizer, only.tokens[: only.scored_from]).endswith("<|im_start|>assistant\n")


def test_windows_are_slices_of_the_whole_document_encoding(corpus, tokenizer):
    windows = make_windows(corpus, tokenizer, parity_split(corpus), max_scored=8, max_context=20)
    for w in windows:
        doc = corpus.get(w.doc_id)
        full = np.asarray(tokenizer.encode(doc.render(), add_special_tokens=False).ids)
        assert w.tokens.dtype == np.int32
        assert 1 <= w.n_scored <= 8 and w.scored_from <= 20
        hits = [
            s for s in range(len(full)) if np.array_equal(full[s : s + len(w.tokens)], w.tokens)
        ]
        assert hits, w.window_id
        start = hits[0]
        # context is capped, and it is the document's preceding tokens (all of them when short)
        assert w.scored_from == min(20, start + w.scored_from)


def test_text_documents_are_tiled_after_a_short_prefix(corpus, tokenizer):
    windows = make_windows(corpus, tokenizer, parity_split(corpus), max_scored=50)
    tiles = _by(windows, "text-1")
    assert [w.kind for w in tiles] == ["text"] * len(tiles) and len(tiles) > 3
    full = np.asarray(tokenizer.encode(LONG_TEXT, add_special_tokens=False).ids)
    scored = np.concatenate([w.scored_tokens for w in tiles])
    np.testing.assert_array_equal(scored, full[16:])
    assert [w.turn for w in tiles] == list(range(len(tiles)))


def test_only_documents_of_the_requested_split(corpus, tokenizer):
    cfg = parity_split(corpus)
    dev = make_windows(corpus, tokenizer, cfg)
    assert {w.doc_id for w in dev} == {"chat-1", "chat-3", "text-1"}
    assert {w.split for w in dev} == {"dev"}
    with pytest.raises(SplitError, match="not an eval split"):
        make_windows(corpus, tokenizer, cfg, split="calibration")


def test_test_windows_need_a_ledger_grant(corpus, tokenizer, tmp_path):
    cfg = parity_split(corpus)
    with pytest.raises(TestSplitSealed):
        make_windows(corpus, tokenizer, cfg, split="test")
    ledger = Ledger(tmp_path / "ledger.jsonl")
    grant = ledger.open_milestone(split_lock_id(cfg, corpus), "m1", ["cfg0"], ["t0"], user="t")
    test = make_windows(corpus, tokenizer, cfg, split="test", grant=grant)
    assert {w.doc_id for w in test} == {"chat-2", "text-2"}
    other = ledger.open_milestone(split_lock_id(cfg, corpus), "m2", ["c"], ["t"], user="t")
    ledger.record_result(other, "0" * 64)  # a grant whose result is recorded is spent
    with pytest.raises(TestSplitSealed):
        make_windows(corpus, tokenizer, cfg, split="test", grant=other)


def test_window_ids_are_stable_unique_and_follow_content(corpus, tokenizer, tmp_path):
    cfg = parity_split(corpus)
    a = make_windows(corpus, tokenizer, cfg)
    b = make_windows(corpus, tokenizer, cfg)
    assert [w.window_id for w in a] == [w.window_id for w in b]
    assert len({w.window_id for w in a}) == len(a)
    docs = [
        d if d.doc_id != "chat-3" else _chat(3, (None, PLAIN + " Edited."))
        for d in corpus.documents
    ]
    write_corpus(docs, tmp_path / "edited.jsonl")
    edited = load_corpus(tmp_path / "edited.jsonl")
    c = make_windows(edited, tokenizer, parity_split(edited))
    changed = {w.window_id for w in a} ^ {w.window_id for w in c}
    assert {w.doc_id for w in a + c if w.window_id in changed} == {"chat-3"}
    shorter = make_windows(corpus, tokenizer, cfg, max_context=5)
    assert {w.window_id for w in shorter}.isdisjoint({w.window_id for w in a})


def test_caps_per_document_and_kinds(corpus, tokenizer):
    cfg = parity_split(corpus)
    capped = make_windows(corpus, tokenizer, cfg, max_windows_per_doc=1)
    assert all(len(_by(capped, d)) == 1 for d in ("chat-1", "chat-3", "text-1"))
    answers = make_windows(corpus, tokenizer, cfg, kinds=("answer",), max_windows_per_doc=2)
    assert [w.turn for w in _by(answers, "chat-1")] == [0, 1]
    assert {w.kind for w in answers} == {"answer"}
    with pytest.raises(SplitError, match="no scoring windows"):
        make_windows(corpus, tokenizer, cfg, kinds=("nothing",))


def test_first_windows_are_the_first_by_id_whatever_the_input_order(corpus, tokenizer):
    """One selection for sweeps, confirm and score: sorted by window id (a content hash), cut
    to the first N; the input order does not matter and no cap keeps every window."""
    from healsweep.data.windows import first_windows

    windows = make_windows(corpus, tokenizer, parity_split(corpus))
    ids = sorted(w.window_id for w in windows)
    assert [w.window_id for w in first_windows(windows)] == ids
    assert [w.window_id for w in first_windows(windows[::-1], 3)] == ids[:3]
    assert first_windows(windows, len(windows) + 5) == first_windows(windows)


def test_context_cap_fits_the_window_into_the_model():
    from healsweep.data.windows import DEFAULT_MAX_CONTEXT, context_cap

    assert context_cap(128, None, 4096) == DEFAULT_MAX_CONTEXT  # room to spare: the default
    assert context_cap(128, None, 1024) == 896 == 1024 - 128  # the demo model: exactly fits
    assert context_cap(32, None, 256) == 256 - 32  # a small model: context cut to fit
    assert context_cap(300, None, 256) == 0
    assert context_cap(32, 100, 256) == 100  # asked for, and it fits
    with pytest.raises(SplitError, match=r"max_context 300 \+ max_scored 32 exceeds .* 256"):
        context_cap(32, 300, 256)
