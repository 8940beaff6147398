"""The sensitivity pass: what moving one tensor group one step down or up the type ladder costs.

A tensor group is one MoE layer's routed gate and up experts (``gu``) or its down experts
(``d``) or, under a file budget, one of the whole file's other groups (attention, shared expert,
token embeddings, output, dense layers: one knob each types every layer's, so each is one group;
:data:`healsweep.sweep.allocator.FILE_GROUPS`). Under a routed-bpw budget (or none) those stay in
their base type and are not moved: they hold no routed weight. Around a base config (a sweep's baseline with its ``fixed`` knobs), each group is moved
one step down and one step up the ladder (the spec's ``allocator.ladder``, else the table of
:mod:`healsweep.kernels.ggml_types`: :func:`step_down`/:func:`step_up`, among the types whose
blocks fill the group's rows), every other group staying in its base type. Each such config, and
the base, is healed and scored on the first dev windows of the sweep (``allocator.windows``) by
the sweep's own work function, as a Ray task placed like a trial; the KLD cost of a move is its
pooled dev KLD minus the base's on the same windows, with a paired bootstrap CI.

Each config's scores are a cached artifact of the stage cache (stage ``sensitivity``), keyed by
the model's fingerprint and the split's lock id, the calibration (settings and documents), the
scoring settings and the windows' count, the base config's and the moved config's student keys,
the move itself, the work function and a digest of the code a trial runs: a second pass, another
sweep or ``healsweep sensitivity`` over the same inputs scores nothing again, and nothing here is
kept by hand. An entry whose windows are not the ones asked for is recomputed.

The moved configs are knobs (:func:`healsweep.sweep.allocator.allocation_knobs`): the base's,
with the group's layer in ``layer_types``, or the other group's ``type_*`` knob changed. The
other groups move along the same ladder less the types only healsweep's own quantizers make
(``q2_0``: those groups go through ggml's quantizer); one stored as the teacher stores it
(``teacher``) moves one step down only, to the ladder's largest type.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import ray
from ray.exceptions import RayTaskError

from healsweep._code import code_digest
from healsweep.cache import StageCache, content_key
from healsweep.data.corpus import load_corpus
from healsweep.errors import HealsweepError, ResultsError
from healsweep.heal.knobs import TEACHER, Knobs, LayerTypes
from healsweep.heal.reads import student_key
from healsweep.heal.size import ModelShapes
from healsweep.heal.trace import calibration_documents, documents_digest
from healsweep.kernels.ggml_types import ROUTED_TYPES, ggml_type, step_down, step_up
from healsweep.model import open_model
from healsweep.score.record import WindowRecord
from healsweep.score.stats import bootstrap_replicates
from healsweep.sweep.allocator import (
    GROUP_NAMES,
    Group,
    Option,
    Proposal,
    allocation_knobs,
    file_groups_of,
    group_size,
    propose,
)
from healsweep.sweep.placed import PlacedWork, work_task
from healsweep.sweep.space import with_point
from healsweep.sweep.spec import SweepSpec
from healsweep.sweep.trial import trial_seed
from healsweep.sweep.work import WorkFn, run_trial_work

log = logging.getLogger(__name__)

STAGE = "sensitivity"  # the stage cache's folder of these entries
VERSION = 1
# What a sensitivity entry runs: this module (its scores), heal (the trial's stages), score and
# the work function (sweep.work, imported here): their import closure keys it
CODE_ROOTS = ("healsweep.sweep.sensitivity", "healsweep.heal.pipeline", "healsweep.heal.evaluate",
              "healsweep.score.runner")  # fmt: skip
N_BOOT = 2000
IDENTITY_KEYS = ("model_fingerprint", "split_lock_id")  # of a sweep's identity, in the key
Say = Callable[[str], None]


@dataclass(frozen=True)
class Move:
    """One group of one MoE layer (or one other group of the file, ``layer`` None) moved from
    its base type to the next type down or up."""

    layer: int | None
    group: str  # gu | d, or one of FILE_GROUPS
    source: str
    target: str

    @property
    def direction(self) -> str:
        """``down`` or ``up`` the ladder (from ``teacher``: down)."""
        return "down" if self.source == TEACHER or self.bits < 0 else "up"

    @property
    def bits(self) -> float | None:
        """The change of the group's bits per weight (None from ``teacher``: its tensors'
        stored types differ)."""
        if TEACHER in (self.source, self.target):
            return None
        return ggml_type(self.target).bits_per_weight - ggml_type(self.source).bits_per_weight

    def label(self) -> str:
        """``layer 2 down iq2_xxs→iq2_xs``, ``attention iq2_xxs→iq2_xs``."""
        where = "" if self.layer is None else f"layer {self.layer} "
        return f"{where}{GROUP_NAMES[self.group]} {self.source}→{self.target}"


def group_widths(shapes: ModelShapes) -> dict[tuple[int, str], int]:
    """The row width (weights per row) of each (layer, group) of the routed experts."""
    return {(layer, group): shape[-1] for _, layer, group, shape, _ in shapes.routed}


def steps(type_name: str, width: int, ladder: Sequence[str] | None) -> tuple[str, str]:
    """``(one step down, one step up)`` from ``type_name`` for rows of ``width`` weights: along
    ``ladder`` (types ordered by bits per weight; those whose blocks do not fill the rows are
    passed over), or the table's ladder without one; ``type_name`` itself where there is none."""
    if ladder is None:
        return step_down(type_name, width), step_up(type_name, width)
    fits = [t for t in ladder if width % ggml_type(t).block_weights == 0]
    if type_name not in fits:
        return type_name, type_name
    at = fits.index(type_name)
    return fits[max(at - 1, 0)], fits[min(at + 1, len(fits) - 1)]


