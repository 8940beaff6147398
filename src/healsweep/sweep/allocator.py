"""The allocator: each tensor group's type chosen under a size budget from measured sensitivities.

A tensor group is one MoE layer's routed gate and up experts (``gu``) or its down experts
(``d``), or one of the other groups of the whole file, each typed by one knob for every layer
(``type_attn`` ... ``type_dense``, so one group each, not one per layer: attention ``attn``, the
shared expert ``shexp``, the token embeddings ``embd``, the output ``output``, the leading dense
layers' FFN ``dense``; :data:`FILE_GROUPS`, their ``layer`` None). The other groups change no
routed bit, so under a routed-bpw budget they stay in their base type (the pass does not move
them); under a file budget (``file_bytes``/``file_mib``/``file_gib``) every group takes part.
The sensitivity pass (:mod:`healsweep.sweep.sensitivity`) measured, on dev windows, what
moving each group one step down or up the type ladder does to the pooled KLD of a base config.
Taking those changes as additive over groups, the allocation of least predicted KLD within a size
limit is a multiple-choice knapsack: each group picks one of its options (its base type, one step
down, one step up), each option with a size change and a predicted KLD change, their sum of size
changes within the room the limit leaves. :func:`best_allocations` solves it exactly by dynamic
programming over the summed size change (in units of the greatest common divisor of the options'
sizes, coarsened upwards, so never over the limit, only where that would need more than
:data:`MAX_STATES` states), keeping the ``k`` best allocations, not only the best: the prediction
is a first-order one, and a sweep scores each proposal for real.

Sizes are exact: a group's stored bits (routed bits per weight) or padded bytes (file budgets)
follow from its tensors' shapes and its type's block geometry (:mod:`healsweep.heal.size`), and
each proposal's size is checked against its limit by :meth:`ModelShapes.size` before it is
proposed. A proposal is stated as knobs: the base's, with ``type_gu``/``type_d`` the type most
of the layers take and ``layer_types`` the layers that differ (block indices in the first half of
the MoE layers, negative ones counted from the last in the second half, so that a recipe reads
"the first layer" and "the last layer" on a deeper model of the family too).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from healsweep.heal.knobs import TEACHER, Knobs, LayerTypes
from healsweep.heal.size import Budget, ConfigSize, ModelShapes
from healsweep.heal.tensor_types import GROUPS as FILE_GROUPS
from healsweep.kernels.ggml_types import fitting_type, ggml_type

MAX_STATES = 200_000  # distinct summed size changes kept at once by the dynamic programme
GROUP_NAMES = {"gu": "gate/up", "d": "down", "attn": "attention", "shexp": "shared expert",
               "embd": "token embeddings", "output": "output", "dense": "dense layers"}  # fmt: skip


@dataclass(frozen=True)
class Option:
    """One type a group may take: its size change and predicted KLD change against the base."""

    type: str
    size: int  # change of the budget's measure: stored bits (routed_bpw) or padded file bytes
    kld: float  # change of pooled dev KLD measured by the sensitivity pass (0 for the base type)


@dataclass(frozen=True)
class Group:
    """One MoE layer's gate/up or down experts, or one other group of the whole file (``layer``
    None), and the types it may take (its base type first)."""

    layer: int | None
    group: str  # gu | d, or one of FILE_GROUPS
    options: tuple[Option, ...]


@dataclass(frozen=True)
class Allocation:
    """One solution: an option index per group, its predicted KLD change and size change."""

    kld: float
    size: int
    picks: tuple[int, ...]


def best_allocations(groups: Sequence[Group], room: int, k: int = 1) -> list[Allocation]:
    """The ``k`` allocations of least predicted KLD change whose summed size change is at most
    ``room`` (negative: the base is over the limit and some groups must move down), best first
    (ties: the smaller, then the earlier picks); [] when none fits."""
    if k < 1:
        raise ValueError(f"best_allocations: k must be >= 1, got {k}")
    sizes = [o.size for g in groups for o in g.options]
    unit = math.gcd(*sizes) or 1
    lo = sum(min(o.size for o in g.options) for g in groups)
    hi = sum(max(o.size for o in g.options) for g in groups)
    if (hi - lo) // unit > MAX_STATES:  # coarser, rounded up: a state never understates a size
        unit = -(-(hi - lo) // MAX_STATES)
    # state: summed size change in units (rounded up) -> its k best partial allocations
    states: dict[int, list[tuple[float, int, tuple[int, ...]]]] = {0: [(0.0, 0, ())]}
    for group in groups:
        grown: dict[int, list[tuple[float, int, tuple[int, ...]]]] = {}
        for state, partials in states.items():
            for pick, option in enumerate(group.options):
                cell = grown.setdefault(state + -(-option.size // unit), [])
                cell.extend((kld + option.kld, size + option.size, picks + (pick,))
                            for kld, size, picks in partials)  # fmt: skip
        states = {state: sorted(cell)[:k] for state, cell in grown.items()}
    # exact sizes decide (a coarsened state only groups allocations of nearly the same size)
    found = sorted(p for cell in states.values() for p in cell if p[1] <= room)
    return [Allocation(kld, size, picks) for kld, size, picks in found[:k]]


def group_size(
    shapes: ModelShapes, layer: int | None, group: str, type_name: str, measure: str
) -> int:
    """The stored size of one layer's group (or one of :data:`FILE_GROUPS`, ``layer`` None) in
    ``type_name``, in ``measure``'s unit: bits (``routed_bpw``; 0 for the other groups, which
    hold no routed weight) or padded file bytes (``file_bytes``)."""
    if group in FILE_GROUPS:
        return 0 if measure == "routed_bpw" else _file_group_bytes(shapes, group, type_name)
    total = 0
    kind = ggml_type(type_name)
    for _, at, name, shape, _ in shapes.routed:
        if at != layer or name != group:
            continue
        *lead, n_in = shape
        rows = math.prod(lead)
        nbytes = rows * kind.row_bytes(n_in)
        total += (
            8 * nbytes
            if measure == "routed_bpw"
            else -(-nbytes // shapes.alignment) * (shapes.alignment)
        )
    return total


def _file_group_bytes(shapes: ModelShapes, group: str, type_name: str) -> int:
    """The padded bytes of ``group``'s tensors in ``type_name`` (each in the type that fits its
    rows, as :func:`healsweep.heal.tensor_types.planned_types` stores it; ``teacher``: as
    stored)."""
    total = 0
    for tensor in shapes.others:
        if tensor.group != group:
            continue
        nbytes = tensor.nbytes
        if type_name != TEACHER:
            chosen = fitting_type(type_name, tensor.shape[-1])
            if chosen.ggml_id != tensor.stored:
                nbytes = math.prod(tensor.shape[:-1]) * chosen.row_bytes(tensor.shape[-1])
        total += -(-nbytes // shapes.alignment) * shapes.alignment
    return total


def file_groups_of(shapes: ModelShapes) -> tuple[str, ...]:
    """The groups of :data:`FILE_GROUPS` the model has tensors of (a tied model has no
    ``output``, a model without leading dense layers no ``dense``)."""
    present = {t.group for t in shapes.others}
    return tuple(g for g in FILE_GROUPS if g in present)


def room_for(shapes: ModelShapes, base: Knobs, budget: Budget, limit: float) -> int:
    """How much the base config's size may grow (negative: must shrink) to fit ``limit``, in
    :func:`group_size`'s unit."""
    size = shapes.size(base)
    if budget.measure == "routed_bpw":
        weights = sum(math.prod(shape) for _, _, _, shape, _ in shapes.routed)
        base_bits = round(size.routed_bpw * weights)
        return math.floor(limit * weights * (1 + 1e-12)) - base_bits
    return math.floor(limit) - size.file_bytes


