"""`healsweep sweep ...` and `healsweep report` at the command line: one-line errors with exit
code 1, and status/report on a results folder (the full run is in test_sweep_e2e)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_results_report import BASE_KLD, CONFIGS, TOKENS, _folder

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, cwd=cwd
    )


def test_bad_spec_is_one_line_and_exit_1(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nsearch_space:\n  gain_d: [0.3, 9]\n")
    run = _cli("sweep", "run", str(spec))
    assert run.returncode == 1
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "bad.yaml:3" in run.stderr and "search_space.gain_d[1]" in run.stderr


def test_resume_and_status_of_a_folder_without_a_sweep(tmp_path):
    for command in (("sweep", "resume"), ("sweep", "status"), ("report",)):
        run = _cli(*command, str(tmp_path))
        assert run.returncode == 1 and "holds no sweep results" in run.stderr, run.stderr


def test_status_and_report_of_a_results_folder(tmp_path):
    folder = _folder(tmp_path)
    status = _cli("sweep", "status", str(folder))
    assert status.returncode == 0, status.stderr
    assert "4 completed, 1 pruned" in status.stdout and "driver: not running" in status.stdout
    assert "trials: 5/5" in status.stdout and "best: trial better" in status.stdout
    rel = float(re.search(r"([-+]\d+\.\d+)% vs baseline", status.stdout).group(1)) / 100
    expected = (BASE_KLD * CONFIGS["better"][1] * TOKENS).sum() / (BASE_KLD * TOKENS).sum() - 1
    assert abs(rel - expected) < 1e-4
    report = _cli("report", str(folder), "--n-boot", "200")
    assert report.returncode == 0, report.stderr
    assert "ACCEPT" in report.stdout and "report.md" in report.stdout
    assert (folder / "report" / "report.html").exists()
