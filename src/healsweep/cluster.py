"""What a machine and its Ray cluster offer: JAX backend facts and Ray node inventory.

Used by ``healsweep doctor`` and ``healsweep cluster status``. Connecting to a cluster is
read-only here: nothing is scheduled except, for the backend census, one tiny task per node.

Three Ray behaviours shape :func:`connect`: ``ray.init`` retries forever (printing a warning every
few seconds) when nothing listens at the address, so the address is first checked with a plain
TCP connection; ``address="auto"`` attaches to *any* Ray found by scanning the process
table, including another program's embedded instance, so without an address only ``RAY_ADDRESS``
or the cluster recorded by the last ``ray start`` on this machine is used; a refused join
(wrong token) logs a warning per retry straight to file descriptor 2, so that output is collected
and summarized in one line.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import tempfile
from dataclasses import dataclass, field

from healsweep.errors import HealsweepError

CONNECT_TIMEOUT_S = 3.0
CENSUS_TIMEOUT_S = 120.0


class ClusterError(HealsweepError):
    """A Ray cluster could not be reached or queried."""


@dataclass(frozen=True)
class JaxInfo:
    """The JAX installation of one process."""

    jax_version: str
    jaxlib_version: str
    backend: str
    devices: tuple[str, ...]
    host: str = field(default_factory=platform.node)


def jax_info() -> JaxInfo:
    """JAX version, default backend and its devices in this process."""
    # lazy: heavy (jax)
    import jax

    # lazy: heavy (jaxlib)
    import jaxlib

    devices = tuple(
        f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}".strip() for d in jax.devices()
    )
    return JaxInfo(jax.__version__, jaxlib.__version__, jax.default_backend(), devices)


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node: id, address, liveness, custom and built-in resources, JAX backend."""

    node_id: str
    address: str
    alive: bool
    resources: dict[str, float]
    jax_backend: str = "?"
    jax_version: str = "?"
    gpus: tuple[str, ...] = ()  # the GPU devices JAX sees on the node ("cuda:0 NVIDIA H200")

    @property
    def declared_gpus(self) -> int:
        """The GPUs Ray offers on the node (its ``GPU`` resource)."""
        return int(self.resources.get("GPU", 0))


def parse_address(address: str, where: str = "--address") -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT``; ``ClusterError`` naming ``where`` when malformed."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(
            f"{where} = {address!r} is not HOST:PORT; pass the head's address, e.g. "
            "192.168.1.20:6379 (metal/head.sh prints it)"
        )
    return host.strip("[]"), int(port)


