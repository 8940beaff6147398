"""A resume with other knobs than the sweep started with is refused in one line."""

from __future__ import annotations

import json

import pytest

from healsweep.errors import ResultsError
from healsweep.results.store import MANIFEST_FILE
from healsweep.sweep.manifest import read_spec, spec_hash, start_manifest
from healsweep.sweep.space import KNOB_NAMES
from healsweep.sweep.spec_files import load_spec, spec_from_dict


@pytest.fixture
def spec():
    return load_spec("sweeps/demo-ablation.yaml", check_paths=False)


def test_a_resume_with_the_same_knobs_appends_a_run(spec, tmp_path):
    start_manifest(tmp_path, spec, {}, kind="run")
    manifest = start_manifest(tmp_path, spec, None, kind="resume")
    assert manifest["knobs"] == sorted(KNOB_NAMES) and [r["kind"] for r in manifest["runs"]] == [
        "run",
        "resume",
    ]


def test_a_sweep_begun_before_the_night_budget_keeps_every_calibration_token(spec, tmp_path):
    """Issue 46: a calibration that names no max_tokens now means ``night`` (a budget); a sweep
    begun before (its manifest without ``calibration_default``) resumes, exports and confirms
    on every token of the pool, as it ran, and its stored spec hashes as before."""
    assert "max_tokens" not in spec.calibration.model_fields_set
    start_manifest(tmp_path, spec, {}, kind="run")
    assert read_spec(tmp_path).calibration.max_tokens == "night"
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    del manifest["calibration_default"]
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    old = read_spec(tmp_path)
    assert old.calibration.max_tokens is None and spec_hash(old) == spec_hash(spec)
    assert start_manifest(tmp_path, old, None, kind="resume")["runs"][-1]["kind"] == "resume"
    given = spec_from_dict({**json.loads(spec.model_dump_json()), "calibration": {"max_tokens": 4096}})
    (tmp_path / "given").mkdir()
    start_manifest(tmp_path / "given", given, {}, kind="run")
    manifest = json.loads((tmp_path / "given" / MANIFEST_FILE).read_text())
    del manifest["calibration_default"]
    (tmp_path / "given" / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert read_spec(tmp_path / "given").calibration.max_tokens == 4096  # as the spec gave it


def test_a_resume_with_other_knobs_is_refused_and_changes_nothing(spec, tmp_path):
    start_manifest(tmp_path, spec, {}, kind="run")
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    manifest["knobs"] = [k for k in sorted(KNOB_NAMES) if k != "quantizer"] + ["retired"]
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = (tmp_path / MANIFEST_FILE).read_text()
    with pytest.raises(ResultsError, match=r"new knobs \['quantizer'\]; knobs gone \['retired'\]"):
        start_manifest(tmp_path, spec, None, kind="resume")
    assert (tmp_path / MANIFEST_FILE).read_text() == before


def test_a_manifest_without_its_knob_list_is_refused(spec, tmp_path):
    """Only development builds before 0.1.0's wrote manifests without the knob list: their
    configs' identities cannot be checked, so resuming them is refused, changing nothing."""
    start_manifest(tmp_path, spec, {}, kind="run")
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    del manifest["knobs"]
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = (tmp_path / MANIFEST_FILE).read_text()
    with pytest.raises(ResultsError, match=r"other knobs \(new knobs \['alpha'.*start a new"):
        start_manifest(tmp_path, spec, None, kind="resume")
    assert (tmp_path / MANIFEST_FILE).read_text() == before


def test_the_retired_checkpoint_interval_still_loads_and_hashes_as_before(tmp_path):
    """Specs and sweep folders from when trials kept Tune checkpoints set or stored
    ``scoring.checkpoint_every`` (8 by default): it is accepted, ignored, and part of the
    stored spec's hash as it was, so such a sweep still resumes."""
    old = spec_from_dict({"name": "x", "scoring": {"checkpoint_every": 8}})
    assert old == spec_from_dict({"name": "x"})
    assert json.loads(old.model_dump_json())["scoring"]["checkpoint_every"] == 8
    start_manifest(tmp_path, old, {}, kind="run")
    resumed = start_manifest(tmp_path, read_spec(tmp_path), None, kind="resume")
    assert resumed["spec_hash"] == spec_hash(old) and len(resumed["runs"]) == 2
