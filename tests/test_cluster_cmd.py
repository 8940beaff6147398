"""`healsweep cluster status` without a reachable cluster, and the pure parts of healsweep.cluster.

Every CLI run is a subprocess with an isolated environment: ``HOME`` and ``RAY_TMPDIR`` point at
the test's folder and no ``RAY_*`` variable leaks in, so another Ray on this machine (another
test's embedded instance, a developer's ``ray start``) can never be picked up. A multi-node
cluster for real is in ``test_multinode.py`` (slow tier).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from _cli import run_cli
from healsweep.cli.cluster_cmd import format_resources, node_lines
from healsweep.cluster import ClusterError, NodeInfo, parse_address, reachable, recorded_address


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends


@pytest.fixture
def env(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    (tmp_path / "home").mkdir()
    (tmp_path / "raytmp").mkdir()
    return {
        **clean,
        "HOME": str(tmp_path / "home"),
        "RAY_TMPDIR": str(tmp_path / "raytmp"),
        "HEALSWEEP_CACHE": str(tmp_path / "cache"),
    }


def _status(env: dict, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = run_cli("cluster", "status", *args, env=env, timeout=120)
    return done, time.monotonic() - start


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    assert done.stdout == ""
    return lines[0]


def test_status_without_a_cluster_exits_1_with_one_line(env):
    done, _ = _status(env)
    line = _one_error_line(done)
    assert "no Ray cluster is running here" in line and "--address" in line


def test_status_at_a_closed_port_exits_1_quickly_naming_the_address(env):
    port = _closed_port()
    done, seconds = _status(env, "--address", f"127.0.0.1:{port}")
    line = _one_error_line(done)
    assert f"127.0.0.1:{port}" in line and "nothing answers" in line
    assert seconds < 60  # ray.init itself would retry forever


def test_status_with_a_malformed_address_exits_1(env):
    done, _ = _status(env, "--address", "head-without-port")
    assert "is not HOST:PORT" in _one_error_line(done)


def test_stale_recorded_cluster_means_none_running_but_ray_address_is_an_error(env, tmp_path):
    # `ray start` records its address here; a head that died leaves the file behind.
    recorded = tmp_path / "raytmp" / "ray" / "ray_current_cluster"
    recorded.parent.mkdir()
    recorded.write_text(f"127.0.0.1:{_closed_port()}\n")
    done, _ = _status(env)
    assert "no Ray cluster is running here" in _one_error_line(done)
    # An address the user set explicitly that nobody answers at is reported as such.
    port = _closed_port()
    done, _ = _status({**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    line = _one_error_line(done)
    assert "RAY_ADDRESS" in line and f"127.0.0.1:{port}" in line


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("192.168.1.20:6379", ("192.168.1.20", 6379)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        (" head.local:6380 ", ("head.local", 6380)),
        ("[::1]:6379", ("::1", 6379)),
    ],
)
def test_parse_address_accepts_host_port(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["head", ":6379", "head:", "head:port", "head:0", "h:65536"])
def test_parse_address_rejects_what_is_not_host_port(address):
    with pytest.raises(ClusterError, match="is not HOST:PORT"):
        parse_address(address, where="RAY_ADDRESS")


def test_reachable_is_true_only_while_something_listens():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert reachable("127.0.0.1", port)
    assert not reachable("127.0.0.1", port, timeout_s=1.0)


def test_recorded_address_reads_the_file_ray_start_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert recorded_address() is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.5:6379\n")
    assert recorded_address() == "10.0.0.5:6379"


def test_node_table_shows_id_address_backend_and_resources():
    nodes = [
        NodeInfo("a" * 56, "10.0.0.5", True, {"CPU": 8.0, "metal": 1.0}, "METAL", "0.5.0"),
        NodeInfo("b" * 56, "10.0.0.6", False, {"memory": 3 * 2**30}),
    ]
    header, first, second = node_lines(nodes)
    assert header.split()[:4] == ["node", "address", "alive", "jax"]
    assert first.split()[:3] == ["aaaaaaaa", "10.0.0.5", "True"]
    assert "METAL (jax 0.5.0)" in first and first.endswith("CPU=8, metal=1")
    assert second.split()[:4] == ["bbbbbbbb", "10.0.0.6", "False", "?"]
    assert second.endswith("memory=3.0GiB")


def test_format_resources_sorts_and_shows_bytes_in_gib():
    shown = format_resources({"object_store_memory": 2**29, "metal": 2.0, "CPU": 0.5})
    assert shown == "CPU=0.5, metal=2, object_store_memory=0.5GiB"
