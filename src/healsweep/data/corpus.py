"""Corpus documents: the JSONL format, its validation, ChatML rendering and ChatML import.

A corpus is a JSONL file with one document per line (``docs/corpus-format.md``). Each document
belongs to a ``source`` with a stable ``index`` (so the parity split applies), a ``stratum``
(the unit of per-stratum reporting) and a ``pool``: ``eval`` documents are scored,
``calibration`` documents feed the healer's calibration trace, ``train`` documents only trained
the demo model. A document holds either chat ``messages`` or plain ``text``.

The users' own corpora are ChatML transcripts in text files; :func:`healsweep.data.chatml.import_chatml_files` turns
them into documents (the parser lives in :mod:`healsweep.data.chatml`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from healsweep._atomic import atomic_file
from healsweep._inputs import decode_utf8, open_regular, quoted, size_setting
from healsweep.bundled import demo_corpus_path
from healsweep.errors import CorpusError

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
POOLS: tuple[str, ...] = ("eval", "calibration", "train")
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>\n\n"

_REQUIRED = ("doc_id", "source", "index", "stratum")
_KNOWN = frozenset((*_REQUIRED, "pool", "messages", "text", "meta"))
DOC_SETTING = "HEALSWEEP_DOC_MIB"
# 1 MiB: about 250,000 tokens of English, longer than the models' contexts; scoring tokenizes a
# document whole at ~300 bytes a token, so 1 MiB of text that is one token a byte costs ~300 MiB
DEFAULT_DOC_MIB = 1.0
# a JSON escape of a UTF-16 surrogate; a pair decodes to one character, a lone one stays a
# surrogate that no UTF-8 encoder (the tokenizer's, the writer's) accepts
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Message(NamedTuple):
    """One ChatML turn."""

    role: str
    content: str


@dataclass(frozen=True)
class Document:
    """One corpus document; exactly one of ``messages`` and ``text`` is set."""

    doc_id: str
    source: str
    index: int
    stratum: str
    messages: tuple[Message, ...] | None = None
    text: str | None = None
    pool: str = "eval"
    meta: dict[str, Any] | None = field(default=None, compare=False)

    def render(self) -> str:
        """The document as the model reads it: ChatML for messages, the text itself otherwise."""
        if self.messages is None:
            return self.text or ""
        return render_chatml(self.messages)

    @cached_property
    def content_hash(self) -> str:
        """sha256 (hex) of the rendered document; any edit of its text changes it."""
        return hashlib.sha256(self.render().encode("utf-8")).hexdigest()

    def to_record(self) -> dict[str, Any]:
        """The JSON object of this document, keys in the documented order."""
        record: dict[str, Any] = {
            "doc_id": self.doc_id,
            "source": self.source,
            "index": self.index,
            "stratum": self.stratum,
            "pool": self.pool,
        }
        if self.messages is not None:
            record["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        else:
            record["text"] = self.text
        if self.meta:
            record["meta"] = self.meta
        return record


@dataclass
class Corpus:
    """A validated list of documents and the file they came from."""

    documents: list[Document]
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.documents)

    def __iter__(self) -> Iterator[Document]:
        return iter(self.documents)

    def pool(self, name: str) -> list[Document]:
        """Documents of one pool (``eval``, ``calibration`` or ``train``), in file order."""
        return [doc for doc in self.documents if doc.pool == name]

    def get(self, doc_id: str) -> Document:
        """The document with this id; ``KeyError`` if there is none."""
        for doc in self.documents:
            if doc.doc_id == doc_id:
                return doc
        raise KeyError(doc_id)


def render_chatml(messages: Iterable[Message]) -> str:
    """ChatML text: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""
    return "".join(f"{IM_START}{m.role}\n{m.content}{IM_END}\n" for m in messages)


def split_think(content: str) -> tuple[str, str] | None:
    """(reasoning, answer) of an assistant turn in the think format, or None if it is not."""
    if not content.startswith(THINK_OPEN):
        return None
    end = content.find(THINK_CLOSE)
    if end < 0:
        return None
    return content[len(THINK_OPEN) : end], content[end + len(THINK_CLOSE) :]


