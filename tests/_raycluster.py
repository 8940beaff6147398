"""A real multi-node Ray cluster on this machine, for the slow tier: the product's local pool
(:mod:`healsweep.bench.localpool`, what `healsweep bench night --nodes N` starts) as a head with
``head_cpus`` CPUs plus one worker node per entry of ``workers`` (that node's custom resources).

:func:`local_ray` is the default tier's: an embedded single-node Ray in the test process, as
``healsweep sweep run`` starts one without ``--address``.

Each node is a ``ray start --block`` process of its own (its own process group), on 127.0.0.1,
with token authentication and ``HOME`` in the pool's folder (the real ``~/.ray`` is never read or
written); on exit exactly the processes it launched are stopped. ``cluster.processes[i]`` is node
i's ``ray start`` (0: the head).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

import ray

from healsweep.bench.localpool import LocalPool, NodeSpec, local_pool

RayCluster = LocalPool


@contextlib.contextmanager
def ray_cluster(
    workers: list[dict[str, float]],
    *,
    worker_cpus: int = 1,
    head_cpus: int = 0,
    timeout_s: float = 180.0,
    extra_env: Mapping[str, str] | None = None,
    worker_env: list[Mapping[str, str]] | None = None,
    worker_gpus: int = 0,
) -> Iterator[LocalPool]:
    """A head plus one worker node per entry of ``workers`` (that node's custom resources);
    ``worker_env``: each worker's own environment (e.g. its own stage cache)."""
    envs = worker_env or [{} for _ in workers]
    nodes = [NodeSpec(cpus=head_cpus)]
    nodes += [
        NodeSpec(cpus=worker_cpus, gpus=worker_gpus, resources=resources, env=env)
        for resources, env in zip(workers, envs, strict=True)
    ]
    with local_pool(nodes, timeout_s=timeout_s, extra_env=extra_env) as pool:
        yield pool


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[str]:
    """An embedded Ray of ``num_cpus`` CPUs in this process (no dashboard, workers' logs not
    forwarded), shut down on exit; yields its GCS address (for a driver in a subprocess)."""
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)  # fmt: skip
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
