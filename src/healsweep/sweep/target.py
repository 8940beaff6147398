"""A size target in one command: the allocation of a user's own model, under a target, from its
own sensitivity (``healsweep heal MODEL --target-bpw X`` or ``--target-size-mib N``).

A target is a routed-bpw limit (the routed experts' stored bits over their weights) or a file
limit (the whole file's bytes, every tensor counted: :mod:`healsweep.heal.size`). The command
takes the healing knobs of a recipe (``--knobs``) and chooses every type itself:

1. the *base*: the config of the recipe's healing knobs with every group in one type of the
   ladder, the largest whose file fits the target (:func:`target_base`). Under a routed-bpw
   target only the routed experts take it, the other groups staying in the types the knobs give
   (they hold no routed weight: under a routed-bpw budget the allocator never moves them);
   under a file target every group does (attention, shared expert, token embeddings, output,
   dense layers: one group each, as their knobs type every layer);
2. the sensitivity pass around that base (:mod:`healsweep.sweep.sensitivity`, as
   ``healsweep sensitivity`` runs it: each group one step down and up the ladder, healed and
   scored on the model's own dev windows of the corpus's split, calibrated on the corpus's
   calibration documents), cached in the stage cache: a second target on the same model whose
   base is the same type scores nothing again;
3. the allocation of least predicted KLD within the target (:func:`healsweep.sweep.allocator
   .allocate`; the base itself where no move is predicted to help);
4. with ``--rounds N`` (default :data:`ROUNDS`; 1: the first allocation as predicted), up to
   N - 1 further rounds (:func:`allocate_target`): the last allocation is scored on the pass's
   windows, and unless it beat every centre before it, the search stops; else the pass runs
   again around it (every group one step from there) and the knapsack allocates anew. The additive prediction is optimistic where groups' gains overlap,
   and one pass sees one step of the ladder only: rounds correct the first and walk past the
   second. The answer is then the centre of least measured KLD, never an unmeasured prediction.

A target outside what the ladder can reach (every group in its smallest type, or in its largest)
is refused by :func:`check_target` before any of this runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from healsweep.errors import SettingError
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.size import MIB, Budget, ModelShapes
from healsweep.kernels.ggml_types import ggml_type
from healsweep.sweep.allocator import Proposal, allocate, file_groups_of

if TYPE_CHECKING:  # the pass and its spec import Ray: the range check must not wait for it
    from healsweep.sweep.sensitivity import SensitivityTable
    from healsweep.sweep.spec import SweepSpec

# The ladder of a target (the table's routed types from IQ1_S to Q4_K, less q2_0, which only
# the routed experts can take, q2_k and q3_k, which the I-quants of their size beat, and iq4_nl,
# IQ4_XS's grid in blocks of 32)
LADDER = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4_xs", "q4_k")
WINDOWS = 24  # dev windows the pass scores each config on (a sweep's allocator.windows)
# Passes at most (--rounds): on demo-medium-cpu at the all-IQ2_XXS file size, three rounds gave
# 0.0765 on 96 dev windows where one gave 0.1029 (docs/demo-model.md); a round that does not
# improve stops the search, so a converged allocation costs one base-only score more than one
ROUNDS = 3
Say = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """A size target: routed bits per weight (``routed_bpw``) or whole-file bytes
    (``file_bytes``)."""

    measure: str
    value: float

    @classmethod
    def of(cls, target_bpw: float | None, target_size_mib: float | None) -> Target:
        """The target of ``--target-bpw`` / ``--target-size-mib`` (exactly one of them)."""
        if (target_bpw is None) == (target_size_mib is None):
            raise SettingError("give one target: --target-bpw X or --target-size-mib N")
        if target_bpw is not None:
            return cls("routed_bpw", float(target_bpw))
        return cls("file_bytes", float(target_size_mib) * MIB)  # type: ignore[arg-type]

    @property
    def whole_file(self) -> bool:
        """Whether every group takes part (a file target)."""
        return self.measure == "file_bytes"

    def budget(self) -> Budget:
        """The budget of this one limit."""
        return Budget(self.measure, (self.value,))

    def label(self, value: float | None = None) -> str:
        """``2.5 routed bpw``, ``3.134 MiB`` (of ``value``, else the target's)."""
        value = self.value if value is None else value
        if self.measure == "routed_bpw":
            return f"{value:.4f} routed bpw"
        return f"{value / MIB:.4f} MiB ({int(value):,} bytes)"

    def metadata(self) -> str:
        """The ``healsweep.target`` field of the written file: ``routed_bpw=2.5``,
        ``file_bytes=3286656``."""
        value = f"{self.value:g}" if self.measure == "routed_bpw" else f"{int(self.value)}"
        return f"{self.measure}={value}"


def usable_ladder(shapes: ModelShapes, ladder: Sequence[str] | None) -> tuple[str, ...]:
    """``ladder`` (else :data:`LADDER`) ordered by bits per weight, less the types whose blocks
    do not fill every routed row of the model; ``SettingError`` when fewer than one is left."""
    names = sorted(dict.fromkeys(ladder or LADDER), key=lambda t: ggml_type(t).bits_per_weight)
    widths = {shape[-1] for _, _, _, shape, _ in shapes.routed}
    fits = tuple(t for t in names if all(w % ggml_type(t).block_weights == 0 for w in widths))
    if not fits:
        raise SettingError(
            f"no type of the ladder {', '.join(names)} fills the routed rows of this model "
            f"(rows of {', '.join(map(str, sorted(widths)))} weights); give a --ladder of types "
            "whose blocks do"
        )
    return fits


def uniform(knobs: Knobs, type_name: str, shapes: ModelShapes, whole_file: bool) -> Knobs:
    """``knobs`` with every routed group in ``type_name`` (no steps, no per-layer types) and,
    with ``whole_file``, every other group the model has too."""
    others = {f"type_{g}": type_name for g in file_groups_of(shapes)} if whole_file else {}
    return knobs.replace(type_gu=type_name, type_d=type_name, up_first=0, up_last=0,
                         layer_types="", **others)  # fmt: skip


def reachable(
    knobs: Knobs, shapes: ModelShapes, target: Target, ladder: Sequence[str]
) -> tuple[float, float]:
    """The smallest and the largest size (in the target's measure) of an allocation along
    ``ladder``: every group in its smallest type, or in its largest."""
    budget = target.budget()
    low, high = (uniform(knobs, t, shapes, target.whole_file) for t in (ladder[0], ladder[-1]))
    return budget.value(shapes.size(low)), budget.value(shapes.size(high))


def check_target(
    knobs: Knobs, shapes: ModelShapes, target: Target, ladder: Sequence[str]
) -> tuple[float, float]:
    """The reachable range of ``target`` (:func:`reachable`); ``SettingError`` naming it when
    the target is below its smallest size or above its largest."""
    low, high = reachable(knobs, shapes, target, ladder)
    if not Budget.within(low, target.value) or target.value > high * (1 + 1e-9):
        flag = "--target-bpw" if target.measure == "routed_bpw" else "--target-size-mib"
        given = (f"{target.value:g}" if target.measure == "routed_bpw"
                 else f"{target.value / MIB:g}")  # fmt: skip
        reach = (f"{low:.4f} to {high:.4f}" if target.measure == "routed_bpw"
                 else f"{low / MIB:.4f} to {high / MIB:.4f}")  # fmt: skip
        raise SettingError(
            f"{flag} {given} is outside what the ladder {ladder[0]} ... {ladder[-1]} reaches on "
            f"this model: {reach}" + (" MiB" if target.whole_file else " routed bpw")
            + " (every group in the smallest type, or in the largest); give a target in that range"
        )
    return low, high


def target_base(
    knobs: Knobs, shapes: ModelShapes, target: Target, ladder: Sequence[str]
) -> Knobs:
    """The base the pass moves groups of: ``knobs`` uniform in the largest ladder type whose
    config fits ``target`` (call :func:`check_target` first: the smallest fits)."""
    budget = target.budget()
    fitting = [t for t in ladder if budget.fits(
        shapes.size(uniform(knobs, t, shapes, target.whole_file)), target.value)]  # fmt: skip
    return uniform(knobs, fitting[-1], shapes, target.whole_file)


def target_spec(
    model: str,
    corpus: str,
    calibration: CalibrationConfig,
    base: Knobs,
    target: Target,
    ladder: Sequence[str],
    *,
    windows: int = WINDOWS,
    cache_root: str | None = None,
    cache_max_gb: float | None = None,
) -> SweepSpec:
    """The sweep spec whose sensitivity pass is the target's: ``base``, the corpus's split,
    its first ``windows`` dev windows, one config at a time on every core of this machine."""
    from healsweep.sweep.spec import SweepSpec  # lazy: heavy (ray)

    budget = ({"routed_bpw": [target.value]} if target.measure == "routed_bpw"
              else {"file_bytes": [int(target.value)]})  # fmt: skip
    spec = SweepSpec.model_validate({
        "name": "target", "model": model, "corpus": corpus,
        "calibration": json.loads(calibration.model_dump_json()),
        "baseline": base.model_dump(), "sampler": "allocator", "budget": budget,
        "allocator": {"ladder": list(ladder), "proposals": 1, "windows": windows},
        "scoring": {"max_windows": windows}, "references": False, "pruner": "none",
        "max_concurrent": 1, "cache_root": cache_root, "cache_max_gb": cache_max_gb,
    })  # fmt: skip
    return spec.with_cpu_share(float(os.cpu_count() or 1))


@dataclass(frozen=True)
class Round:
    """One round of :func:`allocate_target`: its centre, the centre's measured pooled KLD on
    the pass's windows, and the allocation the pass around it proposed (None: not passed)."""

    centre: Knobs
    kld: float
    proposal: Proposal | None


def allocate_target(
    spec_for: Callable[[Knobs], SweepSpec],
    base: Knobs,
    shapes: ModelShapes,
    target: Target,
    *,
    rounds: int = ROUNDS,
    say: Say | None = None,
    **pass_options: Any,
) -> tuple[SensitivityTable, Proposal, list[Round]]:
    """The allocation of least KLD within ``target``, from ``rounds`` sensitivity passes
    (:func:`healsweep.sweep.driver.sensitivity_pass` of ``spec_for(centre)``; ``pass_options``
    to it). Returns the first pass's table, the allocation and the rounds.

    One round is the pass around ``base`` and the knapsack's allocation, the base itself where
    no move is predicted to help. Its prediction adds the moves' measured changes, which is
    optimistic where groups' gains overlap, and it sees one step of the ladder only. Each further
    round measures the last allocation on the pass's windows first (the base-only score a pass
    around it reads back) and stops, keeping the best centre measured, unless it beat every
    earlier one; else it moves every group again, one step from there, and allocates anew.
    With more than one round the answer is a measured centre: the one of least pooled KLD
    (the last allocation too, once measured)."""
    # lazy: heavy (ray, jax)
    from healsweep.sweep.driver import ray_session, sensitivity_pass

    if rounds < 1:
        raise SettingError(f"allocate_target: rounds must be >= 1, got {rounds}")
    say = say or (lambda line: None)
    budget = target.budget()
    history: list[Round] = []
    first: SensitivityTable | None = None
    centre = base
    session = ray_session(spec_for(base), pass_options.get("address"),
                          pass_options.get("num_cpus"))  # fmt: skip
    with session:  # one Ray session for every round
        for n in range(1, rounds + 1):
            if history:  # the last allocation, measured before anything is moved from it
                scored, _ = sensitivity_pass(spec_for(centre), say=say, base_only=True,
                                             **pass_options)  # fmt: skip
                best = min(r.kld for r in history)
                if scored.base_scores.kld >= best:
                    history.append(Round(centre, scored.base_scores.kld, None))
                    say(f"round {n}: the allocation scores {scored.base_scores.kld:.5f}, no "
                        f"better than the best measured ({best:.5f}): stop")  # fmt: skip
                    break
            table, _ = sensitivity_pass(spec_for(centre), say=say, **pass_options)
            first = first or table
            chosen = allocate(table.base, shapes, budget, table.groups(shapes, budget.measure),
                              target.value)  # fmt: skip
            if chosen is None:  # cannot happen: every centre fits
                raise SettingError(f"no allocation fits {target.label()}")
            history.append(Round(centre, table.base_scores.kld, chosen))
            say(f"round {n}: centre {table.base_scores.kld:.5f}, {len(chosen.moves)} groups "
                f"moved, predicted ΔKLD {chosen.predicted_kld:+.5f}")  # fmt: skip
            if not chosen.moves:  # nothing predicted to help: converged
                break
            centre = chosen.knobs
        else:
            if rounds > 1:  # the last allocation, measured too
                scored, _ = sensitivity_pass(spec_for(centre), say=say, base_only=True,
                                             **pass_options)  # fmt: skip
                history.append(Round(centre, scored.base_scores.kld, None))
    assert first is not None
    if rounds == 1:
        return first, history[0].proposal, history  # type: ignore[return-value]
    winner = min(history, key=lambda r: r.kld)
    return first, measured_proposal(base, winner, shapes, target, history[0].kld), history


def measured_proposal(
    base: Knobs, measured: Round, shapes: ModelShapes, target: Target, base_kld: float
) -> Proposal:
    """``measured``'s centre as a proposal against ``base``: its moves off the base, and its
    measured change of pooled KLD in place of a prediction."""
    before = dict(base.expert_types(shapes.moe_layers, shapes.n_layer))
    after = measured.centre.expert_types(shapes.moe_layers, shapes.n_layer)
    moved: list[tuple[int | None, str, str]] = []
    for layer in shapes.moe_layers:
        for group in ("gu", "d"):
            if after[layer].of(group) != before[layer].of(group):
                moved.append((layer, group, after[layer].of(group)))
    for group in file_groups_of(shapes):
        chosen = getattr(measured.centre, f"type_{group}")
        if chosen != getattr(base, f"type_{group}"):
            moved.append((None, group, chosen))
    size = shapes.size(measured.centre)
    return Proposal(target.value, measured.centre, measured.kld - base_kld, size, tuple(moved))


def allocation_record(
    table: SensitivityTable, chosen: Proposal, target: Target, rounds: Sequence[Round] = ()
) -> str:
    """The ``healsweep.allocation`` field of the written file (JSON): the target, the base,
    each group moved off it, the predicted (with rounds: measured) change and the base's pooled
    dev KLD, the sizes, and with more than one round each round's centre and its KLD."""
    steps = [{"types": {k: getattr(r.centre, k) for k in Knobs.TYPES}, "dev_kld": r.kld}
             for r in rounds] if len(rounds) > 1 else []  # fmt: skip
    return json.dumps({
        "rounds": steps,
        "target": target.metadata(),
        "base": {k: v for k, v in table.base.identity().items() if k in Knobs.TYPES},
        "types": {k: getattr(chosen.knobs, k) for k in Knobs.TYPES},
        "moves": [["all" if layer is None else layer, group, t]
                  for layer, group, t in chosen.moves],
        "base_dev_kld": table.base_scores.kld,
        "predicted_delta_kld": chosen.predicted_kld,
        "dev_windows": len(table.base_scores.window_ids),
        "routed_bpw": chosen.size.routed_bpw,
        "file_bytes": chosen.size.file_bytes,
    }, sort_keys=True)  # fmt: skip


def describe(chosen: Proposal, target: Target, measured: bool = False) -> str:
    """One line: the allocation's types and sizes, and its predicted (``measured``: measured,
    on the pass's windows) change of pooled KLD against the first base."""
    knobs = chosen.knobs
    types = f"routed {knobs.type_gu}/{knobs.type_d}"
    if knobs.layer_types:
        types += f" (layers {knobs.layer_types})"
    others = ", ".join(f"{g} {t}" for g, t in knobs.file_types().items())
    sizes = f"{chosen.size.routed_bpw:.4f} routed bpw, {chosen.size.file_mib:.4f} MiB"
    moved = f"{len(chosen.moves)} group{'s' * (len(chosen.moves) != 1)} moved off the base"
    return (f"{types}{', ' + others if others else ''} at {sizes} (target {target.label()}); "
            f"{moved}, {'measured' if measured else 'predicted'} ΔKLD "
            f"{chosen.predicted_kld:+.5f}")  # fmt: skip