def file_steps(type_name: str, ladder: Sequence[str] | None) -> tuple[str, ...]:
    """The types one step down and up from ``type_name`` for one of the other groups: along
    ``ladder`` (else the table's routed types) less the types only healsweep's own quantizers
    make; from ``teacher``, the ladder's largest type alone; none for a type off the ladder."""
    own = {t.name for t in ROUTED_TYPES if t.own_quantizer}
    names = ladder if ladder is not None else [t.name for t in ROUTED_TYPES]
    rungs = [t for t in names if t not in own]
    if type_name == TEACHER:
        return (rungs[-1],) if rungs else ()
    if type_name not in rungs:
        return ()
    at = rungs.index(type_name)
    return tuple(rungs[i] for i in (at - 1, at + 1) if 0 <= i < len(rungs))


def moves(
    base: Knobs, shapes: ModelShapes, ladder: Sequence[str] | None, whole_file: bool = False
) -> list[Move]:
    """Every one-step move of the base config, by layer, group (gate/up first), down then up;
    with ``whole_file`` (a file budget) then each other group's the model has."""
    types = base.expert_types(shapes.moe_layers, shapes.n_layer)
    widths = group_widths(shapes)
    out = []
    for layer in shapes.moe_layers:
        for group in ("gu", "d"):
            source = types[layer].of(group)
            for target in steps(source, widths[(layer, group)], ladder):
                if target != source:
                    out.append(Move(layer, group, source, target))
    for group in file_groups_of(shapes) if whole_file else ():
        source = getattr(base, f"type_{group}")
        out.extend(Move(None, group, source, target) for target in file_steps(source, ladder))
    return out


def moved_knobs(base: Knobs, shapes: ModelShapes, move: Move) -> Knobs:
    """The base config with ``move`` applied (as knobs)."""
    if move.layer is None:
        return base.replace(**{f"type_{move.group}": move.target})
    types = dict(base.expert_types(shapes.moe_layers, shapes.n_layer))
    old = types[move.layer]
    types[move.layer] = LayerTypes(
        move.target if move.group == "gu" else old.gu, move.target if move.group == "d" else old.d
    )
    return allocation_knobs(base, types, shapes.moe_layers, shapes.n_layer)


