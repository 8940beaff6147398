"""The size of a config's file, from its knobs and the model's shapes alone (no quantization).

A config stores each MoE layer's routed experts in the types :meth:`Knobs.expert_types` gives,
each other tensor group in the type its knob gives (``type_attn`` ... ``type_dense``,
:func:`healsweep.heal.tensor_types.planned_types`), and every other tensor as the teacher stores
it (what ``export`` and the llama.cpp baselines write). So its sizes follow from the block
geometry of those types (:mod:`healsweep.kernels.ggml_types`) and the teacher's tensor table:

- ``routed_bpw``: stored bits of every routed expert tensor (``ffn_{gate,up,down}_exps``) over
  their weights, the figure of :func:`healsweep.heal.export.routed_bits_per_weight` and of
  :func:`healsweep.gguf_io.routed_expert_bpw` on the written file;
- ``file_bytes``: the teacher's file with those tensors replaced: its size plus, per replaced
  tensor, the change of its padded data (gguf pads each tensor's data to the file's alignment).
  The whole file: a budget in ``file_bytes``/``file_mib``/``file_gib`` counts every tensor.
  The ``healsweep.*`` metadata an export adds (knobs, alphas, a few hundred bytes) is not
  counted: it is not part of the model, and a llama.cpp file carries its own.

A sweep's size budget (``budget`` in the spec) admits or refuses a config by these figures
before anything is quantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from healsweep.heal.tensor_types import GroupTensor, group_tensors, planned_types
from healsweep.kernels.ggml_types import ggml_type

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel
    from healsweep.heal.knobs import Knobs, LayerTypes

ROUTED_TENSORS = {"ffn_gate_exps.weight": "gu", "ffn_up_exps.weight": "gu",
                  "ffn_down_exps.weight": "d"}  # fmt: skip
MIB = 1 << 20
GIB = 1 << 30
_DEFAULT_ALIGNMENT = 32  # gguf's GGUF_DEFAULT_ALIGNMENT
_SLACK = 1e-9  # a size exactly at a limit is inside it (2.0625 bpw is IQ2_XXS's own)


class ConfigSize(NamedTuple):
    """The stored size of a config's routed experts and of its whole file."""

    routed_bpw: float  # stored bits per weight of the routed expert tensors
    file_bytes: int  # the teacher's file with the routed experts in the config's types

    @property
    def file_mib(self) -> float:
        """``file_bytes`` in MiB (2^20 bytes)."""
        return self.file_bytes / MIB