def reachable(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """True when something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def recorded_address() -> str | None:
    """The cluster address the last ``ray start`` on this machine recorded, if any.

    Ray writes it to ``<temp>/ray/ray_current_cluster``, where ``<temp>`` is ``RAY_TMPDIR``,
    else ``TMPDIR`` on Linux, else ``/tmp``.
    """
    temp = os.environ.get("RAY_TMPDIR")
    if temp is None and sys.platform.startswith("linux"):
        temp = os.environ.get("TMPDIR")
    path = os.path.join(temp or "/tmp", "ray", "ray_current_cluster")
    try:
        with open(path) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _target(address: str | None) -> tuple[str | None, str]:
    """The address to connect to and where it came from (``--address``, env, or recorded)."""
    if address:
        return address, "--address"
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env not in ("auto", "local"):
        return env, "RAY_ADDRESS"
    return recorded_address(), "recorded"


def connect(address: str | None) -> bool:
    """Connect this process to an existing Ray cluster; False when none is running here.

    ``address`` is ``HOST:PORT``; ``None`` uses ``RAY_ADDRESS`` or the local ``ray start``
    session and never starts a cluster. An address the user gave (flag or ``RAY_ADDRESS``) that
    cannot be reached raises ``ClusterError``; a stale recorded one means no cluster.
    """
    # lazy: heavy (ray)
    import ray

    if ray.is_initialized():
        return True
    target, source = _target(address)
    if target is None:
        return False
    asked = source != "recorded"
    host, port = parse_address(target, source if asked else "the recorded Ray address")
    if not reachable(host, port):
        if not asked:
            return False
        raise ClusterError(
            f"nothing answers at {target} (from {source}); check the address and that the head "
            "runs (metal/head.sh)"
        )
    with _RayStderr() as ray_stderr:
        try:
            ray.init(address=target, logging_level="ERROR", log_to_driver=False)
            failure = None
        except Exception as exc:  # Ray raises unrelated types (auth, version, connection)
            failure = exc
    if failure is None:
        sys.stderr.write(ray_stderr.text)  # a successful join's warnings are not hidden
        return True
    raise ClusterError(
        f"cannot join the Ray cluster at {target}: {_join_failure(failure, ray_stderr.text)}"
    ) from failure


class _RayStderr:
    """Collects what Ray's C++ core writes to file descriptor 2 while joining a cluster.

    A refused join makes it log one warning per retry for about 20 s; the caller turns that into
    one line (and writes the text through unchanged when the join succeeds).
    """

    text = ""

    def __enter__(self) -> _RayStderr:
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._sink = tempfile.TemporaryFile()
        os.dup2(self._sink.fileno(), 2)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._sink.seek(0)
        self.text = self._sink.read().decode(errors="replace")
        self._sink.close()


def _join_failure(exc: Exception, ray_stderr: str) -> str:
    if "InvalidAuthToken" in ray_stderr or "Unauthenticated" in ray_stderr:
        return (
            "the cluster refused this machine's auth token; use the head's token "
            "(RAY_AUTH_TOKEN, or ~/.ray/auth_token copied from the head)"
        )
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"{first}; check that this machine has the pool's auth token (RAY_AUTH_TOKEN or "
        "~/.ray/auth_token) and the same Ray and Python versions as the head"
    )


def nodes(census: bool = True) -> list[NodeInfo]:
    """Every node of the connected cluster, with its resources and (census) its JAX backend."""
    # lazy: heavy (ray)
    import ray

    found = [
        NodeInfo(
            node_id=node["NodeID"],
            address=node.get("NodeManagerAddress", "?"),
            alive=bool(node.get("Alive")),
            resources={
                k: float(v) for k, v in node.get("Resources", {}).items() if not _internal(k)
            },
        )
        for node in ray.nodes()
    ]
    return _census(found) if census else found


def _internal(resource: str) -> bool:
    """Ray's per-node bookkeeping resources (``node:<ip>``, ``node:__internal_head__``)."""
    return resource.startswith("node:")


def _census(found: list[NodeInfo]) -> list[NodeInfo]:
    """Ask every alive node, in parallel, for its JAX backend and version."""
    # lazy: heavy (ray)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    refs = {
        node.node_id: probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        ).remote()
        for node in found
        if node.alive
    }
    out = []
    for node in found:
        if node.node_id not in refs:
            out.append(node)
            continue
        try:
            backend, version, gpus = ray.get(refs[node.node_id], timeout=CENSUS_TIMEOUT_S)
        except Exception as exc:  # a node that cannot run the probe is reported, not fatal
            backend, version, gpus = f"unreachable ({type(exc).__name__})", "?", ()
        out.append(
            NodeInfo(node.node_id, node.address, node.alive, node.resources, backend, version, gpus)
        )
    return out


def _probe() -> tuple[str, str, tuple[str, ...]]:
    """(In a zero-resource task on the node) its JAX backend, version and GPU devices. The
    task has no GPU of its own, so Ray leaves CUDA_VISIBLE_DEVICES as the node has it and JAX
    sees every GPU of the node; its allocator is kept from preallocating them."""
    # read by JAX when its backend starts (here, by jax_info below); a no-op if already started
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    info = jax_info()
    gpus = tuple(d for d in info.devices if d.split(":")[0] in ("gpu", "cuda", "rocm"))
    return info.backend, info.jax_version, gpus


__all__ = [
    "ClusterError",
    "JaxInfo",
    "NodeInfo",
    "connect",
    "jax_info",
    "nodes",
    "parse_address",
    "reachable",
    "recorded_address",
]
