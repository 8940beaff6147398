"""Tensor names as gguf-py spells them (``gguf.TENSOR_NAMES``), with their ``.weight``/``.bias``.

Every per-layer tensor of a GGUF model is ``blk.{layer}.<name>``; healsweep keys a layer's
tensors by the part after the prefix (``attn_q.weight``), as :meth:`GGUFModel.layer` does.
"""

from __future__ import annotations

from gguf import MODEL_TENSOR, TENSOR_NAMES

_BLOCK = TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM].split("{bid}")[0]  # "blk."
# The layer key of the tensors outside every block (token_embd, output) where tensors are keyed
# by layer, as a student's replacements are: no block has it.
HEAD = -1


def block_prefix(layer: int) -> str:
    """``blk.{layer}.``: what every tensor name of layer ``layer`` starts with."""
    return f"{_BLOCK}{layer}."


def tensor_name(kind: MODEL_TENSOR, layer: int | None = None, part: str = "weight") -> str:
    """The full name of a tensor (``blk.3.ffn_down_shexp.weight``, ``output_norm.weight``)."""
    return f"{TENSOR_NAMES[kind].format(bid=layer)}.{part}"


def layer_tensor(kind: MODEL_TENSOR, part: str = "weight") -> str:
    """A per-layer tensor's name inside its layer (``ffn_down_shexp.weight``)."""
    return tensor_name(kind, 0, part).removeprefix(block_prefix(0))


def split_block(name: str) -> tuple[int | None, str]:
    """``(layer, name inside it)`` of a per-layer tensor's name; ``(None, name)`` otherwise."""
    if not name.startswith(_BLOCK):
        return None, name
    layer, inside = name[len(_BLOCK) :].split(".", 1)
    return int(layer), inside