def allocation_knobs(
    base: Knobs, types: Mapping[int, LayerTypes], moe_layers: Sequence[int], n_layer: int
) -> Knobs:
    """``base`` with its routed experts in ``types`` (per MoE layer): ``type_gu``/``type_d`` the
    type most layers take (the base's where it ties), no edge steps, ``layer_types`` the others
    (see the module docstring for how a layer is spelled)."""
    moe = list(moe_layers)

    def common(group: str, fallback: str) -> str:
        counts = Counter(types[i].of(group) for i in moe)
        top = max(counts.values())
        return fallback if counts.get(fallback) == top else min(t for t, n in counts.items()
                                                                if n == top)  # fmt: skip

    gu, d = common("gu", base.type_gu), common("d", base.type_d)
    entries = []
    for position, layer in enumerate(moe):
        chosen = types[layer]
        if chosen != LayerTypes(gu, d):
            index = layer if position < (len(moe) + 1) // 2 else layer - n_layer
            entries.append(f"{index}:{chosen.gu}/{chosen.d}")
    return base.replace(type_gu=gu, type_d=d, up_first=0, up_last=0, layer_types=",".join(entries))


@dataclass(frozen=True)
class Proposal:
    """An allocation the allocator proposes for one budget limit."""

    limit: float
    knobs: Knobs
    predicted_kld: float  # predicted change of pooled dev KLD against the base
    size: ConfigSize
    moves: tuple[tuple[int | None, str, str], ...]  # (layer, group, type) off the base

    def to_dict(self) -> dict:
        """JSON-ready (``allocator.json``)."""
        return {
            "limit": self.limit,
            "knobs": self.knobs.identity(),
            "predicted_delta_kld": self.predicted_kld,
            "routed_bpw": self.size.routed_bpw,
            "file_bytes": self.size.file_bytes,
            "moves": [list(m) for m in self.moves],
        }


