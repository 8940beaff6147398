"""Reference and external rows: fixed configs scored on the sweep's dev windows beside the trials.

- ``unhealed``: the baseline's quantizer and knobs with Part A and Part B off (``alpha: none``,
  ``ridge: false``) — what healing is measured against;
- ``plain``: round-to-nearest Q2_0 with ``d = amax/2`` (``quantizer: plain``), no healing — what
  the quantizer's search is measured against;
- ``external`` entries of the spec: GGUF students made elsewhere (``healsweep baseline llama``).

They run before the Tune experiment, each as one Ray task with a trial's resources (at most
``max_concurrent`` at once), so the pruner never sees them and the Optuna study is never told
about them. A task hands back its windows when it finishes; the driver writes them as the config's
consolidated windows file and its ``trials.parquet`` row (``role`` reference or external), which
the results recorder then keeps. A config whose row is completed is not run again; one cut short
(an interrupted driver, a failure) scores only the windows missing from the Parquet rows when the
sweep is resumed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from healsweep.cache import canonical_json
from healsweep.errors import ResultsError
from healsweep.heal.knobs import Knobs
from healsweep.results.schema import (
    Q2_0_BPW,
    knob_columns,
    to_table,
    trial_schema,
    window_schema,
)
from healsweep.results.store import (
    TRIALS_FILE,
    WINDOWS_DIR,
    atomic_write_table,
    consolidate_trial,
    next_seq,
    part_files,
    read_trials,
)
from healsweep.sweep.space import baseline_knobs
from healsweep.sweep.work import WorkFn, run_external_work

log = logging.getLogger(__name__)
ExternalFn = Callable[[Any, str, Any, int], Any]


@dataclass(frozen=True)
class FixedConfig:
    """One reference or external row: what it scores and its identity in the results."""

    role: str  # "reference" | "external"
    label: str  # unhealed | plain | the external entry's name
    knobs: Knobs | None  # None for an external GGUF
    path: str | None = None
    fingerprint: str | None = None
    routed_bpw: float = Q2_0_BPW

    @property
    def trial_id(self) -> str:
        """``ref-<label>`` or ``ext-<label>`` (never a Tune trial id)."""
        return f"{'ref' if self.role == 'reference' else 'ext'}-{self.label}"

    @property
    def config_hash(self) -> str:
        """Content hash over role, label and what is scored (knobs, or the file's fingerprint):
        never equal to a trial's, even when a trial has the reference's knobs."""
        identity = {
            "role": self.role,
            "label": self.label,
            "knobs": self.knobs.model_dump() if self.knobs is not None else None,
            "fingerprint": self.fingerprint,
        }
        return hashlib.sha256(canonical_json(identity).encode()).hexdigest()[:16]


def reference_knobs(spec: Any, name: str) -> Knobs:
    """The knobs of reference ``name``: the baseline with healing off (``plain``: also its
    quantizer replaced by round-to-nearest)."""
    unhealed = baseline_knobs(spec).replace(alpha="none", ridge=False)
    return unhealed.replace(quantizer="plain") if name == "plain" else unhealed


def fixed_configs(spec: Any) -> list[FixedConfig]:
    """The spec's references (in ``REFERENCES`` order), then its external entries."""
    from healsweep.gguf_io import open_model, routed_expert_bpw

    out = [
        FixedConfig("reference", name, reference_knobs(spec, name))
        for name in spec.reference_names()
    ]
    for entry in spec.external:
        model = open_model(entry.path)
        out.append(
            FixedConfig(
                "external",
                entry.name,
                None,
                entry.path,
                model.fingerprint,
                routed_expert_bpw(model),
            )
        )
    return out


def _score_fixed(
    spec: Any, fixed: FixedConfig, done: frozenset, work_fn: WorkFn, external_fn: ExternalFn
) -> list[dict[str, Any]]:
    """(A Ray task) score the config's missing windows; their window records."""
    from healsweep.sweep.trial import _node, enable_compilation_cache, trial_seed, window_record

    enable_compilation_cache()
    seed = trial_seed(spec.seed, fixed.config_hash)
    if fixed.knobs is not None:
        results = work_fn(spec, fixed.knobs, done, seed)
    else:
        results = external_fn(spec, fixed.path, done, seed)
    node = _node()
    return [window_record(result, node) for result in results]


def _task_options(spec: Any) -> dict[str, Any]:
    resources = {"cpu": 1.0, **spec.resources}
    return {
        "num_cpus": resources.pop("cpu"),
        "num_gpus": resources.pop("gpu", 0),
        "resources": resources,
        "max_retries": spec.max_failures,
    }


def run_fixed(
    spec: Any,
    sweep_dir: Path,
    prior: Mapping[str, Mapping[str, dict[str, Any]]],
    work_fn: WorkFn,
    external_fn: ExternalFn = run_external_work,
) -> list[FixedConfig]:
    """Score every fixed config not yet completed (``prior``: finished windows per config
    hash, from the Parquet rows) and record it; returns the configs that were run."""
    import ray

    trials = {row["trial_id"]: row for row in read_trials(sweep_dir).to_pylist()}
    pending = []
    for fixed in fixed_configs(spec):
        row = trials.get(fixed.trial_id)
        if row is not None and row["config_hash"] != fixed.config_hash:
            raise ResultsError(
                f"{sweep_dir}: {fixed.role} {fixed.label!r} is not what the sweep scored before "
                f"(config {row['config_hash']} then, {fixed.config_hash} now: its file or the "
                "baseline changed); restore it, or run a new sweep"
            )
        if row is None or row["status"] != "completed":
            pending.append(fixed)
    if not pending:
        return []
    # An unpicklable work function (a ledger grant inside, say) fails here with its own error,
    # as the trainable's check would, not as a Ray serialization error of the first task.
    ray.cloudpickle.dumps(work_fn)
    (sweep_dir / WINDOWS_DIR).mkdir(parents=True, exist_ok=True)
    task = ray.remote(_score_fixed).options(**_task_options(spec))
    started = time.time()
    waiting = list(pending)
    running: dict[Any, FixedConfig] = {}
    while waiting or running:
        while waiting and len(running) < spec.max_concurrent:
            fixed = waiting.pop(0)
            done = frozenset(prior.get(fixed.config_hash, {}))
            running[task.remote(spec, fixed, done, work_fn, external_fn)] = fixed
        ready, _ = ray.wait(list(running), num_returns=1)
        fixed = running.pop(ready[0])
        try:
            records = ray.get(ready[0])
            status = None
        except Exception as exc:  # recorded as an error row; a resume tries it again
            log.warning("%s %s failed: %s", fixed.role, fixed.label, str(exc).splitlines()[0])
            records, status = [], "error"
        old = list(prior.get(fixed.config_hash, {}).values())
        _record(spec, sweep_dir, fixed, old, records, status, started)
    return pending


def _record(spec, sweep_dir, fixed, old, new, status, started) -> None:
    """Write the new windows (consolidated with any earlier ones) and the config's trial row."""
    from healsweep.sweep.trial import RunningPool

    base = {
        "sweep": spec.name,
        "trial_id": fixed.trial_id,
        "config_hash": fixed.config_hash,
        "is_baseline": False,
        "role": fixed.role,
        "label": fixed.label,
        **(knob_columns(fixed.knobs.model_dump()) if fixed.knobs is not None else {}),
    }
    pool = RunningPool()
    for record in sorted(old, key=lambda r: r["position"]):
        pool.add(record)
    rows = []
    for record in sorted(new, key=lambda r: r["position"]):
        pool.add(record)
        rows.append(
            {**record, **base, **pool.summary(), "pruned": False, "written_at": time.time()}
        )
    windows_dir = sweep_dir / WINDOWS_DIR
    if rows:
        seq = next_seq(part_files(windows_dir).get(fixed.trial_id, []))
        path = windows_dir / f"part-{fixed.trial_id}-{seq:06d}.parquet"
        atomic_write_table(to_table(rows, window_schema()), path)
        consolidate_trial(windows_dir, fixed.trial_id, pruned=False)
    total = max((int(r["windows_total"]) for r in [*old, *new]), default=None)
    summary = pool.summary()
    nodes = sorted({r.get("scored_node_ip") for r in new if r.get("scored_node_ip")})
    row = {
        **base,
        "routed_bpw": fixed.routed_bpw,
        "external_path": fixed.path,
        "status": status or ("completed" if total and pool.windows >= total else "running"),
        "pruned": False,
        "windows_scored": pool.windows,
        "windows_total": total,
        "kld_mean": summary["running_kld_mean"],
        "top1": summary["running_top1"],
        "kld_sum": pool.kld_sum,
        "kld_count": pool.count,
        "top1_count": pool.top1_count,
        "n_failures": 1 if status == "error" else 0,
        "nodes": ",".join(nodes),
        "started_at": started,
        "ended_at": time.time(),
    }
    trials = [t for t in read_trials(sweep_dir).to_pylist() if t["trial_id"] != fixed.trial_id]
    atomic_write_table(to_table([*trials, row], trial_schema()), sweep_dir / TRIALS_FILE)


__all__ = ["FixedConfig", "fixed_configs", "reference_knobs", "run_fixed"]