class ModelShapes(NamedTuple):
    """What sizing a config needs of a model: each routed tensor's layer, group, shape and
    stored bytes, the file's size and alignment, and its layers (read once per model)."""

    routed: tuple[
        tuple[str, int, str, tuple[int, ...], int], ...
    ]  # name, layer, group, shape, bytes
    file_bytes: int
    alignment: int
    moe_layers: tuple[int, ...]
    n_layer: int
    others: tuple[GroupTensor, ...] = ()  # the matrices of the other groups' type knobs

    @classmethod
    def of(cls, model: GGUFModel) -> ModelShapes:
        """The shapes of ``model`` (reads its tensor table, not its data)."""
        routed = []
        for name in model.tensor_names:
            block, _, suffix = name.partition(".")[2].partition(".")
            if name.startswith("blk.") and suffix in ROUTED_TENSORS:
                shape = tuple(model.tensor_shape(name))
                routed.append((name, int(block), ROUTED_TENSORS[suffix], shape,
                               model.tensor_nbytes(name)))  # fmt: skip
        alignment = int(model.metadata("general.alignment", _DEFAULT_ALIGNMENT) or 32)
        return cls(
            tuple(routed),
            model.path.stat().st_size,
            alignment,
            tuple(model.hparams.moe_layers),
            model.hparams.n_layer,
            group_tensors(model),
        )

    def size(self, knobs: Knobs) -> ConfigSize:
        """The sizes of ``knobs``' file (raises ``KnobError`` for a ``layer_types`` entry that
        names no MoE layer, or a type whose blocks do not divide the rows)."""
        types: dict[int, LayerTypes] = knobs.expert_types(self.moe_layers, self.n_layer)
        bits = weights = 0
        file_bytes = self.file_bytes
        for _, layer, group, shape, stored in self.routed:
            *lead, n_in = shape
            rows = 1
            for n in lead:
                rows *= n
            chosen = types.get(layer)
            new = stored if chosen is None else rows * ggml_type(chosen.of(group)).row_bytes(n_in)
            bits += 8 * new
            weights += rows * n_in
            file_bytes += self._padded(new) - self._padded(stored)
        stored_as = {t.name: t for t in self.others}
        for name, chosen in planned_types(self.others, knobs).items():
            tensor = stored_as[name]
            rows = int(np_prod(tensor.shape[:-1]))
            new = rows * chosen.row_bytes(tensor.shape[-1])
            file_bytes += self._padded(new) - self._padded(tensor.nbytes)
        return ConfigSize(bits / weights if weights else float("nan"), file_bytes)

    def file_bytes_of(self, teacher: GGUFModel, other: GGUFModel) -> int:
        """The whole-file bytes of ``other`` (a file of this model: llama.cpp's, an export) as
        :meth:`size` counts a config's: the teacher's file with each of its tensors in
        ``other``'s bytes (padded), so a file and a config compare without either's own
        metadata (llama.cpp's files carry some, an export its ``healsweep.*``). A file whose
        tensors are not the teacher's (another model) counts its size on disk."""
        if list(other.tensor_names) != list(teacher.tensor_names):
            return other.path.stat().st_size
        found = self.file_bytes
        for name in teacher.tensor_names:
            found += self._padded(other.tensor_nbytes(name))
            found -= self._padded(teacher.tensor_nbytes(name))
        return found

    def _padded(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment


def np_prod(values: tuple[int, ...]) -> int:
    """The product of ``values`` (1 for none), as an exact int."""
    found = 1
    for n in values:
        found *= int(n)
    return found


def config_size(model: GGUFModel, knobs: Knobs) -> ConfigSize:
    """The routed bits per weight and file bytes of ``knobs`` on ``model`` (see the module)."""
    return ModelShapes.of(model).size(knobs)


@dataclass(frozen=True)
class Budget:
    """A sweep's size budget: one measure (``routed_bpw`` or ``file_bytes``) and its limits, in
    ascending order (tiers). A config is admitted when it fits the largest limit; its tier is the
    smallest limit it fits (the report ranks configs per tier)."""

    measure: str  # "routed_bpw" | "file_bytes"
    limits: tuple[float, ...]

    def value(self, size: ConfigSize) -> float:
        """``size`` in this budget's measure."""
        return size.routed_bpw if self.measure == "routed_bpw" else float(size.file_bytes)

    def fits(self, size: ConfigSize, limit: float) -> bool:
        """Whether ``size`` is within ``limit`` (a value at the limit is)."""
        return self.within(self.value(size), limit)

    @staticmethod
    def within(value: float, limit: float) -> bool:
        """Whether ``value`` (in the budget's measure) is within ``limit``."""
        return value <= limit * (1 + _SLACK)

    def tier(self, size: ConfigSize) -> float | None:
        """The smallest limit ``size`` fits, or None when it is over budget."""
        return next((limit for limit in self.limits if self.fits(size, limit)), None)

    def admits(self, size: ConfigSize) -> bool:
        """Whether a config of ``size`` may be scored (it fits the largest limit)."""
        return self.tier(size) is not None

    def label(self, limit: float) -> str:
        """``2.0625 bpw``, ``12.50 MiB`` or, from 1 GiB on, ``21.40 GiB``."""
        if self.measure == "routed_bpw":
            return f"{limit:g} bpw"
        if limit >= GIB:
            return f"{limit / GIB:.2f} GiB"
        return f"{limit / MIB:.2f} MiB"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> Budget | None:
        """The budget of a spec's stored ``budget`` section (``routed_bpw``, ``file_bytes``,
        ``file_mib`` or ``file_gib``: a number or a list of them; None or empty: no budget)."""
        if not raw:
            return None
        for key, scale, measure in (("routed_bpw", 1.0, "routed_bpw"),
                                    ("file_bytes", 1.0, "file_bytes"),
                                    ("file_mib", float(MIB), "file_bytes"),
                                    ("file_gib", float(GIB), "file_bytes")):  # fmt: skip
            value = raw.get(key)
            if value is not None:
                values = value if isinstance(value, list | tuple) else [value]
                return cls(measure, tuple(sorted(float(v) * scale for v in values)))
        return None
