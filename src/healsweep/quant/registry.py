"""The registry: which class stores a tensor group in a type under a quantizer, and its entry.

The table is read off the classes (:mod:`healsweep.quant._base`); importing this module defines
every class healsweep ships. A new one is registered by being defined in a module imported here
(see ``docs/architecture.md``, "Where to add a type or a quantizer").
"""

from __future__ import annotations

from typing import Any, NamedTuple

from healsweep.errors import KnobError
from healsweep.quant import ggml, q2_0  # noqa: F401 - their classes register by being defined
from healsweep.quant._base import Arrays, GroupInputs, GroupQuantizer, lookup, registered
from healsweep.quant.values import Quantizer

__all__ = [
    "GroupInputs",
    "GroupQuantizer",
    "QuantizedGroup",
    "quantizer_for",
    "registered",
    "stored",
    "types_with",
]


def quantizer_for(stored_as: str, quantizer: Quantizer | str) -> type[GroupQuantizer]:
    """The class that stores a tensor group as ``stored_as`` under knob ``quantizer``; raises
    :class:`KnobError` for a type no class stores."""
    found = lookup(stored_as, quantizer)
    if found is None:
        raise KnobError(f"no quantizer stores routed experts as {stored_as!r}")
    return found


def stored(type_name: str) -> type[GroupQuantizer]:
    """A class that stores ``type_name``: every class of a type shares its storage format (its
    cache arrays and how alpha folds), so any one reads an entry of that type."""
    for cls in registered():
        if type_name in cls.types:
            return cls
    raise KnobError(f"no quantizer stores routed experts as {type_name!r}")


def types_with(quantizer: Quantizer) -> tuple[str, ...]:
    """The types some class serves under ``quantizer`` itself (not as a fallback), sorted."""
    return tuple(
        sorted({t for cls in registered() if cls.quantizer == quantizer for t in cls.types})
    )


class QuantizedGroup(NamedTuple):
    """Stage ``quantize``: the stacks ``[E, out, in]`` of one tensor group (gate and up, or
    down) in ``type_name``, and the stage's report (``gptq``: experts that fell back)."""

    stacks: tuple[Any, ...]  # in the type's storage: Q2Packed (q2_0), GGMLWeight (a ggml type)
    type_name: str
    report: dict[str, Any]

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        arrays, extra = stored(self.type_name).to_arrays(self.stacks)
        meta = {"type": self.type_name, "tensors": len(self.stacks), "report": self.report}
        return arrays, {**meta, **extra}

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> QuantizedGroup:
        stacks = stored(meta["type"]).from_arrays(arrays, meta, meta["tensors"])
        return cls(stacks, meta["type"], meta["report"])
