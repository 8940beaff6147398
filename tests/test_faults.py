"""Fault injection with real processes (marker ``faults``; `.ci/run` runs it in its second tier).

Every case runs the real CLI on the demo model (a few dev windows of 32 scored tokens) as a
subprocess, injects one fault, and checks from the Parquet results that no window is lost or
double-counted: the raw rows of ``windows/`` (every file, before any de-duplication) hold each
``(config hash, window id)`` exactly once, with metrics.

- a Ray worker node SIGKILLed (its whole ``ray start`` process tree) mid-trial: the trial is
  retried on the other node from the window book, finished windows are not
  scored again;
- the driver SIGKILLed mid-sweep: ``sweep resume`` finishes, and the rows equal those of an
  uninterrupted run of the same spec (KLD to 1e-6 relative);
- cache entries truncated or with a flipped payload byte: detected (checksum) and recomputed
  bit for bit, so
  the numbers are those of the first run; a read-only or full cache dir: one-line error;
- a results dir that fills up mid-sweep (a small tmpfs, filled by another writer): one-line
  error, the rows written so far intact, and ``sweep resume`` completes once space is freed.

Read-only and full disks are made with ``mount`` as root (a read-only bind mount, a tmpfs).
Without root the cache cases use a ``chmod 555`` dir and a ``RLIMIT_FSIZE`` limit on the CLI
process; the results-dir-full case needs root.
Recovery times are recorded with ``record_property`` (see ``--junitxml``) for
``docs/reliability.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _cli import HEALSWEEP, run_cli
from _raycluster import ray_cluster
from healsweep.cache import StageCache

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("kld_sum", "kld_count", "kld_mean", "top1", "top1_count", "delta_p_mean",
           "teacher_nll_sum", "student_nll_sum")  # fmt: skip


# Helpers ------------------------------------------------------------------------------------


def spec_file(folder: Path, name: str, *, windows: int, gains: list[float], **extra) -> Path:
    """A grid sweep over ``gain_d`` on the demo model, scoring ``windows`` small dev windows."""
    spec = {
        "name": name,
        "model": "demo",
        "corpus": "demo",
        "split": str(ROOT / "configs" / "splits" / "demo.yaml"),
        "calibration": {"max_tokens": 1024, "chunk_length": 256},
        "search_space": {"gain_d": gains},
        "sampler": "grid",
        "pruner": "none",
        "max_concurrent": 1,
        "max_failures": 1,
        "scoring": {"max_scored": 32, "max_context": 64, "max_windows": windows, "batch": 1},
        "references": False,  # the faults are the Tune trials'; reference rows: test_sweep_*
        **extra,
    }  # fmt: skip
    path = folder / f"{name}.json"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def cli_env(cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HEALSWEEP_CACHE": str(cache), "PYTHONUNBUFFERED": "1", **extra}


def cli(*args: object, env: dict, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run the real CLI to completion."""
    return run_cli(*args, env=env, timeout=timeout, **kwargs)


def spawn(*args: object, env: dict, log: Path, **kwargs) -> subprocess.Popen:
    """Start the real CLI in its own session (so whatever it starts can be found and stopped)."""
    with open(log, "w") as handle:
        return subprocess.Popen(
            [*HEALSWEEP, *map(str, args)],
            stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True, **kwargs,
        )  # fmt: skip


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process and then every process left in its session (its embedded Ray)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for other in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(other.pid) == proc.pid:
                other.kill()


def raw_rows(sweep_dir: Path) -> list[dict]:
    """Every window row as the files hold it (no de-duplication); [] before the first."""
    folder = sweep_dir / "windows"
    for _ in range(20):  # a live sweep renames and removes part files while we list them
        if not folder.is_dir() or not any(folder.glob("*.parquet")):
            return []
        try:
            return pq.read_table(folder).to_pylist()
        except (OSError, pa.ArrowInvalid):
            time.sleep(0.05)
    return pq.read_table(folder).to_pylist()


