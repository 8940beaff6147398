"""The values of the quantization knobs, and the routed tensor groups a type is chosen for.

StrEnums: each member is its string (``Quantizer.GPTQ == "gptq"``), so YAML, Parquet columns
and cache keys hold the same text as before the knobs were typed. Jax-free and import-free, so
the knobs (and a sweep driver reading them) can name these without loading a quantizer.
"""

from __future__ import annotations

from enum import StrEnum


class Quantizer(StrEnum):
    """Knob ``quantizer``: how a routed expert group is quantized (per type: the registry)."""

    SEARCH = "search"  # Q2_0: importance-weighted signed-scale search; a ggml type: ggml's own
    GPTQ = "gptq"  # error feedback over each expert's input second moment, where a type has it
    PLAIN = "plain"  # Q2_0: round-to-nearest, d = amax/2 (reads no other knob)


class Importance(StrEnum):
    """Knob ``importance``: the Q2_0 search's weights per gate/up input channel."""

    NONE = "none"
    NORM_PROXY = "norm_proxy"  # the FFN norm's gains squared (the audit's shipped proxy)
    ACT = "act"  # E[x²] of each expert's routed calibration tokens


class ImportanceDown(StrEnum):
    """Knob ``importance_down``: the Q2_0 search's weights per down input channel."""

    NONE = "none"
    ACT = "act"  # E[h²] of each teacher expert's hidden activation on its routed tokens


class DownInput(StrEnum):
    """Knob ``down_input``: whose hidden ``h`` down's GPTQ reads on the grids that offer it."""

    TEACHER = "teacher"
    STUDENT = "student"  # the layer's quantized gate and up, down's target re-fitted


class Group(StrEnum):
    """A layer's routed tensor groups, each stored in one type: gate and up (one input), down."""

    GU = "gu"
    D = "d"

    @property
    def tensors(self) -> tuple[str, ...]:
        """The expert tensors of the group (``ffn_<name>_exps``), in file order."""
        return ("gate", "up") if self is Group.GU else ("down",)


GROUPS = tuple(Group)  # gate/up first: a down quantized on the student's h reads them
Q2_0 = "q2_0"  # healsweep's own 2-bit type (ggml type 42), quantized by healsweep's quantizers
