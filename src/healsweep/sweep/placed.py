"""A trial's work (heal + score) as a Ray task placed where its stage entries are.

The Tune trainable (:func:`healsweep.sweep.trial.sweep_trial`) stays a light coordinator on the
head node: it replays what the window book holds, then runs the work as one Ray task with the
spec's ``resources`` (one trial's worth: Tune's ``max_concurrent`` still bounds how many run) and
the placement :mod:`healsweep.sweep.holders` gives it, and reports each window the task streams
back, as the trainable did when it scored them itself. A task that fails fails the trial, which
Tune retries as before (the task itself is never retried); a trial Tune stops (pruned) cancels
its task. The fixed rows run the same task, collected whole (:func:`work_task`).

The task first sets up its process (its GPU, JAX's memory, the compilation cache:
:mod:`healsweep.sweep.devices`); the process's runtime (:func:`healsweep.runtime.current`, made at
its first task and kept for its life, never the driver's) holds its warm entries, resident layers
and cache counters from one task to the next. Then it yields events: ``started`` (its node
and GPUs), one ``window`` per scored window with what the trial's stage caches did so far, then
``done``.
:class:`PlacedWork` turns them into the trial's placement columns (``results.schema``,
:data:`~healsweep.results.schema.PLACEMENT_COLUMNS`) and tells the holders which node now holds
which entries. A streaming task runs ahead of its consumer unless told otherwise, and Tune's pruner
only sees the windows the coordinator reports, so each window waits for a credit the coordinator
gives when it is asked for the next one (:data:`AHEAD`, the sweep's
:class:`~healsweep.sweep.holders.StageHolders` keeps the count).
"""

from __future__ import annotations

import itertools
import json
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from functools import cache
from typing import Any

import ray

from healsweep._rss import peak_rss_bytes
from healsweep.cache import activity, activity_since
from healsweep.heal.knobs import Knobs
from healsweep.profile import profiling
from healsweep.score.record import WindowRecord
from healsweep.sweep.devices import prepare_trial_process
from healsweep.sweep.holders import Placement, held_keys, placement_for, quantization_of
from healsweep.sweep.spec import SweepSpec

Job = Callable[[], Iterator[WindowRecord]]  # the work, its arguments bound (functools.partial)
# The credits a trial's task starts with: the window Tune's pruner is looking at and one more
# in flight, so the task seldom waits and a pruned trial's task scores at most one window that
# is never reported (without credits, a task faster than Tune ran the whole trial ahead).
AHEAD = 2
PROFILE_EVERY = 16  # windows between the phase profiles a task reports (and its first and last)


def stamped(results: Iterable[WindowRecord]) -> Iterator[WindowRecord]:
    """``results``, each with where (the Ray node this runs on) and when it was scored."""
    try:
        node_id, node_ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # outside a Ray worker (direct calls in tests of the pure parts)
        node_id, node_ip = "", ""
    node = {"scored_node_id": node_id, "scored_node_ip": node_ip}
    for result in results:
        yield replace(result, scored_at=time.time(), scored_hostname=socket.gethostname(), **node)


