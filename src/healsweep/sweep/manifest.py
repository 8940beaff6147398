"""The manifest and the stored spec of a sweep.

``spec.json`` is the validated spec with resolved paths (what ``resume`` runs again);
``manifest.json`` records what the results depend on: the spec hash, the split lock id, the
model fingerprint, package and library versions, seeds, one entry per run or resume, and the
head of the sweep's ledger at each run, resume and confirm (``ledger_heads``: what a ledger must
extend to be accepted, :mod:`healsweep.ledger._heads`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import pyarrow

import healsweep
from healsweep._atomic import atomic_write_text
from healsweep._inputs import MIB, read_text
from healsweep.cache import canonical_json
from healsweep.errors import ResultsError
from healsweep.heal.knobs import NIGHT
from healsweep.ledger import Ledger, head_record
from healsweep.ray_orphans import current_session
from healsweep.results.store import MANIFEST_FILE, SPEC_FILE, read_manifest
from healsweep.sweep.budget import planned_trials
from healsweep.sweep.space import KNOB_NAMES
from healsweep.sweep.spec import SweepSpec

LEDGER_HEADS = "ledger_heads"  # the manifest's list of ledger heads it saw


def spec_hash(spec: SweepSpec) -> str:
    """sha256 of the spec's canonical JSON (the results, stage-cache and ledger locations and
    the cache's size limit excluded: moving them is fine, a resume may name another shared
    cache root, and a limit changes what is recomputed, never a result)."""
    locations = {"results", "cache_root", "ledger", "cache_max_gb"}
    body = canonical_json(spec.model_dump(mode="json", exclude=locations))
    return hashlib.sha256(body.encode()).hexdigest()


def _versions() -> dict[str, str]:
    # lazy: heavy (optuna)
    import optuna

    # lazy: heavy (ray)
    import ray


    versions = {m.__name__: m.__version__ for m in (healsweep, ray, optuna, pyarrow)}
    return {**versions, "python": platform.python_version()}


def _check_same_knobs(sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """ResultsError unless the sweep was started with this healsweep's knobs: with another set,
    every config's identity (its hash over all knobs) changes, and a resume would score the
    remaining trials as new configs beside the old ones. (A manifest without its knob list is
    from a development build before 0.1.0's: refused as well.)"""
    recorded = manifest.get("knobs") or []
    current = sorted(KNOB_NAMES)
    if sorted(recorded) == current:
        return
    changes = (
        ("new knobs", set(current) - set(recorded)),
        ("knobs gone", set(recorded) - set(current)),
    )
    change = "; ".join(f"{what} {sorted(names)}" for what, names in changes if names)
    raise ResultsError(
        f"{sweep_dir} was started by a healsweep with other knobs ({change}); resuming would "
        "score its remaining configs under new identities: finish it with the healsweep that "
        f"started it (version {manifest.get('package_version', '?')}) or start a new sweep"
    )


def sweep_ledger(spec: SweepSpec, sweep_dir: Path) -> Ledger:
    """The ledger a new sweep's confirms record in: the spec's ``ledger``, else
    ``RESULTS/ledger.jsonl`` beside the sweep folder."""
    return Ledger(spec.ledger) if spec.ledger else Ledger.in_results(Path(sweep_dir).parent)


def recorded_ledger(sweep_dir: Path, manifest: dict[str, Any]) -> Ledger:
    """The ledger a sweep recorded (its first head's path, relative to the sweep folder), else
    ``RESULTS/ledger.jsonl`` beside it (a sweep from before heads were recorded)."""
    heads = manifest.get(LEDGER_HEADS) or []
    if heads and isinstance(heads[0].get("path"), str):
        return Ledger(os.path.normpath(Path(sweep_dir).absolute() / heads[0]["path"]))
    return Ledger.in_results(Path(sweep_dir).parent)


def ledger_head(ledger: Ledger, sweep_dir: Path, at: str) -> dict[str, Any]:
    """A head record of ``ledger`` for the sweep's manifest (``at``: what recorded it)."""
    return {**head_record(ledger, sweep_dir), "at": at, "time": time.time()}


def append_ledger_head(sweep_dir: Path, head: dict[str, Any]) -> None:
    """Add a head (a confirm's, after it opened or closed a milestone) to the manifest."""
    manifest = read_manifest(sweep_dir)
    manifest[LEDGER_HEADS] = [*manifest.get(LEDGER_HEADS, []), head]
    atomic_write_text(sweep_dir / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))


