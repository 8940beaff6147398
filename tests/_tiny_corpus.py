"""A ten-document corpus for end-to-end tests: calibration prose, chat turns with reasoning and
a tool-call-shaped answer, and short numeric docs, so every stratum and pool is present."""

from __future__ import annotations

from pathlib import Path

from healsweep.data.corpus import Document, Message, write_corpus

ANSWER = '<think>\nExperts route token {i} to a few places.\n</think>\n\n{{"name": "{i}"}}'


def write_tiny_corpus(path: Path) -> Path:
    """Write the corpus to ``path`` (JSONL) and return ``path``."""
    docs = []
    for i in range(4):
        text = "Mixture-of-experts models route every token to a few experts. " * (3 + i)
        docs.append(Document(f"cal-{i}", "cal", i, "cal", text=text, pool="calibration"))
    for i in range(6):
        question = "The quick brown fox jumps over the lazy dog? " * (2 + i)
        messages = (Message("user", question), Message("assistant", ANSWER.format(i=i)))
        docs.append(Document(f"chat-{i}", "chat", i, "chat", messages=messages))
        docs.append(Document(f"docs-{i}", "docs", i, "docs", text=f"Numbers {i} 2 3 4 5. " * 8))
    write_corpus(docs, path)
    return path
