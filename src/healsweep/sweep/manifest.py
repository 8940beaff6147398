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

from healsweep.errors import ResultsError
from healsweep.results.store import (
    MANIFEST_FILE,
    SPEC_FILE,
    atomic_write_text,
    read_manifest,
)
from healsweep.sweep.space import planned_trials
from healsweep.sweep.spec import SweepSpec


def spec_hash(spec: SweepSpec) -> str:
    """sha256 of the spec's canonical JSON (results location excluded: moving them is fine)."""
    body = spec.model_dump(mode="json", exclude={"results"})
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def _versions() -> dict[str, str]:
    import optuna
    import pyarrow
    import ray

    import healsweep

    return {
        "healsweep": healsweep.__version__,
        "ray": ray.__version__,
        "optuna": optuna.__version__,
        "pyarrow": pyarrow.__version__,
        "python": platform.python_version(),
    }


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
        atomic_write_text(spec.model_dump_json(indent=2), sweep_dir / SPEC_FILE)
        manifest = {
            "sweep": spec.name,
            "spec_hash": spec_hash(spec),
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
        manifest["runs"] = [*manifest.get("runs", []), run]
    atomic_write_text(json.dumps(manifest, indent=2, sort_keys=True), sweep_dir / MANIFEST_FILE)
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


__all__ = ["read_spec", "spec_hash", "start_manifest"]
