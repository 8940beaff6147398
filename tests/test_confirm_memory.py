"""`confirm` of the demo stays under 1 GB of peak RSS (issue 47, item 9): slow tier.

A 2-config sweep of the packaged demo model (the shipped healer and gain_d = 0, on 8 dev windows
each) is run through the CLI, then its plain `confirm` opens a scratch ledger's milestone and
scores both configs on every test window of the demo split (542), the teacher's records computed
there. Its peak RSS is the confirm process's own high-water mark (``VmHWM``, read by
``healsweep._rss.peak_rss_bytes`` as the process exits; confirm starts no Ray and no other
process). On main before this item the same confirm peaked at 2,021 MiB (2026-12-07, load 8-12):
each scored-row count and each batch's row total compiled executables that JAX kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from _cli import cli_env, run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RSS_LIMIT = 1 << 30  # bytes

# healsweep's command line in this process, its peak RSS written to argv[1] as it exits
_MEASURED = """
import atexit, sys
from healsweep._rss import peak_rss_bytes
atexit.register(lambda: open(sys.argv[1], "w").write(str(peak_rss_bytes())))
from healsweep.cli import main
main(sys.argv[2:])
"""


def _demo_sweep(root: Path) -> Path:
    """The finished 2-config demo sweep's folder (its ledger a scratch one under ``root``)."""
    spec = {
        "name": "confirm-memory",
        "model": "demo",
        "corpus": "demo",
        "split": str(ROOT / "configs" / "splits" / "demo.yaml"),
        "ledger": str(root / "ledger.jsonl"),
        "baseline": {},
        "search_space": {"gain_d": [0.3, 0.0]},
        "sampler": "grid",
        "pruner": "none",
        "resources": {"cpu": 1},
        "max_concurrent": 1,
        "scoring": {"max_scored": 128, "max_windows": 8, "batch": 8},
        "seed": 0,
    }
    (root / "spec.yaml").write_text(json.dumps(spec))
    run = run_cli("sweep", "run", root / "spec.yaml", "--results", root / "results", "--quiet",
                  cache=root / "cache", timeout=1200)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return root / "results" / spec["name"]


def test_a_plain_confirm_of_the_demo_peaks_under_1_gb(tmp_path):
    sweep = _demo_sweep(tmp_path)
    trials = pq.read_table(sweep / "trials.parquet").to_pylist()
    tuned = next(t["trial_id"] for t in trials if t["role"] == "trial")
    peak_file = tmp_path / "peak.txt"
    run = subprocess.run(
        [sys.executable, "-c", _MEASURED, str(peak_file), "confirm", str(sweep),
         "--milestone", "memory", "--trial", tuned],
        capture_output=True, text=True, env=cli_env(tmp_path / "cache"), timeout=1800,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "milestone 'memory': 542 test windows" in run.stdout, run.stdout
    peak = int(peak_file.read_text())
    assert 0 < peak < RSS_LIMIT, f"confirm of the demo peaked at {peak / 2**20:.0f} MiB"
