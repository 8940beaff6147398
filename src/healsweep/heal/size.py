"""The size of a config's file, from its knobs and the model's shapes alone (no quantization).

A config stores each MoE layer's routed experts in the types :meth:`Knobs.expert_types` gives;
every other tensor stays as the teacher stores it (what ``export`` and the llama.cpp baselines
write). So its sizes follow from the block geometry of those types
(:mod:`healsweep.kernels.ggml_types`) and the teacher's tensor table:

- ``routed_bpw``: stored bits of every routed expert tensor (``ffn_{gate,up,down}_exps``) over
  their weights, the figure of :func:`healsweep.heal.export.routed_bits_per_weight` and of
  :func:`healsweep.gguf_io.routed_expert_bpw` on the written file;
- ``file_bytes``: the teacher's file with those tensors replaced: its size plus, per routed
  tensor, the change of its padded data (gguf pads each tensor's data to the file's alignment).
  The ``healsweep.*`` metadata an export adds (knobs, alphas, a few hundred bytes) is not
  counted: it is not part of the model, and a llama.cpp file carries its own.

A sweep's size budget (``budget`` in the spec) admits or refuses a config by these figures
before anything is quantized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from healsweep.kernels.ggml_types import ggml_type

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel
    from healsweep.heal.knobs import Knobs, LayerTypes

ROUTED_TENSORS = {"ffn_gate_exps.weight": "gu", "ffn_up_exps.weight": "gu",
                  "ffn_down_exps.weight": "d"}  # fmt: skip
MIB = 1 << 20
_DEFAULT_ALIGNMENT = 32  # gguf's GGUF_DEFAULT_ALIGNMENT


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
        return ConfigSize(bits / weights if weights else float("nan"), file_bytes)

    def _padded(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment


def config_size(model: GGUFModel, knobs: Knobs) -> ConfigSize:
    """The routed bits per weight and file bytes of ``knobs`` on ``model`` (see the module)."""
    return ModelShapes.of(model).size(knobs)