def load_corpus(path_or_demo: str | os.PathLike[str]) -> Corpus:
    """Read and validate a corpus JSONL (``"demo"`` = the packaged demo corpus).

    Raises ``CorpusError`` naming the file and line for bad JSON, a missing or mistyped field,
    a duplicate ``doc_id`` or ``(source, index)``, an unknown role or pool, or a document with
    both or neither of ``messages`` and ``text``; and for a file that is not a regular one, a
    byte that is not UTF-8 (naming its offset), a line over the per-document limit
    (``HEALSWEEP_DOC_MIB``, read no further than that) or a lone surrogate.
    """
    path = demo_corpus_path() if str(path_or_demo) == "demo" else Path(path_or_demo)
    try:
        lines = read_document_lines(path)
    except FileNotFoundError:
        hint = (
            "rebuild it with `healsweep demo corpus`"
            if str(path_or_demo) == "demo"
            else ("pass a corpus JSONL path or `demo`")
        )
        raise CorpusError(f"corpus file {path} not found; {hint}") from None
    except OSError as exc:
        raise CorpusError(f"cannot read corpus file {path}: {exc.strerror or exc}") from None
    documents = _parse_numbered(lines, str(path))
    return Corpus(documents=documents, path=path)


def document_limit() -> int:
    """The per-document byte limit: ``HEALSWEEP_DOC_MIB`` (default 1 MiB)."""
    return size_setting(DOC_SETTING, DEFAULT_DOC_MIB)


