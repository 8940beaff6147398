"""Properties of the shipped demo corpus and tokenizer, and the determinism of their builder."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from healsweep.bundled import demo_corpus_path, demo_tokenizer_path
from healsweep.data.chatml import parse_chatml
from healsweep.data.corpus import load_corpus
from healsweep.demo.corpus_builder import DemoCorpusConfig, build_demo_corpus, write_demo_assets
from healsweep.demo.stdlib_facts import MODULE_GROUPS
from healsweep.demo.tokenizer import ADDED_TOKENS, SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[1]
THINK = re.compile(r"<think>\n(?P<reasoning>.+?)\n</think>\n\n(?P<answer>.*)", re.S)
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@cache
def corpus():
    return load_corpus("demo")


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(demo_tokenizer_path()))


@cache
def token_ids(pool: str) -> tuple[tuple[int, ...], ...]:
    docs = corpus().pool(pool)
    encodings = tokenizer().encode_batch([d.render() for d in docs])
    return tuple(tuple(e.ids) for e in encodings)


def test_eval_pool_size_strata_and_parity_split():
    eval_docs = corpus().pool("eval")
    assert len(eval_docs) >= 200
    strata = Counter(d.stratum for d in eval_docs)
    assert len(strata) >= 4 and min(strata.values()) >= 40
    dev = [d for d in eval_docs if d.index % 2 == 1]
    test = [d for d in eval_docs if d.index % 2 == 0]
    assert len(dev) >= 40 and len(test) >= 40
    for stratum in strata:
        assert {d.index % 2 for d in eval_docs if d.stratum == stratum} == {0, 1}


def test_sources_are_one_per_stratum_and_pool_with_dense_indexes():
    by_source: dict[str, list] = {}
    for doc in corpus():
        by_source.setdefault(doc.source, []).append(doc)
    for source, docs in by_source.items():
        assert len({d.stratum for d in docs}) == 1 and len({d.pool for d in docs}) == 1, source
        assert sorted(d.index for d in docs) == list(range(len(docs))), source
    pools = Counter(d.pool for d in corpus())
    assert set(pools) == {"eval", "calibration", "train"}


def test_every_assistant_turn_has_the_think_format():
    for doc in corpus():
        assistant_turns = [m for m in doc.messages if m.role == "assistant"]
        assert assistant_turns, doc.doc_id
        for message in assistant_turns:
            match = THINK.fullmatch(message.content)
            assert match, (doc.doc_id, message.content[:80])
            assert match["reasoning"].strip() and match["answer"].strip(), doc.doc_id
            assert "<think>" not in match["answer"] and "</think>" not in match["reasoning"]


def test_tool_documents_call_listed_tools_and_get_tool_replies():
    tool_docs = [d for d in corpus() if d.stratum == "tool"]
    assert tool_docs
    for doc in tool_docs:
        system = doc.messages[0]
        assert system.role == "system", doc.doc_id
        listed = re.search(r"<tools>\n(.*?)\n</tools>", system.content, re.S)
        assert listed, doc.doc_id
        names = set(re.findall(r'"name": "([a-z_]+)"', listed.group(1)))
        calls = 0
        for turn, message in enumerate(doc.messages):
            if message.role != "assistant":
                continue
            answer = THINK.fullmatch(message.content)["answer"]
            found = TOOL_CALL.fullmatch(answer)
            if found:
                call = json.loads(found.group(1))
                assert set(call) == {"name", "arguments"} and call["name"] in names
                assert isinstance(call["arguments"], dict) and call["arguments"]
                assert doc.messages[turn + 1].role == "tool"
                json.loads(doc.messages[turn + 1].content)
                calls += 1
        assert calls >= 1, doc.doc_id
        assert doc.messages[-1].role == "assistant"
        assert "<tool_call>" not in doc.messages[-1].content


def test_each_eval_stratum_has_multi_turn_documents_of_reasonable_size():
    eval_docs = corpus().pool("eval")
    for stratum in {d.stratum for d in eval_docs}:
        multi = [
            d
            for d in eval_docs
            if d.stratum == stratum and sum(m.role == "user" for m in d.messages) > 1
        ]
        assert len(multi) >= 5, stratum
    lengths = [len(ids) for ids in token_ids("eval")]
    assert 100 <= min(lengths) and max(lengths) <= 1600


def test_calibration_pool_is_large_enough_and_shares_no_16gram_with_eval():
    calibration = token_ids("calibration")
    assert sum(len(ids) for ids in calibration) >= 8000

    def grams(ids: tuple[int, ...]) -> set[tuple[int, ...]]:
        return {ids[i : i + 16] for i in range(len(ids) - 15)}

    eval_grams: set[tuple[int, ...]] = set()
    for ids in token_ids("eval"):
        eval_grams |= grams(ids)
    shared = [i for i, ids in enumerate(calibration) if grams(ids) & eval_grams]
    assert shared == []
    # sanity of the check itself: an eval document shares 16-grams with itself
    assert grams(token_ids("eval")[0]) & eval_grams


def test_pools_come_from_disjoint_stdlib_units():
    units = {pool: set() for pool in ("eval", "calibration", "train")}
    objects = {pool: set() for pool in units}
    for doc in corpus():
        units[doc.pool] |= set(doc.meta["units"])
        objects[doc.pool] |= set(doc.meta.get("objects", []))
    assert not units["eval"] & units["calibration"]
    assert not units["eval"] & units["train"]
    assert not units["calibration"] & units["train"]
    assert not objects["eval"] & (objects["calibration"] | objects["train"])
    # eval documents never reuse an object
    eval_objects = [o for d in corpus().pool("eval") for o in d.meta.get("objects", [])]
    assert len(eval_objects) == len(set(eval_objects))


def test_tokenizer_is_plain_byte_level_bpe_with_single_token_markers():
    tok = tokenizer()
    spec = json.loads(tok.to_str())
    assert 4096 <= tok.get_vocab_size() <= 8192
    assert spec["model"]["type"] == "BPE" and spec["normalizer"] is None
    assert spec["post_processor"] is None and spec["decoder"]["type"] == "ByteLevel"
    steps = [s["type"] for s in spec["pre_tokenizer"]["pretokenizers"]]
    assert steps == ["Split", "ByteLevel"]
    added = {a["content"]: (a["id"], a["special"]) for a in spec["added_tokens"]}
    for i, marker in enumerate(SPECIAL_TOKENS + ADDED_TOKENS):
        assert added[marker] == (i, marker in SPECIAL_TOKENS)
        assert tok.encode(f"x{marker}y").tokens[1] == marker


def test_tokenizer_round_trips_the_corpus_text():
    tok = tokenizer()
    docs = corpus().pool("eval") + corpus().pool("calibration")
    for doc, ids in zip(docs, token_ids("eval") + token_ids("calibration"), strict=True):
        assert tok.decode(list(ids), skip_special_tokens=False) == doc.render()


def test_tokenizer_survives_gguf_metadata(tmp_path):
    from healsweep.model import open_model
    from healsweep.model.synthetic import write_random_model

    path = write_random_model(
        tmp_path / "m.gguf",
        n_layer=1,
        n_embd=64,
        n_expert=4,
        n_ff_exp=64,
        n_ff_shexp=32,
        tokenizer=tokenizer(),
    )
    from_gguf = open_model(path).tokenizer()
    texts = [d.render() for d in corpus().pool("eval")]
    assert [e.ids for e in from_gguf.encode_batch(texts)] == [list(i) for i in token_ids("eval")]


def test_shipped_eval_documents_survive_chatml_import():
    eval_docs = corpus().pool("eval")
    text = "\n".join(doc.render() for doc in eval_docs)
    parsed = parse_chatml(text, "demo.txt")
    assert parsed == [list(doc.messages) for doc in eval_docs]


SMALL = DemoCorpusConfig(
    seed=3,
    eval_per_stratum=3,
    calibration_per_stratum=2,
    train_chars=40_000,
    vocab_size=700,
    eval_objects=40,
    calibration_objects=30,
    eval_topics=2,
    calibration_topics=2,
    max_topics=10,
    groups=tuple(
        g
        for g in MODULE_GROUPS
        if g[0]
        in {
            "json",
            "textwrap",
            "shlex",
            "difflib",
            "fractions",
            "statistics",
            "string",
            "csv",
            "pprint",
            "calendar",
            "queue",
            "colorsys",
            "bisect",
            "fnmatch",
        }
    ),
    min_calibration_tokens=0,
)


def test_builder_is_deterministic_and_seeded(tmp_path):
    first, second = build_demo_corpus(SMALL), build_demo_corpus(SMALL)
    write_demo_assets(first, tmp_path / "a.jsonl", tmp_path / "a-tok.json")
    write_demo_assets(second, tmp_path / "b.jsonl", tmp_path / "b-tok.json")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a-tok.json").read_bytes() == (tmp_path / "b-tok.json").read_bytes()
    names = sorted(p.name for p in tmp_path.iterdir())  # written atomically: no temp left
    assert names == ["a-tok.json", "a.jsonl", "b-tok.json", "b.jsonl"]
    assert Tokenizer.from_file(str(tmp_path / "a-tok.json")).to_str() == first.tokenizer.to_str()
    rebuilt = load_corpus(tmp_path / "a.jsonl")
    assert Counter(d.stratum for d in rebuilt.pool("eval")) == {
        s: 3 for s in ("code", "docs", "json", "tool")
    }
    other = build_demo_corpus(DemoCorpusConfig(**{**SMALL.__dict__, "seed": 4}))
    assert [d.render() for d in other.documents] != [d.render() for d in first.documents]


def test_shipped_asset_paths():
    assert demo_corpus_path().name == "demo-corpus.jsonl" and demo_corpus_path().is_file()
    assert load_corpus(demo_corpus_path()).documents == corpus().documents


@pytest.mark.slow
def test_demo_corpus_command_reproduces_the_shipped_assets(tmp_path):
    from healsweep.demo.corpus_builder import BUILT_WITH

    out = tmp_path / "corpus.jsonl"
    run = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "demo", "corpus", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    rebuilt = load_corpus(out)
    assert len(rebuilt.pool("eval")) >= 200
    if "note: built with" not in run.stdout:  # same interpreter as the shipped build
        assert BUILT_WITH in platform.python_implementation() + " " + platform.python_version()
        assert out.read_bytes() == demo_corpus_path().read_bytes()
        assert (tmp_path / "demo-tokenizer.json").read_bytes() == demo_tokenizer_path().read_bytes()
