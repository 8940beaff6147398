"""Crash safety: a driver killed with SIGKILL mid-sweep is resumed without re-running finished
trials or re-scoring finished windows; two sweeps in one results root do not disturb each other.

Drivers run as real subprocesses attached to this module's Ray cluster (as ``--address`` would);
the trial work is ``toy_work`` from ``test_sweep_tune`` (see there).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from healsweep.errors import ResultsError
from healsweep.results.store import read_trials
from healsweep.sweep.driver import resume_sweep
from healsweep.sweep.fixed import reference_knobs
from healsweep.sweep.space import config_hash
from healsweep.sweep.spec_files import spec_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _raycluster import local_ray  # noqa: E402
from test_sweep_tune import N_WINDOWS, toy_work  # noqa: E402

_DRIVER = """
import functools, json, sys
sys.path.insert(0, {tests!r})
import ray
from test_sweep_tune import toy_identity, toy_work
from healsweep.sweep.driver import run_sweep
from healsweep.sweep.spec_files import spec_from_dict
ray.init(address={address!r}, logging_level="WARNING", log_to_driver=False)
spec = spec_from_dict(json.loads({spec!r}))
work = functools.partial(toy_work, log={log!r}, delay={delay})
run_sweep(spec, results_root={root!r}, work_fn=work, identity_fn=toy_identity)
"""


@pytest.fixture(scope="module")
def ray_address():
    with local_ray(2) as address:
        yield address


def _spawn(address: str, spec: dict, root: Path, log: Path, delay: float) -> subprocess.Popen:
    code = _DRIVER.format(
        tests=str(Path(__file__).resolve().parent),
        address=address,
        spec=json.dumps(spec),
        log=str(log),
        delay=delay,
        root=str(root),
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _lines(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def _wait(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"driver exited early:\n{proc.stdout.read().decode()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError("timed out waiting for the sweep")
        time.sleep(0.2)


def _completed(sweep_dir: Path, roles=("trial", "baseline", "reference")) -> set[str]:
    rows = read_trials(sweep_dir).to_pylist()  # one open file while the driver replaces it
    return {r["config_hash"] for r in rows if r["status"] == "completed" and r["role"] in roles}


@pytest.mark.slow  # 26-66 s each: the default tier stays near 15 minutes (stop 44)
def test_sigkilled_driver_resumes_without_rescoring(ray_address, tmp_path):
    spec = {
        "name": "crash",
        "search_space": {"alpha": ["gaussian", "none"], "gain_d": [0.3, 0.0]},
        "max_concurrent": 2,
    }
    log = tmp_path / "scored.log"
    sweep_dir = tmp_path / "crash"
    proc = _spawn(ray_address, spec, tmp_path, log, delay=0.25)
    # the reference rows (unhealed, plain) run first: 2 x N_WINDOWS lines, then the trials
    trials_done = functools.partial(_completed, sweep_dir, ("trial", "baseline"))
    try:
        _wait(lambda: trials_done() and len(_lines(log)) >= 3 * N_WINDOWS + 6, 240, proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    recorded = {
        (r["config_hash"], r["window_id"]) for r in pq.read_table(sweep_dir / "windows").to_pylist()
    }
    finished_trials = _completed(sweep_dir)
    scored_before = len(_lines(log))
    assert finished_trials and len(recorded) < 6 * N_WINDOWS
    assert len(_completed(sweep_dir, ("reference",))) == 2

    run = resume_sweep(sweep_dir, work_fn=functools.partial(toy_work, log=str(log)))

    rescored = _lines(log)[scored_before:]
    assert rescored, "the resume scored nothing"
    assert not set(rescored) & recorded, "a finished window was scored again"
    assert not {chash for chash, _ in rescored} & finished_trials, "a finished trial re-ran"
    # toy_work logs a reference under its knobs' hash: neither reference scored again
    spec_obj = spec_from_dict(spec)
    ref_knobs = {config_hash(reference_knobs(spec_obj, name)) for name in ("unhealed", "plain")}
    assert not {chash for chash, _ in rescored} & ref_knobs, "a finished reference re-ran"
    assert [t["status"] for t in run.trials] == ["completed"] * 6
    rows = pq.read_table(sweep_dir / "windows").to_pylist()
    keys = [(r["config_hash"], r["window_id"]) for r in rows]
    assert len(keys) == len(set(keys)) == 6 * N_WINDOWS  # raw files: no duplicate rows
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert [r["kind"] for r in manifest["runs"]] == ["run", "resume"]


@pytest.mark.slow
def test_two_sweeps_in_one_root_do_not_disturb_each_other(ray_address, tmp_path):
    specs = {
        name: {
            "name": name,
            "search_space": {"gain_d": gains},
            "max_concurrent": 1,
            "references": False,
        }  # fmt: skip
        for name, gains in (("first", [0.3, 0.0]), ("second", [0.3, 1.0]))
    }
    logs = {name: tmp_path / f"{name}.log" for name in specs}
    procs = {
        name: _spawn(ray_address, spec, tmp_path, logs[name], 0.05) for name, spec in specs.items()
    }
    try:
        _wait(lambda: (tmp_path / "first" / "spec.json").exists(), 120, procs["first"])
        if procs["first"].poll() is None:  # a second driver on a running sweep is refused
            with pytest.raises(ResultsError, match="being run by"):
                resume_sweep(tmp_path / "first", work_fn=toy_work)
        for proc in procs.values():
            assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    for name in specs:
        sweep_dir = tmp_path / name
        rows = pq.read_table(sweep_dir / "windows").to_pylist()
        assert len(rows) == 2 * N_WINDOWS and {r["sweep"] for r in rows} == {name}
        assert sorted((r["config_hash"], r["window_id"]) for r in rows) == sorted(
            _lines(logs[name])
        )
        trials = pq.read_table(sweep_dir / "trials.parquet").to_pylist()
        assert [t["status"] for t in trials] == ["completed", "completed"]
        assert json.loads((sweep_dir / "manifest.json").read_text())["sweep"] == name
    gains = {
        name: sorted(
            r["knob_gain_d"] for r in pq.read_table(tmp_path / name / "trials.parquet").to_pylist()
        )
        for name in specs
    }
    assert gains == {"first": [0.0, 0.3], "second": [0.3, 1.0]}


def test_a_sweep_being_started_is_refused_as_running_before_its_manifest_exists(tmp_path):
    """A driver writes spec.json under its lock before the manifest: a resume in between is
    told the sweep is being run (CI saw "holds no sweep results" there, under load)."""
    import fcntl

    from healsweep.results.store import LOCK_FILE, SPEC_FILE

    sweep_dir = tmp_path / "starting"
    sweep_dir.mkdir()
    (sweep_dir / SPEC_FILE).write_text(spec_from_dict({"name": "starting"}).model_dump_json())
    with open(sweep_dir / LOCK_FILE, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242")
        held.flush()
        with pytest.raises(ResultsError, match="sweep starting is being run by pid 4242"):
            resume_sweep(sweep_dir, work_fn=toy_work)
    with pytest.raises(ResultsError, match="holds no sweep results"):  # let go: what it holds
        resume_sweep(sweep_dir, work_fn=toy_work)
