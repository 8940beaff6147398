"""The Ray Tune function trainable of a sweep: one trial = one config, reported window by window.

A trial scores its dev windows in a seeded per-trial order and calls ``tune.report`` after each
one with the window's metrics, its index in the sweep's fixed global order (the pruner's step),
and the running token-pooled KLD and top-1. Every ``scoring.checkpoint_every`` windows the report
carries a small JSON checkpoint of every finished window (``{window_id: record}``).

A trial that starts or restarts learns the windows its config has already finished from three
places: the driver's :mod:`~healsweep.sweep.book` (filled from the Parquet results when a sweep is
resumed, and by every trial as it goes, so this works across machines without shared storage),
and its Tune checkpoint. Finished windows are *replayed* (reported again with their stored
metrics, flagged ``replayed``), never scored twice; the results writer drops rows it already
holds, so a replay adds no duplicate.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from healsweep.sweep.space import baseline_knobs, config_hash, resolve_knobs
from healsweep.sweep.work import WindowResult, WorkFn

CHECKPOINT_FILE = "windows.json"
TARGET_METRIC = "running_kld_mean"


def trial_seed(sweep_seed: int, chash: str) -> int:
    """The seed of a config's window order: stable across retries and resumed runs."""
    digest = hashlib.sha256(f"{sweep_seed}:{chash}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _node() -> dict[str, str]:
    import ray

    try:
        node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
    except Exception:  # outside a Ray worker (direct calls in tests of the pure parts)
        node_id, node_ip = "", ""
    return {
        "scored_node_id": node_id,
        "scored_node_ip": node_ip,
        "scored_hostname": socket.gethostname(),
    }


def window_record(result: WindowResult, node: Mapping[str, str]) -> dict[str, Any]:
    """The flat record of one scored window (what the checkpoint and the Parquet row hold)."""
    return {
        "window_id": result.window_id,
        "window_index": result.window_index,
        "position": result.position,
        "windows_total": result.windows_total,
        "stratum": result.stratum,
        "source": result.source,
        "doc_id": result.doc_id,
        "kind": result.kind,
        **result.metrics,
        "scored_at": time.time(),
        **node,
    }


class RunningPool:
    """Token-pooled KLD and top-1 over the windows seen so far."""

    def __init__(self) -> None:
        self.kld_sum = 0.0
        self.count = 0
        self.top1_count = 0
        self.windows = 0

    def add(self, record: Mapping[str, Any]) -> None:
        """Add one window record."""
        self.windows += 1
        self.kld_sum += float(record["kld_sum"])
        self.count += int(record["kld_count"])
        top1 = record.get("top1_count")
        if top1 is None:
            top1 = round(float(record["top1"]) * int(record["kld_count"]))
        self.top1_count += int(top1)

    def summary(self) -> dict[str, float]:
        """``windows_done``, ``running_kld_mean`` and ``running_top1`` (NaN before a token)."""
        if not self.count:
            return {
                "windows_done": self.windows,
                TARGET_METRIC: float("nan"),
                "running_top1": float("nan"),
            }
        return {
            "windows_done": self.windows,
            TARGET_METRIC: self.kld_sum / self.count,
            "running_top1": self.top1_count / self.count,
        }


def enable_compilation_cache() -> None:
    """Keep JAX's compiled forwards on disk (``$HEALSWEEP_CACHE/jax``) so that a new worker
    process, e.g. of a re-run or resumed sweep, does not compile every window shape again.
    A cache directory the user configured (``JAX_COMPILATION_CACHE_DIR``) is left alone."""
    import jax

    from healsweep.cache import default_cache_dir

    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(default_cache_dir() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _read_checkpoint(checkpoint: Any) -> dict[str, dict[str, Any]]:
    """Finished windows of a trial's checkpoint; {} when it is missing or unreadable (e.g. it
    was written on another node without shared storage): those windows are then scored again
    and the results writer keeps the first row of each."""
    if checkpoint is None:
        return {}
    try:
        with checkpoint.as_directory() as folder:
            return dict(json.loads((Path(folder) / CHECKPOINT_FILE).read_text())["done"])
    except (OSError, ValueError, KeyError):
        return {}


def _checkpoint(done: Mapping[str, Any], chash: str) -> tuple[Any, str]:
    from ray import tune

    folder = tempfile.mkdtemp(prefix="healsweep-ckpt-")
    payload = {"version": 1, "config_hash": chash, "done": dict(done)}
    (Path(folder) / CHECKPOINT_FILE).write_text(json.dumps(payload))
    return tune.Checkpoint.from_directory(folder), folder


def sweep_trial(
    config: Mapping[str, Any],
    *,
    spec: Any,
    book: Any,
    work_fn: WorkFn,
) -> None:
    """The function trainable (wrap with ``tune.with_parameters``); ``book`` is the handle of
    the sweep's :class:`~healsweep.sweep.book.WindowBook`. See the module docstring."""
    import ray
    from ray import tune

    enable_compilation_cache()
    knobs = resolve_knobs(spec, config)
    chash = config_hash(knobs)
    is_baseline = chash == config_hash(baseline_knobs(spec))
    done: dict[str, dict[str, Any]] = dict(ray.get(book.done.remote(chash)))
    from_checkpoint = _read_checkpoint(tune.get_checkpoint())
    done.update(from_checkpoint)
    pool = RunningPool()
    every = spec.scoring.checkpoint_every

    def report(record: dict[str, Any], *, replayed: bool, save: bool) -> None:
        pool.add(record)
        metrics = {
            **record,
            "config_hash": chash,
            "is_baseline": is_baseline,
            "replayed": replayed,
            **pool.summary(),
        }
        if not save:
            tune.report(metrics)
            return
        checkpoint, folder = _checkpoint(done, chash)
        try:
            tune.report(metrics, checkpoint=checkpoint)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    replay = sorted(done.values(), key=lambda r: r["position"])
    for i, record in enumerate(replay):
        # One checkpoint after the replay when it holds windows the checkpoint did not.
        last = i == len(replay) - 1
        report(record, replayed=True, save=last and len(done) > len(from_checkpoint))
    fresh = 0
    node = _node()
    for result in work_fn(spec, knobs, frozenset(done), trial_seed(spec.seed, chash)):
        record = window_record(result, node)
        done[result.window_id] = record
        book.add.remote(chash, record)
        fresh += 1
        last = pool.windows + 1 == result.windows_total
        report(record, replayed=False, save=fresh % every == 0 or last)


__all__ = [
    "CHECKPOINT_FILE",
    "TARGET_METRIC",
    "RunningPool",
    "enable_compilation_cache",
    "sweep_trial",
    "trial_seed",
    "window_record",
]
