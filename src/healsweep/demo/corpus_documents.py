"""Writers of the demo corpus's documents, one per stratum: code, docs, json, tool.

Each writer takes the standard-library facts it is about, a seeded ``random.Random`` and a
wording family (``A`` or ``B``, :mod:`healsweep.demo.corpus_phrases`) and returns ChatML
messages. Every assistant turn is ``<think>\\n…\\n</think>\\n\\n`` + answer; every fact stated
comes from the object itself (docstring, signature, source, its syntax tree).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

from healsweep.data.corpus import Message
from healsweep.demo.corpus_phrases import PHRASES, TOOLS
from healsweep.demo.stdlib_facts import Param, StdlibObject, Topic, code_facts

# Per-family wording of the sentences that carry facts.
_FACT_WORDS: dict[str, dict[str, str]] = {
    "A": {
        "takes": "It takes {params}.",
        "no_params": "It takes no arguments.",
        "calls": "Along the way it calls {calls}.",
        "no_calls": "It does not call other functions.",
        "raises": "The body contains `raise` statements for {raises}.",
        "no_raises": "There is no explicit `raise` in its body.",
        "returns": "It hands its result back with `return`.",
        "yields": "It is a generator: values come out through `yield`.",
        "lines": "The body is {n} lines long.",
        "default": "`{name}` (default `{value}`)",
        "defaults": "These parameters have defaults: {items}.",
        "no_defaults": "None of its parameters has a default value, so all are required.",
        "members": "The `{m}` module documents {names}.",
        "sig_answer": "`{q}` takes {params}. Call it as `{call}`.",
    },
    "B": {
        "takes": "Arguments: {params}.",
        "no_params": "No arguments.",
        "calls": "Helpers used: {calls}.",
        "no_calls": "Calls nothing else.",
        "raises": "Explicit raises: {raises}.",
        "no_raises": "Never raises explicitly.",
        "returns": "Result: returned.",
        "yields": "Generator (uses yield).",
        "lines": "{n} lines in total.",
        "default": "{name}={value}",
        "defaults": "Optional ones: {items}.",
        "no_defaults": "Every argument is mandatory.",
        "members": "Names in {m}: {names}.",
        "sig_answer": "Call form: `{call}`; arguments: {params}.",
    },
}


def _say(rng: random.Random, family: str, slot: str, **slots: str) -> str:
    return rng.choice(PHRASES[family][slot]).format(**slots)


def _fact(family: str, key: str, **slots: object) -> str:
    return _FACT_WORDS[family][key].format(**slots)


def assistant(reasoning: str, answer: str) -> Message:
    """An assistant turn in the think format."""
    return Message("assistant", f"<think>\n{reasoning}\n</think>\n\n{answer}")


def names(items: Sequence[str]) -> str:
    """`a`, `b` and `c`."""
    quoted = [f"`{item}`" for item in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def summary(text: str, limit: int = 220) -> str:
    """The first sentence of the first paragraph, on one line."""
    first = " ".join(text.split("\n\n", 1)[0].split())
    match = re.search(r"(?<=[.!?])\s", first)
    sentence = first[: match.start()] if match else first
    return sentence if len(sentence) <= limit else sentence[: limit - 3].rstrip() + "..."


def excerpt(text: str, limit: int) -> str:
    """Whole leading paragraphs of ``text`` up to about ``limit`` characters."""
    kept: list[str] = []
    for paragraph in text.split("\n\n"):
        if kept and sum(len(p) for p in kept) + len(paragraph) > limit:
            break
        kept.append(paragraph if len(paragraph) <= limit else paragraph[:limit].rstrip() + " ...")
    return "\n\n".join(kept)


def call_form(obj: StdlibObject) -> str:
    """How a reader calls the object: the signature without ``self``/``cls``."""
    signature = re.sub(r"^\((self|cls)(, )?", "(", obj.signature or "(...)")
    return f"{obj.qualname}{signature}"


def params_text(obj: StdlibObject, family: str) -> str:
    """The parameters in words, or '' if there are none."""
    params = obj.public_params()
    if not params:
        return ""
    items = []
    for p in params:
        shown = {"var_positional": f"*{p.name}", "var_keyword": f"**{p.name}"}.get(p.kind, p.name)
        items.append(shown)
    return names(items)


def _takes(obj: StdlibObject, family: str) -> str:
    text = params_text(obj, family)
    return _fact(family, "takes", params=text) if text else _fact(family, "no_params")


def _defaults(obj: StdlibObject, family: str) -> str:
    items = [
        _fact(family, "default", name=p.name, value=p.default)
        for p in obj.public_params()
        if p.default is not None
    ]
    return (
        _fact(family, "defaults", items=", ".join(items)) if items else _fact(family, "no_defaults")
    )


def _explain_code(obj: StdlibObject, family: str) -> str:
    facts = code_facts(obj.source or "")
    parts = [summary(obj.doc), _takes(obj, family)]
    if facts["calls"]:
        parts.append(_fact(family, "calls", calls=names(facts["calls"])))
    if facts["raises"]:
        parts.append(_fact(family, "raises", raises=names(facts["raises"])))
    if facts["yields"]:
        parts.append(_fact(family, "yields"))
    elif facts["returns"]:
        parts.append(_fact(family, "returns"))
    return " ".join(parts)


def code_document(objs: Sequence[StdlibObject], rng: random.Random, family: str) -> list[Message]:
    """Explain-the-source conversation: the first object's code, then follow-ups."""
    first = objs[0]
    slots = {"q": first.qualname, "m": first.module, "kind": first.kind}
    lines = (first.source or "").count("\n")
    messages = [
        Message("user", _say(rng, family, "code_ask", **slots)),
        assistant(
            " ".join(
                [
                    _say(rng, family, "code_think", **slots),
                    _fact(family, "lines", n=lines),
                    _say(rng, family, "code_plan"),
                ]
            ),
            f"{_say(rng, family, 'code_intro', **slots)}\n\n```python\n{first.source}```\n\n"
            + _explain_code(first, family),
        ),
    ]
    for other in objs[1:]:
        other_slots = {"q": other.qualname, "m": other.module, "kind": other.kind}
        messages.append(Message("user", _say(rng, family, "code_more", **other_slots)))
        messages.append(
            assistant(
                " ".join(
                    [_say(rng, family, "code_think", **other_slots), _say(rng, family, "code_plan")]
                ),
                f"{_say(rng, family, 'code_intro', **other_slots)}\n\n```python\n{other.source}```\n\n"
                + _explain_code(other, family),
            )
        )
    if len(objs) == 1 and rng.random() < 0.5:
        facts = code_facts(first.source or "")
        if rng.random() < 0.5:
            calls = facts["calls"]
            answer = (
                _fact(family, "calls", calls=names(calls)) if calls else _fact(family, "no_calls")
            )
            messages.append(Message("user", _say(rng, family, "code_calls_ask")))
        else:
            raises = facts["raises"]
            answer = (
                _fact(family, "raises", raises=names(raises))
                if raises
                else _fact(family, "no_raises")
            )
            messages.append(Message("user", _say(rng, family, "code_raises_ask")))
        messages.append(assistant(_say(rng, family, "code_think", **slots), answer))
    return messages


