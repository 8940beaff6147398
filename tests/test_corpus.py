"""The corpus JSONL format, its validation, ChatML rendering and the ChatML import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from healsweep.data.chatml import import_chatml_files, parse_chatml
from healsweep.data.corpus import (
    Document,
    Message,
    load_corpus,
    render_chatml,
    split_think,
    write_corpus,
)
from healsweep.errors import CorpusError

ROOT = Path(__file__).resolve().parents[1]

GOOD = {
    "doc_id": "a-0",
    "source": "a",
    "index": 0,
    "stratum": "chat",
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nshort\n</think>\n\nhello"},
    ],
}


def _write_lines(path: Path, records: list[object]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _record(**changes: object) -> dict:
    record = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is None:
            record.pop(key, None)
        else:
            record[key] = value
    return record


def test_load_corpus_reads_fields_and_renders_chatml(tmp_path):
    text_doc = {
        "doc_id": "t-0",
        "source": "t",
        "index": 0,
        "stratum": "prose",
        "pool": "train",
        "text": "plain text",
    }
    corpus = load_corpus(_write_lines(tmp_path / "c.jsonl", [GOOD, "", text_doc]))
    assert len(corpus) == 2
    chat, plain = corpus.documents
    assert (chat.doc_id, chat.source, chat.index, chat.stratum, chat.pool) == (
        "a-0",
        "a",
        0,
        "chat",
        "eval",
    )
    assert chat.messages == (
        Message("user", "hi"),
        Message("assistant", "<think>\nshort\n</think>\n\nhello"),
    )
    assert chat.render() == (
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nshort\n</think>\n\nhello<|im_end|>\n"
    )
    assert plain.render() == "plain text" and plain.pool == "train"
    assert corpus.pool("train") == [plain] and corpus.get("a-0") is chat
    assert split_think(chat.messages[1].content) == ("short", "hello")
    assert split_think("no think here") is None


def test_content_hash_follows_the_rendered_text_not_meta():
    base = Document("d", "s", 0, "x", messages=(Message("user", "a"),))
    same_text = Document("e", "s", 1, "y", messages=(Message("user", "a"),), meta={"k": 1})
    other = Document("d", "s", 0, "x", messages=(Message("user", "b"),))
    assert base.content_hash == same_text.content_hash != other.content_hash
    assert len(base.content_hash) == 64


def test_write_then_load_round_trips_and_is_byte_stable(tmp_path):
    docs = [
        Document(
            "a-0000",
            "a",
            0,
            "code",
            messages=(
                Message("system", "sys"),
                Message("user", "q\n\nwith gap"),
                Message("assistant", "ünïcode ✓"),
            ),
            meta={"objects": ["json.dumps"]},
        ),
        Document("b-0000", "b", 0, "prose", text="some text\n", pool="calibration"),
    ]
    first = write_corpus(docs, tmp_path / "one.jsonl").read_bytes()
    second = write_corpus(docs, tmp_path / "two.jsonl").read_bytes()
    assert first == second
    loaded = load_corpus(tmp_path / "one.jsonl").documents
    assert loaded == docs
    assert loaded[0].meta == {"objects": ["json.dumps"]}


BAD_LINES = [
    ("{not json", "bad JSON"),
    ("[1, 2]", "must be a JSON object"),
    (_record(doc_id=None), "missing field 'doc_id'"),
    (_record(stratum=None), "missing field 'stratum'"),
    (_record(index=-1), "'index' must be an integer"),
    (_record(index="3"), "'index' must be an integer"),
    (_record(source=""), "'source' must be a non-empty string"),
    (_record(pool="holdout"), "unknown pool"),
    (_record(extra=1), "unknown field"),
    (_record(text="also text"), "both of 'messages' and 'text'"),
    (_record(messages=None), "neither of 'messages' and 'text'"),
    (_record(messages=[]), "non-empty list"),
    (_record(messages=[{"role": "narrator", "content": "x"}]), "unknown role 'narrator'"),
    (_record(messages=[{"role": "user"}]), "exactly 'role' and 'content'"),
    (_record(messages=[{"role": "user", "content": "a<|im_end|>"}]), "ChatML marker"),
]


@pytest.mark.parametrize(("bad", "expected"), BAD_LINES)
def test_each_malformed_line_names_file_and_line(tmp_path, bad, expected):
    ok = _record(doc_id="ok", index=5)
    path = _write_lines(tmp_path / "bad.jsonl", [ok, bad])
    with pytest.raises(CorpusError) as info:
        load_corpus(path)
    message = str(info.value)
    assert f"{path}:2:" in message and expected in message
    assert "\n" not in message


def test_duplicates_name_the_second_line(tmp_path):
    dup_id = _write_lines(tmp_path / "d1.jsonl", [GOOD, _record(index=1)])
    with pytest.raises(
        CorpusError, match=r"d1\.jsonl:2: duplicate doc_id 'a-0' \(first on line 1\)"
    ):
        load_corpus(dup_id)
    dup_key = _write_lines(tmp_path / "d2.jsonl", [GOOD, "", _record(doc_id="other")])
    with pytest.raises(CorpusError, match=r"d2\.jsonl:3: duplicate \(source, index\)"):
        load_corpus(dup_key)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        load_corpus(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(CorpusError, match="no documents"):
        load_corpus(tmp_path / "empty.jsonl")


# --- ChatML import ---------------------------------------------------------------------------

CONVERSATIONS = [
    [Message("user", "one line")],
    [
        Message("system", "be brief"),
        Message("user", "two\n\nparagraphs"),
        Message("assistant", "<think>\nhm\n</think>\n\nanswer\n"),
        Message("user", "again?"),
        Message("assistant", "<think>\nok\n</think>\n\nyes"),
    ],
    [
        Message("system", "tools"),
        Message("user", "look it up"),
        Message("assistant", '<think>\ncall\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call>'),
        Message("tool", '{"result": 1}'),
        Message("assistant", ""),
    ],
    [Message("user", "  leading and trailing spaces  \n")],
]


def _users_file(conversations: list[list[Message]]) -> str:
    # The users' format: rendered transcripts joined by blank lines.
    return "\n".join(render_chatml(c) for c in conversations)


def test_import_round_trips_rendered_documents(tmp_path):
    path = tmp_path / "chat_json.txt"
    path.write_text(_users_file(CONVERSATIONS), encoding="utf-8")
    docs = import_chatml_files([path])
    assert [list(d.messages) for d in docs] == CONVERSATIONS
    assert [d.index for d in docs] == [0, 1, 2, 3]
    assert {d.source for d in docs} == {"chat_json"} == {d.stratum for d in docs}
    assert docs[2].doc_id == "chat_json-0002"
    # render -> import -> render is the identity on the text as well
    assert "\n".join(d.render() for d in docs) == path.read_text()


def test_import_boundaries_system_always_user_after_blank_line():
    text = (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>user\nsame document<|im_end|>\n"
        "<|im_start|>system\nnew document without blank line<|im_end|>\n\n\n"
        "<|im_start|>assistant\ncontinues after a blank line<|im_end|>\n\n"
        "<|im_start|>user\nthird document<|im_end|>"
    )
    docs = parse_chatml(text, "f.txt")
    assert [[m.role for m in d] for d in docs] == [
        ["user", "assistant", "user"],
        ["system", "assistant"],
        ["user"],
    ]


def test_import_source_and_stratum_options(tmp_path):
    first, second = tmp_path / "x.txt", tmp_path / "y.txt"
    first.write_text(_users_file(CONVERSATIONS[:2]))
    second.write_text(_users_file(CONVERSATIONS[2:]))
    docs = import_chatml_files([first, second], source="mine", stratum="ops", pool="calibration")
    assert [(d.source, d.index, d.stratum, d.pool) for d in docs] == [
        ("mine", i, "ops", "calibration") for i in range(4)
    ]
    (tmp_path / "sub").mkdir()
    clash = tmp_path / "sub" / "x.txt"
    clash.write_text(_users_file(CONVERSATIONS[:1]))
    with pytest.raises(CorpusError, match="also the stem"):
        import_chatml_files([first, clash])


MALFORMED = [
    ("<|im_start|>user\nhi<|im_end|>\nstray text\n", 3, "text outside any message"),
    ("\n\n<|im_start|>user\nhi<|im_end|> trailing\n", 4, "text outside any message"),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nno end\n", 3, "unterminated"),
    ("<|im_start|>user\nhi\n\n<|im_start|>assistant\nx<|im_end|>\n", 1, "unterminated"),
    ("<|im_start|>user\nhi<|im_end|>\n\n<|im_start|>robot\nbeep<|im_end|>\n", 4, "unknown role"),
    ("<|im_start|>\nno role<|im_end|>\n", 1, "unknown role"),
]


@pytest.mark.parametrize(("text", "line", "expected"), MALFORMED)
def test_malformed_chatml_names_file_and_line(tmp_path, text, line, expected):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(CorpusError) as info:
        import_chatml_files([path])
    assert f"{path}:{line}: {expected}" in str(info.value)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, timeout=120
    )


def test_cli_import_writes_a_loadable_corpus_and_fails_in_one_line(tmp_path):
    good = tmp_path / "ops.txt"
    good.write_text(_users_file(CONVERSATIONS))
    out = tmp_path / "corpus.jsonl"
    run = _cli("corpus", "import", str(good), "--out", str(out), "--stratum", "ops")
    assert run.returncode == 0, run.stderr
    loaded = load_corpus(out)
    assert [list(d.messages) for d in loaded] == CONVERSATIONS
    assert {d.stratum for d in loaded} == {"ops"}

    bad = tmp_path / "broken.txt"
    bad.write_text("<|im_start|>user\nnever closed\n")
    run = _cli("corpus", "import", str(bad), "--out", str(tmp_path / "x.jsonl"))
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad}:1: unterminated" in lines[0]
    assert "Traceback" not in run.stderr and not (tmp_path / "x.jsonl").exists()

    broken_jsonl = _write_lines(tmp_path / "b.jsonl", [GOOD, "{oops"])
    run = _cli("corpus", "info", str(broken_jsonl))
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0
    assert f"{broken_jsonl}:2: bad JSON" in run.stderr