def wait_for(predicate: Callable[[], bool], timeout: float, proc=None, log=None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise AssertionError(f"the driver exited early ({proc.returncode}):\n{tail}")
        if time.time() > deadline:
            raise AssertionError("timed out waiting for the sweep")
        time.sleep(0.1)


def assert_complete(sweep_dir: Path, n_configs: int, n_windows: int) -> dict[tuple, dict]:
    """No window lost or double-counted: every (config, window) once, with metrics."""
    rows = raw_rows(sweep_dir)
    keys = [(r["config_hash"], r["window_id"]) for r in rows]
    assert len(keys) == len(set(keys)), "a window was recorded twice"
    assert len({k[0] for k in keys}) == n_configs
    assert len(keys) == n_configs * n_windows, f"{len(keys)} rows, not {n_configs}x{n_windows}"
    for row in rows:
        assert row["kld_count"] > 0 and math.isfinite(row["kld_sum"]) and row["kld_sum"] >= 0
        assert row["windows_total"] == n_windows
    trials = pq.read_table(sweep_dir / "trials.parquet").to_pylist()
    assert [t["status"] for t in trials] == ["completed"] * n_configs
    assert all(t["windows_scored"] == n_windows for t in trials)
    return {key: row for key, row in zip(keys, rows, strict=True)}


def one_line_error(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 1, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0][len("error: ") :]


def can_mount() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def mounted(folder: Path, *, readonly: bool = False, size: str | None = None) -> Iterator[Path]:
    """``folder`` as a read-only bind mount or a tmpfs of ``size``, unmounted afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    if size is not None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       check=True)  # fmt: skip
    else:
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        if readonly:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """One stage cache for the sweeps of this module: the first fills it with the demo's
    calibration trace, the others reuse it (cached stages do not change any number)."""
    return tmp_path_factory.mktemp("fault-cache")


# Worker node killed ---------------------------------------------------------------------------

WORKERS = [{"metal": 1, "node_a": 1}, {"metal": 1, "node_b": 1}]
# Fast node-death detection (defaults take ~30 s): the GCS health-checks every raylet.
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a node's ``ray start`` process and every descendant (raylet, workers)."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(family, timeout=10)


def test_worker_node_killed_mid_trial_is_retried_on_the_other_node(
    tmp_path, warm_cache, record_property
):
    spec = spec_file(tmp_path, "nodekill", windows=12, gains=[0.3, 0.0],
                     resources={"metal": 1}, max_failures=2)  # fmt: skip
    extra = {"HEALSWEEP_CACHE": str(warm_cache), **FAST_HEALTH}
    with ray_cluster(WORKERS, extra_env=extra) as cluster:
        node_of = {
            node["node_id"]: j
            for node in cluster.nodes
            for j, wanted in enumerate(WORKERS)
            if next(k for k in wanted if k.startswith("node_")) in node["resources"]
        }
        sweep_dir = tmp_path / "results" / "nodekill"
        log = tmp_path / "driver.log"
        driver = spawn("sweep", "run", spec, "--address", cluster.address, "--results",
                       tmp_path / "results", env={**cluster.env, "PYTHONUNBUFFERED": "1"},
                       log=log)  # fmt: skip
        try:
            wait_for(lambda: len(raw_rows(sweep_dir)) >= 2, 600, driver, log)
            before = {r["window_id"]: r for r in raw_rows(sweep_dir)}
            victim_trial = next(iter(before.values()))["trial_id"]
            victim_node = next(iter(before.values()))["scored_node_id"]
            assert len(before) < 12, "the first trial finished before the kill"
            _kill_tree(cluster.processes[1 + node_of[victim_node]])
            killed_at = time.time()
            assert driver.wait(timeout=600) == 0, log.read_text()[-5000:]
        finally:
            if driver.poll() is None:
                kill_session(driver)
    out = log.read_text()
    assert "2 trials (2 completed)" in out, out[-3000:]
    rows = assert_complete(sweep_dir, 2, 12)
    retried = [r for r in rows.values() if r["trial_id"] == victim_trial]
    assert len(retried) == 12
    on_victim = [r for r in retried if r["scored_node_id"] == victim_node]
    elsewhere = [r for r in retried if r["scored_node_id"] != victim_node]
    assert on_victim and elsewhere, "the trial did not move to the other node"
    assert all(r["scored_at"].timestamp() <= killed_at for r in on_victim)
    assert all(r["scored_at"].timestamp() > killed_at for r in elsewhere)
    assert {node_of[r["scored_node_id"]] for r in elsewhere} == {1 - node_of[victim_node]}
    for window_id, row in before.items():  # finished before the kill: kept, not re-scored
        assert rows[(row["config_hash"], window_id)]["scored_at"] == row["scored_at"]
    trials = {t["trial_id"]: t for t in pq.read_table(sweep_dir / "trials.parquet").to_pylist()}
    assert trials[victim_trial]["n_failures"] >= 1
    resumed = min(r["written_at"].timestamp() for r in elsewhere)
    record_property("recover_s", round(resumed - killed_at, 1))
    record_property("windows_before_kill", len(on_victim))


# Driver killed --------------------------------------------------------------------------------


def test_sigkilled_driver_resume_equals_an_uninterrupted_run(tmp_path, warm_cache, record_property):
    spec = spec_file(tmp_path, "crash", windows=6, gains=[0.3, 0.0, 1.0])
    env = cli_env(warm_cache)
    killed_root, clean_root = tmp_path / "killed", tmp_path / "clean"
    clean = cli("sweep", "run", spec, "--results", clean_root, env=env)
    assert clean.returncode == 0, clean.stderr[-3000:]
    expected = assert_complete(clean_root / "crash", 3, 6)

    sweep_dir = killed_root / "crash"
    log = tmp_path / "killed.log"
    proc = spawn("sweep", "run", spec, "--results", killed_root, env=env, log=log)
    try:
        wait_for(lambda: 3 <= len(raw_rows(sweep_dir)) < 12, 300, proc, log)
    finally:
        kill_session(proc)
    killed_at = time.time()
    before = {(r["config_hash"], r["window_id"]): r for r in raw_rows(sweep_dir)}
    assert 3 <= len(before) < 18

    resume = cli("sweep", "resume", sweep_dir, env=env)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert "3 trials (3 completed)" in resume.stdout
    got = assert_complete(sweep_dir, 3, 6)
    assert set(got) == set(expected)
    for key, row in got.items():
        for name in METRICS:
            assert row[name] == pytest.approx(expected[key][name], rel=1e-6, abs=1e-9), (key, name)
    for key, row in before.items():  # rows recorded before the kill are kept, not re-scored
        assert got[key]["scored_at"] == row["scored_at"]
    first_new = min(r["written_at"].timestamp() for k, r in got.items() if k not in before)
    record_property("recover_s", round(first_new - killed_at, 1))
    record_property("rows_before_kill", len(before))


# Cache faults ---------------------------------------------------------------------------------


def _score(cache: Path, out: Path, **env_extra: str) -> subprocess.CompletedProcess:
    return cli("score", "--model", "demo", "--ref", "demo", "--max-windows", "4",
               "--max-scored", "32", "--max-context", "64", "--json", out,
               env=cli_env(cache, **env_extra))  # fmt: skip


def _window_klds(path: Path) -> dict[str, float]:
    record = json.loads(path.read_text())
    return {w["window_id"]: w["kld_sum"] for w in record["windows"]}


def test_corrupt_cache_entries_are_recomputed_never_used(tmp_path, record_property):
    cache = tmp_path / "cache"
    first = _score(cache, tmp_path / "first.json")
    assert first.returncode == 0, first.stderr[-3000:]
    entries = sorted((cache / "teacher_logits").rglob("*.hsc"))
    assert len(entries) >= 2
    truncated, flipped = entries[0], entries[1]
    originals = {p: StageCache(cache).get("teacher_logits", p.stem) for p in (truncated, flipped)}
    blob = truncated.read_bytes()
    truncated.write_bytes(blob[: len(blob) // 2])
    blob = bytearray(flipped.read_bytes())
    for offset in range(len(blob) // 2, len(blob) // 2 + 16):  # array bytes, checksum untouched
        blob[offset] ^= 0xFF
    flipped.write_bytes(bytes(blob))

    start = time.time()
    second = _score(cache, tmp_path / "second.json")
    record_property("recover_s", round(time.time() - start, 1))
    assert second.returncode == 0, second.stderr[-3000:]
    klds = _window_klds(tmp_path / "second.json")
    # A recomputed entry equals the original bit for bit (each window's teacher output is a
    # function of that window alone, whatever batch recomputes it), so the scores are the first
    # run's exactly (issue 40: they differed in the 6th digit when a rebuild ran alone).
    assert klds == _window_klds(tmp_path / "first.json")
    # Student == teacher: every window's KLD is 0; a used corrupt teacher row would not be.
    assert max(klds.values()) == pytest.approx(0.0, abs=1e-3 * 32)
    for path, (arrays, meta) in originals.items():
        again = StageCache(cache).get("teacher_logits", path.stem)
        assert again is not None, f"{path.name} was not rewritten"
        assert again[1] == meta and set(again[0]) == set(arrays)
        for name, array in arrays.items():
            np.testing.assert_array_equal(again[0][name], array, err_msg=name)


def test_read_only_cache_dir_is_one_line(tmp_path):
    cache = tmp_path / "cache"
    if can_mount():
        with mounted(cache, readonly=True):
            run = _score(cache, tmp_path / "out.json")
        reason = "Read-only file system"
    else:
        cache.mkdir()
        cache.chmod(0o555)
        run = _score(cache, tmp_path / "out.json")
        reason = "Permission denied"
    message = one_line_error(run)
    assert message.startswith(f"cannot write cache entry under {cache}: {reason}")
    assert message.endswith("free disk space or point HEALSWEEP_CACHE at a writable directory")
    assert not (tmp_path / "out.json").exists()


def test_full_cache_dir_is_one_line(tmp_path):
    if can_mount():
        with mounted(tmp_path / "cache", size="64k") as cache:
            run = _score(cache, tmp_path / "out.json")
        reason = "No space left on device"
    else:
        cache = tmp_path / "cache"
        run = _score_with_fsize_limit(cache, tmp_path / "out.json", 64 * 1024)
        reason = "File too large"
    message = one_line_error(run)
    assert message.startswith(f"cannot write cache entry under {cache}: {reason}")
    assert not (tmp_path / "out.json").exists()


def _score_with_fsize_limit(cache: Path, out: Path, limit: int) -> subprocess.CompletedProcess:
    import resource

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return cli("score", "--model", "demo", "--ref", "demo", "--max-windows", "4",
               "--max-scored", "32", "--max-context", "64", "--json", out,
               env=cli_env(cache), preexec_fn=limit_files)  # fmt: skip


# Results dir full ------------------------------------------------------------------------------


def _fill(folder: Path) -> Path:
    """Another writer takes every free byte of ``folder``'s filesystem."""
    filler = folder / "filler.bin"
    with open(filler, "wb") as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\0" * 65536)
            handle.flush()
    return filler


def test_results_dir_filling_up_mid_sweep(tmp_path, warm_cache, record_property):
    spec = spec_file(tmp_path, "full", windows=12, gains=[0.3, 0.0])
    env = cli_env(warm_cache)
    log = tmp_path / "driver.log"
    with mounted(tmp_path / "results", size="32m") as results:
        sweep_dir = results / "full"
        proc = spawn("sweep", "run", spec, "--results", results, env=env, log=log)
        try:
            wait_for(lambda: len(raw_rows(sweep_dir)) >= 3, 600, proc, log)
            filler = _fill(results)
            filled_at = time.time()
            proc.wait(timeout=600)
            stopped_at = time.time()
        finally:
            if proc.poll() is None:
                kill_session(proc)
        # Ray Tune logs the failed trial task (with its traceback) before the driver stops;
        # what healsweep itself prints is the last line, and it is the only error line.
        lines = log.read_text().strip().splitlines()
        assert proc.returncode == 1, lines[-40:]
        assert [x for x in lines if x.startswith("error: ")] == [lines[-1]], lines[-40:]
        assert lines[-1] == (
            f"error: cannot write to {sweep_dir}: No space left on device; the windows recorded "
            f"so far are kept: free space (or fix the folder), then `healsweep sweep resume "
            f"{sweep_dir}`"
        )
        kept = {(r["config_hash"], r["window_id"]): r for r in raw_rows(sweep_dir)}
        assert len(kept) >= 3

        filler.unlink()
        start = time.time()
        resume = cli("sweep", "resume", sweep_dir, env=env)
        resumed_at = time.time()
        assert resume.returncode == 0, resume.stderr[-3000:]
        rows = assert_complete(sweep_dir, 2, 12)
    for key, row in kept.items():  # the rows written before the disk filled are intact
        for name in ("scored_at", *METRICS):
            assert rows[key][name] == row[name], (key, name)
    record_property("stopped_after_s", round(stopped_at - filled_at, 1))
    record_property("resume_s", round(resumed_at - start, 1))


# Stage cache full mid-sweep -------------------------------------------------------------------


def _cache_work(spec, knobs, done, seed, *, toy_work, log: str, cache_root: str):
    """``toy_work`` (test_sweep_tune) that keeps 256 KiB per window in the real stage cache
    before the window counts as scored, as a trial's stages keep their outputs."""
    from healsweep.sweep.space import config_hash

    cache = StageCache(cache_root)
    for record in toy_work(spec, knobs, done, seed, log=log, delay=0.05):
        payload = {"x": np.full(64 * 1024, record.window_index, np.float32)}
        cache.put("toy_entry", f"{config_hash(knobs)}-{record.window_id}", payload)
        yield record


def test_a_full_stage_cache_stops_the_sweep_with_one_line_and_resume_finishes(tmp_path):
    """The H100 night's follow-ups each failed on a full disk (issue 38): the first trial whose
    stage cache cannot be written stops the sweep, naming the cache root; nothing retries, the
    windows recorded so far are kept, and a resume once there is room completes every window."""
    import functools

    import ray

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from healsweep.errors import CacheError
    from healsweep.sweep.driver import resume_sweep, run_sweep
    from healsweep.sweep.spec_files import spec_from_dict
    from test_sweep_tune import N_WINDOWS, toy_identity, toy_work

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spec = spec_from_dict({"name": "cachefull", "search_space": {"gain_d": [0.3, 0.0, 1.0]},
                           "max_concurrent": 1, "max_failures": 3})  # fmt: skip
    # 2 references + 3 trials of 12 windows, 260 KiB each: 13 MiB; 8 MiB hold the references
    # and part of the first trial.
    with mounted(tmp_path / "cache", size="8m") as cache:
        work = functools.partial(_cache_work, toy_work=toy_work, log=str(tmp_path / "scored.log"),
                                 cache_root=str(cache))  # fmt: skip
        sweep_dir = tmp_path / "results" / "cachefull"
        with pytest.raises(CacheError) as stopped:
            run_sweep(spec, results_root=tmp_path / "results", work_fn=work,
                      identity_fn=toy_identity, num_cpus=2)  # fmt: skip
        message = str(stopped.value)
        assert message.startswith(
            f"a trial cannot write the stage cache under {cache}: No space left on device; "
            "the sweep stopped"
        ), message
        assert message.endswith(f"then `healsweep sweep resume {sweep_dir}`"), message
        kept = {(r["config_hash"], r["window_id"]): r for r in raw_rows(sweep_dir)}
        assert 2 * N_WINDOWS <= len(kept) < 5 * N_WINDOWS
        trials = pq.read_table(sweep_dir / "trials.parquet").to_pylist()
        assert max(t["n_failures"] for t in trials) <= 1, trials  # stopped, not retried

        subprocess.run(["mount", "-o", "remount,size=64m", str(cache)], check=True)
        run = resume_sweep(sweep_dir, work_fn=work, num_cpus=2)
    assert [t["status"] for t in run.trials] == ["completed"] * 5  # 2 references, 3 configs
    rows = {(r["config_hash"], r["window_id"]): r for r in raw_rows(sweep_dir)}
    assert len(rows) == len(raw_rows(sweep_dir)) == 5 * N_WINDOWS  # each window once
    for key, row in kept.items():  # rows from before the stop are kept, not scored again
        assert rows[key]["scored_at"] == row["scored_at"]
