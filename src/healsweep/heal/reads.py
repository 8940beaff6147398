"""What each stage reads of the knobs (its cache-key contribution), and the key of a student.

A stage's key holds exactly the knobs it reads, so it changes only when something that stage
depends on changes, and equal outputs share one entry. Part A's and Part B's reads are knob
semantics (:meth:`Knobs.for_stage`); what ``quantize`` reads is its quantizer class's to say
(:mod:`healsweep.quant.registry`). Jax-free: the sweep driver and the results read keys.
"""

from __future__ import annotations

import hashlib
from typing import Any

from healsweep.cache import canonical_json
from healsweep.errors import KnobError
from healsweep.heal.knobs import Knobs
from healsweep.quant.registry import quantizer_for
from healsweep.quant.values import GROUPS, Group
from healsweep.stage_names import STUDENT_STAGES, Stage


def stage_reads(
    knobs: Knobs, stage: Stage | str, *, group: Group | None = None, stored_as: str | None = None
) -> dict[str, Any]:
    """Exactly the knobs ``stage`` reads under ``knobs``; {} for a stage that reads none.

    ``quantize`` is one stage per layer and tensor group: with ``group`` (``gu`` or ``d``) and
    the type that group of the layer is ``stored_as`` (:meth:`Knobs.expert_types`), what its
    class reads (``q2_0``: the quantizer's knobs of that group; a ggml type: ``{"type": name}``
    and, where a class refines ggml's grid, ``quantizer`` and ``gptq_damp``). Without ``group``,
    what quantizing the whole model may read, for any model: the type knobs off their defaults,
    and the knobs each type some layer may store each group in reads (its ``type`` left out).
    """
    if stage not in set(Stage):
        raise KnobError(f"unknown stage {stage!r}; stages are {', '.join(Stage)}")
    if stage != Stage.QUANTIZE:
        return knobs.for_stage(stage)
    if group is not None:
        if stored_as is None:
            raise ValueError("stage_reads: a quantize group needs the type it is stored as")
        return quantizer_for(stored_as, knobs.quantizer).reads(knobs, group, stored_as)
    read: dict[str, Any] = {}
    for each in GROUPS:
        for name in knobs.possible_types(each):
            found = quantizer_for(name, knobs.quantizer).reads(knobs, each, name)
            read.update({k: v for k, v in found.items() if k != "type"})
    read.update(knobs.type_reads())
    return read


def student_key(knobs: Knobs) -> str:
    """A short hash of what builds and scores this config's student: the knobs each stage reads
    (:func:`stage_reads`) and the score-time knobs. Configs with one student key score the same
    on every window of a sweep (e.g. ``gamma`` is inert with ``alpha: none``), so a sweep scores
    that student once, whatever rows name it."""
    reads = {stage.value: stage_reads(knobs, stage) for stage in STUDENT_STAGES}
    reads.update({knob: getattr(knobs, knob) for knob in Knobs.SCORING})
    return hashlib.sha256(canonical_json(reads).encode()).hexdigest()[:16]