def docs_document(objs: Sequence[StdlibObject], rng: random.Random, family: str) -> list[Message]:
    """Prose answers from docstrings, one object per user turn, maybe a follow-up on defaults."""
    messages: list[Message] = []
    for turn, obj in enumerate(objs):
        slots = {"q": obj.qualname, "m": obj.module, "s": summary(obj.doc)}
        answer = excerpt(obj.doc, 1000) + "\n\n"
        answer += _say(rng, family, "docs_usage", call=call_form(obj))
        messages.append(
            Message("user", _say(rng, family, "docs_next" if turn else "docs_ask", **slots))
        )
        reasoning = [_say(rng, family, "docs_think", **slots), _say(rng, family, "docs_plan")]
        messages.append(assistant(" ".join(reasoning), answer))
    last = objs[-1]
    if last.public_params() and rng.random() < 0.4:
        slots = {"q": last.qualname, "m": last.module, "s": summary(last.doc)}
        messages.append(Message("user", _say(rng, family, "docs_more")))
        messages.append(
            assistant(_say(rng, family, "docs_think", **slots), _defaults(last, family))
        )
    return messages


def topic_document(
    topic: Topic, part: int, rng: random.Random, family: str, turns: int = 1
) -> list[Message]:
    """A reference topic answered from its paragraphs, starting at chunk ``part``."""
    chunks = topic_chunks(topic)
    messages: list[Message] = []
    for turn, chunk in enumerate(chunks[part : part + turns]):
        slots = {"t": topic.title, "s": summary(chunk, 160)}
        slot = "topic_ask" if turn == 0 else "topic_more"
        messages.append(Message("user", _say(rng, family, slot, **slots)))
        reasoning = " ".join(
            [_say(rng, family, "topic_think", **slots), _say(rng, family, "topic_plan")]
        )
        messages.append(assistant(reasoning, chunk))
    return messages


def topic_chunks(topic: Topic, limit: int = 1400) -> list[str]:
    """The topic's paragraphs grouped into answers of about ``limit`` characters."""
    chunks: list[str] = []
    current: list[str] = []
    for paragraph in topic.paragraphs:
        paragraph = paragraph if len(paragraph) <= limit else paragraph[:limit].rstrip() + " ..."
        if current and sum(len(p) + 2 for p in current) + len(paragraph) > limit:
            chunks.append("\n\n".join(current))
            current = []
        current.append(paragraph)
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def _doc_block(obj: StdlibObject) -> str:
    return f"{obj.qualname}{obj.signature}\n\n{excerpt(obj.doc, 600)}"


