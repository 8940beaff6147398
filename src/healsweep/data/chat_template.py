"""Documents in the model's own chat format, and where each assistant turn's scored text sits.

A GGUF may carry its chat template (``tokenizer.chat_template``, Jinja2). :class:`ChatFormat`
renders a conversation with it as transformers' ``apply_chat_template`` does: a sandboxed,
immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block that renders its body, a ``tojson`` filter that keeps
non-ASCII and HTML characters as they are, the ``raise_exception`` and ``strftime_now``
globals, and as variables ``messages`` (``{"role", "content"}`` dicts), ``add_generation_prompt``,
``tools`` and ``documents`` (None) and the file's special tokens (``bos_token``, ``eos_token``,
``unk_token``, ``pad_token``). One deliberate difference: ``strftime_now`` formats a fixed instant
(:data:`TEMPLATE_CLOCK`), not the clock, so a document renders to the same text on every day and
its windows keep their ids. A file without a template keeps ChatML
(:func:`healsweep.data.corpus.render_chatml`), byte for byte.

Where the scored text sits. Templates rewrite messages (Qwen3 strips the newlines around the
reasoning and drops the reasoning of turns before the last user message; DeepSeek-R1 drops the
reasoning of every turn), so positions come from the template itself: the conversation is
rendered a second time with each *piece* of message text (a message's content, or an assistant
turn's reasoning and answer, split as :func:`healsweep.data.corpus.split_think` does) replaced by
a unique sentinel, and the real rendering is aligned literal by literal against it, each piece
allowed to have lost leading or trailing whitespace. A piece whose sentinel is absent was
dropped by the template. Should the alignment fail (a template that branches on the text
itself), each piece is searched for in message order instead (``RenderedChat.exact`` is False).

From the located pieces, per assistant turn (the same boundaries as ChatML's,
:mod:`healsweep.data.windows`):

- ``think``: from the ``<think>`` before the reasoning through the ``</think>`` after it;
- ``answer``: from there, or from the answer's first character when the text holds no reasoning
  for the turn, through the end-of-turn marker (the file's eos, eot or eom token) that follows
  the answer (after whitespace, if any), when one does.

A turn whose reasoning the template dropped has an answer window only; ``dropped_reasoning``
lists those turns.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple

from gguf import Keys

from healsweep.data._template_sandbox import (
    RenderLimitExceeded,
    RenderLimits,
    budgeted,
    guard_filters,
    make_environment,
    render_limits,
)
from healsweep.data.corpus import (
    IM_END,
    THINK_CLOSE,
    THINK_OPEN,
    Message,
    render_chatml,
    split_think,
)
from healsweep.errors import ChatTemplateError

THINK_START = "<think>"
THINK_END = "</think>"
TEMPLATE_CLOCK = datetime(2025, 1, 1)  # what strftime_now formats (see the module docstring)
SPECIAL_TOKEN_KEYS = (
    ("bos_token", Keys.Tokenizer.BOS_ID),
    ("eos_token", Keys.Tokenizer.EOS_ID),
    ("unk_token", Keys.Tokenizer.UNK_ID),
    ("pad_token", Keys.Tokenizer.PAD_ID),
)
END_OF_TURN_KEYS = (  # GLM-4.5 files, for one, end turns with eot <|user|> / eom <|observation|>
    Keys.Tokenizer.EOS_ID,
    Keys.Tokenizer.EOT_ID,
    Keys.Tokenizer.EOM_ID,
)
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a sentinel's number
_FIX = (
    "fix the template (gguf-new-metadata IN OUT --chat-template-file T.jinja) or remove it "
    "(--remove-metadata tokenizer.chat_template) to have documents rendered as ChatML"
)


class Region(NamedTuple):
    """A stretch of rendered text to score: ``think`` or ``answer`` of assistant turn ``turn``."""

    kind: str
    turn: int
    start: int  # character offsets in the rendered text
    end: int


class Span(NamedTuple):
    """Where one piece of message ``message`` sits in the rendered text.

    ``part`` is ``content`` (a whole message), or ``reasoning``/``answer`` of an assistant turn
    in the think format."""

    message: int
    part: str
    start: int
    end: int


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered through a chat format, with its pieces and scored regions."""

    text: str
    spans: tuple[Span, ...]  # the pieces found in ``text``, in text order
    regions: tuple[Region, ...]  # think/answer per assistant turn, in turn order
    dropped_reasoning: tuple[int, ...]  # assistant turns whose reasoning is not in ``text``
    exact: bool = True  # located by sentinels (True) or by searching the text (False)