def read_document_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line of the corpus file ``path``: a regular
    file of UTF-8 text, each line (one document) read only up to :func:`document_limit`.
    ``OSError`` of the open propagates."""
    limit = document_limit()
    lines, offset, number = [], 0, 0
    with open_regular(path, "corpus", error=CorpusError) as fh:
        size = os.fstat(fh.fileno()).st_size
        while raw := fh.readline(limit + 2):  # the document, its newline, one byte more
            number += 1
            body = raw.rstrip(b"\r\n")
            if len(body) > limit:
                raise CorpusError(
                    f"{path}:{number}: the document is over the per-document limit of "
                    f"{limit:,} bytes ({DOC_SETTING}, docs/corpus-format.md); split it into "
                    f"several documents, or raise {DOC_SETTING}"
                )
            text = decode_utf8(raw, str(path), "corpus", offset=offset, line=number,
                               error=CorpusError)  # fmt: skip
            offset += len(raw)
            if offset > size:
                break  # a /proc file says size 0 and gives more: refused below
            if text.strip():
                lines.append((number, text))
    if offset != size:
        raise CorpusError(
            f"{path} gave {offset:,} bytes where its size says {size:,}: it changed while read, "
            "or is a /proc or /sys file; a corpus is read only from a regular file on disk"
        )
    return lines


def parse_corpus_lines(lines: Sequence[str], where: str) -> list[Document]:
    """Validate JSONL lines into documents; errors name ``where`` and the 1-based line."""
    return _parse_numbered(enumerate(lines, start=1), where)


def _parse_numbered(lines: Iterable[tuple[int, str]], where: str) -> list[Document]:
    documents: list[Document] = []
    seen_ids: dict[str, int] = {}
    seen_keys: dict[tuple[str, int], int] = {}
    for lineno, line in lines:
        if not line.strip():
            continue
        doc = _parse_record(line, f"{where}:{lineno}")
        if doc.doc_id in seen_ids:
            raise CorpusError(
                f"{where}:{lineno}: duplicate doc_id {quoted(doc.doc_id)} (first on line "
                f"{seen_ids[doc.doc_id]}); give every document a unique doc_id"
            )
        key = (doc.source, doc.index)
        if key in seen_keys:
            raise CorpusError(
                f"{where}:{lineno}: duplicate (source, index) = ({quoted(doc.source)}, {doc.index}) "
                f"(first on line {seen_keys[key]}); indexes must be unique within a source"
            )
        seen_ids[doc.doc_id] = lineno
        seen_keys[key] = lineno
        documents.append(doc)
    if not documents:
        raise CorpusError(f"{where}: the corpus holds no documents; add one JSON object per line")
    return documents


def _parse_record(line: str, where: str) -> Document:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where}: bad JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise CorpusError(
            f"{where}: the JSON nests too deep for Python's parser; a document is an object "
            "of strings, messages and a flat meta"
        ) from None
    if _SURROGATE_ESCAPE.search(line):
        _refuse_lone_surrogates(record, where)
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: a document must be a JSON object, got {type(record).__name__}")
    for name in _REQUIRED:
        if name not in record:
            raise CorpusError(f"{where}: missing field {name!r}; every document needs {_REQUIRED}")
    unknown = sorted(set(record) - _KNOWN)
    if unknown:
        raise CorpusError(f"{where}: unknown field(s) {quoted(unknown)}; allowed: {sorted(_KNOWN)}")
    for name in ("doc_id", "source", "stratum"):
        if not isinstance(record[name], str) or not record[name]:
            raise CorpusError(f"{where}: field {name!r} must be a non-empty string")
    index = record["index"]
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise CorpusError(f"{where}: field 'index' must be an integer >= 0, got {quoted(index)}")
    pool = record.get("pool", "eval")
    if pool not in POOLS:
        raise CorpusError(f"{where}: unknown pool {quoted(pool)}; use one of {POOLS}")
    meta = record.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise CorpusError(f"{where}: field 'meta' must be a JSON object")
    has_messages, has_text = "messages" in record, "text" in record
    if has_messages == has_text:
        which = "both" if has_messages else "neither"
        raise CorpusError(
            f"{where}: document has {which} of 'messages' and 'text'; give exactly one"
        )
    messages, text = None, None
    if has_messages:
        messages = _parse_messages(record["messages"], where)
    else:
        text = record["text"]
        if not isinstance(text, str) or not text:
            raise CorpusError(f"{where}: field 'text' must be a non-empty string")
    return Document(
        doc_id=record["doc_id"],
        source=record["source"],
        index=index,
        stratum=record["stratum"],
        messages=messages,
        text=text,
        pool=pool,
        meta=meta,
    )


def _refuse_lone_surrogates(record: Any, where: str) -> None:
    """CorpusError when a string of the record holds a lone surrogate (``"\\ud800"`` escaped in
    the JSON): no UTF-8 encoder, the tokenizer's included, can write it."""
    pending = [([], record)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            pending += [([*path, str(k)], k) for k in value]
            pending += [([*path, str(k)], v) for k, v in value.items()]
        elif isinstance(value, list):
            pending += [([*path, str(i)], v) for i, v in enumerate(value)]
        elif isinstance(value, str) and (found := _SURROGATE.search(value)):
            field = ".".join(path) or "(the document)"
            raise CorpusError(
                f"{where}: field {quoted(field, 80)} holds a lone surrogate (U+{ord(found[0]):04X}, "
                f"at character {found.start():,}), which is not text any UTF-8 encoder writes; "
                "escape a character outside the BMP as a surrogate pair, or remove it"
            )


def _parse_messages(raw: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise CorpusError(f"{where}: field 'messages' must be a non-empty list")
    messages = []
    for number, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != {"role", "content"}:
            raise CorpusError(
                f"{where}: message {number} must be an object with exactly 'role' and 'content'"
            )
        role, content = item["role"], item["content"]
        if role not in ROLES:
            raise CorpusError(f"{where}: message {number} has unknown role {quoted(role)}; use {ROLES}")
        if not isinstance(content, str):
            raise CorpusError(f"{where}: message {number} content must be a string")
        if IM_START in content or IM_END in content:
            raise CorpusError(
                f"{where}: message {number} content contains a ChatML marker; "
                "split it into separate messages"
            )
        messages.append(Message(role, content))
    return tuple(messages)


def validate_documents(documents: Iterable[Document], where: str) -> list[Document]:
    """Run :func:`load_corpus`'s checks on in-memory documents (line = position + 1)."""
    lines = [json.dumps(doc.to_record(), ensure_ascii=False) for doc in documents]
    return parse_corpus_lines(lines, where)


def write_corpus(documents: Iterable[Document], path: str | os.PathLike[str]) -> Path:
    """Write documents as JSONL (UTF-8, one object per line), atomically; same input, same bytes."""
    target = Path(path)
    lines = [json.dumps(doc.to_record(), ensure_ascii=False) + "\n" for doc in documents]
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(target, "w", encoding="utf-8", newline="\n") as handle:
        handle.writelines(lines)
    return target