def _events(
    job: Job,
    resources: Mapping[str, float],
    own_process: bool = True,
    pace: tuple[Any, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """(In the task's process) set the process up, run ``job`` and describe it as events.
    ``own_process=False``: the work runs in the coordinator itself (see :meth:`PlacedWork.records`).
    ``pace``: ``(holders, work id)``, each window waits for a credit of its coordinator's first
    (:meth:`~healsweep.sweep.holders.StageHolders.take_window`)."""

    seen = prepare_trial_process(resources, own_process=own_process)
    started, cpu, before = time.time(), time.process_time(), activity()
    yield {"event": "started", "node": ray.get_runtime_context().get_node_id(), **seen}
    with profiling() as profile:

        def stats(profiled: bool) -> dict[str, Any]:
            detail = activity_since(before)
            found = {
                "cache_hits": sum(detail["hits"].values()),
                "cache_computed": sum(detail["computed"].values()),
                "cache_waited": sum(detail["waited"].values()),
                "cache_detail": json.dumps(detail, sort_keys=True),
                "work_s": time.time() - started,
                "work_cpu_s": time.process_time() - cpu,
                "peak_rss_mb": peak_rss_bytes() / 2**20,
            }
            if profiled:  # tens of KB for a deep model: not with every window Tune logs
                found["phase_profile"] = json.dumps(profile.rows(), separators=(",", ":"))
            return found

        records = stamped(job())
        for n in itertools.count(1):
            if pace is not None:
                holders, work = pace
                ray.get(holders.take_window.remote(work))
            record = next(records, None)
            if record is None:
                break
            # the student is built by the first window; the scoring phases grow after it
            yield {"event": "window", "record": record, **stats(n == 1 or n % PROFILE_EVERY == 0)}
        yield {"event": "done", **stats(True)}


def _collected(job: Job, resources: Mapping[str, float]) -> list[dict[str, Any]]:
    """(In the task's process) every event of :func:`_events`, returned when the work ends."""
    return list(_events(job, resources))


def _options(spec: SweepSpec, retries: int) -> dict[str, Any]:
    resources = spec.trial_resources()
    options = {
        "num_cpus": resources.pop("cpu"),
        "num_gpus": resources.pop("gpu", 0),
        "resources": resources,
        "max_retries": retries,
    }
    if options["num_gpus"] and _one_gpu_per_node():
        # Every node has one GPU: a process reused for the next trial is given the same one, so
        # it keeps its warm state (resident layers, compiled code) instead of starting afresh.
        options["max_calls"] = 0
    return options


def _one_gpu_per_node() -> bool:
    """Whether no alive node of the cluster offers Ray more than one GPU."""
    return all(node["Resources"].get("GPU", 0) <= 1 for node in ray.nodes() if node["Alive"])


@cache
def _remote(fn: Callable, options: str) -> Any:
    # Resources are declared here, on the remote function, not in .options(): Ray then gives a
    # task with GPUs a fresh worker process (max_calls=1) unless told otherwise (max_calls=0,
    # one GPU per node), so a process's JAX backend only ever sees the GPU Ray gave it.
    return ray.remote(**json.loads(options))(fn)


def work_task(spec: SweepSpec, *, collected: bool = False) -> Any:
    """The Ray remote function of the spec's trial work: streaming :func:`_events` (a trial:
    never retried by Ray, Tune retries the trial), or returning them all at the end
    (``collected``: a fixed row, retried on a lost worker up to ``max_failures`` times)."""
    if collected:
        return _remote(_collected, json.dumps(_options(spec, spec.max_failures), sort_keys=True))
    return _remote(_events, json.dumps(_options(spec, 0), sort_keys=True))


class PlacedWork:
    """The work of one trial or fixed row: where it is asked to run and what it did there
    (:attr:`columns`, the row's placement columns)."""

    def __init__(self, spec: SweepSpec, holders: Any, knobs: Knobs | None) -> None:
        self.spec = spec
        self.holders = holders
        self.quantization = quantization_of(knobs) if knobs is not None else None
        self.placement: Placement | None = None
        self.work = uuid.uuid4().hex  # its name to the holders (its credits, its load)
        self.node: str | None = None
        self._built = False
        self._total_s: float | None = None
        self.columns: dict[str, Any] = {"placement": spec.placement}

    def place(self) -> Placement:
        """Ask the holders where the work should run (placed on that node, for their count)."""
        ask = ray.get(self.holders.ask.remote(self.quantization))
        self.placement = placement_for(self.spec.placement, ask)
        self.holders.placed.remote(self.work, self.quantization, self.placement.target)
        self.columns.update(
            quantization=self.quantization, holders=",".join(self.placement.holders)
        )
        return self.placement

    def observe(self, event: Mapping[str, Any]) -> WindowRecord | None:
        """Take one event of the task; the window record it carries, if any."""
        kind = event["event"]
        if kind == "started":
            self.node = event["node"]
            self.holders.started.remote(self.work, self.node)
            holders = self.placement.holders
            on_holder = self.node in holders if holders else None
            self.columns.update(placed_node=self.node, on_holder=on_holder, gpus=event["gpus"],
                                threads=event.get("threads"))  # fmt: skip
            return None
        stats = {k: v for k, v in event.items() if k not in ("event", "record")}
        self.columns.update(stats)
        if not self._built:  # the student is built before its first window is scored
            keys = held_keys(self.quantization, json.loads(stats["cache_detail"]))
            if kind == "window" and keys:
                self._built = True
                self.holders.built.remote(self.node, keys, self.work, stats["work_s"])
        if kind == "done":
            self._total_s = stats["work_s"]
        return event.get("record")

    def close(self) -> None:
        """The work has ended (or failed, or was stopped): its node counts it no more; a work
        that ran to its end tells the holders how long it took."""
        if self.placement is not None:
            self.holders.ended.remote(self.work, self._total_s)
            self.placement = None

    def records(self, job: Job, *, here: bool = False) -> Iterator[WindowRecord]:
        """Run ``job`` as a placed task, yielding its window records as they are scored; the
        task is cancelled if the caller stops early (a pruned trial). ``here``: run it in this
        process instead (a trial restored from a sweep started before trials were placed holds
        the work's resources itself: a task would wait for them behind it)."""
        if here:
            self.placement = Placement("here", None, ())
            self.columns.update(quantization=self.quantization, holders="")  # as place() does
            events = _events(job, self.spec.trial_resources(), own_process=False)
            try:
                for event in events:
                    record = self.observe(event)
                    if record is not None:
                        yield record
            finally:
                events.close()
                self.close()
            return
        placement = self.place()
        stream = work_task(self.spec).options(scheduling_strategy=placement.strategy)
        # The task scores a window only on a credit, and a credit is given each time the
        # caller asks for the next window (Tune asks once the pruner let the trial go on), so a
        # pruned trial's task has scored at most AHEAD - 1 windows past its last reported one.
        work = self.work
        self.holders.give_windows.remote(work, AHEAD)
        events = stream.remote(job, self.spec.trial_resources(), pace=(self.holders, work))
        try:
            for ref in events:
                record = self.observe(ray.get(ref))
                if record is not None:
                    yield record
                    self.holders.give_windows.remote(work)
        finally:
            ray.cancel(events)  # a stream that has ended ignores it
            self.holders.forget.remote(work)
            self.close()
