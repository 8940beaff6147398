"""Scoring windows: a stretch of scored tokens with the document's preceding tokens as context.

Where the scored text starts (character boundaries in the rendered document):

- ``think``: right after ``<|im_start|>assistant\\n`` of an assistant turn in the think format;
  scores the reasoning from ``<think>`` through ``</think>``.
- ``answer``: right after ``</think>``; scores the answer body *including* the blank line that
  follows ``</think>`` (it is text the model must produce, and it is where the answer mode
  starts) and the closing ``<|im_end|>``. An assistant turn without the think format gives one
  ``answer`` window that starts right after ``<|im_start|>assistant\\n``.
- ``text``: documents without chat markup are tiled into consecutive scored stretches, the
  first starting after ``text_min_context`` tokens.

That is ChatML, the rendering of a model file without a chat template. With a ``chat`` format
(:func:`healsweep.data.chat_template.model_chat_format`) a document is rendered through the
file's own template and the same boundaries are found in that text from the template's markers
(:mod:`healsweep.data.chat_template`); a turn whose reasoning the template leaves out has an
``answer`` window only, and :func:`make_windows` warns how many turns that is.

A token belongs to the scored stretch when its first character lies inside it, so a token that
straddles a boundary is context. At most ``max_scored`` tokens are scored per window; the context
is the document's preceding tokens, at most ``max_context`` of them. Scored token ``j``
(``scored_from <= j < scored_from + n_scored``) is predicted from the logits at ``j - 1``.

``window_id`` is a content hash of (document content hash, kind, turn, token ids, scored range):
it changes when the document, the tokens it is cut from (the tokenizer, the chat format) or the
window limits change, and only then. The document content hash (of the messages' ChatML
rendering) and so the split are the same whatever model reads the document.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from healsweep.data.chat_template import ChatFormat, Region, render_document
from healsweep.data.corpus import IM_END, IM_START, THINK_CLOSE, THINK_OPEN, Document, split_think
from healsweep.data.split import check_named_ids, require_access, split_lock_id
from healsweep.errors import SplitError

Kind = Literal["think", "answer", "text"]
_ID_TAG = "healsweep-window-v1"
DEFAULT_MAX_CONTEXT = 896  # context tokens before a window's scored stretch, at most
_THINK_END = THINK_CLOSE.rstrip("\n")  # "\n</think>": the answer starts right after it


@dataclass(frozen=True, eq=False)
class Window:
    """One scoring window (see the module docstring for the conventions)."""

    window_id: str
    doc_id: str
    source: str
    doc_index: int
    stratum: str
    split: str
    kind: Kind
    tokens: np.ndarray  # int32 [n_context + n_scored]
    scored_from: int
    n_scored: int
    turn: int = 0  # assistant turn (0-based) for think/answer, stretch number for text

    @property
    def scored_tokens(self) -> np.ndarray:
        """The scored token ids, ``tokens[scored_from : scored_from + n_scored]``."""
        return self.tokens[self.scored_from : self.scored_from + self.n_scored]

    def to_record(self) -> dict[str, Any]:
        """JSON-ready description (token ids as a list)."""
        return {
            "window_id": self.window_id,
            "doc_id": self.doc_id,
            "source": self.source,
            "doc_index": self.doc_index,
            "stratum": self.stratum,
            "split": self.split,
            "kind": self.kind,
            "turn": self.turn,
            "tokens": [int(t) for t in self.tokens],
            "scored_from": self.scored_from,
            "n_scored": self.n_scored,
        }


def chat_regions(doc: Document, chat: ChatFormat | None = None) -> list[Region]:
    """Character ranges to score in a chat document, think/answer per assistant turn, in the
    text of :func:`healsweep.data.chat_template.render_document` (ChatML when ``chat`` is None)."""
    if chat is not None and not chat.is_chatml:
        rendered = chat.render_chat(doc.messages or (), what=f"document {doc.doc_id!r}")
        return list(rendered.regions)
    regions: list[Region] = []
    pos, turn = 0, 0
    text = doc.render()
    for message in doc.messages or ():
        header = f"{IM_START}{message.role}\n"
        start = pos + len(header)
        end = start + len(message.content)
        assert text[start:end] == message.content, "render() layout changed"
        if message.role == "assistant":
            parts = split_think(message.content)
            if parts is None:
                regions.append(Region("answer", turn, start, end + len(IM_END)))
            else:
                think_end = start + len(THINK_OPEN) + len(parts[0]) + len(_THINK_END)
                regions.append(Region("think", turn, start, think_end))
                regions.append(Region("answer", turn, think_end, end + len(IM_END)))
            turn += 1
        pos = end + len(IM_END) + 1
    return regions


def _token_index(starts: np.ndarray, char_pos: int) -> int:
    """Number of tokens whose first character lies before ``char_pos``."""
    return int(np.searchsorted(starts, char_pos, side="left"))


def _window_id(
    doc: Document, kind: str, turn: int, tokens: np.ndarray, scored_from: int, n_scored: int
) -> str:
    digest = hashlib.sha256()
    digest.update(f"{_ID_TAG}|{doc.content_hash}|{kind}|{turn}|{scored_from}|{n_scored}|".encode())
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return digest.hexdigest()[:24]


def document_windows(
    doc: Document,
    token_ids: np.ndarray,
    token_starts: np.ndarray,
    split: str,
    *,
    max_scored: int = 128,
    max_context: int = DEFAULT_MAX_CONTEXT,
    max_windows: int | None = None,
    text_min_context: int = 16,
    kinds: Iterable[str] = ("think", "answer", "text"),
    chat: ChatFormat | None = None,
) -> list[Window]:
    """The windows of one tokenized document (``token_starts``: first character of each token
    in ``render_document(doc, chat)``).

    ``max_windows`` caps the windows of this document (the first ones of the wanted ``kinds``).
    """
    wanted = set(kinds)
    n_tok = len(token_ids)
    spans: list[tuple[Kind, int, int, int]] = []  # kind, turn, first token, end token
    if doc.messages is not None:
        for region in chat_regions(doc, chat):
            lo = max(_token_index(token_starts, region.start), 1)
            hi = _token_index(token_starts, region.end)
            if hi > lo and region.kind in wanted:
                spans.append((region.kind, region.turn, lo, min(hi, lo + max_scored)))
    elif "text" in wanted:
        for stretch, lo in enumerate(range(max(text_min_context, 1), n_tok, max_scored)):
            spans.append(("text", stretch, lo, min(n_tok, lo + max_scored)))
    windows = []
    for kind, turn, lo, hi in spans[:max_windows]:
        first = max(0, lo - max_context)
        tokens = np.asarray(token_ids[first:hi], dtype=np.int32)
        scored_from, n_scored = lo - first, hi - lo
        windows.append(
            Window(
                window_id=_window_id(doc, kind, turn, tokens, scored_from, n_scored),
                doc_id=doc.doc_id,
                source=doc.source,
                doc_index=doc.index,
                stratum=doc.stratum,
                split=split,
                kind=kind,
                tokens=tokens,
                scored_from=scored_from,
                n_scored=n_scored,
                turn=turn,
            )
        )
    return windows


def make_windows(
    corpus: Any,
    tokenizer: Any,
    split_cfg: Any,
    split: str = "dev",
    grant: Any = None,
    max_scored: int = 128,
    max_context: int = DEFAULT_MAX_CONTEXT,
    *,
    max_windows_per_doc: int | None = None,
    text_min_context: int = 16,
    kinds: Iterable[str] = ("think", "answer", "text"),
    chat: ChatFormat | None = None,
) -> list[Window]:
    """Windows of every document that ``split_cfg`` assigns to ``split``, in corpus order.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (nothing is added around the text); ``chat`` is
    the model's chat format (``model_chat_format(model)``; None = ChatML). Windows of
    ``split="test"`` need a ledger ``grant`` for this split's lock id (else ``TestSplitSealed``);
    ``calibration``/``excluded`` are not eval splits (``SplitError``). Raises ``SplitError`` when
    the split yields no window, ``ChatTemplateError`` when the template fails on a document.
    """

    if max_scored < 1 or max_context < 0:
        raise ValueError(
            f"make_windows: max_scored must be >= 1 and max_context >= 0, got {max_scored}, "
            f"{max_context}"
        )
    # a config naming documents the corpus lacks is refused here as `split show` refuses it,
    # not scored as if it matched
    check_named_ids(split_cfg, corpus)
    lock_id = split_lock_id(split_cfg, corpus) if split == "test" else ""
    require_access(split, grant, lock_id)
    docs = [d for d in getattr(corpus, "documents", corpus) if split_cfg.assign(d) == split]
    windows: list[Window] = []
    for doc, ids, starts in _tokenize(docs, tokenizer, chat):
        windows += document_windows(
            doc,
            ids,
            starts,
            split,
            max_scored=max_scored,
            max_context=max_context,
            max_windows=max_windows_per_doc,
            text_min_context=text_min_context,
            kinds=kinds,
            chat=chat,
        )
    _warn_dropped_reasoning(docs, chat)
    if not windows:
        raise SplitError(
            f"the {split!r} split gives no scoring windows ({len(docs)} documents); check the "
            "split config and that its documents have assistant turns or text"
        )
    return windows


def context_cap(max_scored: int, max_context: int | None, context_length: int) -> int:
    """The context a window may carry for a model of ``context_length`` tokens: ``max_context``
    as asked, or by default ``DEFAULT_MAX_CONTEXT`` cut so that a whole window (context and
    ``max_scored`` scored tokens) fits the model. Every command that builds windows for a model
    (sweep, confirm, score) takes it from here. ``SplitError`` when an asked ``max_context``
    does not fit."""
    if max_context is None:
        return max(0, min(DEFAULT_MAX_CONTEXT, context_length - max_scored))
    if max_context + max_scored > context_length:
        raise SplitError(
            f"max_context {max_context} + max_scored {max_scored} exceeds the model's context "
            f"length {context_length}; lower one of them"
        )
    return max_context


def first_windows(windows: Iterable[Window], limit: int | None = None) -> list[Window]:
    """The windows in the fixed global order, sorted by ``window_id``, and the first ``limit``
    of them when capped: the one selection of sweeps (dev), ``confirm`` (test) and ``score``.
    A window id is a content hash, so the first ``limit`` are a seed-free uniform sample: each
    stratum keeps about its share of the windows, and pooled figures estimate those of the
    whole split (a cut round-robin over strata would weight small strata up)."""
    ordered = sorted(windows, key=lambda window: window.window_id)
    return ordered if limit is None else ordered[:limit]


def _warn_dropped_reasoning(docs: list[Document], chat: ChatFormat | None) -> None:
    """Warn once when the chat template leaves reasoning out (those turns have no think window)."""
    if chat is None or chat.is_chatml:
        return
    dropped = turns = 0
    for doc in docs:
        if doc.messages is not None:
            rendered = chat.render_chat(doc.messages, what=f"document {doc.doc_id!r}")
            dropped += len(rendered.dropped_reasoning)
            turns += sum(
                1 for m in doc.messages if m.role == "assistant" and split_think(m.content)
            )
    if dropped:
        warnings.warn(
            f"the chat template of {chat.source} leaves out the reasoning of {dropped} of {turns} "
            "assistant turns with reasoning; those turns have an answer window only",
            stacklevel=3,
        )


def _tokenize(
    docs: list[Document], tokenizer: Any, chat: ChatFormat | None = None
) -> Iterator[tuple[Document, np.ndarray, np.ndarray]]:
    texts = [render_document(doc, chat) for doc in docs]
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    for doc, enc in zip(docs, encodings, strict=True):
        ids = np.asarray(enc.ids, dtype=np.int32)
        starts = np.asarray([start for start, _ in enc.offsets], dtype=np.int64)
        yield doc, ids, starts


__all__ = [
    "Kind",
    "Window",
    "chat_regions",
    "document_windows",
    "context_cap",
    "first_windows",
    "make_windows",
]