@dataclass(frozen=True)
class ChatFormat:
    """How a model reads a conversation: its Jinja chat template, or ChatML (``template=None``).

    ``special_tokens`` are the template variables ``(name, text)``, ``end_of_turn`` the markers
    an answer window may end with, ``source`` the file the template came from (for errors),
    ``limits`` what one render may spend (:mod:`healsweep.data._template_sandbox`).
    """

    template: str | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()
    end_of_turn: tuple[str, ...] = (IM_END,)
    source: str = "ChatML"
    limits: RenderLimits = RenderLimits()

    @property
    def is_chatml(self) -> bool:
        """True when documents are rendered as ChatML (the file has no template)."""
        return self.template is None

    def describe(self) -> str:
        """One line for reports: ChatML, or the template's size and sha256 (as ``model info``)."""
        if self.template is None:
            return "ChatML (the file has no chat template)"
        digest = hashlib.sha256(self.template.encode("utf-8")).hexdigest()[:12]
        return f"the file's chat template ({len(self.template)} chars, sha256 {digest})"

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        what: str = "a conversation",
    ) -> str:
        """The text of ``messages`` as this format renders it (``what`` names them in errors)."""
        if self.template is None:
            if add_generation_prompt:
                raise ValueError("ChatFormat.render: ChatML documents take no generation prompt")
            return render_chatml(messages)
        return self._render(_as_dicts(messages), add_generation_prompt, what)

    def render_chat(
        self, messages: Sequence[Message], *, what: str = "a conversation"
    ) -> RenderedChat:
        """Render ``messages`` and locate their pieces and think/answer regions (module doc)."""
        if self.template is None:
            raise ValueError("ChatFormat.render_chat: ChatML regions come from data.windows")
        return _render_chat(self, tuple(Message(m.role, m.content) for m in messages), what)

    def _render(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, what: str
    ) -> str:
        # One budget covers the compile too: what Jinja still evaluates while it compiles (an
        # ``{% autoescape %}`` value; constant folding is off, see make_environment) runs the
        # same guarded filters, so it is bounded like the render.
        try:
            with budgeted(self.limits):
                compiled = self._compiled()
                return compiled.render(
                    messages=messages,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **dict(self.special_tokens),
                )
        except RenderLimitExceeded as exc:
            raise ChatTemplateError(
                f"{self.source}: tokenizer.chat_template was stopped on {what}: {exc} (the "
                f"limits of one render are {self.limits.describe()}); for a legitimate large "
                "template raise HEALSWEEP_TEMPLATE_SECONDS / HEALSWEEP_TEMPLATE_MIB, otherwise "
                + _FIX
            ) from None
        except ChatTemplateError:
            raise
        except Exception as exc:  # raise_exception(), undefined names, type errors in the template
            raise ChatTemplateError(
                f"{self.source}: tokenizer.chat_template failed on {what} "
                f"({type(exc).__name__}: {_first_line(exc)}); " + _FIX
            ) from exc

    def _compiled(self) -> Any:
        try:
            return _compile(self.template)
        except RenderLimitExceeded:
            raise
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(
                f"{self.source}: tokenizer.chat_template does not compile ({_first_line(exc)}); "
                + _FIX
            ) from exc


CHATML = ChatFormat()