def start_manifest(
    sweep_dir: Path, spec: SweepSpec, identity: dict[str, Any] | None, kind: str
) -> dict:
    """Write ``spec.json`` and a new manifest (``kind="run"``), or append a resume entry; either
    way the head of the sweep's ledger is recorded (``ledger_heads``; a ledger that does not
    verify is refused here, before anything runs)."""
    run = {
        "kind": kind,
        "started_at": time.time(),
        "host": platform.node(),
        "versions": _versions(),
        "ray_session": current_session(),  # what a resume stops if this driver is killed
    }
    if kind == "run":
        atomic_write_text(sweep_dir / SPEC_FILE, spec.model_dump_json(indent=2))
        manifest = {
            "sweep": spec.name,
            "spec_hash": spec_hash(spec),
            "knobs": sorted(KNOB_NAMES),  # a config's identity is its value of each
            "package_version": run["versions"]["healsweep"],
            **(identity or {}),
            "seeds": {"window_order": spec.seed, "sampler": spec.sampler.seed},
            "sampler": spec.sampler.type,
            "pruner": spec.pruner.model_dump(),
            "planned_trials": planned_trials(spec),
            # what a calibration that names no max_tokens uses (read_spec): sweeps begun before
            # the night budget have no such key and keep every token, as they ran
            "calibration_default": NIGHT,
            "created_at": run["started_at"],
            "runs": [run],
            LEDGER_HEADS: [ledger_head(sweep_ledger(spec, sweep_dir), sweep_dir, "run")],
        }
    else:
        manifest = read_manifest(sweep_dir)
        if manifest.get("spec_hash") != spec_hash(spec):
            raise ResultsError(
                f"{sweep_dir / SPEC_FILE} no longer matches the manifest's spec hash; the stored "
                "spec was edited: restore it or start a new sweep"
            )
        _check_same_knobs(sweep_dir, manifest)
        manifest["runs"] = [*manifest.get("runs", []), run]
        head = ledger_head(recorded_ledger(sweep_dir, manifest), sweep_dir, "resume")
        manifest[LEDGER_HEADS] = [*manifest.get(LEDGER_HEADS, []), head]
    atomic_write_text(sweep_dir / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def recorded_ray_sessions(sweep_dir: str | Path) -> list[str]:
    """The Ray session folders the sweep's runs recorded on this host ([] without a manifest)."""
    try:
        manifest = read_manifest(sweep_dir)
    except ResultsError:
        return []
    runs = manifest.get("runs", [])
    return [r["ray_session"] for r in runs
            if r.get("ray_session") and r.get("host") == platform.node()]  # fmt: skip


def read_spec(sweep_dir: str | Path) -> SweepSpec:
    """The stored spec of a sweep (``ResultsError`` when missing or damaged)."""
    path = Path(sweep_dir) / SPEC_FILE
    manifest = read_manifest(sweep_dir)  # a clear error when this is not a sweep folder
    try:
        text = read_text(path, "stored sweep spec", 64 * MIB, error=ResultsError)
        spec = SweepSpec.model_validate_json(text)
    except FileNotFoundError:
        raise ResultsError(f"{path} is missing; the sweep folder is incomplete") from None
    except ValueError as exc:
        raise ResultsError(f"{path} is not a valid sweep spec ({exc}); restore it") from None
    if "calibration_default" in manifest or "max_tokens" in spec.calibration.model_fields_set:
        return spec
    # Begun when a calibration naming no max_tokens meant every token: so it resumes, exports
    # and confirms on the calibration it ran on (its stored form, and so its hash, unchanged).
    every = spec.calibration.model_copy(update={"max_tokens": None})
    return spec.model_copy(update={"calibration": every})
