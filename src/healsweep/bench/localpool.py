"""A local pool: N Ray nodes on this host, each a ``ray start --block`` process of its own.

`healsweep bench night --nodes N` runs its sweep on one (and the multi-node tests reuse it): a
head plus N-1 worker nodes, all on 127.0.0.1, with token authentication (a fresh random token in
the environment; ``HOME`` is a folder of the pool, so the user's ``~/.ray`` is never read or
written), no dashboard, a small object store and every port chosen free. Each node gets its own
environment on top of the pool's (e.g. its own ``HEALSWEEP_CACHE``): what a node's ``ray start``
sees reaches the worker processes it starts. On exit, even on failure or Ctrl-C, exactly the
processes it launched are stopped (their process groups and every descendant), so no other Ray
on the host is touched.

Ray's Unix sockets live under the temp dir and their paths must stay under ~107 bytes, so the
pool's folder is a short one under /tmp, removed on exit.
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from healsweep.errors import HealsweepError

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


class PoolError(HealsweepError):
    """A local Ray pool could not be started."""


def free_port() -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalPool:
    """A running pool: its address, the environment a driver needs, its folder and processes;
    ``nodes``: ``[{"node_id", "resources"}]`` of the alive nodes, head first when known."""

    address: str
    env: dict[str, str]
    root: Path
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)
    nodes: list[dict] = field(default_factory=list)

    def run(self, args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """Run a command with the pool's environment (token, HOME), capturing its output."""
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )


def pool_env(home: Path, token: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every node and driver of a pool runs with."""
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
    for _ in range(attempts):
        proc = _start([*args, *_node_ports(head=False)], env, log)
        if _started(proc, log, timeout_s):
            return proc
        stop([proc])
    raise PoolError(f"a Ray worker node of the local pool did not start (its log, {log}):\n"
                    f"{_tail(log)}")  # fmt: skip


def wait_for_nodes(pool: LocalPool, expected: int, timeout_s: float) -> list[dict]:
    """Poll ``ray.nodes()`` until ``expected`` nodes are alive; the alive nodes' records."""
    done = pool.run(
        [sys.executable, "-c", _WAIT_SCRIPT, pool.address, str(expected), str(timeout_s)],
        timeout=timeout_s + 120,
    )
    if done.returncode != 0:
        raise PoolError(f"could not query the local pool at {pool.address}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class NodeSpec:
    """One node of a pool: its CPUs, GPUs (Ray lets a node declare GPUs it lacks), custom
    resources and environment (on top of the pool's)."""

    cpus: int = 1
    gpus: int = 0
    resources: Mapping[str, float] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def local_pool(
    nodes: Sequence[NodeSpec],
    *,
    timeout_s: float = 180.0,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[LocalPool]:
    """Start ``nodes[0]`` as the head and the others as workers; stop them all on exit."""
    if not nodes:
        raise PoolError("a local pool needs at least one node")
    root = Path(tempfile.mkdtemp(prefix="hsray-", dir="/tmp"))
    home = root / "home"
    home.mkdir()
    env = pool_env(home, secrets.token_hex(32), extra_env)
    pool = LocalPool(f"127.0.0.1:{free_port()}", env, root)
    common = ["--node-ip-address", "127.0.0.1", "--object-store-memory", str(OBJECT_STORE_BYTES),
              "--disable-usage-stats"]  # fmt: skip

    def node_args(node: NodeSpec) -> list[str]:
        args = ["--num-cpus", str(node.cpus), "--num-gpus", str(node.gpus)]
        return [*args, "--resources", json.dumps(dict(node.resources)), *common]

    try:
        head_args = ["--head", "--port", pool.address.rsplit(":", 1)[1], "--include-dashboard",
                     "false", "--temp-dir", str(root / "ray"), *node_args(nodes[0]),
                     *_node_ports(head=True)]  # fmt: skip
        log = root / "node0.log"
        head = _start(head_args, {**env, **nodes[0].env}, log)
        pool.processes.append(head)
        if not _started(head, log, timeout_s):
            raise PoolError(f"the Ray head of the local pool did not start:\n{_tail(log)}")
        for i, node in enumerate(nodes[1:], start=1):
            args = ["--address", pool.address, *node_args(node)]
            # One at a time: nodes of one host share the session's socket folder, and two
            # starting together can pick the same socket name.
            log = root / f"node{i}.log"
            pool.processes.append(_start_worker(args, {**env, **node.env}, log, timeout_s))
        pool.nodes = wait_for_nodes(pool, len(nodes), timeout_s)
        if len(pool.nodes) != len(nodes):
            logs = "\n".join(_tail(p) for p in sorted(root.glob("*.log")))
            raise PoolError(f"only {len(pool.nodes)} of {len(nodes)} Ray nodes came up:\n{logs}")
        yield pool
    finally:
        stop(pool.processes)
        shutil.rmtree(root, ignore_errors=True)