def propose(
    base: Knobs,
    shapes: ModelShapes,
    budget: Budget,
    groups: Sequence[Group],
    per_limit: int,
) -> list[Proposal]:
    """Up to ``per_limit`` allocations per limit of ``budget`` (ascending), best predicted first,
    each inside its limit and different from the base and from every earlier proposal."""
    out: list[Proposal] = []
    seen = {student_types(base, shapes)}
    for limit in budget.limits:
        room = room_for(shapes, base, budget, limit)
        # one more than asked: the base allocation may be among the best
        for found in best_allocations(groups, room, per_limit + len(out) + 1):
            knobs, moves = apply_picks(base, shapes, groups, found.picks)
            key = student_types(knobs, shapes)
            if key in seen:
                continue
            size = shapes.size(knobs)
            if not budget.fits(size, limit):  # cannot happen: sizes are exact; kept as a guard
                continue
            seen.add(key)
            out.append(Proposal(limit, knobs, found.kld, size, tuple(moves)))
            if sum(p.limit == limit for p in out) == per_limit:
                break
    return out


def apply_picks(
    base: Knobs, shapes: ModelShapes, groups: Sequence[Group], picks: Sequence[int]
) -> tuple[Knobs, tuple[tuple[int | None, str, str], ...]]:
    """``base`` with each group in its picked option's type (as knobs), and the moves
    ``(layer, group, type)`` where that is not the base type."""
    types = dict(base.expert_types(shapes.moe_layers, shapes.n_layer))
    files: dict[str, str] = {}
    moves = []
    for group, pick in zip(groups, picks, strict=True):
        if not pick:
            continue
        chosen = group.options[pick].type
        moves.append((group.layer, group.group, chosen))
        if group.layer is None:
            files[f"type_{group.group}"] = chosen
        else:
            old = types[group.layer]
            types[group.layer] = (
                old._replace(gu=chosen) if group.group == "gu" else old._replace(d=chosen)
            )
    knobs = allocation_knobs(base, types, shapes.moe_layers, shapes.n_layer)
    return (knobs.replace(**files) if files else knobs), tuple(moves)


def allocate(
    base: Knobs, shapes: ModelShapes, budget: Budget, groups: Sequence[Group], limit: float
) -> Proposal | None:
    """The allocation of least predicted KLD within ``limit`` (the base itself when no move is
    predicted to help), or None when none fits."""
    found = best_allocations(groups, room_for(shapes, base, budget, limit), 1)
    if not found:
        return None
    knobs, moves = apply_picks(base, shapes, groups, found[0].picks)
    size = shapes.size(knobs)
    if not budget.fits(size, limit):  # cannot happen: sizes are exact; kept as a guard
        return None
    return Proposal(limit, knobs, found[0].kld, size, moves)


def student_types(knobs: Knobs, shapes: ModelShapes) -> tuple:
    """What a config stores each group in: two configs of equal key are one student's types."""
    routed = knobs.expert_types(shapes.moe_layers, shapes.n_layer)
    return (tuple(sorted((i, t.gu, t.d) for i, t in routed.items())),
            tuple(sorted(knobs.file_types().items())))  # fmt: skip
