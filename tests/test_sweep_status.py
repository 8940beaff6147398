"""driver_running: a driver's exclusive lock is seen, another probe's is not."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time

from healsweep.results.store import LOCK_FILE
from healsweep.sweep.status import driver_running

_HOLD = """
import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, getattr(fcntl, sys.argv[2]))
if sys.argv[2] == "LOCK_EX":
    handle.truncate(0); handle.write("pid 4242"); handle.flush()
print("held", flush=True)
time.sleep(30)
"""


def _holder(path, mode):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), mode], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_driver_is_seen_and_a_concurrent_probe_is_not(tmp_path):
    assert driver_running(tmp_path) is None  # no lock file: no driver
    lock = tmp_path / LOCK_FILE
    prober = _holder(lock, "LOCK_SH")  # another process probing at this moment
    try:
        assert driver_running(tmp_path) is None
    finally:
        prober.kill()
        prober.wait()
    driver = _holder(lock, "LOCK_EX")
    try:
        assert driver_running(tmp_path) == "pid 4242"
    finally:
        driver.kill()
        driver.wait()
    time.sleep(0.05)
    assert driver_running(tmp_path) is None  # the driver is gone: its lock went with it
    with open(lock, "a+") as handle:  # and the probe left the file unlocked
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_sweep_status_runs_with_ray_and_optuna_blocked(tmp_path):
    # `sweep status` must answer where Ray and Optuna are not installed (a login node, a laptop
    # looking at a synced results folder): the subprocess makes importing either an ImportError.
    from test_results_report import _folder

    sweep_dir = _folder(tmp_path)
    code = (
        "import sys\n"
        "sys.modules.update(ray=None, optuna=None)  # import ray -> ImportError\n"
        "from healsweep.cli import main\n"
        f"sys.argv = ['healsweep', 'sweep', 'status', {str(sweep_dir)!r}]\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "windows" in out.stdout and "completed" in out.stdout, out.stdout
    blocked = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['ray'] = None; import ray"],
        capture_output=True,
        text=True,
    )
    assert blocked.returncode != 0 and "import of ray halted" in blocked.stderr  # a real block
def test_status_reads_a_sweep_without_importing_ray_optuna_or_jax():
    code = (
        "import sys, healsweep.sweep.status, healsweep.cli.sweep_cmd\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'optuna', 'jax'})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _row(trial_id, role, status, kld, windows=(8, 8)):
    return {"trial_id": trial_id, "role": role, "is_baseline": role == "baseline",
            "status": status, "kld_mean": kld, "config_hash": f"h-{trial_id}", "label": None,
            "windows_scored": windows[0], "windows_total": windows[1]}  # fmt: skip


def test_one_best_rule_for_progress_status_confirm_and_export(tmp_path):
    """The best trial is the completed trial with the lowest pooled KLD, the baseline included
    (``results.schema.best_trial``); the progress line and ``confirm`` agree (``export --best``
    also asks the decision rule: tests/test_export_trial.py), and confirm refuses to pick the
    baseline as the config to test against itself."""
    import pytest

    from healsweep.confirm import choose_configs
    from healsweep.errors import ResultsError
    from healsweep.results.schema import best_trial, end_status, scored_all
    from healsweep.sweep.progress import Progress

    rows = [
        _row("base", "baseline", "completed", 0.30),
        _row("good", "trial", "completed", 0.20),
        _row("cut", "trial", "pruned", 0.10, (3, 8)),  # lower, but it did not finish
        _row("ref-plain", "reference", "completed", 0.05),  # not a trial
    ]
    assert best_trial(rows)["trial_id"] == "good"
    assert Progress.of(rows, 3, 0, 0.0).best_trial == "good"
    assert [(r["trial_id"], b) for r, b in choose_configs(rows, None, tmp_path)] == [
        ("base", True), ("good", False)
    ]
    rows[0]["kld_mean"] = 0.15  # nothing beats the baseline now
    assert best_trial(rows)["trial_id"] == "base"
    assert Progress.of(rows, 3, 0, 0.0).best_trial == "base"
    with pytest.raises(ResultsError, match="best completed dev trial is the baseline itself"):
        choose_configs(rows, None, tmp_path)
    assert [r["trial_id"] for r, _ in choose_configs(rows, ["good"], tmp_path)] == ["base", "good"]
    # one pruned rule: stopped before every window, whoever asks
    assert end_status(3, 8) == "pruned" and end_status(8, 8) == "completed"
    assert not scored_all(0, None) and not scored_all(0, 0) and scored_all(9, 8)
