"""The demo tokenizer: a byte-level BPE trained with `tokenizers` on the demo training pool.

It is deliberately plain so that it maps onto GGUF's gpt2-style BPE metadata and back: a BPE
model over the 256 ByteLevel symbols (no unknown token), no normalizer, the Qwen2 split regex
followed by ByteLevel (no regex of its own, no prefix space), a ByteLevel decoder and no
post-processor (nothing is added around the text). The chat markers are single tokens:
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` are special (control) tokens with ids 0-2;
``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>`` are added non-special tokens with ids
3-6, so they survive decoding and window boundaries fall on token boundaries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from healsweep._atomic import atomic_write_text
from healsweep.bundled import demo_tokenizer_path
from healsweep.errors import TokenizerError

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<tool_call>", "</tool_call>")
DEFAULT_VOCAB_SIZE = 6144

# The Qwen2 pre-tokenizer split: contractions, letter runs with one leading non-letter, single
# digits, punctuation runs, newline runs with their indentation, and whitespace.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def load_demo_tokenizer() -> Tokenizer:
    """The packaged demo tokenizer; ``TokenizerError`` naming the rebuild command if missing."""
    path = demo_tokenizer_path()
    if not path.is_file():
        raise TokenizerError(
            f"demo tokenizer {path} is missing; rebuild it with `healsweep demo corpus`"
        )
    return Tokenizer.from_file(str(path))


def _empty_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on ``texts`` (the rendered training documents).

    ``vocab_size`` counts every token, the 7 marker tokens included. Training is deterministic:
    the same texts in the same order give the same tokenizer.
    """
    markers = (*SPECIAL_TOKENS, *ADDED_TOKENS)
    if vocab_size < 256 + len(markers) + 1:
        raise ValueError(
            f"train_tokenizer: vocab_size must exceed {256 + len(markers)}, got {vocab_size}"
        )
    tokenizer = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(markers),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return _mark_added_tokens_non_special(tokenizer)


def _mark_added_tokens_non_special(tokenizer: Tokenizer) -> Tokenizer:
    # The trainer registers every marker as special; <think> & co. must stay visible in decoded
    # text (as in Qwen3), so they become plain added tokens.
    spec = json.loads(tokenizer.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] in ADDED_TOKENS:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(spec))


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike[str]) -> Path:
    """Write ``tokenizer.json`` (pretty JSON; the same tokenizer gives the same bytes)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(target, tokenizer.to_str(pretty=True) + "\n")


def marker_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Token id of every chat marker; ``TokenizerError`` if one is not a single token."""
    ids = {}
    for marker in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        token_id = tokenizer.token_to_id(marker)
        if token_id is None:
            raise TokenizerError(
                f"tokenizer has no single token for {marker!r}; use the demo tokenizer"
            )
        ids[marker] = token_id
    return ids