class Scores(NamedTuple):
    """A config's per-window sums on the pass's windows (in the sweep's global window order)."""

    window_ids: tuple[str, ...]
    kld_sum: np.ndarray  # [W] float64
    kld_count: np.ndarray  # [W] int64 (scored tokens)
    top1_count: np.ndarray  # [W] int64

    @property
    def kld(self) -> float:
        """Token-pooled KLD."""
        return float(self.kld_sum.sum() / self.kld_count.sum())

    @property
    def top1(self) -> float:
        """Token-pooled top-1 agreement."""
        return float(self.top1_count.sum() / self.kld_count.sum())

    @classmethod
    def of(cls, records: Sequence[WindowRecord]) -> Scores:
        """The scores of a config's window records (any order)."""
        rows = sorted(records, key=lambda r: r.window_index)
        return cls(
            tuple(r.window_id for r in rows),
            np.array([r.metrics.kld_sum for r in rows], np.float64),
            np.array([r.metrics.kld_count for r in rows], np.int64),
            np.array([r.metrics.top1_count for r in rows], np.int64),
        )

    def to_entry(self, meta: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The cache entry: the arrays, and the window ids with ``meta``."""
        arrays = {"kld_sum": self.kld_sum, "kld_count": self.kld_count,
                  "top1_count": self.top1_count}  # fmt: skip
        return arrays, {**meta, "window_ids": list(self.window_ids)}

    @classmethod
    def from_entry(cls, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Scores:
        """Inverse of :meth:`to_entry`."""
        return cls(tuple(meta["window_ids"]), np.asarray(arrays["kld_sum"], np.float64),
                   np.asarray(arrays["kld_count"], np.int64),
                   np.asarray(arrays["top1_count"], np.int64))  # fmt: skip


@dataclass(frozen=True)
class MoveResult:
    """A move, what it changes of the size, and what it did to the pooled dev KLD."""

    move: Move
    knobs: Knobs
    size: int  # change of stored bits (routed) of the whole model
    file_bytes: int  # change of the file's padded bytes
    scores: Scores
    base: Scores

    @property
    def delta_kld(self) -> float:
        """Pooled KLD of the moved config minus the base's (negative: better)."""
        return self.scores.kld - self.base.kld

    @property
    def rel_change(self) -> float:
        """``delta_kld`` relative to the base's pooled KLD."""
        return self.scores.kld / self.base.kld - 1.0

    def rel_change_ci(self, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
        """Paired bootstrap 95% CI (over windows) of :attr:`rel_change`."""
        def cols(s: Scores) -> dict[str, np.ndarray]:
            return {"kld": s.kld_sum, "n": s.kld_count.astype(np.float64),
                    "top1": s.top1_count.astype(np.float64)}  # fmt: skip

        rel, _ = bootstrap_replicates(cols(self.base), cols(self.scores), n_boot, seed)
        lo, hi = np.quantile(rel, [0.025, 0.975])
        return float(lo), float(hi)


@dataclass(frozen=True)
class SensitivityTable:
    """The pass's result: the base config's scores and every move's."""

    base: Knobs
    base_scores: Scores
    ladder: tuple[str, ...] | None
    results: tuple[MoveResult, ...]
    routed_weights: int  # of the model: a move's bits over them is its change of routed bpw

    def groups(self, shapes: ModelShapes, measure: str) -> list[Group]:
        """The allocator's view: per (layer, group), its base type and each measured move as
        options (size change in ``measure``'s unit, KLD change); the other groups of the file
        (one each) only under a file measure (under ``routed_bpw`` they stay in their base
        type: a move of theirs changes no routed bit)."""
        types = self.base.expert_types(shapes.moe_layers, shapes.n_layer)
        where = [(layer, group, types[layer].of(group))
                 for layer in shapes.moe_layers for group in ("gu", "d")]  # fmt: skip
        if measure != "routed_bpw":
            where += [(None, g, getattr(self.base, f"type_{g}")) for g in file_groups_of(shapes)]
        out = []
        for layer, group, source in where:
            here = group_size(shapes, layer, group, source, measure)
            options = [Option(source, 0, 0.0)]
            for r in self.results:
                if (r.move.layer, r.move.group) == (layer, group):
                    size = group_size(shapes, layer, group, r.move.target, measure) - here
                    options.append(Option(r.move.target, size, r.delta_kld))
            out.append(Group(layer, group, tuple(options)))
        return out

    def to_dict(self, n_boot: int = N_BOOT) -> dict[str, Any]:
        """JSON-ready (``SWEEP/sensitivity.json``, ``healsweep sensitivity --json``)."""
        rows = []
        for r in self.results:
            lo, hi = r.rel_change_ci(n_boot)
            rows.append({
                "layer": r.move.layer, "group": r.move.group, "from": r.move.source,
                "to": r.move.target, "direction": r.move.direction, "bits": r.move.bits,
                "delta_bits": r.size, "delta_routed_bpw": r.size / self.routed_weights,
                "delta_file_bytes": r.file_bytes,
                "kld": r.scores.kld, "delta_kld": r.delta_kld, "rel_change": r.rel_change,
                "rel_change_ci": [lo, hi], "top1": r.scores.top1,
                "student": student_key(r.knobs), "knobs": r.knobs.identity(),
            })  # fmt: skip
        return {
            "base": {
                "knobs": self.base.identity(),
                "student": student_key(self.base),
                "kld": self.base_scores.kld,
                "top1": self.base_scores.top1,
            },  # fmt: skip
            "ladder": list(self.ladder) if self.ladder is not None else None,
            "windows": len(self.base_scores.window_ids),
            "moves": rows,
        }


def sensitivity_base(spec: SweepSpec) -> Knobs:
    """The config the pass moves groups of: the baseline with the spec's ``fixed`` knobs."""
    return with_point(spec, {})


def pass_spec(spec: SweepSpec) -> SweepSpec:
    """The spec whose dev windows the pass scores: the sweep's, cut to ``allocator.windows``."""
    windows = spec.allocator.windows if spec.allocator is not None else None
    if windows is None or (spec.scoring.max_windows or math.inf) <= windows:
        return spec
    scoring = spec.scoring.model_copy(update={"max_windows": windows})
    copied = spec.model_copy(update={"scoring": scoring})
    copied._given = spec._given  # its stored form, so its hash, unchanged
    return copied


def _work_name(work_fn: Callable) -> str:
    fn = getattr(work_fn, "func", work_fn)  # a functools.partial's function
    return f"{fn.__module__}.{fn.__qualname__}"


def entry_key(
    spec: SweepSpec,
    identity: Mapping[str, Any],
    knobs: Knobs,
    base: Knobs,
    move: Move | None,
    work_fn: Callable,
) -> str:
    """The cache key of one config's scores (see the module docstring)."""
    scoring = spec.scoring
    return content_key(
        STAGE,
        VERSION,
        {
            "model": identity.get("model_fingerprint"),
            "split": identity.get("split_lock_id"),
            "calibration": spec.calibration.key_inputs(),
            "calibration_documents": _calibration_digest(spec),
            "scoring": {
                "max_scored": scoring.max_scored,
                "max_context": scoring.max_context,
                "max_windows": scoring.max_windows,
                "teacher_cache": scoring.teacher_cache,
            },  # fmt: skip
            "base": student_key(base),
            "student": student_key(knobs),
            "move": None if move is None else [move.layer, move.group, move.source, move.target],
            "work": _work_name(work_fn),
            "code": code_digest(CODE_ROOTS),
        },
    )


def _calibration_digest(spec: SweepSpec) -> str:
    corpus = load_corpus(spec.calibration.corpus)
    return documents_digest(calibration_documents(corpus, spec.calibration))


class _Config(NamedTuple):
    knobs: Knobs
    move: Move | None
    key: str


def run_sensitivity(
    spec: SweepSpec,
    identity: Mapping[str, Any],
    *,
    work_fn: WorkFn = run_trial_work,
    holders: Any = None,
    say: Say | None = None,
    base_only: bool = False,
) -> SensitivityTable:
    """The pass over ``spec``'s base config (in a running Ray session; ``identity`` the
    sweep's, :func:`healsweep.sweep.work.sweep_identity`): cached configs are read, the others
    scored as Ray tasks, ``max_concurrent`` at once, each placed by ``holders`` (the sweep's
    :class:`~healsweep.sweep.holders.StageHolders`) when given. ``say`` gets a line as each
    config is done. With ``base_only`` the base config alone is scored (a table of no moves,
    under the key a full pass around it reads back)."""

    say = say or (lambda line: None)
    scored_spec = pass_spec(spec)
    base = sensitivity_base(spec)
    ladder = tuple(spec.allocator.ladder) if spec.allocator and spec.allocator.ladder else None
    shapes = ModelShapes.of(open_model(spec.model))
    whole_file = spec.budget is not None and spec.budget.budget().measure == "file_bytes"
    configs = [_Config(base, None, entry_key(scored_spec, identity, base, base, None, work_fn))]
    for move in () if base_only else moves(base, shapes, ladder, whole_file):
        knobs = moved_knobs(base, shapes, move)
        configs.append(_Config(knobs, move, entry_key(scored_spec, identity, knobs, base, move,
                                                      work_fn)))  # fmt: skip
    cache = StageCache(spec.cache_root, spec.cache_max_gb)
    found: dict[str, Scores] = {}
    for config in configs:
        entry = cache.get(STAGE, config.key)
        if entry is not None:
            found[config.key] = Scores.from_entry(*entry)
    windows = _expected_windows(found, configs)
    pending = [c for c in configs if c.key not in found or found[c.key].window_ids != windows]
    say(f"{'score of' if base_only else f'sensitivity of {len(configs) - 1} moves around'} "
        f"{_describe(base, shapes)}: "
        f"{len(configs) - len(pending)} of {len(configs)} configs cached, {len(pending)} to "
        f"score on {scored_spec.scoring.max_windows or 'all'} dev windows")  # fmt: skip
    for n, (config, scores, seconds) in enumerate(
        _score(scored_spec, pending, work_fn, holders), 1
    ):
        found[config.key] = scores
        meta = {"knobs": config.knobs.identity(), "seconds": seconds,
                "move": None if config.move is None else vars(config.move)}  # fmt: skip
        cache.put(STAGE, config.key, *scores.to_entry(meta))
        label = "base" if config.move is None else config.move.label()
        say(f"[{n}/{len(pending)}] {label}: pooled KLD {scores.kld:.5f} on "
            f"{len(scores.window_ids)} windows ({seconds:.0f} s)")  # fmt: skip
    base_scores = found[configs[0].key]
    results = []
    for config in configs[1:]:
        scores = found[config.key]
        if scores.window_ids != base_scores.window_ids:
            raise RuntimeError("sensitivity: a moved config scored other windows than the base")
        move = config.move
        assert move is not None
        bits = group_size(shapes, move.layer, move.group, move.target, "routed_bpw") - group_size(
            shapes, move.layer, move.group, move.source, "routed_bpw")  # fmt: skip
        nbytes = group_size(shapes, move.layer, move.group, move.target, "file_bytes") - (
            group_size(shapes, move.layer, move.group, move.source, "file_bytes"))  # fmt: skip
        results.append(MoveResult(move, config.knobs, bits, nbytes, scores, base_scores))
    weights = sum(math.prod(shape) for _, _, _, shape, _ in shapes.routed)
    return SensitivityTable(base, base_scores, ladder, tuple(results), weights)


def _expected_windows(found: Mapping[str, Scores], configs: Sequence[_Config]) -> tuple | None:
    """The windows the cached entries agree on (the base's when it is cached), else None."""
    base = found.get(configs[0].key)
    return base.window_ids if base is not None else None


def _describe(base: Knobs, shapes: ModelShapes) -> str:
    size = shapes.size(base)
    types = f"{base.type_gu}/{base.type_d}" + (f" ({base.layer_types})" if base.layer_types else "")
    others = "".join(f", {g} {t}" for g, t in base.file_types().items())
    return f"{types}{others} at {size.routed_bpw:.4g} routed bpw, {size.file_mib:.4g} MiB"


def _score(spec: SweepSpec, pending: Sequence[_Config], work_fn: WorkFn, holders: Any) -> Any:
    """Yield ``(config, scores, seconds)`` as each pending config's Ray task ends."""
    task = work_task(spec, collected=True)
    waiting = list(pending)
    running: dict[Any, tuple[_Config, PlacedWork | None, float]] = {}
    while waiting or running:
        while waiting and len(running) < spec.max_concurrent:
            config = waiting.pop(0)
            seed = trial_seed(spec.seed, student_key(config.knobs))
            job = partial(work_fn, spec, config.knobs, frozenset(), seed)
            work = PlacedWork(spec, holders, config.knobs) if holders is not None else None
            options = task.options(scheduling_strategy=work.place().strategy) if work else task
            running[options.remote(job, spec.trial_resources())] = (config, work, time.time())
        ready, _ = ray.wait(list(running), num_returns=1)
        config, work, started = running.pop(ready[0])
        try:
            events = ray.get(ready[0])
            if work is not None:  # the holders learn where its entries are
                records = [r for r in map(work.observe, events) if r is not None]
            else:
                records = [e["record"] for e in events if e.get("record") is not None]
        except Exception as exc:
            for ref in running:
                ray.cancel(ref)
            raise _failed(config, exc) from None
        finally:
            if work is not None:
                work.close()
        yield config, Scores.of(records), time.time() - started


def _failed(config: _Config, exc: Exception) -> Exception:
    """A config's task failed: its own error when it is a healsweep one (a missing quantizer,
    a bad file), else one line naming the config; what was scored before stays cached."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    label = "the base config" if config.move is None else config.move.label()
    if isinstance(cause, HealsweepError):
        return type(cause)(f"sensitivity pass, {label}: {cause}")
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
    return ResultsError(
        f"sensitivity pass, {label}: the config failed ({first}); the configs scored so far "
        "are cached: fix the cause and run it again"
    )


def proposals_of(spec: SweepSpec, table: SensitivityTable) -> list[Proposal]:
    """The allocator's proposals from ``table`` under the spec's budget
    (:func:`healsweep.sweep.allocator.propose`)."""

    shapes = ModelShapes.of(open_model(spec.model))
    budget = spec.budget.budget()
    groups = table.groups(shapes, budget.measure)
    return propose(table.base, shapes, budget, groups, spec.allocator_settings().proposals)


def allocator_record(table: SensitivityTable, proposals: Sequence[Proposal]) -> dict[str, Any]:
    """What ``allocator.json`` holds: the sensitivity table and the proposals."""
    return {"sensitivity": table.to_dict(), "proposals": [p.to_dict() for p in proposals]}
