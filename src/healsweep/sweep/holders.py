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

* a node holding its quantization: ``NodeAffinitySchedulingStrategy(node, soft=True)``. The trial
  waits for that node while it is alive and can run it at all (a follow-up costs seconds there and
  a quantization anywhere else); Ray runs it elsewhere once the node has left the pool;
* else a node holding the calibration trace: soft affinity that spills
  (``_spill_on_unavailable``): there if it has room now, else wherever Ray puts it, so a cold
  trial never queues behind a busy node and a worker that joins late takes new quantizations;
* else, and always under ``placement: ray``, Ray's default scheduling.

Among several holders, the one with the fewest of the sweep's trials placed on it is asked. A
node becomes a holder once a trial there has built its student, not when it starts one: trials of
one quantization started together spread over the pool (each node then holds it) rather than all
queueing behind the first.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from healsweep.cache import canonical_json
from healsweep.heal.knobs import Knobs, Stage
from healsweep.results.store import read_trials

TRACE = "trace"  # the holder key of the sweep's calibration trace (one per sweep)
# The stage whose entries name a node as a holder: what a trial there hit or computed.
_HOLDS = {Stage.QUANTIZE.value: "quantization", Stage.CALIB_TRACE.value: TRACE}


def quantization_of(knobs: Knobs) -> str:
    """The quantized experts a config needs, named within one sweep: a short hash of the knobs
    the quantize stage reads (its cache key's other inputs, the model, trace and code, are the
    sweep's)."""
    quantize = canonical_json(knobs.for_stage(Stage.QUANTIZE))
    return "q-" + hashlib.sha256(quantize.encode()).hexdigest()[:16]


def held_keys(quantization: str | None, detail: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The holder keys a node gained from a trial's stage-cache activity ``detail`` (hits,
    computed, waited per stage): its quantization once the quantize stage ran or was served
    there, the trace once the calibration trace was."""
    touched = {stage for counts in detail.values() for stage, n in counts.items() if n}
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


@ray.remote(num_cpus=0, max_restarts=0)
class StageHolders:
    """``{holder key: [node ids]}`` of one sweep run (keys: :func:`quantization_of` ids and
    :data:`TRACE`) and the trials placed on each node now; also the window credits that pace
    each placed task (:mod:`healsweep.sweep.placed`). It dies with the driver; a resumed
    sweep starts one from the rows of the trials already run (:func:`prior_holders`)."""

    def __init__(self, prior: Mapping[str, Iterable[str]]) -> None:
        self._holders = {key: list(dict.fromkeys(nodes)) for key, nodes in prior.items()}
        self._placed: Counter[str] = Counter()
        self._credits: dict[str, _Credits] = {}

    def ask(self, quantization: str | None) -> tuple[list[str], list[str]]:
        """(nodes holding ``quantization``, nodes holding the trace), each with the least
        loaded first (ties: the earliest holder)."""

        def ranked(key: str | None) -> list[str]:
            nodes = self._holders.get(key, []) if key else []
            return sorted(nodes, key=lambda node: self._placed[node])

        return ranked(quantization), ranked(TRACE)

    def move(self, was: str | None, now: str | None) -> None:
        """A trial's work left node ``was`` (or was not on one) for node ``now`` (or ended)."""
        if was:
            self._placed[was] -= 1
        if now:
            self._placed[now] += 1

    def built(self, node: str, keys: list[str]) -> None:
        """``node`` now holds the entries of ``keys``."""
        for key in keys:
            nodes = self._holders.setdefault(key, [])
            if node not in nodes:
                nodes.append(node)

    async def take_window(self, work: str) -> None:
        """(A placed task) wait until the coordinator of ``work`` lets it score one more window
        (:meth:`give_windows`): the task runs at most that far ahead of the pruner."""
        credits = self._credits.setdefault(work, _Credits())
        while credits.left <= 0:
            credits.ready.clear()
            await credits.ready.wait()
        credits.left -= 1

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


def open_holders(prior: Mapping[str, Iterable[str]]) -> ray.actor.ActorHandle:
    """Start the sweep's :class:`StageHolders` on the head node (where the window book lives,
    for the same reason: it must outlive any worker)."""
    from healsweep.sweep.trial import HEAD_NODE_RESOURCE

    return StageHolders.options(resources={HEAD_NODE_RESOURCE: 0.001}).remote(dict(prior))


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
class Placement:
    """Where one trial's work was asked to run: the Ray scheduling strategy, the node it names
    (None: Ray's choice) and the nodes that held the trial's quantization when it was placed."""

    strategy: Any
    target: str | None
    holders: tuple[str, ...]


def placement_for(mode: str, holders: list[str], traces: list[str]) -> Placement:
    """The placement of a trial whose quantization ``holders`` and trace holders ``traces``
    hold (see the module docstring); ``mode`` is the spec's ``placement``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if mode == "cache" and holders:
        strategy = NodeAffinitySchedulingStrategy(holders[0], soft=True)
        return Placement(strategy, holders[0], tuple(holders))
    if mode == "cache" and traces:
        strategy = NodeAffinitySchedulingStrategy(traces[0], soft=True, _spill_on_unavailable=True)
        return Placement(strategy, traces[0], ())
    return Placement("DEFAULT", None, tuple(holders))
