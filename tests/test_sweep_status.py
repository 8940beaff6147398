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
