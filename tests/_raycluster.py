"""A real multi-node Ray cluster on this machine, for the slow tier.

:func:`ray_cluster` starts a head and N worker nodes as separate ``ray start --block``
processes (each in its own process group), all on 127.0.0.1, with token authentication (a fresh
random token passed through the environment; ``HOME`` points at a temporary folder, so the real
``~/.ray`` is never read or written), no dashboard, a small object store and every port chosen
free. It waits until every node is alive and, on exit, stops exactly the processes it launched
(their process groups and every descendant), so no other Ray on the machine is affected.

Ray's Unix sockets live under the temp dir and their paths must stay under ~107 bytes, so the
temp dir is a short folder under the system temp rather than pytest's (long) ``tmp_path``; it is
removed on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE_BYTES = 100 * 1024 * 1024

# Polls ray.nodes() from one short-lived driver until the expected nodes are alive.
_WAIT_SCRIPT = """
import json, sys, time, ray
address, expected, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.time() + timeout
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= expected or time.time() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{"node_id": n["NodeID"], "resources": n["Resources"]} for n in alive]))
"""


def free_port() -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RayCluster:
    """A running cluster: its address, the environment a driver needs, and its processes."""

    address: str
    env: dict[str, str]
    temp_dir: Path
    workers: list[dict[str, float]]
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)
    nodes: list[dict] = field(default_factory=list)

    def run(self, args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """Run a command with the cluster's environment (token, HOME), capturing its output."""
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )


def cluster_env(home: Path, token: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every node and driver of the cluster runs with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        {
            "HOME": str(home),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "RAY_TMPDIR": str(home.parent),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def _node_ports(head: bool) -> list[str]:
    ports = {
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
    }
    if head:  # the minimal dashboard process still runs without --include-dashboard
        ports["--dashboard-port"] = free_port()
    return [str(part) for item in ports.items() for part in item]


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as handle:
        return subprocess.Popen(
            [RAY, "start", "--block", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped without touching others
        )


def _family(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launched process and all of its descendants (Ray's daemons and workers)."""
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop(processes: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM the launched process groups and their descendants, then SIGKILL what is left."""
    family = [p for proc in processes for p in _family(proc)]
    for proc in reversed(processes):  # workers first, the head last
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.terminate()
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for member in alive:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    for proc in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _started(proc: subprocess.Popen, log: Path, timeout_s: float) -> bool:
    """Wait for ``ray start --block`` to report its node registered; False if it exited."""
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline:
        with contextlib.suppress(OSError):
            if "Ray runtime started" in log.read_text(errors="replace"):
                return True
        time.sleep(0.5)
    return False


def _start_worker(
    args: list[str], env: dict[str, str], log: Path, timeout_s: float, attempts: int = 2
) -> subprocess.Popen:
    """Start a worker node; retry once (Ray gives a raylet 30 s to register on a busy host)."""
    for attempt in range(attempts):
        proc = _start([*args, *_node_ports(head=False)], env, log)
        if _started(proc, log, timeout_s):
            return proc
        stop([proc])
        if attempt == attempts - 1:
            raise RuntimeError(f"a Ray worker node did not start:\n{_tail(log)}")
    raise AssertionError("unreachable")


def wait_for_nodes(cluster: RayCluster, expected: int, timeout_s: float) -> list[dict]:
    """Poll ``ray.nodes()`` until ``expected`` nodes are alive; the alive nodes' records."""
    done = cluster.run(
        [sys.executable, "-c", _WAIT_SCRIPT, cluster.address, str(expected), str(timeout_s)],
        timeout=timeout_s + 120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"could not query the test cluster:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def ray_cluster(
    workers: list[dict[str, float]],
    *,
    worker_cpus: int = 1,
    head_cpus: int = 0,
    timeout_s: float = 180.0,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[RayCluster]:
    """A head plus one worker node per entry of ``workers`` (that node's custom resources)."""
    root = Path(tempfile.mkdtemp(prefix="hsray-", dir="/tmp"))
    home = root / "home"
    home.mkdir()
    env = cluster_env(home, secrets.token_hex(32), extra_env)
    port = free_port()
    cluster = RayCluster(f"127.0.0.1:{port}", env, root, workers)
    common = [
        "--node-ip-address",
        "127.0.0.1",
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--disable-usage-stats",
    ]
    try:
        head_args = [
            "--head",
            "--port",
            str(port),
            "--num-cpus",
            str(head_cpus),
            "--include-dashboard",
            "false",
            "--temp-dir",
            str(root / "ray"),
            *common,
            *_node_ports(head=True),
        ]
        head = _start(head_args, env, root / "head.log")
        cluster.processes.append(head)
        if not _started(head, root / "head.log", timeout_s):
            raise RuntimeError(f"the Ray head did not start:\n{_tail(root / 'head.log')}")
        for i, resources in enumerate(workers):
            worker_args = [
                "--address",
                cluster.address,
                "--num-cpus",
                str(worker_cpus),
                "--resources",
                json.dumps(resources),
                *common,
            ]
            # One at a time: nodes of one machine share the session's socket folder, and two
            # starting together can pick the same socket name.
            log = root / f"worker{i}.log"
            cluster.processes.append(_start_worker(worker_args, env, log, timeout_s))
        cluster.nodes = wait_for_nodes(cluster, 1 + len(workers), timeout_s)
        if len(cluster.nodes) != 1 + len(workers):
            logs = "\n".join(_tail(p) for p in sorted(root.glob("*.log")))
            raise RuntimeError(
                f"only {len(cluster.nodes)} of {1 + len(workers)} Ray nodes came up:\n{logs}"
            )
        yield cluster
    finally:
        stop(cluster.processes)
        shutil.rmtree(root, ignore_errors=True)
