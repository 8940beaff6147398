"""Parse the users' ChatML transcript files into documents of messages.

A file holds ChatML documents joined by blank lines. Each message is
``<|im_start|>{role}`` alone on a line, the content on the following lines, and ``<|im_end|>``
right after the content (the rendering of :func:`healsweep.data.corpus.render_chatml`).

Document boundaries: a ``system`` message always opens a new document; a ``user`` message opens
one when at least one blank line separates it from the previous ``<|im_end|>`` (inside a
document messages follow each other line by line, so a multi-turn transcript stays one
document). ``assistant`` and ``tool`` messages continue the current document.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from healsweep._inputs import read_text, size_setting
from healsweep.data.corpus import (
    DOC_SETTING,
    IM_END,
    IM_START,
    POOLS,
    ROLES,
    Document,
    Message,
    document_limit,
)
from healsweep.errors import CorpusError

IMPORT_SETTING = "HEALSWEEP_IMPORT_MIB"  # the size limit of one ChatML file (default 256 MiB)


def parse_chatml(text: str, where: str) -> list[list[Message]]:
    """Split ChatML text into documents of messages; errors name ``where`` and the line.

    Raises ``CorpusError`` for text outside any message, an ``<|im_start|>`` without its
    ``<|im_end|>``, and an unknown role.
    """
    lines = text.replace("\r\n", "\n").split("\n")
    documents: list[list[Message]] = []
    current: list[Message] = []
    role: str | None = None
    opened_at = 0
    body: list[str] = []
    gap = False  # a blank line since the last <|im_end|>
    for lineno, line in enumerate(lines, start=1):
        if role is None:
            if not line.strip():
                gap = True
                continue
            if not line.startswith(IM_START):
                raise CorpusError(
                    f"{where}:{lineno}: text outside any message ({_clip(line)}); every line "
                    "must belong to an <|im_start|>role ... <|im_end|> block"
                )
            role = line[len(IM_START) :].strip()
            if role not in ROLES:
                raise CorpusError(
                    f"{where}:{lineno}: unknown role {_clip(role)}; use one of {', '.join(ROLES)}"
                )
            if current and (role == "system" or (role == "user" and gap)):
                documents.append(current)
                current = []
            opened_at, body, gap = lineno, [], False
            continue
        if IM_START in line:
            raise _unterminated(where, opened_at, f"a new <|im_start|> on line {lineno}")
        end = line.find(IM_END)
        if end < 0:
            body.append(line)
            continue
        body.append(line[:end])
        rest = line[end + len(IM_END) :]
        if rest.strip():
            raise CorpusError(
                f"{where}:{lineno}: text outside any message after <|im_end|> ({_clip(rest)}); "
                "start the next message on its own line"
            )
        current.append(Message(role, "\n".join(body)))
        role = None
    if role is not None:
        raise _unterminated(where, opened_at, "the end of the file")
    if current:
        documents.append(current)
    return documents


def _unterminated(where: str, lineno: int, reached: str) -> CorpusError:
    return CorpusError(
        f"{where}:{lineno}: unterminated <|im_start|> (no <|im_end|> before {reached}); "
        "close the message with <|im_end|>"
    )


def _clip(text: str, limit: int = 40) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def import_chatml_files(
    paths: Sequence[str | os.PathLike[str]],
    *,
    source: str | None = None,
    stratum: str | None = None,
    pool: str = "eval",
) -> list[Document]:
    """Documents from ChatML transcript files (documents joined by blank lines).

    The source defaults to each file's stem and the index is the document's order in its file;
    with an explicit ``source`` the index continues across the files in the order given. The
    stratum defaults to the source. Malformed input raises ``CorpusError`` naming file and line.
    """
    if pool not in POOLS:
        raise CorpusError(f"unknown pool {pool!r}; use one of {POOLS}")
    documents: list[Document] = []
    next_index: dict[str, int] = {}
    origin: dict[str, str] = {}
    for raw_path in paths:
        path = Path(raw_path)
        name = source or path.stem
        if source is None and name in origin:
            raise CorpusError(
                f"{path}: source {name!r} is also the stem of {origin[name]}; "
                "rename one file or pass --source"
            )
        origin[name] = str(path)
        try:
            text = read_text(path, "ChatML file", size_setting(IMPORT_SETTING, 256),
                             setting=IMPORT_SETTING, error=CorpusError)  # fmt: skip
        except FileNotFoundError:
            raise CorpusError(f"{path}: file not found; pass ChatML text files to import") from None
        except OSError as exc:
            raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
        for number, messages in enumerate(parse_chatml(text, str(path)), start=1):
            _check_size(messages, path, number)
            index = next_index.get(name, 0)
            next_index[name] = index + 1
            documents.append(
                Document(
                    doc_id=f"{name}-{index:04d}",
                    source=name,
                    index=index,
                    stratum=stratum or name,
                    messages=tuple(messages),
                    pool=pool,
                )
            )
    return documents


def _check_size(messages: Sequence[Message], path: Path, number: int) -> None:
    """CorpusError when a document is over the per-document limit its corpus line would be."""
    limit = document_limit()
    size = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in messages)
    if size > limit:
        raise CorpusError(
            f"{path}: document {number} holds {size:,} bytes, over the per-document limit of "
            f"{limit:,} bytes ({DOC_SETTING}, docs/corpus-format.md); split it or raise "
            f"{DOC_SETTING}"
        )
