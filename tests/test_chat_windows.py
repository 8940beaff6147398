"""Windows, calibration tokens and trace chunks of GGUF files that carry a chat template.

Random files with Qwen3's and DeepSeek-R1's real templates (``tests/fixtures/chat_templates``)
and tokenizers holding each family's turn markers as control tokens: the documents the windows
are cut from are what transformers renders (``expected.json``), the think/answer boundaries sit
on the template's markers, and a file without a template gives exactly the ChatML windows.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from healsweep.data.chat_template import CHATML, model_chat_format, render_document
from healsweep.data.corpus import Document, Message, load_corpus, write_corpus
from healsweep.data.leakage import calibration_tokens
from healsweep.data.split import parity_split, split_lock_id
from healsweep.data.windows import make_windows
from healsweep.errors import ChatTemplateError
from healsweep.heal.knobs import CalibrationConfig
from healsweep.heal.trace import make_chunks
from healsweep.model import describe_model, open_model
from healsweep.model.synthetic import CONTROL_TOKENS, train_tiny_tokenizer, write_random_model

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
SPEC = json.loads((FIXTURES / "cases.json").read_text(encoding="utf-8"))
EXPECTED = {
    (e["template"], e["case"]): e["rendered"]
    for e in json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))["expected"]
}
DEEPSEEK_MARKERS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁outputs▁end｜>",
)  # fmt: skip


def _template(name: str) -> str:
    return (FIXTURES / SPEC["templates"][name]["file"]).read_text(encoding="utf-8")


def _case(name: str) -> tuple[Message, ...]:
    case = next(c for c in SPEC["cases"] if c["name"] == name)
    return tuple(Message(m["role"], m["content"]) for m in case["messages"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Odd indexes (dev): the multi-turn and tool cases; even (test): single turn; calibration."""
    docs = [
        Document("multi", "chat", 1, "math", messages=_case("multi_turn")),
        Document("tool", "chat", 3, "tools", messages=_case("tool_turn")),
        Document("single", "chat", 2, "math", messages=_case("single_turn")),
        Document("cal", "chat", 5, "tools", messages=_case("tool_turn"), pool="calibration"),
        Document("prose", "docs", 1, "docs", text="Plain text is not a chat. " * 12),
    ]
    path = tmp_path_factory.mktemp("chat-corpus") / "c.jsonl"
    write_corpus(docs, path)
    return load_corpus(path)


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("qwen") / "qwen3-template.gguf"
    return open_model(write_random_model(path, "qwen3moe", tokenizer=tiny_tokenizer,
                                         chat_template=_template("qwen3")))  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory):
    tokenizer = train_tiny_tokenizer(pre="deepseek-v3", control_tokens=DEEPSEEK_MARKERS)
    path = tmp_path_factory.mktemp("deepseek") / "r1-template.gguf"
    written = write_random_model(
        path, "deepseek2", tokenizer=tokenizer, bos=DEEPSEEK_MARKERS[0], eos=DEEPSEEK_MARKERS[1],
        chat_template=_template("deepseek_r1"),
    )  # fmt: skip
    return open_model(written)


def _decode(model, ids) -> str:
    return model.tokenizer().decode([int(i) for i in ids], skip_special_tokens=False)


