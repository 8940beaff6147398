"""Multi-node Ray for real, on one machine: a head and two worker nodes started with `ray start`.

Each worker offers ``{"metal": 1}`` plus a resource naming it (``node_a`` / ``node_b``), one CPU,
and the head offers no CPU, so a trial that asks for ``{metal: 1}`` can only run on a worker and
two concurrent trials must run on different workers. Checked from outside the product:

- `healsweep cluster status --address` lists the three node ids that ``ray.nodes()`` reports,
  each worker's custom resources, and the JAX backend and version of every node; a driver with
  another token is refused (token auth is on) with one line; `doctor --address` sums what the
  alive nodes offer;
- `healsweep sweep run --address` with a 4-trial grid runs trials on both workers (the
  ``scored_node_id`` of the Parquet rows, matched to the workers' node ids) and every window of
  every trial reaches the driver's results exactly once.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax
import pyarrow.parquet as pq
import pytest

from _cli import HEALSWEEP
from _raycluster import ray_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
WORKERS = [{"metal": 1, "node_a": 1}, {"metal": 1, "node_b": 1}]
MAX_WINDOWS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head (0 CPUs) and the two workers of ``WORKERS``, sharing one stage cache folder."""
    cache = tmp_path_factory.mktemp("multinode-cache")
    with ray_cluster(WORKERS, extra_env={"HEALSWEEP_CACHE": str(cache)}) as running:
        yield running


def _healsweep(cluster, *args: str, timeout: float = 900):
    return cluster.run([*HEALSWEEP, *args], timeout=timeout)


def _worker_ids(cluster) -> dict[str, str]:
    """``{"node_a": node id, "node_b": node id}`` from ``ray.nodes()`` (via the fixture)."""
    ids = {}
    for node in cluster.nodes:
        for name in ("node_a", "node_b"):
            if name in node["resources"]:
                ids[name] = node["node_id"]
    assert len(ids) == 2, cluster.nodes
    return ids


def test_cluster_status_lists_every_node_its_resources_and_jax_backend(cluster):
    done = _healsweep(cluster, "cluster", "status", "--address", cluster.address, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.strip()}
    assert "3 node(s), 3 alive" in done.stdout
    workers = _worker_ids(cluster)
    for node in cluster.nodes:
        line = rows[node["node_id"][:8]]
        assert f"cpu (jax {jax.__version__})" in line, line
        assert " True " in line, line
    for name, node_id in workers.items():
        line = rows[node_id[:8]]
        assert f"{name}=1" in line and "metal=1" in line and "CPU=1" in line, line
    head = [n["node_id"] for n in cluster.nodes if n["node_id"] not in workers.values()]
    assert len(head) == 1
    assert "metal" not in rows[head[0][:8]] and "CPU" not in rows[head[0][:8]]


def test_a_driver_without_the_clusters_token_is_refused_with_one_line(cluster):
    wrong = {**cluster.env, "RAY_AUTH_TOKEN": "0" * 64}
    done = subprocess.run(
        [*HEALSWEEP, "cluster", "status", "--address", cluster.address],
        env=wrong,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot join the Ray cluster"), lines
    assert "auth token" in lines[0]


def test_doctor_with_address_reports_what_the_cluster_offers(cluster):
    done = _healsweep(cluster, "doctor", "--address", cluster.address, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("ray cluster:"))
    assert line.startswith("ray cluster: 3 alive node(s) of 3, offers CPU=2, ")
    assert "metal=2" in line and "node_a=1" in line and "node_b=1" in line


def _spec(tmp_path: Path) -> Path:
    spec = {
        "name": "multinode",
        "model": "demo",
        "corpus": "demo",
        "split": str(ROOT / "configs" / "splits" / "demo.yaml"),
        "calibration": {"max_tokens": 1024, "chunk_length": 256},
        "search_space": {"gain_d": [0.3, 0.0], "ridge": [True, False]},
        "sampler": "grid",
        "pruner": "none",
        "resources": {"metal": 1},
        "max_concurrent": 2,
        "max_failures": 1,
        "scoring": {"max_scored": 32, "max_context": 64, "max_windows": MAX_WINDOWS},
        "references": False,  # the trials' placement is under test here
    }
    path = tmp_path / "multinode.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def test_sweep_with_address_runs_trials_on_both_workers_and_every_window_reaches_driver(
    cluster, tmp_path
):
    results = tmp_path / "results"
    done = _healsweep(
        cluster,
        "sweep",
        "run",
        str(_spec(tmp_path)),
        "--address",
        cluster.address,
        "--results",
        str(results),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    assert "4 trials (4 completed)" in done.stdout, done.stdout

    sweep_dir = results / "multinode"
    trials = pq.read_table(sweep_dir / "trials.parquet").to_pylist()
    assert len(trials) == 4
    assert {t["status"] for t in trials} == {"completed"}
    assert len({t["config_hash"] for t in trials}) == 4

    rows = pq.read_table(sweep_dir / "windows").to_pylist()
    workers = _worker_ids(cluster)
    by_trial: dict[str, list[dict]] = {}
    for row in rows:
        by_trial.setdefault(row["trial_id"], []).append(row)
    assert set(by_trial) == {t["trial_id"] for t in trials}
    window_sets = set()
    for trial_id, trial_rows in by_trial.items():
        ids = [r["window_id"] for r in trial_rows]
        assert len(ids) == len(set(ids)) == MAX_WINDOWS, (trial_id, ids)
        window_sets.add(frozenset(ids))
        # One trial is one process: all of its windows were scored on one worker node.
        assert len({r["scored_node_id"] for r in trial_rows}) == 1, trial_id
        assert all(r["windows_total"] == MAX_WINDOWS for r in trial_rows)
        assert all(r["kld_count"] > 0 and r["kld_mean"] >= 0.0 for r in trial_rows)
    assert len(window_sets) == 1, "every trial scores the same dev windows"
    used = {r["scored_node_id"] for r in rows}
    assert used == set(workers.values()), (used, workers)
