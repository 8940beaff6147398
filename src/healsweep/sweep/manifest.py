"""The manifest and the stored spec of a sweep.

``spec.json`` is the validated spec with resolved paths (what ``resume`` runs again);
``manifest.json`` records what the results depend on: the spec hash, the split lock id, the
model fingerprint, package and library versions, seeds, and one entry per run or resume.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path
from typing import Any

from healsweep._atomic import atomic_write_text
from healsweep.cache import canonical_json
from healsweep.errors import ResultsError
from healsweep.results.store import MANIFEST_FILE, SPEC_FILE, read_manifest
from healsweep.sweep.space import KNOB_NAMES, planned_trials
from healsweep.sweep.spec import SweepSpec


def spec_hash(spec: SweepSpec) -> str:
    """sha256 of the spec's canonical JSON (the results and stage-cache locations and the
    cache's size limit excluded: moving them is fine, a resume may name another shared cache
    root, and a limit changes what is recomputed, never a result)."""
    body = canonical_json(
        spec.model_dump(mode="json", exclude={"results", "cache_root", "cache_max_gb"})
    )
    return hashlib.sha256(body.encode()).hexdigest()


def _versions() -> dict[str, str]:
    import optuna
    import pyarrow
    import ray

    import healsweep

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


def start_manifest(
    sweep_dir: Path, spec: SweepSpec, identity: dict[str, Any] | None, kind: str
) -> dict:
    """Write ``spec.json`` and a new manifest (``kind="run"``), or append a resume entry."""
    run = {
        "kind": kind,
        "started_at": time.time(),
        "host": platform.node(),
        "versions": _versions(),
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
            "created_at": run["started_at"],
            "runs": [run],
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
    atomic_write_text(sweep_dir / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_spec(sweep_dir: str | Path) -> SweepSpec:
    """The stored spec of a sweep (``ResultsError`` when missing or damaged)."""
    path = Path(sweep_dir) / SPEC_FILE
    read_manifest(sweep_dir)  # a clear error when this is not a sweep folder
    try:
        return SweepSpec.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsError(f"{path} is missing; the sweep folder is incomplete") from None
    except ValueError as exc:
        raise ResultsError(f"{path} is not a valid sweep spec ({exc}); restore it") from None
