"""A byte-level BPE tokenizer of a real model's vocabulary size, for random models.

A real vocabulary (about 152k entries for Qwen) is what makes the output head, the teacher cache
and the per-window scoring cost what they cost on a real model; the tiny trained tokenizer of
:mod:`synthetic` (384 entries) makes them free. Training a BPE up to 152k merges would need a
large corpus and minutes, so the vocabulary is grown instead: the tiny tokenizer's trained
merges come first (so text tokenizes as before, and the chat markers stay single special
tokens), then merges drawn from a seeded generator, each joining two tokens already in the
vocabulary into a new one. The result is a valid BPE (every merge's parts and result are tokens,
every byte has its token) that ``tokenizers``, healsweep's GGUF loader and llama.cpp all read,
deterministic in ``(vocab_size, seed)`` and built in about a second for 152k entries.
"""

from __future__ import annotations

import json

import numpy as np

from healsweep.errors import TokenizerError

_MAX_CHARS = 12  # longest grown token, in byte-level characters (real BPE tokens are short)
_DRAWS = 1 << 16  # candidate pairs drawn per batch


def grown_tokenizer(base, vocab_size: int, seed: int = 0):
    """``base`` (a byte-level BPE ``tokenizers.Tokenizer``) grown to ``vocab_size`` tokens in all,
    its added tokens kept (special tokens at their ids, the others moved to the end).

    New merges join a random token (the first part) and a random token that does not start a
    word (no leading ``Ġ``), both of at most ``_MAX_CHARS`` characters together, skipping pairs
    whose result is a token already. Raises :class:`TokenizerError` when ``vocab_size`` is
    smaller than ``base``'s vocabulary.
    """
    # lazy: heavy (tokenizers)
    from tokenizers import AddedToken, Tokenizer

    spec = json.loads(base.to_str())
    model = spec["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = list(model.get("merges", []))
    as_text = bool(merges) and isinstance(merges[0], str)  # older tokenizers: "a b", newer: [a, b]
    added = spec.get("added_tokens", [])
    special = {a["content"] for a in added if a.get("special")}
    moved = [a for a in added if a["content"] not in vocab]  # added after training: re-added
    target = vocab_size - len(moved)
    if target < len(vocab):
        raise TokenizerError(
            f"vocab_size {vocab_size} is smaller than the base tokenizer's "
            f"{len(vocab) + len(moved)} tokens; ask for at least that many"
        )
    pieces = [t for t in sorted(vocab, key=vocab.get) if t not in special]
    inner = [t for t in pieces if not t.startswith("Ġ")]  # tokens that continue a word
    rng = np.random.default_rng([seed, vocab_size])
    while len(vocab) < target:
        firsts = rng.integers(0, len(pieces), _DRAWS)
        seconds = rng.integers(0, len(inner), _DRAWS)
        for i, j in zip(firsts.tolist(), seconds.tolist(), strict=True):
            left, right = pieces[i], inner[j]
            joined = left + right
            if len(joined) > _MAX_CHARS or joined in vocab:
                continue
            vocab[joined] = len(vocab)
            merges.append(f"{left} {right}" if as_text else [left, right])
            pieces.append(joined)
            if not joined.startswith("Ġ"):
                inner.append(joined)
            if len(vocab) == target:
                break
    model["vocab"], model["merges"] = vocab, merges
    spec["added_tokens"] = [a for a in added if a not in moved]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_tokens(
        [AddedToken(a["content"], special=a.get("special", False), normalized=False) for a in moved]
    )
    return tokenizer