def _json_record(obj: StdlibObject, family: str) -> dict[str, object]:
    params = obj.public_params()
    if family == "A":
        shown = [p.name if p.default is None else f"{p.name}={p.default}" for p in params]
        return {
            "name": obj.name,
            "module": obj.module,
            "kind": obj.kind,
            "params": shown,
            "summary": summary(obj.doc),
        }
    return {
        "qualified_name": obj.qualname,
        "defined_in": obj.module,
        "category": obj.kind,
        "arguments": {
            "required": [p.name for p in params if _required(p)],
            "optional": [p.name for p in params if not _required(p)],
        },
        "first_sentence": summary(obj.doc),
    }


def _required(param: Param) -> bool:
    return param.default is None and param.kind not in ("var_positional", "var_keyword")


def json_document(objs: Sequence[StdlibObject], rng: random.Random, family: str) -> list[Message]:
    """Field extraction as JSON, one object per user turn."""
    messages: list[Message] = []
    for turn, obj in enumerate(objs):
        slots = {"q": obj.qualname, "m": obj.module, "kind": obj.kind, "block": _doc_block(obj)}
        messages.append(
            Message("user", _say(rng, family, "json_ask" if turn == 0 else "json_next", **slots))
        )
        params = params_text(obj, family)
        reasoning = _say(rng, family, "json_think", **slots)
        if params:
            reasoning += " " + _say(rng, family, "json_params", params=params)
        answer = json.dumps(_json_record(obj, family), indent=2, ensure_ascii=False)
        messages.append(assistant(reasoning, answer))
    return messages


def _tool_schema(family: str, name: str, arg: str, description: str) -> str:
    if family == "A":
        return json.dumps(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": {arg: {"type": "string"}},
                        "required": [arg],
                    },
                },
            }
        )
    return json.dumps({"name": name, "about": description, "args": {arg: "string"}})


def _call(family: str, purpose: str, value: str) -> tuple[str, str]:
    name, arg, _ = TOOLS[family][purpose]
    return (
        name,
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': {arg: value}})}\n</tool_call>",
    )


def _tool_result(obj: StdlibObject, family: str, purpose: str, members: Sequence[str]) -> str:
    if family == "A":
        result: dict[str, object] = {
            "signature": {"qualname": obj.qualname, "kind": obj.kind, "signature": obj.signature},
            "doc": {"qualname": obj.qualname, "docstring": excerpt(obj.doc, 700)},
            "members": {"module": obj.module, "members": list(members)},
        }[purpose]
    else:
        result = {
            "signature": {"target": obj.qualname, "type": obj.kind, "call": call_form(obj)},
            "doc": {"target": obj.qualname, "text": excerpt(obj.doc, 700)},
            "members": {"module_name": obj.module, "names": list(members)},
        }[purpose]
    return json.dumps(result, ensure_ascii=False)


def tool_document(
    objs: Sequence[StdlibObject], rng: random.Random, family: str, members: dict[str, list[str]]
) -> list[Message]:
    """Multi-turn tool calling: lookups through <tool_call> blocks and tool turns, then answers."""
    tools = "\n".join(
        _tool_schema(family, *TOOLS[family][p]) for p in ("signature", "doc", "members", "source")
    )
    messages = [Message("system", _say(rng, family, "tool_system", tools=tools))]
    for turn, obj in enumerate(objs):
        slots = {"q": obj.qualname, "m": obj.module}
        plan = rng.choice(("signature", "doc", "members") if turn else ("signature", "doc"))
        ask = {"signature": "tool_ask_sig", "doc": "tool_ask_doc", "members": "tool_ask_members"}
        messages.append(Message("user", _say(rng, family, ask[plan], **slots)))
        lookups = ["signature", "doc"] if plan == "doc" else [plan]
        target = obj.module if plan == "members" else obj.qualname
        for step, purpose in enumerate(lookups):
            tool, call = _call(family, purpose, target)
            slot = "tool_think_call" if step == 0 else "tool_think_next"
            messages.append(assistant(_say(rng, family, slot, tool=tool), call))
            messages.append(
                Message("tool", _tool_result(obj, family, purpose, members.get(obj.module, [])))
            )
        params = params_text(obj, family) or "-"
        if plan == "members":
            answer = _fact(family, "members", m=obj.module, names=names(members[obj.module]))
        elif plan == "signature":
            answer = _fact(family, "sig_answer", q=obj.qualname, params=params, call=call_form(obj))
        else:
            answer = (
                excerpt(obj.doc, 500)
                + "\n\n"
                + _fact(family, "sig_answer", q=obj.qualname, params=params, call=call_form(obj))
            )
        messages.append(assistant(_say(rng, family, "tool_think_done"), answer))
    return messages
