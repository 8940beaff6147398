"""What each hyperparameter may hold, checked before anything is sized by it.

A GGUF's metadata is the first thing healsweep trusts about a file, and everything later (the
expected-tensor table, the forward's reshapes, top-k routing) is sized by it. A file of under a
megabyte can claim a billion layers or zero heads, so every value is checked where it is read:

- its type and range, field by field (:data:`FIELD_RULES`, :func:`checked_value`): a count is
  an integer (not a string, a float or a per-layer array), positive where a zero would divide or
  size nothing;
- the relations between fields (:func:`check_relations`): heads divide the width and each other,
  ``expert_used_count <= expert_count``, groups divide the experts, RoPE dims fit a head, and the
  layer count is no more than the blocks the file has tensors for.

Both run before the expected-tensor table is built (``model.files.open_model``), so a hostile
header fails in one line, in microseconds, with no allocation it sized. Each message names the
metadata key, its value and what was expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from healsweep.errors import GGUFFormatError

_INCONSISTENT = "the metadata is inconsistent, re-export the file"
_BLOCK = re.compile(r"^blk\.(\d+)\.")

# field -> (kind, range): kind "int" (an integer), "float" (a finite number), "bool" or "str";
# range "positive" (> 0), "non-negative" (>= 0) or None
_P, _N = "positive", "non-negative"
FIELD_RULES: dict[str, tuple[str, str | None]] = {
    "n_layer": ("int", _P), "n_embd": ("int", _P), "n_head": ("int", _P),
    "n_head_kv": ("int", _P), "head_dim": ("int", _P), "n_expert": ("int", _P),
    "n_expert_used": ("int", _P), "n_ff_exp": ("int", _P), "n_ff_shexp": ("int", _N),
    "n_vocab": ("int", _P), "n_rot": ("int", _P), "n_ff": ("int", _N),
    "n_expert_shared": ("int", _N), "n_leading_dense": ("int", _N),
    "n_expert_groups": ("int", _N), "n_group_used": ("int", _N), "n_layer_nextn": ("int", _N),
    "head_dim_v": ("int", _P), "head_dim_mla": ("int", _P), "head_dim_v_mla": ("int", _P),
    "q_lora_rank": ("int", _N), "kv_lora_rank": ("int", _N), "yarn_orig_ctx": ("int", _P),
    "context_length": ("int", _P), "gating_func": ("int", _N),
    "rms_norm_eps": ("float", _P), "rope_freq_base": ("float", _P),
    "expert_weights_scale": ("float", _N), "yarn_factor": ("float", _P),
    "yarn_log_mul": ("float", None), "expert_weights_norm": ("bool", None),
    "rope_scaling": ("str", None),
}  # fmt: skip
_EXPECTED = {
    "int": "an integer",
    "float": "a finite number",
    "bool": "a boolean",
    "str": "a string",
}


def _is_array(raw: Any) -> bool:
    """A metadata array (a list, or gguf_io's arrays held as stored bytes)."""
    return isinstance(raw, Sequence) and not isinstance(raw, str | bytes)


def _show(raw: Any) -> str:
    if _is_array(raw):
        return f"an array of {len(raw)} values"
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


def checked_value(key: str, field: str, raw: Any) -> Any:
    """``raw`` (the metadata value of ``key``, hparam ``field``) if it has the field's type and
    range; :class:`GGUFFormatError` naming the key, the value and what was expected otherwise."""
    kind, rule = FIELD_RULES.get(field, ("any", None))
    ok = {
        "int": isinstance(raw, int) and not isinstance(raw, bool),
        "float": isinstance(raw, int | float) and not isinstance(raw, bool)
        and math.isfinite(raw),
        "bool": isinstance(raw, bool) or raw in (0, 1),
        "str": isinstance(raw, str),
        "any": True,
    }[kind]  # fmt: skip
    if not ok:
        per_layer = " (per-layer values are not supported)" if _is_array(raw) else ""
        raise GGUFFormatError(
            f"{key} is {_show(raw)}; expected {_EXPECTED[kind]}{per_layer}: {_INCONSISTENT}"
        )
    below = {_P: lambda v: v <= 0, _N: lambda v: v < 0, None: lambda v: False}[rule]
    if below(raw):
        noun = "integer" if kind == "int" else "number"
        raise GGUFFormatError(f"{key} is {_show(raw)}; expected a {rule} {noun}: {_INCONSISTENT}")
    return raw


def blocks_in(tensor_names: Iterable[str]) -> int:
    """How many blocks the file has tensors for: one more than the highest ``blk.N`` index."""
    indices = [int(m.group(1)) for name in tensor_names if (m := _BLOCK.match(name))]
    return max(indices) + 1 if indices else 0


def check_relations(hp: Any, key: Callable[[str], str], n_blocks: int, has: Callable) -> None:
    """Raise :class:`GGUFFormatError` for hparams that contradict each other or the file.

    ``key(field)`` is a field's full metadata key, ``n_blocks`` the blocks the file has tensors
    for (:func:`blocks_in`), ``has(field)`` whether the file states the field itself.
    """

    def fail(field: str, value: Any, expected: str) -> None:
        raise GGUFFormatError(f"{key(field)} is {_show(value)}; expected {expected}: "
                              f"{_INCONSISTENT}")  # fmt: skip

    if hp.n_layer < 1:
        fail("n_layer", hp.n_layer + hp.n_layer_nextn,
             f"more than {key('n_layer_nextn')} = {hp.n_layer_nextn}")  # fmt: skip
    if hp.n_layer > n_blocks:
        fail(
            "n_layer",
            hp.n_layer + hp.n_layer_nextn,
            f"at most the {n_blocks} blocks the file has tensors for (blk.0 to blk.{n_blocks - 1})"
            if n_blocks
            else "blocks, but the file has no blk.* tensors",
        )
    if not has("head_dim") and hp.n_embd % hp.n_head:
        fail("n_head", hp.n_head, f"a divisor of {key('n_embd')} = {hp.n_embd} (no "
                                  f"{key('head_dim')} states another head size)")  # fmt: skip
    if hp.n_head % hp.n_head_kv:
        fail("n_head_kv", hp.n_head_kv, f"a divisor of {key('n_head')} = {hp.n_head}")
    if hp.n_expert_used > hp.n_expert:
        fail(
            "n_expert_used",
            hp.n_expert_used,
            f"at most {key('n_expert')} = {hp.n_expert} (experts used per token)",
        )
    if hp.n_expert_groups > 1:
        if hp.n_expert % hp.n_expert_groups:
            fail(
                "n_expert_groups",
                hp.n_expert_groups,
                f"a divisor of {key('n_expert')} = {hp.n_expert}",
            )
        if not 1 <= hp.n_group_used <= hp.n_expert_groups:
            fail("n_group_used", hp.n_group_used, f"1 to {key('n_expert_groups')} = "
                                                  f"{hp.n_expert_groups}")  # fmt: skip
        per_group = hp.n_expert // hp.n_expert_groups
        if hp.n_expert_used > hp.n_group_used * per_group:
            fail(
                "n_expert_used",
                hp.n_expert_used,
                f"at most the {hp.n_group_used * per_group} experts of "
                f"{hp.n_group_used} selectable groups",
            )
    if hp.n_leading_dense >= hp.n_layer:
        fail(
            "n_leading_dense",
            hp.n_leading_dense,
            f"fewer than the {hp.n_layer} layers (some must have experts)",
        )
    if hp.n_leading_dense and hp.n_ff < 1:
        fail("n_ff", hp.n_ff, f"a positive width for the {hp.n_leading_dense} dense layers")
    if hp.rope_dim > hp.head_dim or hp.rope_dim % 2:
        fail("n_rot", hp.rope_dim, f"an even number of dims, at most the head's {hp.head_dim}")
