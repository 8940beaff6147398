"""Reference and external rows: fixed configs scored on the sweep's dev windows beside the trials
(docs/contracts.md, "Sweeps and results").

Each runs as one Ray task with a trial's resources before the Tune experiment, so neither the
pruner nor the Optuna study ever sees it; it is placed like a trial (:mod:`healsweep.sweep.placed`:
the ``unhealed`` reference quantizes as the baseline does, so the baseline trial then runs where
those entries are). Its windows come back when the task ends and the results recorder writes them
with the config's ``trials.parquet`` row. A window another row has already
scored for the same student is taken from that row instead of scored again (and the trials of a
reference's student replay the reference's windows: :mod:`healsweep.sweep.trial`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray

from healsweep.bundled import resolve_model
from healsweep.cache import StageCache
from healsweep.errors import ResultsError
from healsweep.gguf_io import routed_expert_bpw
from healsweep.heal.knobs import Knobs
from healsweep.heal.llama_baseline import write_llama_baseline
from healsweep.heal.reads import student_key
from healsweep.model import open_model
from healsweep.quant.values import Quantizer
from healsweep.results.schema import Role, TrialStatus, fixed_config_hash, knob_columns, scored_all
from healsweep.score.record import WindowRecord
from healsweep.sweep.placed import PlacedWork, work_task
from healsweep.sweep.progress import Phase, Progress, notify
from healsweep.sweep.recorder import ResultsRecorder
from healsweep.sweep.sizes import config_size, model_shapes
from healsweep.sweep.spec import SweepSpec
from healsweep.sweep.trial import prior_windows, trial_seed
from healsweep.sweep.work import WorkFn, run_external_work

log = logging.getLogger(__name__)
# An external GGUF's work: (spec, its path, ids of the windows done, seed) -> its records.
ExternalFn = Callable[[SweepSpec, str, Collection[str], int], Iterator[WindowRecord]]


@dataclass(frozen=True)
class FixedConfig:
    """One reference or external row: what it scores and its identity in the results."""

    role: Role  # reference | external
    label: str  # unhealed | plain | the external entry's name
    knobs: Knobs | None  # None for an external GGUF
    path: str | None = None
    fingerprint: str | None = None
    routed_bpw: float | None = None
    file_bytes: int | None = None

    @property
    def trial_id(self) -> str:
        """``ref-<label>`` or ``ext-<label>`` (never a Tune trial id)."""
        return f"{'ref' if self.role == Role.REFERENCE else 'ext'}-{self.label}"

    @property
    def config_hash(self) -> str:
        """Content hash over role, label and what is scored (knobs, or the file's fingerprint):
        never equal to a trial's, even when a trial has the reference's knobs."""
        return fixed_config_hash(self.role, self.label, self.knobs, self.fingerprint)

    @property
    def student(self) -> str:
        """The student it scores, as :func:`~healsweep.results.schema.student_of` names it."""
        return self.config_hash if self.knobs is None else student_key(self.knobs)

    def columns(self) -> dict[str, Any]:
        """Its config columns in the results (an external has no knob columns)."""
        return {
            "config_hash": self.config_hash,
            "is_baseline": False,
            "role": self.role.value,
            "label": self.label,
            "routed_bpw": self.routed_bpw,
            "file_bytes": self.file_bytes,
            "external_path": self.path,
            **knob_columns(self.knobs),
        }


# What each reference changes beyond the baseline with healing off (results.schema.REFERENCES)
_REFERENCE_KNOBS: dict[str, dict[str, Any]] = {
    "unhealed": {},
    "plain": {"quantizer": Quantizer.PLAIN},  # round-to-nearest Q2_0: ordinary quantization
}


def reference_knobs(spec: SweepSpec, name: str) -> Knobs:
    """The knobs of reference ``name``: the baseline with healing off (``plain``: also its
    quantizer replaced by round-to-nearest)."""
    return spec.baseline.replace(**Knobs.UNHEALED, **_REFERENCE_KNOBS[name])


def fixed_configs(spec: SweepSpec, sweep_dir: Path) -> list[FixedConfig]:
    """The spec's references (in ``REFERENCES`` order), then its external entries (a recipe's
    file as built into ``sweep_dir``: :func:`build_externals`)."""

    out = []
    for name in spec.reference_names():
        knobs = reference_knobs(spec, name)
        size = config_size(spec.model, knobs)
        bpw, nbytes = (None, None) if size is None else size
        out.append(FixedConfig(Role.REFERENCE, name, knobs, routed_bpw=bpw, file_bytes=nbytes))
    teacher = open_model(resolve_model(spec.model)) if spec.external else None
    for entry in spec.external:
        path = entry.file(sweep_dir)
        model = open_model(path)
        # counted as a config's file is (heal.size): without its own metadata
        nbytes = model_shapes(spec.model).file_bytes_of(teacher, model)
        out.append(FixedConfig(Role.EXTERNAL, entry.name, None, path, model.fingerprint,
                               routed_expert_bpw(model), nbytes))  # fmt: skip
    return out


def build_externals(spec: SweepSpec, sweep_dir: Path) -> list[Path]:
    """Build the file of every ``external`` llama recipe not built yet into
    ``SWEEP/external/NAME.gguf`` (written atomically, so one that exists is complete and is
    reused, e.g. by a resume); its importance rows come from the sweep's calibration trace, in
    the stage cache the trials share. Returns the files built now; tells the sweep's progress
    sink which file it is building."""

    built = []
    todo = [e for e in spec.external
            if e.llama is not None and not e.built_path(sweep_dir).is_file()]  # fmt: skip
    started = time.time()
    for n, entry in enumerate(todo, 1):
        assert entry.llama is not None
        note = (
            f"building llama.cpp's {entry.llama.type} file {entry.name} ({n}/{len(todo)})"
            + (" with an importance matrix from the calibration trace" if entry.llama.imatrix
               else "")
        )  # fmt: skip
        notify(sweep_dir, Progress(planned=0, phase=Phase.EXTERNALS, note=note,
                                   elapsed_s=time.time() - started))  # fmt: skip
        calibration = spec.calibration if entry.llama.imatrix else None
        out = write_llama_baseline(open_model(spec.model), entry.llama.type,
                                   entry.built_path(sweep_dir), calibration=calibration,
                                   cache=StageCache(spec.cache_root, spec.cache_max_gb),
                                   all_tensors=entry.llama.all_tensors)  # fmt: skip
        log.info("external %s: built %s", entry.name, out)
        built.append(out)
    return built


def _job(
    spec: SweepSpec,
    fixed: FixedConfig,
    done: frozenset[str],
    work_fn: WorkFn,
    external_fn: ExternalFn,
) -> Iterator[WindowRecord]:
    """(In the Ray task) score the config's missing windows."""
    seed = trial_seed(spec.seed, fixed.config_hash)
    if fixed.knobs is not None:
        return work_fn(spec, fixed.knobs, done, seed)
    return external_fn(spec, fixed.path, done, seed)


