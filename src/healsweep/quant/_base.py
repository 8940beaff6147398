"""The base of the registry: :class:`GroupQuantizer`, one subclass per (quantizer, storage type).

A subclass names what it serves in its class statement, as gguf-py's ``quants.py`` does::

    class Q2Gptq(Q2Stored, types=("q2_0",), quantizer=Quantizer.GPTQ): ...

and says, as class attributes and three small methods, everything the pipeline asks of it:

- what it reads: ``knobs`` (per tensor group, the knob names in its cache key; ``inert`` maps a
  knob to the value at which it is left out, the value from before it existed, so earlier keys
  hold), ``keys_type`` (whether its key names the storage type), :meth:`reads_trace` (the
  calibration trace) and :meth:`reads_gate_up` (the layer's quantized gate and up);
- ``key_stage``: the stage name its cache keys are built under (a ``Stage`` of heal);
- :meth:`quantize`: a layer's tensor group, from :class:`GroupInputs`;
- how it is stored: :meth:`to_arrays` / :meth:`from_arrays` (the cache entry), shared by the
  classes of one type; :meth:`fold_alpha` (Part A's alpha into its scales) is the storage
  format's (:mod:`healsweep.quant.formats`).

A class with ``quantizer=None`` serves its types under every ``quantizer`` value no other class
claims for them (ggml's own quantizer, which reads no knob). Nothing is kept at module level:
the table is read off the subclasses when asked (:func:`registered`), so a class is registered
by being defined; claiming a (type, quantizer) twice, or serving one without defining every
abstract method, is a ``TypeError`` at definition.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from healsweep.kernels.ggml_types import ggml_type
from healsweep.quant.formats import stack_format
from healsweep.quant.values import Group, Quantizer

Arrays = dict[str, np.ndarray]


class GroupInputs(NamedTuple):
    """What quantizing one layer's tensor group may read; a class reads only what it declares."""

    weights: Mapping[str, Any]  # the teacher's routed stacks [E, out, in] and ffn_norm, by suffix
    group: Group
    stored_as: str  # the routed-expert type name
    read: Mapping[str, Any]  # the knobs of its key (GroupQuantizer.reads), nothing else
    trace_layer: Mapping[str, np.ndarray] | None  # where reads_trace: the layer's trace
    min_tokens: int  # calibration: experts with fewer routed tokens use a fallback
    gate_up: Any = None  # where reads_gate_up: the layer's QuantizedGroup of gate and up

    def stacks(self) -> list[Any]:
        """The group's teacher stacks ``[E, out, in]``, in :attr:`Group.tensors` order."""
        return [self.weights[f"ffn_{name}_exps.weight"] for name in self.group.tensors]

    def trace(self, name: str) -> np.ndarray | None:
        """Array ``name`` of the layer's trace, None where the class reads no trace."""
        return None if self.trace_layer is None else self.trace_layer[name]


class GroupQuantizer(ABC):
    """One way to store a layer's routed tensor group in a type (see the module docstring)."""

    types: ClassVar[tuple[str, ...]] = ()
    quantizer: ClassVar[Quantizer | None] = None
    key_stage: ClassVar[str]
    knobs: ClassVar[Mapping[Group, tuple[str, ...]]] = {}
    inert: ClassVar[Mapping[str, Any]] = {}
    keys_type: ClassVar[bool] = False

    def __init_subclass__(
        cls,
        *,
        types: tuple[str, ...] | None = None,
        quantizer: Quantizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if types is None:  # a storage format's base: it serves nothing itself
            return
        missing = sorted(
            name
            for name in dir(cls)
            if getattr(getattr(cls, name, None), "__isabstractmethod__", False)
        )
        if missing:
            raise TypeError(f"{cls.__name__} serves {types} but does not define {missing}")
        for name in types:
            ggml_type(name)  # a routed-expert type healsweep knows, else KnobError
            taken = lookup(name, quantizer, exact=True)
            if taken is not None:
                raise TypeError(
                    f"{cls.__name__}: ({name}, {quantizer}) is served by {taken.__name__} already"
                )
        cls.types, cls.quantizer = tuple(types), quantizer

    @classmethod
    def reads(cls, knobs: Any, group: Group, stored_as: str) -> dict[str, Any]:
        """The knobs quantizing ``group`` as ``stored_as`` reads (its cache-key contribution):
        of ``knobs`` (heal's ``Knobs``), each name in ``knobs[group]`` except at its ``inert``
        value, and the type where ``keys_type``."""
        found: dict[str, Any] = {"type": stored_as} if cls.keys_type else {}
        for name in cls.knobs.get(group, ()):
            value = getattr(knobs, name)
            if name not in cls.inert or value != cls.inert[name]:
                found[name] = value
        return found

    @classmethod
    def reads_trace(cls, read: Mapping[str, Any], group: Group) -> bool:
        """Whether quantizing ``group`` under the knobs ``read`` reads the calibration trace."""
        return True

    @classmethod
    def reads_gate_up(cls, read: Mapping[str, Any], group: Group) -> bool:
        """Whether ``group`` is quantized from the layer's quantized gate and up (so those come
        first and their key is in its key)."""
        return False

    @classmethod
    @abstractmethod
    def quantize(cls, inputs: GroupInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The group's stacks (one per tensor of :attr:`Group.tensors`) and the stage report."""

    @classmethod
    @abstractmethod
    def to_arrays(cls, stacks: tuple[Any, ...]) -> tuple[Arrays, dict[str, Any]]:
        """The stacks as cache arrays and the metadata :meth:`from_arrays` needs."""

    @classmethod
    @abstractmethod
    def from_arrays(cls, arrays: Arrays, meta: Mapping[str, Any], count: int) -> tuple[Any, ...]:
        """The ``count`` stacks of a cache entry (:meth:`to_arrays`'s arrays and metadata)."""

    @classmethod
    def fold_alpha(cls, stack: Any, factor: float | np.ndarray) -> Any:
        """``stack`` with ``factor`` (a scalar, or one per expert ``[E]``) folded into its fp16
        scales, as its storage format folds it (:meth:`StorageFormat.fold_alpha`)."""
        return stack_format(stack).fold_alpha(stack, factor)


def registered() -> Iterator[type[GroupQuantizer]]:
    """Every class that serves a type: the subclasses of :class:`GroupQuantizer` defined so far."""
    todo = list(GroupQuantizer.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "types" in vars(cls):  # declared in its class statement, not inherited
            yield cls


def lookup(
    stored_as: str, quantizer: Quantizer | str | None, *, exact: bool = False
) -> type[GroupQuantizer] | None:
    """The class that stores a group as ``stored_as`` under knob ``quantizer`` (the one that
    claims the pair, else the one that serves the type under any quantizer), None if none does;
    ``exact``: only a class that claims the pair itself."""
    table = {(name, cls.quantizer): cls for cls in registered() for name in cls.types}
    found = table.get((stored_as, quantizer))
    if found is None and not exact:
        found = table.get((stored_as, None))
    return found