def _windows(corpus, model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        windows = make_windows(corpus, model.tokenizer(), parity_split(corpus),
                               chat=model_chat_format(model), **kwargs)  # fmt: skip
    return windows, [str(w.message) for w in caught]


def _by(windows, doc_id):
    return {(w.kind, w.turn): w for w in windows if w.doc_id == doc_id}


def test_a_file_without_template_gives_the_chatml_windows(random_gguf, corpus):
    model = open_model(random_gguf("qwen3moe"))
    assert model_chat_format(model) is CHATML
    plain = make_windows(corpus, model.tokenizer(), parity_split(corpus))
    chatml, caught = _windows(corpus, model)
    assert not caught
    assert [w.to_record() for w in chatml] == [w.to_record() for w in plain]


def test_qwen3_file_windows_sit_on_its_markers_and_its_documents_are_transformers_text(
    qwen_model, corpus
):
    windows, caught = _windows(corpus, qwen_model)
    multi = _by(windows, "multi")
    assert sorted(multi) == [("answer", 0), ("answer", 1), ("think", 1)]
    last_think, last_answer = multi["think", 1], multi["answer", 1]
    document = _decode(qwen_model, last_answer.tokens)  # the document up to the last <|im_end|>
    assert document + "\n" == EXPECTED["qwen3", "multi_turn"]
    assert _decode(qwen_model, last_think.scored_tokens) == (
        "<think>\nThree times three is nine.\n</think>"
    )
    assert _decode(qwen_model, last_think.tokens[: last_think.scored_from]).endswith(
        "<|im_start|>assistant\n"
    )
    assert _decode(qwen_model, last_answer.scored_tokens) == (
        "\n\nIt is 9, because 3 * 3 = 9.<|im_end|>"
    )
    assert _decode(qwen_model, multi["answer", 0].scored_tokens) == "The answer is 4.<|im_end|>"
    im_end = qwen_model.tokenizer().token_to_id("<|im_end|>")
    assert last_answer.scored_tokens[-1] == im_end
    assert caught == [
        f"the chat template of {qwen_model.path} leaves out the reasoning of 1 of 3 assistant "
        "turns with reasoning; those turns have an answer window only"
    ]


def test_deepseek_r1_file_reads_its_own_turn_markers_and_has_answer_windows_only(
    deepseek_model, corpus
):
    windows, caught = _windows(corpus, deepseek_model)
    tok = deepseek_model.tokenizer()
    multi = _by(windows, "multi")
    assert sorted(multi) == [("answer", 0), ("answer", 1)]
    answer = multi["answer", 1]
    assert _decode(deepseek_model, answer.tokens) == EXPECTED["deepseek_r1", "multi_turn"]
    marker_ids = {tok.token_to_id(m) for m in DEEPSEEK_MARKERS[:4]}
    assert None not in marker_ids and marker_ids <= set(answer.tokens.tolist())
    assert answer.tokens[0] == tok.token_to_id(DEEPSEEK_MARKERS[0])  # bos from the template
    assert answer.scored_tokens[-1] == tok.token_to_id(DEEPSEEK_MARKERS[1])
    assert _decode(deepseek_model, answer.scored_tokens) == (
        "It is 9, because 3 * 3 = 9.<｜end▁of▁sentence｜>"
    )
    # after a tool output, R1's template keeps the whole message, reasoning included
    tool = _by(windows, "tool")
    assert sorted(tool) == [("answer", 0), ("answer", 1), ("think", 1)]
    assert _decode(deepseek_model, tool["think", 1].scored_tokens) == (
        "<think>\nThe tool says 21 C and clear.\n</think>"
    )
    assert caught and "leaves out the reasoning of 2 of 3" in caught[0]


def test_split_and_document_identity_do_not_depend_on_the_model(
    random_gguf, qwen_model, deepseek_model, corpus
):
    cfg = parity_split(corpus)
    lock = split_lock_id(cfg, corpus)
    by_model = {}
    for model in (open_model(random_gguf("qwen3moe")), qwen_model, deepseek_model):
        windows, _ = _windows(corpus, model)
        by_model[model.path] = windows
        assert split_lock_id(cfg, corpus) == lock
        assert {(w.doc_id, w.split) for w in windows} == {("multi", "dev"), ("tool", "dev"),
                                                          ("prose", "dev")}  # fmt: skip
    # a window's id follows what it scores: the same tokens and range (a prefix both renderings
    # share, plain text under one tokenizer) keep the id, any other rendering changes it
    chatml, qwen = ({(w.doc_id, w.kind, w.turn): w for w in ws} for ws in
                    list(by_model.values())[:2])  # fmt: skip
    same = 0
    for key in chatml.keys() & qwen.keys():
        a, b = chatml[key], qwen[key]
        same_scoring = (a.scored_from, a.n_scored) == (b.scored_from, b.n_scored)
        same_scoring = same_scoring and np.array_equal(a.tokens, b.tokens)
        assert (a.window_id == b.window_id) == same_scoring, key
        same += same_scoring
    assert 0 < same < len(chatml.keys() & qwen.keys())


def test_calibration_and_trace_chunks_are_rendered_with_the_template(qwen_model, corpus):
    chat = model_chat_format(qwen_model)
    (tokens,) = calibration_tokens(corpus, parity_split(corpus), qwen_model.tokenizer(), chat)
    assert _decode(qwen_model, tokens) == EXPECTED["qwen3", "tool_turn"]
    (chunk,), _ = make_chunks(corpus.pool("calibration"), qwen_model.tokenizer(),
                              CalibrationConfig(max_tokens=None, chunk_length=512), chat)  # fmt: skip
    np.testing.assert_array_equal(chunk.tokens, tokens)
    # the tool turn's content and the <tool_call> block, found in Qwen's <tool_response> wrapping
    tool_text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tool_output = '{"temp_c": 21, "sky": "clear"}'
    count = lambda text: len(qwen_model.tokenizer().encode(text).ids)  # noqa: E731
    assert chunk.tool_tokens == pytest.approx(count(tool_text) + count(tool_output), abs=2)


def test_a_template_that_raises_is_one_line_naming_the_file(tmp_path, tiny_tokenizer, corpus):
    template = "{{ raise_exception('Only user and assistant roles are supported!') }}"
    path = write_random_model(tmp_path / "strict.gguf", tokenizer=tiny_tokenizer,
                              chat_template=template)  # fmt: skip
    model = open_model(path)
    with pytest.raises(ChatTemplateError) as info:
        make_windows(corpus, model.tokenizer(), parity_split(corpus),
                     chat=model_chat_format(model))  # fmt: skip
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: tokenizer.chat_template failed")
    assert "document 'multi'" in message and "Only user and assistant roles" in message
    assert "--remove-metadata tokenizer.chat_template" in message


def test_model_info_says_whether_documents_use_the_files_template(random_gguf, qwen_model):
    assert describe_model(open_model(random_gguf("qwen3moe")))["chat_template"] is None
    summary = describe_model(qwen_model)["chat_template"]
    assert summary["chars"] == len(_template("qwen3"))
    assert model_chat_format(qwen_model).describe().endswith(f"sha256 {summary['sha256']})")


def test_chatml_control_tokens_stay_the_default_markers():
    assert CONTROL_TOKENS == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    doc = Document("d", "s", 1, "s", messages=(Message("user", "hi"),))
    assert render_document(doc) == render_document(doc, CHATML) == doc.render()
