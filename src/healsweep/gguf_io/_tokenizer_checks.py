"""The ``tokenizer.ggml.*`` metadata checked before a tokenizer is built or a token id is used.

A tokenizer is built from the file's token list, types and merges, and every window's token ids
index the embedding. So each key is checked for its type, its length and its relation to the
others and to the embedding when the model is opened (:func:`check_tokenizer_fields`), and the
merges when the tokenizer is built (:func:`check_merges`); each refusal is one line naming the key
and, for an array, the item. A control or user-defined token costs the ``tokenizers`` library
about 90 bytes of memory per byte of its text (its added-token matcher): such tokens are held to
:data:`ADDED_TOKEN_BYTES` each, which no real vocabulary comes near.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gguf import GGUFValueType, Keys

from healsweep.errors import TokenizerError
from healsweep.gguf_io._arrays import NumericArray, StringArray

ADDED_TOKEN_BYTES = 4096  # longest control / user-defined token (real ones: under 100 bytes)
TOKEN_TYPES = range(0, 7)  # gguf TokenType: 1 normal ... 6 byte (0: undefined)
_ADDED_TYPES = (3, 4)  # control, user-defined
_FIX = "the tokenizer metadata is corrupt, re-export the GGUF (or pass a tokenizer.json with --tokenizer)"


def check_tokenizer_fields(fields: Mapping[str, Any], rows: int, where: str) -> None:
    """Raise :class:`TokenizerError` unless the file's tokenizer metadata is consistent: the
    token list is strings, one per embedding row (``rows``); the token types are integers of
    :data:`TOKEN_TYPES`, one per token; every ``tokenizer.ggml.*_token_id`` is an integer id of
    a token; no control or user-defined token is longer than :data:`ADDED_TOKEN_BYTES`; there
    are no more merges than tokens. ``fields`` are the header's (name → ``Field``)."""
    tokens = fields.get(Keys.Tokenizer.LIST)
    if tokens is None:
        return
    if not isinstance(tokens.value, StringArray):
        raise TokenizerError(f"{where}: {Keys.Tokenizer.LIST} is {_kind(tokens)}; expected an "
                             f"array of strings: {_FIX}")  # fmt: skip
    n_tokens = len(tokens.value)
    if n_tokens != rows:
        raise TokenizerError(
            f"{where}: {Keys.Tokenizer.LIST} holds {n_tokens:,} tokens but the embedding "
            f"(token_embd.weight) has {rows:,} rows; every token id must index a row: {_FIX}"
        )
    types = _token_types(fields.get(Keys.Tokenizer.TOKEN_TYPE), n_tokens, where)
    for name, field in fields.items():
        if name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
            _check_id(name, field.value, n_tokens, where)
    if types is not None:
        _check_added_lengths(tokens.value, types, where)
    merges = fields.get(Keys.Tokenizer.MERGES)
    if merges is not None and not isinstance(merges.value, StringArray):
        raise TokenizerError(f"{where}: {Keys.Tokenizer.MERGES} is {_kind(merges)}; expected an "
                             f"array of strings: {_FIX}")  # fmt: skip
    if merges is not None and len(merges.value) > n_tokens:
        raise TokenizerError(f"{where}: {Keys.Tokenizer.MERGES} holds {len(merges.value):,} "
                             f"merges for {n_tokens:,} tokens (each merge makes a token): {_FIX}")  # fmt: skip


def _kind(field: Any) -> str:
    value = field.value
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Sequence):
        item = GGUFValueType(field.item_type).name.lower() if field.item_type is not None else "?"
        return f"an array of {item}"
    return f"a single {GGUFValueType(field.type).name.lower()}"


def _token_types(field: Any, n_tokens: int, where: str) -> np.ndarray | None:
    key = Keys.Tokenizer.TOKEN_TYPE
    if field is None:
        return None
    value = field.value
    if not isinstance(value, NumericArray) or value.to_numpy().dtype.kind not in "iu":
        raise TokenizerError(f"{where}: {key} is {_kind(field)}; expected an array of integers "
                             f"(1 normal, 3 control, 4 user-defined, ...): {_FIX}")  # fmt: skip
    if len(value) != n_tokens:
        raise TokenizerError(f"{where}: {key} holds {len(value):,} types for {n_tokens:,} tokens; "
                             f"expected one per token: {_FIX}")  # fmt: skip
    types = value.to_numpy()
    bad = np.flatnonzero((types < TOKEN_TYPES.start) | (types >= TOKEN_TYPES.stop))
    if len(bad):
        raise TokenizerError(f"{where}: {key}[{bad[0]}] is {types[bad[0]]}; expected a token "
                             f"type 0 to 6 (1 normal, 3 control, 4 user-defined, ...): {_FIX}")  # fmt: skip
    return types


def _check_id(key: str, value: Any, n_tokens: int, where: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_tokens:
        return
    shown = repr(value) if isinstance(value, int | float | bool) else "a " + type(value).__name__
    if isinstance(value, str):
        shown = "a string " + repr(value[:40] + ("..." if len(value) > 40 else ""))
    raise TokenizerError(f"{where}: {key} is {shown}; expected the integer id of one of the "
                         f"{n_tokens:,} tokens (0 to {n_tokens - 1:,}): {_FIX}")  # fmt: skip


def _check_added_lengths(tokens: StringArray, types: np.ndarray, where: str) -> None:
    lengths = tokens.lengths()
    added = np.isin(types, _ADDED_TYPES) & (lengths > ADDED_TOKEN_BYTES)
    if added.any():
        index = int(np.flatnonzero(added)[0])
        raise TokenizerError(
            f"{where}: {Keys.Tokenizer.LIST}[{index}] is a control or user-defined token of "
            f"{int(lengths[index]):,} bytes; such tokens may have at most {ADDED_TOKEN_BYTES:,} "
            f"(each costs the tokenizer about 90 bytes of memory per byte): {_FIX}"
        )


def check_merges(merges: Sequence[str], vocab: Mapping[str, int], where: str) -> list[tuple]:
    """The merges as pairs, each ``"a b"`` naming two tokens whose concatenation is a token;
    :class:`TokenizerError` naming the first that is not."""
    pairs = []
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space or left not in vocab or right not in vocab or left + right not in vocab:
            shown = merge if len(merge) <= 40 else merge[:37] + "..."
            raise TokenizerError(
                f"{where}: {Keys.Tokenizer.MERGES}[{i}] is {shown!r}; expected two tokens of "
                f"{Keys.Tokenizer.LIST} separated by a space, whose concatenation is a token: "
                + _FIX
            )
        pairs.append((left, right))
    return pairs