def model_chat_format(model: Any) -> ChatFormat:
    """The chat format of a GGUF model: its ``tokenizer.chat_template``, else ChatML.

    ``model`` needs ``metadata(key)`` and ``path`` (a :class:`healsweep.gguf_io.GGUFModel`).
    """
    template = model.metadata(Keys.Tokenizer.CHAT_TEMPLATE)
    if not isinstance(template, str) or not template:
        return CHATML
    tokens = model.metadata(Keys.Tokenizer.LIST) or []

    def text_of(key: str) -> str | None:
        index = model.metadata(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    special = tuple(
        (name, text) for name, key in SPECIAL_TOKEN_KEYS if (text := text_of(key)) is not None
    )
    ends = tuple(dict.fromkeys(t for key in END_OF_TURN_KEYS if (t := text_of(key))))
    return ChatFormat(template, special, ends, str(model.path), render_limits())


def render_document(doc: Any, chat: ChatFormat | None = None) -> str:
    """The text the model reads for a corpus document: chat messages through ``chat`` (ChatML
    when None or without a template), plain ``text`` as it is."""
    if doc.messages is None or chat is None or chat.is_chatml:
        return doc.render()
    return chat.render_chat(doc.messages, what=f"document {doc.doc_id!r}").text


# --- rendering ----------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _as_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The Jinja environment chat templates run in (see the module docstring)."""
    # lazy: heavy (jinja2)
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        # rendering only needs its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    env = make_environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = TEMPLATE_CLOCK.strftime
    guard_filters(env)  # every filter, the ones above included, within the render's budget
    return env


# --- locating the pieces ------------------------------------------------------------------------


class _Piece(NamedTuple):
    message: int
    part: str
    text: str


def _pieces(messages: Sequence[Message]) -> tuple[list[_Piece], list[dict[str, str]]]:
    """The pieces of every message, and the messages with each non-empty piece as a sentinel."""
    pieces: list[_Piece] = []
    skeleton: list[dict[str, str]] = []

    def sentinel(message: int, part: str, text: str) -> str:
        if not text:
            return ""  # an empty piece has no extent to find
        pieces.append(_Piece(message, part, text))
        return f"{_OPEN}{len(pieces) - 1}{_CLOSE}"

    for i, m in enumerate(messages):
        think = split_think(m.content) if m.role == "assistant" else None
        if think is None:
            content = sentinel(i, "content", m.content)
        else:
            reasoning = sentinel(i, "reasoning", think[0])
            content = THINK_OPEN + reasoning + THINK_CLOSE + sentinel(i, "answer", think[1])
        skeleton.append({"role": m.role, "content": content})
    return pieces, skeleton


def _trimmings(text: str) -> list[str]:
    """``text`` and what a template's strip/lstrip/rstrip may leave of it, longest first."""
    variants = [text]
    for chars in ("\n", None):
        variants += [text.strip(chars), text.lstrip(chars), text.rstrip(chars)]
    return sorted(dict.fromkeys(variants), key=len, reverse=True)


def _split_skeleton(skeleton: str) -> tuple[list[str], list[int]] | None:
    """Literal texts and sentinel numbers, alternating (``len(literals) == len(ids) + 1``)."""
    literals, ids, pos = [], [], 0
    while (start := skeleton.find(_OPEN, pos)) >= 0:
        stop = skeleton.find(_CLOSE, start)
        number = skeleton[start + 1 : stop]
        if stop < 0 or not number.isdigit():
            return None
        literals.append(skeleton[pos:start])
        ids.append(int(number))
        pos = stop + 1
    literals.append(skeleton[pos:])
    return literals, ids


def _align(text: str, skeleton: str, pieces: list[_Piece]) -> list[Span] | None:
    """Spans of the pieces in ``text`` by walking the sentinel rendering; None if it does not fit."""
    parts = _split_skeleton(skeleton)
    if parts is None:
        return None
    literals, ids = parts
    if len(set(ids)) != len(ids) or not text.startswith(literals[0]):
        return None  # a piece rendered twice, or the texts differ outside the pieces
    pos = len(literals[0])
    spans = []
    for number, after in zip(ids, literals[1:], strict=True):
        piece = pieces[number]
        for rendered in _trimmings(piece.text):
            if text.startswith(rendered, pos) and text.startswith(after, pos + len(rendered)):
                break
        else:
            return None
        spans.append(Span(piece.message, piece.part, pos, pos + len(rendered)))
        pos += len(rendered) + len(after)
    return spans if pos == len(text) else None


def _search(text: str, pieces: list[_Piece]) -> list[Span]:
    """Spans found by looking for each piece (whitespace-trimmed) in order: the fallback."""
    spans, cursor = [], 0
    for piece in pieces:
        core = piece.text.strip()
        at = text.find(core, cursor) if core else -1
        if at >= 0:
            spans.append(Span(piece.message, piece.part, at, at + len(core)))
            cursor = at + len(core)
    return spans


def _regions(
    text: str, spans: list[Span], messages: Sequence[Message], end_of_turn: tuple[str, ...]
) -> tuple[list[Region], list[int]]:
    """Think/answer regions per assistant turn, and the turns whose reasoning was dropped."""
    located = {(s.message, s.part): s for s in spans}
    starts = sorted(s.start for s in spans)
    ends = sorted(s.end for s in spans)

    def previous_end(pos: int) -> int:  # where the text before ``pos`` stops being a piece
        return max((e for e in ends if e <= pos), default=0)

    def next_start(pos: int) -> int:  # where the next piece after ``pos`` begins
        return min((s for s in starts if s >= pos), default=len(text))

    regions: list[Region] = []
    dropped: list[int] = []
    turn = 0
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        think = split_think(m.content)
        reasoning = located.get((i, "reasoning"))
        answer = located.get((i, "content" if think is None else "answer"))
        think_end = None
        if reasoning is not None:
            opened = text.rfind(THINK_START, previous_end(reasoning.start), reasoning.start)
            closed = text.find(THINK_END, reasoning.end, next_start(reasoning.end))
            start = opened if opened >= 0 else reasoning.start
            end = closed + len(THINK_END) if closed >= 0 else reasoning.end
            if answer is None or end <= answer.start:
                regions.append(Region("think", turn, start, end))
                think_end = end
        elif think is not None and think[0]:
            dropped.append(turn)
        answer_from = think_end if think_end is not None else answer.start if answer else None
        answer_to = answer.end if answer is not None else think_end
        if answer_from is not None and answer_to is not None:
            tail = text[answer_to : next_start(answer_to)]
            gap = len(tail) - len(tail.lstrip())
            marker = next((e for e in end_of_turn if tail.startswith(e, gap)), None)
            end = answer_to + gap + len(marker) if marker else answer_to
            if end > answer_from:
                regions.append(Region("answer", turn, answer_from, end))
        turn += 1
    return regions, dropped


@lru_cache(maxsize=4096)
def _render_chat(chat: ChatFormat, messages: tuple[Message, ...], what: str) -> RenderedChat:
    text = chat._render(_as_dicts(messages), False, what)
    pieces, skeleton = _pieces(messages)
    spans = None
    if not any(_OPEN in m.content or _CLOSE in m.content for m in messages):
        spans = _align(text, chat._render(skeleton, False, what), pieces)
    exact = spans is not None
    if spans is None:
        spans = _search(text, pieces)
    spans.sort(key=lambda s: s.start)
    regions, dropped = _regions(text, spans, messages, chat.end_of_turn)
    return RenderedChat(text, tuple(spans), tuple(regions), tuple(dropped), exact)


__all__ = [
    "CHATML",
    "TEMPLATE_CLOCK",
    "ChatFormat",
    "Region",
    "RenderedChat",
    "Span",
    "model_chat_format",
    "render_document",
]
