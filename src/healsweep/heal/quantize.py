"""Stage ``quantize``: one layer's routed experts of one tensor group, in one storage type.

A layer's routed experts come in two tensor groups, each with its own storage type (knobs
``type_gu``, ``type_d``, ``up_first``/``up_last``, ``layer_types``; :meth:`Knobs.expert_types`):
``gu`` (gate and up, which read the same input, so one importance row and one GPTQ ``H_e``
serve both) and ``d`` (down). Each (layer, group, type) is its own cache entry, so a trial that
changes one group's type, or only a knob that one group reads (``gain_d``), re-quantizes that
group alone.

How a group is quantized is the registry's (:mod:`healsweep.quant.registry`): the class of its
type under the knob ``quantizer`` says which knobs and inputs it reads, and so what the entry's
key holds, quantizes it, and folds Part A's alpha into its scales. This module only asks: it has
no branch on a type or a quantizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from healsweep.bundled import BUNDLED_MODELS, demo_model_path
from healsweep.cache import StageCache
from healsweep.errors import CacheError, GGUFFormatError, HealsweepError
from healsweep.heal.knobs import CalibrationConfig, Knobs, LayerTypes
from healsweep.heal.stages import ExpertStacks, stage_key
from healsweep.kernels.ggml_types import ROUTED_TYPES, ggml_type
from healsweep.quant.formats import format_of
from healsweep.quant.registry import GroupInputs, QuantizedGroup, quantizer_for
from healsweep.quant.values import GROUPS, Q2_0, Group

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel
    from healsweep.quant.formats import format_of
from healsweep.model import open_model
from healsweep.quant.registry import GroupQuantizer


def group_quantizer(knobs: Knobs, stored_as: str) -> type[GroupQuantizer]:
    """The class that quantizes a group stored as ``stored_as`` under ``knobs``."""
    return quantizer_for(stored_as, knobs.quantizer)


def group_reads(knobs: Knobs, group: Group, stored_as: str) -> dict[str, Any]:
    """The knobs quantizing ``group`` as ``stored_as`` reads: its key's knobs (its class's)."""
    return group_quantizer(knobs, stored_as).reads(knobs, group, stored_as)


def layer_experts(gate_up: QuantizedGroup, down: QuantizedGroup) -> ExpertStacks:
    """A layer's three routed stacks from its two groups."""
    return ExpertStacks(*gate_up.stacks, *down.stacks)


def layer_keys(model: GGUFModel, knobs: Knobs, trace_key: str | None, layer: int) -> dict[str, str]:
    """``{group: quantize key}`` of ``layer`` under ``knobs`` (the layer's two entries)."""
    types = expert_types(model, knobs)[layer]
    keys: dict[str, str] = {}
    for g in GROUPS:  # gate/up first: a down quantized from the student's h names its key
        keys[g] = quantize_key(model, knobs, trace_key, layer, g, types.of(g), keys.get(Group.GU))
    return keys


def cached_experts(cache: StageCache, keys: dict[str, str]) -> ExpertStacks:
    """A layer's routed stacks from its quantize entries ``keys`` (:func:`layer_keys`);
    :class:`~healsweep.errors.CacheError` when one is not in ``cache``."""
    found = {}
    for group, key in keys.items():
        entry = cache.get("quantize", key)
        if entry is None:
            raise CacheError(f"quantize entry {key[:16]} ({group}) is not in {cache.root}")
        found[group] = QuantizedGroup.from_entry(*entry)
    return layer_experts(found[Group.GU], found[Group.D])


def reads_trace(knobs: Knobs, group: Group, stored_as: str) -> bool:
    """Whether quantizing ``group`` as ``stored_as`` reads the calibration trace (a ggml type
    always, for its importance rows; ``q2_0`` for ``act`` importance or ``gptq``)."""
    cls = group_quantizer(knobs, stored_as)
    return cls.reads_trace(cls.reads(knobs, group, stored_as), group)


def reads_gate_up(knobs: Knobs, group: Group, stored_as: str) -> bool:
    """Whether ``group`` stored as ``stored_as`` is quantized from the layer's quantized gate
    and up (``down_input: student``), so their quantization comes first and is in its key."""
    cls = group_quantizer(knobs, stored_as)
    return cls.reads_gate_up(cls.reads(knobs, group, stored_as), group)


def quantize_key(
    model: GGUFModel,
    knobs: Knobs,
    trace_key: str | None,
    layer: int,
    group: Group,
    stored_as: str,
    gate_up_key: str | None = None,
) -> str:
    """Key of ``group`` of ``layer`` stored as ``stored_as``: the model, the knobs its class
    reads, and the trace where it reads one; for a down quantized from the quantized gate and
    up (:func:`reads_gate_up`), their key ``gate_up_key`` too. Each class's entries have its own
    key stage (``quantize``, ``quantize_gptq``, ``quantize_plain``, ``quantize_ggml``)."""
    cls = group_quantizer(knobs, stored_as)
    read = cls.reads(knobs, group, stored_as)
    parts = {
        "model": model.fingerprint,
        "knobs": read,
        "trace": trace_key if cls.reads_trace(read, group) else None,
        "layer": layer,
        "group": group,
    }
    if cls.reads_gate_up(read, group):
        parts["gate_up"] = gate_up_key
    return stage_key(cls.key_stage, parts)


def expert_types(model: GGUFModel, knobs: Knobs) -> dict[int, LayerTypes]:
    """The storage types of each MoE layer's two tensor groups under ``knobs``."""
    return knobs.expert_types(model.hparams.moe_layers, model.hparams.n_layer)


