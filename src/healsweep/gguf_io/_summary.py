"""A plain-data summary of a GGUF model: shape, storage by tensor type, tokenizer."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from typing import Any

from gguf import Keys

from healsweep.errors import TokenizerError
from healsweep.gguf_io._model import GGUFModel
from healsweep.gguf_io._names import block_prefix
from healsweep.gguf_io._tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED


def tensor_storage(model: GGUFModel) -> dict[str, dict[str, int]]:
    """Per ggml type name: number of tensors, stored bytes and element count."""
    by_type: dict[str, dict[str, int]] = defaultdict(
        lambda: {"tensors": 0, "bytes": 0, "elements": 0}
    )
    for name in model.tensor_names:
        row = by_type[model.tensor_type(name).name]
        row["tensors"] += 1
        row["bytes"] += model.tensor_nbytes(name)
        row["elements"] += math.prod(model.tensor_shape(name))
    return dict(sorted(by_type.items()))


ROUTED_EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def routed_expert_bpw(model: GGUFModel) -> float:
    """Stored bits per weight of the routed experts (every ``ffn_{gate,up,down}_exps``), from
    the tensors' bytes in the file; NaN for a model without routed experts."""
    stored = elements = 0
    for name in model.tensor_names:
        if name.endswith(ROUTED_EXPERT_SUFFIXES):
            stored += model.tensor_nbytes(name)
            elements += math.prod(model.tensor_shape(name))
    return 8 * stored / elements if elements else float("nan")


def layer_bytes(model: GGUFModel, i: int = 0) -> tuple[int, int]:
    """(stored bytes, float32 bytes once dequantized) of block ``i``'s tensors."""
    prefix = block_prefix(i)
    stored = dequantized = 0
    for name in model.tensor_names:
        if name.startswith(prefix):
            stored += model.tensor_nbytes(name)
            dequantized += 4 * math.prod(model.tensor_shape(name))
    return stored, dequantized


def tokenizer_summary(model: GGUFModel) -> dict[str, Any]:
    """Vocabulary size, merges, pre-tokenizer, special tokens (or the reason there is none)."""
    try:
        tok = model.tokenizer()
    except TokenizerError as exc:
        return {"error": str(exc)}
    types = model.metadata(Keys.Tokenizer.TOKEN_TYPE) or []
    tokens = model.metadata(Keys.Tokenizer.LIST) or []

    def name_of(key: str) -> str | None:
        idx = model.metadata(key)
        return tokens[idx] if idx is not None and idx < len(tokens) else None

    return {
        "model": model.metadata(Keys.Tokenizer.MODEL),
        "pre": model.metadata(Keys.Tokenizer.PRE),
        "vocab": tok.get_vocab_size(),
        "merges": len(model.metadata(Keys.Tokenizer.MERGES) or []),
        "control_tokens": sum(1 for t in types if t == TOKEN_CONTROL),
        "user_defined_tokens": sum(1 for t in types if t == TOKEN_USER_DEFINED),
        "bos": name_of(Keys.Tokenizer.BOS_ID),
        "eos": name_of(Keys.Tokenizer.EOS_ID),
        "chatml": "<|im_start|>" in tokens and "<|im_end|>" in tokens,
    }


def chat_template_summary(model: GGUFModel) -> dict[str, Any] | None:
    """Size and sha256 (first 12 hex digits) of ``tokenizer.chat_template``; None without one."""
    template = model.metadata(Keys.Tokenizer.CHAT_TEMPLATE)
    if not isinstance(template, str) or not template:
        return None
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest()[:12]
    return {"chars": len(template), "sha256": digest}
