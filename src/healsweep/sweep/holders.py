"""Which node of the pool holds which of a sweep's stage entries, and where a trial is therefore
asked to run (docs/contracts.md, "Placement").

A worker's stage cache is its own (``$HEALSWEEP_CACHE``), so a trial belongs on the node that
holds its upstream entries: above all its quantized experts, which bring their routed outputs,
Part A and the ridge basis with them (a trial that changes only rho or eta computes two small
stages there, and the quantization, and maybe the teacher trace, anywhere else). Within one sweep
the model, the calibration and the code are fixed, so the quantized experts a trial needs are
named by its quantization knobs alone (:func:`quantization_of`), known before it runs, on any
node, without the model file. :class:`StageHolders`, an actor on the head node, records which
node built which quantization and which traced the calibration set, and the trial asks Ray for a
node through Ray's own scheduling (:func:`placement_for`):

* a node holding its quantization, or building it now:
  ``NodeAffinitySchedulingStrategy(node, soft=True)``, the one with a free slot or else the
  shortest expected wait first. The trial waits for that node (Ray runs it elsewhere once the node
  has left the pool) unless another node has a free slot now and the wait costs more than
  building the quantization there: then it goes to that node as a new quantization would. A
  node left idle while a follow-up queues behind a busy holder is a loss as real as a rebuild,
  so the two are weighed in the same unit, seconds, from what the sweep's own works measured
  (:class:`_Durations`: a build's time to its first window less a follow-up's, against the
  remaining time of the holder's running work: from its own pace of windows once it scores,
  else its kind's length less its elapsed time). Until a kind has been measured, the trial
  waits for a holder, and is not made to wait for a node still building;
* else a node holding the calibration trace: soft affinity that spills
  (``_spill_on_unavailable``): there if it has room now, else wherever Ray puts it, so a cold
  trial never queues behind a busy node and a worker that joins late takes new quantizations;
* else, and always under ``placement: ray``, Ray's default scheduling.

Ray still does the scheduling; the holders only choose which node a trial's soft affinity names,
and whether it may spill. A node becomes a holder once a trial there has built its student (its
first window); while a trial builds a quantization, its node is that quantization's builder.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from healsweep.cache import canonical_json
from healsweep.heal.knobs import Knobs
from healsweep.heal.reads import stage_reads
from healsweep.results.store import read_trials
from healsweep.stage_names import Stage
from healsweep.sweep.spec import RAY_RESOURCE_NAMES

# Ray gives the head node this resource; Ray Train pins its own state actor the same way.
HEAD_NODE_RESOURCE = "node:__internal_head__"
TRACE = "trace"  # the holder key of the sweep's calibration trace (one per sweep)
# The stage whose entries name a node as a holder: what a trial there hit or computed.
_HOLDS = {Stage.QUANTIZE.value: "quantization", Stage.CALIB_TRACE.value: TRACE}
_HELD_BY = ("hits", "computed", "waited")  # the activity kinds that leave an entry on the node


def quantization_of(knobs: Knobs) -> str:
    """The quantized experts a config needs, named within one sweep: a short hash of the knobs
    the quantize stage reads (its cache key's other inputs, the model, trace and code, are the
    sweep's)."""
    quantize = canonical_json(stage_reads(knobs, Stage.QUANTIZE))
    return "q-" + hashlib.sha256(quantize.encode()).hexdigest()[:16]


def held_keys(quantization: str | None, detail: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The holder keys a node gained from a trial's stage-cache activity ``detail`` (hits,
    computed, waited per stage): its quantization once the quantize stage ran or was served
    there, the trace once the calibration trace was (bytes and evictions say nothing of what
    the node holds)."""
    touched = {stage for kind in _HELD_BY for stage, n in detail.get(kind, {}).items() if n}
    keys = []
    for stage, what in _HOLDS.items():
        if stage in touched:
            keys.append(quantization if what == "quantization" else what)
    return [key for key in keys if key]


@dataclass
class _Credits:
    """The windows a placed task may still score before it waits for its coordinator."""

    left: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


# The kinds of work, by what its node lacked when it started: the calibration trace (cold), the
# trial's quantization (build), or nothing (a follow-up).
COLD, BUILD, FOLLOW = "cold", "build", "follow"


@dataclass
class _Work:
    """A placed trial's work as the holders see it: the node it was asked for (``target``) until
    it starts on ``node``, when it started (the actor's clock), its kind there, its seconds to
    the first window, and its window credits taken (one before each window; when the second
    and the last were taken)."""

    quantization: str | None
    target: str | None
    node: str | None = None
    started: float | None = None
    kind: str = BUILD
    first_s: float | None = None
    taken: int = 0
    second_at: float | None = None
    last_at: float | None = None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class _Durations:
    """Seconds the sweep's works took by kind, measured by their tasks: to the first window
    (the student built) and in all; the scoring seconds and windows of each whole work."""

    first: dict[str, list[float]] = field(default_factory=lambda: {COLD: [], BUILD: [], FOLLOW: []})
    total: dict[str, list[float]] = field(default_factory=lambda: {COLD: [], BUILD: [], FOLLOW: []})
    scoring: list[float] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)

    def rebuild_s(self) -> float | None:
        """What building a quantization on a node that has the trace adds to a trial: a
        build's time to its first window (a cold one's while no other was measured, an upper
        bound) less a follow-up's; None until one was measured."""
        build = _mean(self.first[BUILD]) or _mean(self.first[COLD])
        if build is None:
            return None
        return max(0.0, build - (_mean(self.first[FOLLOW]) or 0.0))

    def expected_s(self, kind: str) -> float | None:
        """The expected seconds of a whole work of ``kind``, from the nearest kind measured
        (a follow-up not yet measured: a build's less what building adds)."""
        for source in {COLD: (COLD, BUILD), BUILD: (BUILD, COLD), FOLLOW: (FOLLOW,)}[kind]:
            total = _mean(self.total[source])
            if total is not None:
                return total
        build, rebuild = _mean(self.total[BUILD]) or _mean(self.total[COLD]), self.rebuild_s()
        return None if build is None or rebuild is None else max(0.0, build - rebuild)

    def remaining_s(self, work: _Work, now: float) -> float | None:
        """The expected seconds until ``work`` ends (None: not started, or nothing of its kind
        measured). Once it is scoring, from its own pace (its windows so far, the windows a
        whole work scored); before, its kind's length less its elapsed time, and at least its
        scoring still to come (a work that overruns is not taken for finished)."""
        if work.started is None:
            return None
        windows = _mean([float(n) for n in self.windows])
        if work.taken >= 3 and windows and work.second_at is not None and work.last_at:
            pace = (work.last_at - work.second_at) / (work.taken - 2)
            left = pace * max(0.0, windows - work.taken + 1) - (now - work.last_at)
            return max(0.0, left)
        expected = self.expected_s(work.kind)
        if expected is None:
            return None
        floor = (_mean(self.scoring) or 0.0) if work.first_s is None else 0.0
        return max(expected - (now - work.started), floor)


@ray.remote(num_cpus=0, max_restarts=0)
class StageHolders:
    """``{holder key: [node ids]}`` of one sweep run (keys: :func:`quantization_of` ids and
    :data:`TRACE`), the works placed on each node now and how long works took (so a
    follow-up waits for a busy holder only while that is cheaper than rebuilding, see
    :func:`placement_for`); also the window credits that pace each placed task
    (:mod:`healsweep.sweep.placed`). It dies with the driver; a resumed sweep starts one from
    the rows of the trials already run (:func:`prior_holders`)."""

    def __init__(self, prior: Mapping[str, Iterable[str]], per_trial: Mapping[str, float]) -> None:
        self._holders = {key: list(dict.fromkeys(nodes)) for key, nodes in prior.items()}
        self._per_trial = dict(per_trial)
        self._works: dict[str, _Work] = {}
        self._durations = _Durations()
        self._credits: dict[str, _Credits] = {}

    def _slots(self) -> dict[str, int]:
        """``{node: trials it can run at once}`` of the alive nodes (a node that joined late
        is counted as soon as it is alive)."""
        slots = {}
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            have = node["Resources"]
            fits = [int(have.get(RAY_RESOURCE_NAMES.get(r, r), 0) // amount)
                    for r, amount in self._per_trial.items() if amount > 0]  # fmt: skip
            slots[node["NodeID"]] = min(fits) if fits else 1
        return slots

    def _loads(self) -> dict[str, NodeLoad]:
        now, slots = time.monotonic(), self._slots()
        on: dict[str, list[_Work]] = {node: [] for node in slots}
        for work in self._works.values():
            node = work.node or work.target
            if node in on:
                on[node].append(work)
        loads = {}
        for node, works in on.items():
            free = slots[node] - len(works)
            waits = [self._durations.remaining_s(work, now) for work in works]
            known = [w for w in waits if w is not None]
            wait = 0.0 if free > 0 else (min(known) if known and len(known) == len(waits) else None)
            loads[node] = NodeLoad(free, wait, len(works))
        return loads

    def ask(self, quantization: str | None) -> Ask:
        """Where ``quantization``'s entries are or are being built, where the trace is, each
        alive node's load and what a rebuild costs (:func:`placement_for` decides)."""
        loads = self._loads()
        held = (
            [n for n in self._holders.get(quantization, []) if n in loads] if quantization else []
        )
        building = [w.node for w in self._works.values() if w.node in loads and w.kind != FOLLOW
                    and quantization and w.quantization == quantization]  # fmt: skip
        traces = [n for n in self._holders.get(TRACE, []) if n in loads]
        return Ask(held, list(dict.fromkeys(building)), traces, loads, self._durations.rebuild_s())

    def placed(self, work: str, quantization: str | None, target: str | None) -> None:
        """A work is asked to run on ``target`` (None: where Ray puts it)."""
        self._works[work] = _Work(quantization, target)

    def started(self, work: str, node: str) -> None:
        """The work started on ``node``: it builds its quantization there unless the node
        holds it, and the trace too unless the node holds that."""
        entry = self._works.get(work)
        if entry is not None:
            entry.node, entry.started = node, time.monotonic()
            if node not in self._holders.get(TRACE, []):
                entry.kind = COLD
            elif entry.quantization and node in self._holders.get(entry.quantization, []):
                entry.kind = FOLLOW

    def built(self, node: str, keys: list[str], work: str | None = None,
              first_s: float | None = None) -> None:  # fmt: skip
        """``node`` now holds the entries of ``keys``; ``work`` scored its first window
        ``first_s`` seconds after it started."""
        for key in keys:
            nodes = self._holders.setdefault(key, [])
            if node not in nodes:
                nodes.append(node)
        entry = self._works.get(work) if work else None
        if entry is not None and first_s is not None:
            entry.first_s = first_s
            self._durations.first[entry.kind].append(first_s)

    def ended(self, work: str, total_s: float | None = None) -> None:
        """The work has ended (``total_s``: it ran to its end in that many seconds; None: it
        failed or was stopped, and measures nothing)."""
        entry = self._works.pop(work, None)
        if entry is not None and total_s is not None and entry.started is not None:
            self._durations.total[entry.kind].append(total_s)
            if entry.first_s is not None:
                self._durations.scoring.append(max(0.0, total_s - entry.first_s))
            self._durations.windows.append(max(0, entry.taken - 1))

    async def take_window(self, work: str) -> None:
        """(A placed task) wait until the coordinator of ``work`` lets it score one more window
        (:meth:`give_windows`): the task runs at most that far ahead of the pruner."""
        credits = self._credits.setdefault(work, _Credits())
        while credits.left <= 0:
            credits.ready.clear()
            await credits.ready.wait()
        credits.left -= 1
        entry = self._works.get(work)
        if entry is not None:  # its pace: when each window began
            entry.taken += 1
            entry.last_at = time.monotonic()
            if entry.taken == 2:
                entry.second_at = entry.last_at

    def give_windows(self, work: str, n: int = 1) -> None:
        """(A trial's coordinator) let the task of ``work`` score ``n`` more windows."""
        credits = self._credits.setdefault(work, _Credits())
        credits.left += n
        credits.ready.set()

    def forget(self, work: str) -> None:
        """The work has ended: drop its credits."""
        self._credits.pop(work, None)

    def snapshot(self) -> dict[str, list[str]]:
        """Every holder key and its nodes (tests, diagnostics)."""
        return {key: list(nodes) for key, nodes in self._holders.items()}


def open_holders(
    prior: Mapping[str, Iterable[str]], per_trial: Mapping[str, float]
) -> ray.actor.ActorHandle:
    """Start the sweep's :class:`StageHolders` on the head node (where the window book lives,
    for the same reason: it must outlive any worker); ``per_trial``: the resources of one
    trial (``SweepSpec.trial_resources``), which say how many trials a node runs at once."""
    options = StageHolders.options(resources={HEAD_NODE_RESOURCE: 0.001})
    return options.remote(dict(prior), dict(per_trial))


def prior_holders(sweep_dir: Path) -> dict[str, list[str]]:
    """Holders from the rows of the trials (and fixed rows) a sweep has run: a resumed sweep on
    the same pool goes on placing follow-ups where their entries are. (A node of an earlier
    cluster is no longer alive: Ray's soft affinity then schedules as if it had no holder.)"""
    prior: dict[str, list[str]] = {}
    for row in read_trials(sweep_dir).to_pylist():
        node, detail = row.get("placed_node"), row.get("cache_detail")
        if not node or not detail:
            continue
        for key in held_keys(row.get("quantization"), json.loads(detail)):
            nodes = prior.setdefault(key, [])
            if node not in nodes:
                nodes.append(node)
    return prior


@dataclass(frozen=True)
class NodeLoad:
    """A node's load when a trial is placed: trial slots free now, the expected seconds until
    one frees (0 when one is free; None when a work there has nothing of its kind measured)
    and the works placed there."""

    free: int
    wait_s: float | None
    works: int


@dataclass(frozen=True)
class Ask:
    """What the holders know when a trial is placed (:meth:`StageHolders.ask`): the nodes
    holding its quantization, those building it now, those holding the trace, each alive
    node's load, and the seconds building the quantization adds to a trial (None: none
    measured yet)."""

    holders: list[str]
    building: list[str]
    traces: list[str]
    loads: dict[str, NodeLoad]
    rebuild_s: float | None


@dataclass(frozen=True)
class Placement:
    """Where one trial's work was asked to run: the Ray scheduling strategy, the node it names
    (None: Ray's choice) and the nodes that held (or were building) the trial's quantization
    when it was placed."""

    strategy: Any
    target: str | None
    holders: tuple[str, ...]


_IDLE = NodeLoad(1, 0.0, 0)  # a node the holders have no load for: free, no wait


def _rank(nodes: list[str], loads: Mapping[str, NodeLoad]) -> list[str]:
    """Nodes with a free slot first, then by the shortest expected wait, then by fewest works
    (ties: the order given, earliest holder first)."""

    def key(node: str) -> tuple[bool, float, int]:
        load = loads.get(node, _IDLE)
        wait = load.wait_s if load.wait_s is not None else float("inf")
        return (load.free <= 0, wait, load.works)

    return sorted(nodes, key=key)


def placement_for(mode: str, ask: Ask) -> Placement:
    """The placement of a trial (see the module docstring); ``mode`` is the spec's
    ``placement``."""

    near = tuple(ask.holders + [n for n in ask.building if n not in ask.holders])
    if mode != "cache":
        return Placement("DEFAULT", None, near)
    if near:
        best = _rank(list(near), ask.loads)[0]
        load = ask.loads.get(best, _IDLE)
        free_elsewhere = any(ld.free > 0 for n, ld in ask.loads.items() if n not in near)
        known = load.wait_s is not None
        # wait for the holder unless a node is free now and waiting costs more than a rebuild
        # there (a node still building it, with nothing measured yet, is not waited for)
        cheaper_elsewhere = free_elsewhere and (
            (known and ask.rebuild_s is not None and load.wait_s > ask.rebuild_s)
            or (not known and best not in ask.holders)
        )
        if load.free > 0 or not cheaper_elsewhere:
            return Placement(NodeAffinitySchedulingStrategy(best, soft=True), best, near)
        others = [n for n, ld in ask.loads.items() if n not in near and ld.free > 0]
        traced = [n for n in ask.traces if n in others]
        target = _rank(traced or others, ask.loads)[0]
        strategy = NodeAffinitySchedulingStrategy(target, soft=True, _spill_on_unavailable=True)
        return Placement(strategy, target, near)
    if ask.traces:
        target = _rank(list(ask.traces), ask.loads)[0]
        strategy = NodeAffinitySchedulingStrategy(target, soft=True, _spill_on_unavailable=True)
        return Placement(strategy, target, ())
    return Placement("DEFAULT", None, ())