def check_quantizable(
    model: GGUFModel, knobs: Knobs | None = None, knob_file: str | None = None
) -> None:
    """Raise :class:`GGUFFormatError` unless every routed expert's rows fill whole blocks of the
    type chosen for them (without ``knobs``: Q2_0's blocks of 64): gate/up rows hold
    ``n_embd`` values, down rows ``n_ff_exp``; a ``layer_types`` entry that names no MoE layer
    raises :class:`~healsweep.errors.KnobError`. Called before any teacher pass, so that such a
    model fails in seconds, naming its file, the types that do fit its rows (smallest first)
    and the packaged models the knobs do fit (``knob_file``: where the knobs came from, for the
    command the message suggests)."""
    problem = _misfit(model, knobs)
    if problem is None:
        return
    layer, group, found = problem
    hp = model.hparams
    widths = {Group.GU: hp.n_embd, Group.D: hp.n_ff_exp}
    named = "/".join(f"ffn_{n}_exps" for n in group.tensors)
    # a misfit every MoE layer shares (the knob default's, a type asked for all) names no layer
    every_layer = all(ggml_type(t.of(group)) == found for t in _layer_types(model, knobs))
    where = named if every_layer else f"blk.{layer}.{named}"
    ladder = "; ".join(
        f"{label} (rows of {widths[g]}): {fitting_types(widths[g])}"
        for g, label in ((Group.GU, "gate/up"), (Group.D, "down"))
    ) if widths[Group.GU] != widths[Group.D] else fitting_types(widths[group])  # fmt: skip
    elsewhere = [name for name in _packaged_fits(knobs) if str(model.path) != str(name[1])]
    hint = (
        f"; these knobs fit the packaged model {elsewhere[0][0]} (rows of {elsewhere[0][2]}): "
        f"run them there (`healsweep heal {elsewhere[0][0]} --knobs {knob_file or 'K.yaml'} "
        "--out OUT.gguf`)"
        if elsewhere else ""
    )  # fmt: skip
    raise GGUFFormatError(
        f"{model.path}: the rows of {where} hold {widths[group]} values, not a multiple of the "
        f"{found.name.upper()} block of {found.block_weights}; they cannot be stored as "
        f"{found.name}. The types that fit this model, smallest first: {ladder}{hint}"
    )


def fitting_types(width: int) -> str:
    """The routed-expert types whose blocks fill rows of ``width`` weights, by bits per weight:
    ``q2_0 (2.25 bits), iq4_nl (4.5 bits)``."""
    fits = sorted((t for t in ROUTED_TYPES if width % t.block_weights == 0),
                  key=lambda t: t.bits_per_weight)  # fmt: skip
    return ", ".join(f"{t.name} ({t.bits_per_weight:g} bits)" for t in fits) or "none"


def _layer_types(model: GGUFModel, knobs: Knobs | None) -> list[LayerTypes]:
    """The routed types of each MoE layer, in order (without ``knobs``: Q2_0's, the default)."""
    types = expert_types(model, knobs) if knobs is not None else {}
    return [types.get(layer, LayerTypes(Q2_0, Q2_0)) for layer in model.hparams.moe_layers]


def _misfit(model: GGUFModel, knobs: Knobs | None) -> tuple[int, Group, Any] | None:
    """The first (layer, group, type) whose blocks do not fill the rows, or None."""
    hp = model.hparams
    widths = {Group.GU: hp.n_embd, Group.D: hp.n_ff_exp}
    for layer, chosen in zip(hp.moe_layers, _layer_types(model, knobs), strict=True):
        for group in GROUPS:
            found = ggml_type(chosen.of(group))
            if widths[group] % found.block_weights:
                return layer, group, found
    return None


def _packaged_fits(knobs: Knobs | None) -> list[tuple[str, Path, int]]:
    """The packaged models (``demo``, ``demo-medium-cpu``) whose routed rows the knobs' types
    fill: (name, file, gate/up row width)."""

    fits = []
    for name in BUNDLED_MODELS:
        path = demo_model_path(name)
        try:
            packaged = open_model(path)
            if _misfit(packaged, knobs) is None:
                fits.append((name, path, packaged.hparams.n_embd))
        except HealsweepError:  # a missing file, a layer_types entry it lacks: not a fit
            continue
    return fits


def quantize_group(
    weights: dict[str, Any],
    knobs: Knobs,
    trace_layer: dict[str, np.ndarray] | None,
    calibration: CalibrationConfig,
    group: Group,
    stored_as: str,
    gate_up: QuantizedGroup | None = None,
) -> QuantizedGroup:
    """``group``'s routed stacks of one layer in ``stored_as``; ``weights`` from
    :func:`healsweep.heal.stages.expert_weights`, ``trace_layer`` where :func:`reads_trace`,
    ``gate_up`` (the layer's quantized gate and up) where :func:`reads_gate_up`. The class
    reads the knobs of its key and nothing else."""
    if reads_gate_up(knobs, group, stored_as) and gate_up is None:
        raise ValueError("down_input: student needs the layer's quantized gate and up")
    cls = group_quantizer(knobs, stored_as)
    read = cls.reads(knobs, group, stored_as)
    inputs = GroupInputs(
        weights, Group(group), stored_as, read, trace_layer, calibration.min_tokens_per_expert,
        gate_up,
    )  # fmt: skip
    stacks, report = cls.quantize(inputs)
    return QuantizedGroup(stacks, stored_as, report)


def fold_alpha(knobs: Knobs, stored_as: str, stack: Any, factor: float | np.ndarray) -> Any:
    """``stack`` (stored as ``stored_as``) with Part A's ``factor`` folded into its fp16 scales
    (a scalar, or one per expert ``[E]``), as the type's storage format folds it."""
    return format_of(ggml_type(stored_as).ggml_id).fold_alpha(stack, factor)