def run_fixed(
    spec: SweepSpec,
    sweep_dir: Path,
    work_fn: WorkFn,
    holders: Any,
    external_fn: ExternalFn = run_external_work,
) -> list[FixedConfig]:
    """Score every fixed config not yet completed (only its student's windows missing from the
    Parquet rows) and record it; returns the configs that were run. ``holders``: the sweep's
    :class:`~healsweep.sweep.holders.StageHolders`."""

    recorder = ResultsRecorder(sweep_dir, spec)
    recorder.setup()
    recorder.phase = Phase.FIXED
    pending = []
    for fixed in fixed_configs(spec, sweep_dir):
        row = recorder.trials.get(fixed.trial_id)
        if row is not None and row["config_hash"] != fixed.config_hash:
            raise ResultsError(
                f"{sweep_dir}: {fixed.role} {fixed.label!r} is not what the sweep scored before "
                f"(config {row['config_hash']} then, {fixed.config_hash} now: its file or the "
                "baseline changed); restore it, or run a new sweep"
            )
        if row is None or row["status"] != TrialStatus.COMPLETED:
            pending.append(fixed)
    if not pending:
        return []
    prior = prior_windows(sweep_dir)
    for fixed in pending:  # windows scored for its student by another row: not scored again
        recorder.open(fixed.trial_id, fixed.columns())
        mine = recorder.pool(fixed.trial_id).window_ids
        known = prior.get(fixed.student, {}).values()
        replayed = sorted((r for r in known if r.window_id not in mine), key=lambda r: r.position)
        recorder.record(fixed.trial_id, [record.to_dict() for record in replayed])
    task = work_task(spec, collected=True)
    started = time.time()
    waiting = list(pending)
    running: dict[Any, tuple[FixedConfig, PlacedWork]] = {}
    while waiting or running:
        while waiting and len(running) < spec.max_concurrent:
            fixed = waiting.pop(0)
            done = frozenset(recorder.pool(fixed.trial_id).window_ids)
            work = PlacedWork(spec, holders, fixed.knobs)
            job = partial(_job, spec, fixed, done, work_fn, external_fn)
            options = task.options(scheduling_strategy=work.place().strategy)
            running[options.remote(job, spec.trial_resources())] = (fixed, work)
            recorder.start(fixed.trial_id)
        ready, _ = ray.wait(list(running), num_returns=1)
        fixed, work = running.pop(ready[0])
        try:
            events, status = ray.get(ready[0]), None
        except Exception as exc:  # recorded as an error row; a resume tries it again
            log.warning("%s %s failed: %s", fixed.role, fixed.label, str(exc).splitlines()[0])
            events, status = [], TrialStatus.ERROR
        records = [r for r in map(work.observe, events) if r is not None]
        work.close()
        row = recorder.open(fixed.trial_id, fixed.columns())
        row.update(started_at=started, n_failures=int(status == TrialStatus.ERROR))
        row.update(work.columns)
        records = sorted(records, key=lambda record: record.position)
        recorder.record(fixed.trial_id, [record.to_dict() for record in records])
        recorder.count_scored(len(records))
        pool = recorder.pool(fixed.trial_id)
        ended = TrialStatus.COMPLETED if scored_all(len(pool.window_ids), pool.total) else None
        recorder.finish(fixed.trial_id, status or ended or TrialStatus.RUNNING)
    return pending
