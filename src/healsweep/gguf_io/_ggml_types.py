"""ggml type 42 (Q2_0) taught to gguf-py, which does not name it yet (gguf-py 0.19).

This module is the one place healsweep registers the type with gguf-py: the enum member
``GGMLQuantizationType.Q2_0 = 42`` and its block geometry in ``GGML_QUANT_SIZES`` (64 weights,
18 bytes: fp16 ``d``, then 16 bytes of 2-bit codes, LSB first). gguf-py's reader then maps
type-42 tensors as bytes and its writer accepts them as ``raw_dtype``; decoding stays with
``kernels.ggml_decode`` (in the graph). Delete this module and its callers' ``q2_0_type()``
once gguf-py names the type: :func:`q2_0_type` already defers to gguf-py's own member then.
"""

from __future__ import annotations

from typing import Any

GGML_Q2_0 = 42
Q2_0_BLOCK = (64, 18)  # (weights per block, bytes per block), as in ggml's block_q2_0


def q2_0_type() -> Any:
    """gguf-py's ``GGMLQuantizationType`` member for type 42, registered on first call."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    members = GGMLQuantizationType._value2member_map_
    member = members.get(GGML_Q2_0)
    if member is None:
        # What ``enum`` does for a member declared in the class body, done after the fact.
        member = int.__new__(GGMLQuantizationType, GGML_Q2_0)
        member._name_, member._value_ = "Q2_0", GGML_Q2_0
        type.__setattr__(GGMLQuantizationType, "Q2_0", member)
        GGMLQuantizationType._member_map_["Q2_0"] = member
        GGMLQuantizationType._member_names_.append("Q2_0")
        members[GGML_Q2_0] = member
    sizes = GGML_QUANT_SIZES.setdefault(member, Q2_0_BLOCK)
    if tuple(sizes) != Q2_0_BLOCK:
        raise RuntimeError(
            f"gguf-py gives ggml type 42 ({member.name}) blocks of {sizes}, healsweep's Q2_0 is "
            f"{Q2_0_BLOCK}; this gguf-py is incompatible"
        )
    return member
